"""The file part of the load planner (ckptd.format.file_plan): pure functions, tested with tables."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.common.boxes import Box
from ckptd.format.file_plan import FileInPlace, LoadMismatch, PieceInfo, StagedRead, Wanted, extras_source, plan_pieces, rank_extras
from ckptd.format.index import FragmentRecord, QuantRecord, SideRecord, TensorRecord
from index_rig import B, F1, F2, OPT, W, fragment, index_of  # tests/index_rig.py


def _want(name: str, shape: tuple[int, ...], box: Box | None = None) -> Wanted:
    return Wanted(name, name.split("/")[0], shape, box or Box.full(shape))


def _local(files: tuple[str, ...] = (F1, F2)) -> dict[str, FileInPlace]:
    return {f: FileInPlace(f"/root/job/step-00000007/{f}") for f in files}


@pytest.mark.parametrize(
    ("wanted", "pieces"),
    [
        # the whole weight: both fragments, in fragment order
        ([_want("model/w", (4, 2))], [("model/w", F1, 0, Box((0, 0), (2, 2))), ("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        # rows 1-2 (another layout): both fragments overlap; each piece is the stored fragment
        ([_want("model/w", (4, 2), Box((1, 0), (2, 2)))], [("model/w", F1, 0, Box((0, 0), (2, 2))), ("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        # rows 2-3: only the second file
        ([_want("model/w", (4, 2), Box((2, 0), (2, 2)))], [("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        ([_want("model/b", (2,))], [("model/b", F1, 16, Box((0,), (2,)))]),
    ],
)
def test_the_pieces_of_each_wanted_box_are_the_stored_fragments_that_overlap_it(wanted: list[Wanted], pieces: list[Any]) -> None:
    planned = plan_pieces(index_of((B, W)), wanted, ["model"], False, _local())
    assert [(p.name, p.path.rsplit("/", 1)[1], p.offset, p.fragment) for p in planned.pieces] == pieces
    assert all(p.source == "file" for p in planned.pieces) and planned.reads == ()


@pytest.mark.parametrize(
    ("wanted", "kinds", "missing", "unexpected"),
    [
        ([_want("model/w", (4, 2)), _want("model/b", (2,))], ["model"], (), ()),
        ([_want("model/w", (4, 2))], ["model"], (), ("model/b",)),
        ([_want("model/w", (4, 2))], ["model", "optim"], (), ("model/b", "optim/m")),
        ([_want("model/w", (4, 2)), _want("model/new", (3,))], ["model"], ("model/new",), ("model/b",)),
        ([_want("model/w", (4, 2)), _want("model/b", (2,)), _want("rng/cuda", (8,))], ["model", "rng"], (), ()),  # rng/ is optional
    ],
)
def test_missing_and_unexpected_names(wanted: list[Wanted], kinds: list[str], missing: tuple[str, ...], unexpected: tuple[str, ...]) -> None:
    planned = plan_pieces(index_of((B, W, OPT)), wanted, kinds, False, _local())
    assert (planned.missing, planned.unexpected) == (missing, unexpected)
    if missing or unexpected:
        with pytest.raises(LoadMismatch, match=r"pass strict=False to load the rest"):
            plan_pieces(index_of((B, W, OPT)), wanted, kinds, True, _local())


def test_a_shape_that_differs_from_the_steps_is_refused_with_both_shapes() -> None:
    with pytest.raises(LoadMismatch, match=r"'model/w' has shape \[4, 2\] in step 7 but the state being loaded has \[4, 3\]"):
        plan_pieces(index_of((W,)), [_want("model/w", (4, 3))], ["model"], False, _local())


def test_staged_files_give_one_read_per_range_however_many_tensors_share_it() -> None:
    locations = {
        F1: FileInPlace("/dev/shm/s1", 0, True),
        F2: FileInPlace("/dev/shm/s2", 1, True),
    }
    wanted = [_want("model/w", (4, 2)), _want("model/b", (2,)), _want("model/w", (4, 2), Box((0, 0), (1, 2)))]
    planned = plan_pieces(index_of((B, W)), wanted, ["model"], False, locations)
    assert [p.path for p in planned.pieces] == ["/dev/shm/s1", "/dev/shm/s2", "/dev/shm/s1", "/dev/shm/s1"]
    assert planned.reads == (StagedRead(F1, 0, 0, 16), StagedRead(F2, 1, 0, 16), StagedRead(F1, 0, 16, 8))


def test_a_quantized_fragment_loads_as_codes_with_its_scales_from_the_files() -> None:
    scales = SideRecord(file=F2, key="s", dtype="F32", shape=(2,), offset=40, nbytes=8, checksum="xxh3:9")
    coded = TensorRecord("optim/m", "optimizer", "F32", (2,), (fragment(F1, 24, Box((0,), (2,)), QuantRecord("lin-i8", 2, scales=scales)),))
    planned = plan_pieces(index_of((coded,)), [_want("optim/m", (2,))], ["optim"], False, _local())
    (piece,) = planned.pieces
    assert piece.decode is not None and piece.decode.codec == "lin-i8" and piece.decode.block == 2
    assert piece.decode.scales is not None and piece.decode.scales.path.endswith(F2) and piece.decode.scales.offset == 40


# ------------------------------------------------------------------ issue 30 finding 3: per-rank extras

# A step of 2 ranks: each rank's own "extra/t" (rank 0's in F1, rank 1's in F2), a tensor
# "extra/shared" of every rank (saved with a layout rule, or before extras were per rank).
OWN = tuple(
    TensorRecord(f"extra/rank{r}/t", "extra", "F32", (2,), (fragment(file, 32, Box((0,), (2,))),), rank=r) for r, file in ((0, F1), (1, F2))
)
SHARED = TensorRecord("extra/shared", "extra", "F32", (2,), (fragment(F1, 48, Box((0,), (2,))),))


def _own(name: str, rank: int) -> Wanted:
    """A per-rank request, as rank `rank`'s client sends it (its own name)."""
    key, _, rest = name.partition("/")
    return Wanted(f"{key}/rank{rank}/{rest}", "extra", (2,), Box.full((2,)), per_rank=True)


