"""The pure parts of tests/bench/gpu_stall.py (target judging, the tables, budget, space, checksums)
and of its profile (tests/bench/gpu_profile.py), run on fabricated numbers and traces; its
host-side sampling and the save copies' cut (--chunk-mib) on CPU, the latter on the strict CUDA
stand-in: the GPU benchmark's verdicts are checked here, where no GPU is needed."""

from __future__ import annotations

import importlib.util
import math
import time
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
        "copy.d2h": 0.0205, "copy.stall": 0.025, "copy.step": 0.125, "copy.restore": 0.021,
        "overlap.stall": stall_ms / 1e3, "overlap.step": 0.100 * step, "overlap.restore": 0.022,
        "ipc.stall": ipc_ms / 1e3, "ipc.step": 0.1005 * step, "ipc.restore": 0.022,
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


def test_the_targets_are_issue_33s() -> None:
    for tensors in (1, 40, 168, 680, 4000):
        assert gs.stall_limit_s(tensors) == pytest.approx(0.005)  # at every size
    assert (gs.D2H_MIN, gs.H2D_MIN, gs.STEP_MAX, gs.IPC_OVER_OVERLAP_MAX, gs.STALL_OVER_DCP_MAX) == (0.95, 0.9, 1.01, 1.0, 0.05)
    assert gs.CHECK_BUDGET_S <= 480


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
        "step.overlap": [_round(step=1.02) for _ in range(3)],
        "stall.ipc": [_round(stall_ms=12.0, ipc_ms=6.0) for _ in range(3)],
        "dcp.overlap": [_round(stall_ms=4.0, ipc_ms=1.0, dcp_ms=30.0) for _ in range(3)],
    }
    for key, rounds in cases.items():
        words = _words(gs.judge(_results(rounds)))
        assert words[key] == "FAIL", (key, words)
    slow_copy = [dict(_round(), **{"copy.d2h": 0.0215}) for _ in range(3)]  # 0.93 of the floor
    assert _words(gs.judge(_results(slow_copy)))["d2h"] == "FAIL"
    slow_restore = [dict(_round(), **{m + ".restore": 0.0235 for m in gs.MODES}) for _ in range(3)]  # 0.85
    assert _words(gs.judge(_results(slow_restore)))["h2d"] == "FAIL"


def test_targets_are_medians_of_per_round_ratios() -> None:
    # the floor drifts from round to round; the copy follows it at 0.95: every round passes
    rounds = []
    for floor in (0.010, 0.020, 0.040):
        rounds.append(dict(_round(), **{"floor.d2h": floor, "copy.d2h": floor / 0.96}))
    rounds[1]["copy.d2h"] = 0.100  # one bad round does not decide
    verdict = {v.key: v for v in gs.judge(_results(rounds))}["d2h"]
    assert verdict.passed and verdict.text == "0.960"


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


def test_without_pytest_the_gpu_tests_are_skipped_with_the_reason_and_fail_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find_spec(name, *a))
    summary, ok = gs.run_gpu_tests(5.0)
    assert ok is None and "pytest is not installed" in summary
    lines, passed = gs.summary_table([_results([_round() for _ in range(3)])], "GPU", "DefaultStager", (summary, ok))
    text = "\n".join(lines)
    assert passed and "SKIPPED" in text and "pytest is not installed" in text and "-> ALL PASS" in text
    _, failed = gs.summary_table([_results([_round()])], "GPU", "DefaultStager", ("1 failed (exit 1)", False))
    assert not failed


def _trace() -> list[dict]:
    """A fabricated torch.profiler chrome trace (microseconds): a step without a save, then one
    with a save whose copies run on stream 20 beside the step's own upload on stream 7."""
    def x(cat: str, name: str, ts: float, dur: float, **args: object) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    return [
        x("user_annotation", "no save", 0, 50),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1, 2, stream=7, bytes=64),
        x("kernel", "gemm", 3, 10, stream=7), x("kernel", "gemm", 14, 20, stream=7),
        x("kernel", "small", 5, 1, stream=9),
        x("user_annotation", "overlap", 100, 80),
        x("cuda_runtime", "cudaHostRegister", 101, 5),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 104, 4, stream=7, bytes=64),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 102, 30, stream=20, bytes=10**9),
        x("kernel", "gemm", 108, 12, stream=7), x("kernel", "gemm", 130, 22, stream=7),
    ]


