"""What a step's index repeats from one save of a layout to the next, pure.

Between two saves of one layout only the checksums of the fragments change: their files,
keys, boxes, offsets and sizes, the tensor records around them, the Hugging Face index files,
and the check that every tensor is covered exactly once, are the same. `IndexLayout` keeps all
of that, as text with holes where each save's checksums go, and `IndexLayouts` keeps a job's
last one. At 4,000 tensors this made `step_files` 31 -> 16.5 ms (issue 33, item 5: the
commit is on the path to durable).

A layout is reused only when the manifests' fragments have the same names and the same fields
besides their checksums, value for value (`IndexLayout.fits`), so the text it gives is the text
`CheckpointIndex.to_json_bytes` makes of the same records (tests/daemon/test_index_layout.py
holds it to that). A fragment with a quantization record carries per-save values in that record
(frames, scales' checksums): such a save's fragments rarely compare equal, and its layout is
then made anew, as every layout of a first save is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from ckptd.common.boxes import coverage_problems
from ckptd.format.index import GROUP_OF_KIND, FragmentRecord, TensorRecord
from ckptd.format.json_text import fragment_sums, hf_index_json, interleave, json_str, tensor_pieces
from ckptd.daemon.plan.save_plan import SavePlan

Fragments = Sequence[tuple[str, FragmentRecord]]  # (logical tensor, fragment): every node's, node by node

# Every field of a fragment record but its checksums (boxes as tuples: compared in C).
_FIXED = operator.attrgetter("file", "key", "box.offsets", "box.lengths", "dtype", "offset", "nbytes", "chunk_bytes", "quant")


class IncompleteStep(ValueError):
    """The nodes' manifests do not cover every tensor exactly once; the message names them."""


@dataclass(frozen=True, eq=False)
class IndexLayout:
    """A step's index for one plan and one set of fragment places, checksums left out.

    Fragments are numbered as the nodes list them (`Fragments`). `order` numbers them as the
    index lists them: tensors in plan order, a tensor's fragments by box. `pieces` is the
    index's tensors text cut at each fragment's checksum and chunk digests
    (json_text.fragment_sums): pieces[0], sums of order[0], pieces[1], ..., pieces[-1]."""

    plan: SavePlan
    names: tuple[str, ...]  # the logical tensor of each fragment
    fixed: tuple[tuple[object, ...], ...]  # _FIXED of each fragment
    order: tuple[int, ...]
    bounds: tuple[int, ...]  # tensor i's fragments are order[bounds[i]:bounds[i + 1]]
    pieces: tuple[str, ...]
    hf_indexes: tuple[tuple[str, bytes], ...]  # the step's Hugging Face index files: (name, bytes)

    @classmethod
    def of(cls, plan: SavePlan, fragments: Fragments) -> "IndexLayout":
        """The layout of `fragments` under `plan`. Raises IncompleteStep when they do not hold
        every tensor's bytes exactly once, or hold a tensor the plan does not have."""
        by_name: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(fragments):
            by_name.setdefault(name, []).append(i)
        unknown = sorted(set(by_name) - {t.name for t in plan.tensors})
        if unknown:
            raise IncompleteStep(f"the nodes wrote {len(unknown)} tensors the save's plan does not have: {', '.join(unknown[:5])}")
        problems = []
        for t in plan.tensors:
            found = [fragments[i][1] for i in by_name.get(t.name, ())]
            problem = coverage_problems(t.shape, [f.box for f in found])
            if not problem and len({(f.box.offsets, f.box.lengths) for f in found}) < len(found):
                problem = ["a box of it is written twice"]  # coverage_problems counts identical boxes once
            if problem:
                problems.append(f"{t.name}: {problem[0]}")
        if problems:
            raise IncompleteStep(f"{len(problems)} tensors are not written exactly once: " + "; ".join(problems[:5]))
        order: list[int] = []
        bounds = [0]
        pieces = [""]
        for n, t in enumerate(plan.tensors):
            at = by_name.get(t.name, [])
            if len(at) > 1:
                at = sorted(at, key=lambda i: fragments[i][1].box)
            order.extend(at)
            bounds.append(len(order))
            record = TensorRecord(t.name, t.kind, t.dtype, t.shape, tuple(fragments[i][1] for i in at), t.aliases, t.rank)
            first, *rest = tensor_pieces(record)
            pieces[-1] += f"{',' if n else ''}{json_str(t.name)}:{first}"
            pieces += rest
        return cls(
            plan=plan,
            names=tuple(name for name, _ in fragments),
            fixed=tuple(map(_FIXED, (f for _, f in fragments))),
            order=tuple(order),
            bounds=tuple(bounds),
            pieces=tuple(pieces),
            hf_indexes=_hf_indexes(plan, fragments, by_name),
        )

    def fits(self, plan: SavePlan, fragments: Fragments) -> bool:
        """Whether `fragments` under `plan` have this layout: the same plan object, the same
        fragments in the same order, every field but the checksums equal."""
        return (
            plan is self.plan
            and tuple(name for name, _ in fragments) == self.names
            and tuple(map(_FIXED, (f for _, f in fragments))) == self.fixed
        )

    def tensors(self, fragments: Fragments) -> tuple[TensorRecord, ...]:
        """The index's tensor records, of `fragments` (which this layout fits)."""
        bounds, order = self.bounds, self.order
        records = []
        for i, t in enumerate(self.plan.tensors):
            first, end = bounds[i], bounds[i + 1]
            held = (fragments[order[first]][1],) if end == first + 1 else tuple(fragments[order[j]][1] for j in range(first, end))
            records.append(TensorRecord(t.name, t.kind, t.dtype, t.shape, held, t.aliases, t.rank))
        return tuple(records)

    def tensors_json(self, fragments: Fragments) -> str:
        """The members of the index's "tensors" object, as CheckpointIndex.to_json_bytes writes self.tensors(fragments)."""
        return interleave(list(self.pieces), [text for i in self.order for text in fragment_sums(fragments[i][1])])


class IndexLayouts:
    """A job's last index layout: most of its saves repeat it."""

    def __init__(self) -> None:
        self._last: IndexLayout | None = None

    def of(self, plan: SavePlan, fragments: Fragments) -> IndexLayout:
        """The last layout when it fits, else a new one (kept). Raises as IndexLayout.of."""
        last = self._last
        if last is not None and last.fits(plan, fragments):
            return last
        self._last = IndexLayout.of(plan, fragments)
        return self._last


def _hf_indexes(plan: SavePlan, fragments: Fragments, by_name: dict[str, list[int]]) -> tuple[tuple[str, bytes], ...]:
    """The step's `<group>.safetensors.index.json` files: which file holds each stored key."""
    kinds = {t.name: t.kind for t in plan.tensors}
    in_group: dict[str, list[FragmentRecord]] = {}
    split: set[str] = set()  # the groups with a tensor stored in fragments
    for name, at in sorted(by_name.items()):
        group = GROUP_OF_KIND[kinds[name]]
        in_group.setdefault(group, []).extend(fragments[i][1] for i in at)
        if len(at) > 1:
            split.add(group)
    out = []
    for group in ("model", "master_weights", "optimizer"):
        # a dropped master weight is the model weight's bytes: not in the master files
        pieces = [piece for f in in_group.get(group, ()) for piece in f.stored_pieces()]
        if pieces and not (group == "model" and group in split):  # fragments: `ckptd export` makes the HF form
            weight_map = {piece.key: piece.file for piece in pieces}
            out.append((f"{group}.safetensors.index.json", hf_index_json(sum(piece.nbytes for piece in pieces), weight_map)))
    return tuple(out)