@pytest.mark.parametrize(
    ("rank", "file"),
    [
        (0, F1),  # its own copy
        (1, F2),
        (2, F1),  # a rank the step does not have (more ranks now): rank 0's, as its JSON extras
        (5, F1),
    ],
)
def test_issue30_finding3_a_ranks_own_extras_tensor_comes_from_its_extras_source(rank: int, file: str) -> None:
    planned = plan_pieces(index_of((W, *OWN)), [_own("extra/t", rank)], ["extra"], True, _local(), rank)
    assert [(p.name, p.path.rsplit("/", 1)[1]) for p in planned.pieces] == [(f"extra/rank{rank}/t", file)]
    assert planned.unexpected == () and planned.missing == ()  # the other rank's copy is neither


def test_issue30_finding3_a_shared_extras_tensor_of_an_older_step_serves_every_rank() -> None:
    index = index_of((W, SHARED))
    for rank in (0, 1, 3):
        planned = plan_pieces(index, [_own("extra/shared", rank)], ["extra"], True, _local(), rank)
        assert [p.name for p in planned.pieces] == [f"extra/rank{rank}/shared"] and planned.pieces[0].offset == 48


def test_issue30_finding3_a_plain_request_of_a_per_rank_tensor_takes_the_sources_copy() -> None:
    """Loaded with a layout rule (or as a DTensor) now: the copy of the rank whose extras it gets."""
    want = Wanted("extra/t", "extra", (2,), Box.full((2,)))
    planned = plan_pieces(index_of((W, *OWN)), [want], ["extra"], True, _local(), 1)
    assert [(p.name, p.path.rsplit("/", 1)[1]) for p in planned.pieces] == [("extra/t", F2)]


def test_issue30_finding3_only_the_source_ranks_own_tensors_can_be_unexpected_or_missing() -> None:
    index = index_of((W, *OWN))
    planned = plan_pieces(index, [], ["extra"], False, _local(), 1)
    assert planned.unexpected == ("extra/rank1/t",)
    planned = plan_pieces(index, [_own("extra/u", 1)], ["extra"], False, _local(), 1)
    assert planned.missing == ("extra/rank1/u",) and planned.unexpected == ("extra/rank1/t",)
    with pytest.raises(LoadMismatch, match=r"missing from step 7: extra/rank1/u; in step 7 but not in the state being loaded: extra/rank1/t"):
        plan_pieces(index, [_own("extra/u", 1)], ["extra"], True, _local(), 1)
    assert plan_pieces(index, [], ["extra"], False, _local(), 4).unexpected == ("extra/rank0/t",)  # rank 0's extras


def test_issue30_finding3_a_per_rank_request_must_carry_the_ranks_own_name() -> None:
    with pytest.raises(LoadMismatch, match=r"rank 1 asks for 'extra/rank0/t' as its own tensor.*rank1"):
        plan_pieces(index_of((W, *OWN)), [_own("extra/t", 0)], ["extra"], True, _local(), 1)


def test_issue30_finding3_whose_extras_a_rank_loads() -> None:
    saved = {0: {"r": 0, "rng": {"python": 0}}, 1: {"r": 1, "rng": {"python": 1}}}
    assert [extras_source(r, 2) for r in range(4)] == [0, 1, 0, 0]
    assert rank_extras(saved, 1, 2) == saved[1]  # its own, RNG state included
    assert rank_extras(saved, 3, 2) == {"r": 0}  # rank 0's, without rank 0's generators
    assert rank_extras({}, 0, 1) == {}