def test_the_profile_says_what_the_save_cost_the_step() -> None:
    gp = _load_profile()
    without, with_save = gp.analyze(_trace(), ["no save", "overlap"])
    assert (without.wall_ms, without.kernel_ms, without.idle_ms) == pytest.approx((0.050, 0.030, 0.001))
    assert (without.step_copy_ms, without.step_copies, without.save_copy_ms, without.overlap_ms) == pytest.approx((0.002, 1, 0.0, 0.0))
    assert (with_save.kernel_ms, with_save.idle_ms) == pytest.approx((0.034, 0.010))  # 108-120, 130-152
    assert (with_save.step_copy_ms, with_save.save_copy_ms, with_save.overlap_ms) == pytest.approx((0.004, 0.030, 0.004))
    assert with_save.save_copy_bytes == 10**9 and with_save.register_calls == {"cudaHostRegister": 1}
    lines = gp.table([without, with_save], "profile at 1 GiB")
    text = "\n".join(lines)
    assert "kernels waited" in text and "overlapping the step's transfers" in text and "cudaHostRegister" in text
    assert "overlap: the step took +0.03 ms" in text and "waits +0.01 ms" in text and "1 page-locking calls" in text


def test_the_profile_samples_the_threads_of_the_trainer_and_the_daemon_on_cpu(tmp_path: Path) -> None:
    import subprocess
    import threading

    gp = _load_profile()
    daemon = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a daemon that works all along

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    go, done, end = threading.Event(), threading.Event(), threading.Event()

    def pool_thread() -> None:  # as the client's copy pool: alive before and after the save
        go.wait()
        busy(0.05)
        done.set()
        end.wait(30)

    worker = threading.Thread(target=pool_thread, name="ckptd-copy_0", daemon=True)
    worker.start()

    def with_save() -> None:
        go.set()
        busy(0.02)
        done.wait()
        time.sleep(0.2)  # the daemon works meanwhile

    try:
        found = gp.capture([("no save", lambda: busy(0.02)), ("overlap", with_save)], daemon.pid, tmp_path / "t.json", cuda=False)
    finally:
        daemon.kill()
        daemon.wait()
    without, saving = found
    end.set()
    worker.join()
    assert without.wall_ms > 15 and saving.wall_ms > 200
    assert saving.host.client_threads_ms >= 40 and without.host.client_threads_ms < 5
    assert saving.host.trainer_main_ms >= 15 and saving.host.daemon_ms > 20 and saving.host.daemon_top[0][0].startswith("python/")
    assert "CPU: ckptd client threads" in "\n".join(gp.table(found, "profile"))


def test_save_copies_cut_every_chunk_on_the_cuda_stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import types

    import fakecuda
    from ckptd.client._handoff.cuda import CudaBackend

    mib = 2**20
    cuda = fakecuda.FakeCuda().install(monkeypatch)
    backend = CudaBackend()
    arena = tmp_path / "arena"
    arena.write_bytes(b"\0" * 8 * mib)
    dst = backend.host_view(str(arena), 8 * mib)
    big = cuda.to_device(torch.randn(5 * mib // 4))  # 5 MiB
    gs.split_copies(types.SimpleNamespace(_handoff=types.SimpleNamespace(backend=backend)), 2 * mib)
    backend.copy([(big, mib, 5 * mib)], dst, {0}).wait()
    assert [c.nbytes for c in cuda.copies] == [mib, 2 * mib, 2 * mib]  # cut at 2 and 4 MiB of the arena
    assert torch.equal(dst[mib : 6 * mib], big.view(torch.uint8))
    backend.close()


def _load_profile():
    path = Path(__file__).resolve().parent / "bench" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("ckptd_bench_gpu_profile", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
