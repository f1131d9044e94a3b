"""JSON text of the step's files, made directly instead of by json's encoders, byte for byte what
they write: the index's tensor records (compact: one encoder call per record took half of the
index's 38 ms at 4,000 tensors) and a Hugging Face `*.safetensors.index.json` (indented: json's
indenting encoder is pure Python, 9 ms at 4,000 keys), both at every commit (issue 33).
Pure. The records are format/index.py's, read by attribute (typed Any: index.py imports this
module, and no import circle is allowed, not even for types)."""

from __future__ import annotations

import json
from typing import Any, Iterable

json_str = json.encoder.encode_basestring_ascii  # a str as json's encoders write it (ensure_ascii)
_compact = json.JSONEncoder(separators=(",", ":")).encode


def json_ints(values: Iterable[int]) -> str:
    """A sequence of ints as json's compact encoder writes it."""
    return f"[{','.join(map(str, values))}]"


def fragment_sums(f: Any) -> tuple[str, str]:
    """The text of f's checksum and of its chunks' digests ("" when it records no chunks): what
    goes into the holes fragment_pieces leaves (f: a FragmentRecord)."""
    return json_str(f.checksum), json_str(f.chunk_xxh3) if f.chunk_bytes else ""


def fragment_pieces(f: Any) -> tuple[str, str, str]:
    """The compact JSON of f.to_json() cut at its two fragment_sums: (before the checksum,
    between it and the chunks' digests, after them). A layout of the index repeats these from
    save to save (daemon/plan/index_layout.py); only the sums change."""
    head = (
        f'{{"file":{json_str(f.file)},"key":{json_str(f.key)},"offsets":{json_ints(f.box.offsets)},'
        f'"lengths":{json_ints(f.box.lengths)},"dtype":{json_str(f.dtype)},"offset":{f.offset},'
        f'"nbytes":{f.nbytes},"checksum":'
    )
    middle = f',"chunks":{{"bytes":{f.chunk_bytes},"xxh3":' if f.chunk_bytes else ""
    tail = "}" if f.chunk_bytes else ""
    if f.quant is not None:
        tail += f',"quant":{_compact(f.quant.to_json())}'
    return head, middle, tail + "}"


def fragment_json(f: Any) -> str:
    """The compact JSON of f.to_json() (f: a FragmentRecord)."""
    head, middle, tail = fragment_pieces(f)
    checksum, chunks = fragment_sums(f)
    return f"{head}{checksum}{middle}{chunks}{tail}"


def tensor_pieces(t: Any) -> list[str]:
    """The compact JSON of t.to_json() cut at each fragment's two fragment_sums, in order:
    2 * len(t.fragments) + 1 pieces (t: a TensorRecord)."""
    pieces = [
        f'{{"kind":{json_str(t.kind)},"dtype":{json_str(t.dtype)},"shape":{json_ints(t.shape)},'
        f'"aliases":[{",".join(map(json_str, t.aliases))}],"fragments":['
    ]
    for i, f in enumerate(t.fragments):
        head, middle, tail = fragment_pieces(f)
        pieces[-1] += head if i == 0 else f",{head}"
        pieces += [middle, tail]
    end = f',"rank":{t.rank}' if t.rank is not None else ""
    pieces[-1] += f"]{end}}}"
    return pieces


def tensor_json(t: Any) -> str:
    """The compact JSON of t.to_json() (t: a TensorRecord)."""
    return interleave(tensor_pieces(t), [text for f in t.fragments for text in fragment_sums(f)])


def interleave(pieces: list[str], holes: list[str]) -> str:
    """pieces[0] + holes[0] + pieces[1] + ... + pieces[-1]; len(pieces) == len(holes) + 1."""
    if len(pieces) != len(holes) + 1:
        raise ValueError(f"{len(pieces)} pieces of text around {len(holes)} holes")
    parts = [""] * (len(pieces) + len(holes))
    parts[0::2] = pieces
    parts[1::2] = holes
    return "".join(parts)


def compact_json(value: Any) -> str:
    """`value` as json.dumps(value, separators=(",", ":")) writes it (the step's small files)."""
    return _compact(value)


def extra_json_text(format_name: str, step: int, ranks: dict[int, str]) -> bytes:
    """extra.json from each rank's extras as compact_json text: the bytes of json.dumps({"format":
    format_name, "step": step, "ranks": {"<rank>": extras, ...}}, separators=(",", ":")), ranks in
    the order given, and a newline."""
    members = ",".join(f'"{int(rank)}":{text}' for rank, text in ranks.items())
    return f'{{"format":{json_str(format_name)},"step":{int(step)},"ranks":{{{members}}}}}\n'.encode()


def hf_index_json(total_size: int, weight_map: dict[str, str]) -> bytes:
    """A Hugging Face `*.safetensors.index.json`: which file holds each key; the bytes of
    json.dumps({"metadata": {"total_size": ...}, "weight_map": <sorted>}, indent=2) and a newline."""
    entries = ",\n".join(f"    {json_str(key)}: {json_str(weight_map[key])}" for key in sorted(weight_map))
    weights = f"{{\n{entries}\n  }}" if entries else "{}"
    return f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n  "weight_map": {weights}\n}}\n'.encode()