def test_a_held_snapshot_serves_the_lossless_tensors_it_has_and_files_the_rest() -> None:
    """`in_memory` (the daemon's held snapshot) gives a box's pieces, or None for a tensor not wholly
    held here; a lossy (quantized) tensor always loads from the files."""
    lossy = TensorRecord("model/b", "model", "F32", (2,), (fragment(F1, 16, Box((0,), (2,)), QuantRecord("lin-i8", 2)),))
    asked: list[str] = []

    def in_memory(spec: Wanted, record: TensorRecord) -> list[PieceInfo] | None:
        asked.append(spec.name)
        return [PieceInfo(spec.name, "shm", "/dev/shm/arena", 0, 32, Box((0, 0), (4, 2)), "F32", "")] if spec.name == "model/w" else None

    planned = plan_pieces(index_of((W, lossy, OPT)), [_want("model/w", (4, 2)), _want("model/b", (2,)), _want("optim/m", (2,))], ["model"], False, _local(), 0, in_memory)
    assert [(p.name, p.source) for p in planned.pieces] == [("model/w", "shm"), ("model/b", "file"), ("optim/m", "file")]
    assert asked == ["model/w", "optim/m"]


def _bias(name: str, checksum: str, offset: int = 32, dtype: str = "F32", quant: QuantRecord | None = None) -> TensorRecord:
    """A (2,) tensor of the step stored whole in F1, its bytes' checksum `checksum`."""
    stored = FragmentRecord(F1, f"k{offset}", Box((0,), (2,)), dtype, offset, 8, checksum, quant=quant)
    return TensorRecord(name, "model", "F32", (2,), (stored,))


@pytest.mark.parametrize(
    ("alias", "strict", "unexpected", "refused"),
    [
        # saved untied (or imported) with equal values: the alias is the same tensor, found
        (_bias("model/tied", "xxh3-64:aa"), True, (), False),
        # different values: one tensor cannot take both; strict refuses, non-strict loads the name's
        (_bias("model/tied", "xxh3-64:bb"), True, (), True),
        (_bias("model/tied", "xxh3-64:bb"), False, ("model/tied",), False),
        # equal bytes of another dtype, or coded bytes: not told equal
        (_bias("model/tied", "xxh3-64:aa", dtype="BF16"), False, ("model/tied",), False),
        (_bias("model/tied", "xxh3-64:aa", quant=QuantRecord("lin-i8", 2)), False, ("model/tied",), False),
    ],
)
def test_a_tied_tensors_alias_stored_apart_is_found_when_its_values_are_the_same(
    alias: TensorRecord, strict: bool, unexpected: tuple[str, ...], refused: bool
) -> None:
    index = index_of((_bias("model/own", "xxh3-64:aa", offset=16), alias))
    want = Wanted("model/own", "model", (2,), Box.full((2,)), aliases=("model/tied",))
    if refused:
        with pytest.raises(LoadMismatch, match=r"'model/own' and 'model/tied' are one tensor in the state being loaded \(tied\), but step 7 holds different values"):
            plan_pieces(index, [want], ["model"], strict, _local())
        return
    planned = plan_pieces(index, [want], ["model"], strict, _local())
    assert [p.name for p in planned.pieces] == ["model/own"]  # the name's value, read once
    assert planned.unexpected == unexpected and planned.missing == ()
    assert planned.compared == ("model/tied",)  # the plan holds for this step's values only: not reused for another step


def test_a_tied_tensors_alias_saved_as_its_alias_is_the_same_record() -> None:
    tied = TensorRecord("model/own", "model", "F32", (2,), _bias("model/own", "xxh3-64:aa").fragments, aliases=("model/tied",))
    want = Wanted("model/own", "model", (2,), Box.full((2,)), aliases=("model/tied",))
    planned = plan_pieces(index_of((tied,)), [want], ["model"], True, _local())
    assert (planned.missing, planned.unexpected, planned.compared, len(planned.pieces)) == ((), (), (), 1)


@pytest.mark.parametrize(
    ("alias", "why"),
    [
        (_bias("model/tied", "xxh3-64:bb"), "different values"),
        (TensorRecord("model/tied", "model", "BF16", (2,), _bias("model/tied", "xxh3-64:aa", dtype="BF16").fragments), "values of different dtypes or shapes"),
        (_bias("model/tied", "xxh3-64:aa", quant=QuantRecord("lin-i8", 2)), "values stored coded (quantized or cast), which cannot be told equal,"),
        (
            TensorRecord(
                "model/tied", "model", "F32", (2,),
                (FragmentRecord(F1, "k40", Box((0,), (1,)), "F32", 40, 4, "xxh3-64:a1"), FragmentRecord(F1, "k44", Box((1,), (1,)), "F32", 44, 4, "xxh3-64:a2")),
            ),
            "values stored in fragments of different boxes, which cannot be told equal,",
        ),
    ],
)
def test_a_strict_refusal_of_a_tied_tensor_says_what_the_step_holds(alias: TensorRecord, why: str) -> None:
    index = index_of((_bias("model/own", "xxh3-64:aa", offset=16), alias))
    want = Wanted("model/own", "model", (2,), Box.full((2,)), aliases=("model/tied",))
    with pytest.raises(LoadMismatch) as refused:
        plan_pieces(index, [want], ["model"], True, _local())
    assert f"but step 7 holds {why} for them; load into a model where they are not tied" in str(refused.value)
