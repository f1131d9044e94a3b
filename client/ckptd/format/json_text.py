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


def fragment_json(f: Any) -> str:
    """The compact JSON of f.to_json() (f: a FragmentRecord)."""
    text = (
        f'{{"file":{json_str(f.file)},"key":{json_str(f.key)},"offsets":{json_ints(f.box.offsets)},'
        f'"lengths":{json_ints(f.box.lengths)},"dtype":{json_str(f.dtype)},"offset":{f.offset},'
        f'"nbytes":{f.nbytes},"checksum":{json_str(f.checksum)}'
    )
    if f.chunk_bytes:
        text += f',"chunks":{{"bytes":{f.chunk_bytes},"xxh3":{json_str(f.chunk_xxh3)}}}'
    if f.quant is not None:
        text += f',"quant":{_compact(f.quant.to_json())}'
    return text + "}"


def tensor_json(t: Any) -> str:
    """The compact JSON of t.to_json() (t: a TensorRecord)."""
    text = (
        f'{{"kind":{json_str(t.kind)},"dtype":{json_str(t.dtype)},"shape":{json_ints(t.shape)},'
        f'"aliases":[{",".join(map(json_str, t.aliases))}],"fragments":[{",".join(map(fragment_json, t.fragments))}]'
    )
    if t.rank is not None:
        text += f',"rank":{t.rank}'
    return text + "}"


def hf_index_json(total_size: int, weight_map: dict[str, str]) -> bytes:
    """A Hugging Face `*.safetensors.index.json`: which file holds each key; the bytes of
    json.dumps({"metadata": {"total_size": ...}, "weight_map": <sorted>}, indent=2) and a newline."""
    entries = ",\n".join(f"    {json_str(key)}: {json_str(weight_map[key])}" for key in sorted(weight_map))
    weights = f"{{\n{entries}\n  }}" if entries else "{}"
    return f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n  "weight_map": {weights}\n}}\n'.encode()
