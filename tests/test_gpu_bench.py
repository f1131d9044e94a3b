"""The pure parts of tests/bench/gpu_stall.py (target judging, the tables, budget, space, checksums),
run on fabricated numbers: the GPU benchmark's verdicts are checked here, where no GPU is needed."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

GIB = 2**30


def _load():
    path = Path(__file__).resolve().parent / "bench" / "gpu_stall.py"
    spec = importlib.util.spec_from_file_location("ckptd_bench_gpu_stall", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gs = _load()


def _round(stall_ms: float = 2.0, ipc_ms: float = 1.5, step: float = 1.0, dcp_ms: float = 50.0) -> dict[str, float]:
    """One round of a 1 GiB state on a healthy machine (seconds)."""
    return {
        "floor.d2h": 0.020, "floor.h2d": 0.020, "baseline.step": 0.100,
        "copy.d2h": 0.021, "copy.stall": 0.025, "copy.step": 0.125, "copy.restore": 0.023,
        "overlap.stall": stall_ms / 1e3, "overlap.step": 0.100 * step, "overlap.restore": 0.024,
        "ipc.stall": ipc_ms / 1e3, "ipc.step": 0.101 * step, "ipc.restore": 0.024,
        "dcp.blocked": 0.010, "dcp.stall": dcp_ms / 1e3, "dcp.step": 0.150,
    }


def _results(rounds: list[dict[str, float]], tensors: int = 40) -> object:
    r = gs.SizeResults(1.0, nbytes=GIB, tensors=tensors, layers=3, floor_bytes=GIB, fwd_bwd_s=0.08)
    r.rounds = rounds
    for mode in gs.MODES:
        r.restores[mode] = [True] * (len(rounds) + 1)
        r.saves[mode] = len(rounds) + 1
        r.modes_in_use[mode] = mode
        r.in_memory[mode] = True
    return r


def _words(verdicts) -> dict[str, str]:
    return {v.key: v.word for v in verdicts}


def test_the_stall_limit_is_5_ms_at_40_tensors_15_ms_at_680_and_linear_between() -> None:
    assert gs.stall_limit_s(40) == pytest.approx(0.005)
    assert gs.stall_limit_s(680) == pytest.approx(0.015)
    assert gs.stall_limit_s(168) == pytest.approx(0.007)
    assert gs.stall_limit_s(1) == pytest.approx(0.005)


def test_a_healthy_run_passes_every_target_and_the_table_says_so() -> None:
    r = _results([_round() for _ in range(3)])
    words = _words(gs.judge(r))
    assert set(words) == set(gs.TARGET_ROWS) and set(words.values()) == {"PASS"}, words
    lines, passed = gs.summary_table([r], "NVIDIA H100 80GB HBM3", "DefaultStager", ("9 passed in 41.0s (exit 0)", True))
    text = "\n".join(lines)
    assert passed and "NVIDIA H100 80GB HBM3" in text and "0 FAIL, 0 MISSING, 0 NOT RUN -> ALL PASS" in text
    assert "1 GiB (40 tensors)" in text
    assert any("target:" in line for line in gs.size_report(r))


def test_each_missed_target_fails_alone() -> None:
    cases = {
        "stall.overlap": [_round(stall_ms=6.0, ipc_ms=5.5) for _ in range(3)],
        "ipc_vs_overlap": [_round(stall_ms=2.0, ipc_ms=3.0) for _ in range(3)],
        "step.overlap": [_round(step=1.05) for _ in range(3)],
        "dcp.overlap": [_round(stall_ms=4.0, ipc_ms=1.0, dcp_ms=30.0) for _ in range(3)],
    }
    for key, rounds in cases.items():
        words = _words(gs.judge(_results(rounds)))
        assert words[key] == "FAIL", (key, words)
    slow_copy = [dict(_round(), **{"copy.d2h": 0.025}) for _ in range(3)]  # 0.8 of the floor
    assert _words(gs.judge(_results(slow_copy)))["d2h"] == "FAIL"
    slow_restore = [dict(_round(), **{m + ".restore": 0.030 for m in gs.MODES}) for _ in range(3)]
    assert _words(gs.judge(_results(slow_restore)))["h2d"] == "FAIL"


def test_targets_are_medians_of_per_round_ratios() -> None:
    # the floor drifts from round to round; the copy follows it at 0.95: every round passes
    rounds = []
    for floor in (0.010, 0.020, 0.040):
        rounds.append(dict(_round(), **{"floor.d2h": floor, "copy.d2h": floor / 0.95}))
    rounds[1]["copy.d2h"] = 0.100  # one bad round does not decide
    verdict = {v.key: v for v in gs.judge(_results(rounds))}["d2h"]
    assert verdict.passed and verdict.text == "0.950"


def test_a_fallback_a_torn_restore_an_error_or_a_missing_part_never_passes() -> None:
    r = _results([_round() for _ in range(2)])
    r.modes_in_use["ipc"] = "overlap"
    r.notes.append("ipc: fell back to 'overlap': no GPU memory left")
    r.restores["overlap"][-1] = False
    r.errors["copy"] = "CheckpointError: cudaMemcpy failed"
    words = _words(gs.judge(r))
    assert words["ok.ipc"] == words["ok.overlap"] == words["ok.copy"] == "FAIL"
    fallback = {v.key: v for v in gs.judge(r)}["ok.ipc"]
    assert "no GPU memory left" in fallback.detail
    for row in r.rounds:
        del row["dcp.stall"]
    words = _words(gs.judge(r))
    assert words["dcp.overlap"] == words["dcp.ipc"] == "MISSING"
    skipped = gs.SizeResults(16.0, skipped="not enough space: disk: 34.0 GiB needed, 20.0 GiB free")
    lines, passed = gs.summary_table([_results([_round()]), skipped], "GPU", "plain", ("1 failed, 8 passed (exit 1)", False))
    text = "\n".join(lines)
    assert not passed and "NOT RUN" in text and "34.0 GiB needed" in text and "NOT ALL PASS" in text


def test_checksums_change_with_any_bit_and_any_swap() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g).to(torch.bfloat16),
               torch.arange(5, dtype=torch.int64), torch.tensor(3.0)]
    base = gs.checksums(tensors)
    assert base.dtype == torch.int64 and base.shape == (4,)
    assert torch.equal(gs.checksums([t.clone() for t in tensors]), base)
    flipped = tensors[0].clone()
    flipped.view(torch.int32)[500] ^= 1  # the lowest mantissa bit
    assert not torch.equal(gs.checksums([flipped, *tensors[1:]]), base)
    swapped = tensors[0].clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert not torch.equal(gs.checksums([swapped, *tensors[1:]]), base)


def test_space_budget_and_floor_size() -> None:
    plenty = {"disk_free": 50 * GIB, "shm_free": 63 * GIB, "ram_available": 120 * GIB, "gpu_free": 79 * GIB}
    assert gs.space_shortfalls(16 * GIB, shm_dcp=True, **plenty) == []
    short = gs.space_shortfalls(16 * GIB, shm_dcp=False, **dict(plenty, disk_free=20 * GIB))
    assert short == ["disk: 34.0 GiB needed, 20.0 GiB free"]
    assert gs.floor_size(16 * GIB, 79 * GIB) == 16 * GIB
    assert gs.floor_size(16 * GIB, 50 * GIB) == 2 * GIB
    assert gs.floor_size(16 * GIB, 10 * GIB) == GIB
    assert gs.predict_size_s(None, 16, 1) is None
    assert gs.predict_size_s(gs.SizeCost(4.0, setup_s=20.0, round_s=10.0), 16.0, 2) == pytest.approx(160.0)
    assert gs.another_round_fits(left_s=100.0, round_s=60.0, reserve_s=13.0)
    assert not gs.another_round_fits(left_s=70.0, round_s=60.0, reserve_s=13.0)


def test_options_and_the_pytest_summary() -> None:
    args = gs.parse_args([])
    assert args.sizes == [1.0, 4.0, 16.0] and args.reps == [5, 3, 2] and not args.check and args.budget_s is None
    assert gs.parse_args(["--check", "--reps", "2"]).reps == [2, 2, 2]
    assert gs.parse_args(["--sizes", "1,16", "--reps", "4,1"]).reps == [4, 1]
    with pytest.raises(SystemExit) as exc:
        gs.parse_args(["--help"])
    assert exc.value.code == 0
    with pytest.raises(SystemExit):
        gs.parse_args(["--only", "copy,nvme"])
    out = "..s.F\n=== short test summary info ===\nFAILED tests/x.py::t\n1 failed, 3 passed, 1 skipped in 12.3s\n"
    assert gs.parse_pytest_summary(out) == "1 failed, 3 passed, 1 skipped in 12.3s"
    assert not math.isnan(gs.stall_limit_s(680))


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: with a GPU main() runs the benchmark")
def test_without_a_gpu_the_check_exits_2_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert gs.main(["--check"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
