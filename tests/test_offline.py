"""ckptd.offline: a step saved through a daemon is read back without one — listed, opened,
loaded in place into another layout, read whole, decoded when quantized."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, CheckpointError, CheckpointNotFound, LocalShard
from ckptd.daemon.importer.importing import import_checkpoint
from ckptd.offline import list_steps, open_step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture(scope="module")
def saved(module_daemons) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    daemon = module_daemons.start()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointClient("off", address=daemon.address, on_error="raise", run_config={"lr": 1e-2}) as ckpt:
        for step in (1, 2):
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            ckpt.save(step, {"model": model, "optimizer": opt, "extra": {"epoch": step}}, quantize="O1" if step == 2 else "none").wait_durable(timeout=60)
    daemon.stop()
    return module_daemons.root, model, opt


def test_steps_are_listed_in_commit_order(saved) -> None:
    root, _, _ = saved
    infos = list_steps(root, "off")
    assert [i.step for i in infos] == [1, 2]
    assert infos[-1].path == root / "off" / "step-00000002" and infos[-1].size_bytes > 0


def test_a_step_loads_in_place_with_its_extras_and_decoded_moments(saved) -> None:
    root, model, opt = saved
    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    state = {"model": fresh, "optimizer": fresh_opt, "extra": {"epoch": 0}}
    step = open_step(root, "off")
    assert step.step == 2 and step.load(state) == 2
    assert state["extra"]["epoch"] == 2
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    exp_avg = fresh_opt.state[fresh[0].weight]["exp_avg"]  # int8-quantized: close, not equal
    assert torch.allclose(exp_avg, opt.state[model[0].weight]["exp_avg"], atol=2e-3, rtol=0.05)
    assert step.environment["trainer"]["run_config"] == {"lr": 1e-2}


def test_whole_tensors_state_dicts_and_boxes(saved) -> None:
    root, model, _ = saved
    step = open_step(root / "off" / "step-00000001")
    weights = step.state_dict("model")
    assert set(weights) == set(model.state_dict())
    assert torch.equal(step.tensor("model/0.weight"), weights["0.weight"])
    box = step.read_box("model/0.weight", (4, 2), (8, 3))
    assert torch.equal(box, weights["0.weight"][4:12, 2:5])
    assert {t.kind for t in step.tensors()} == {"model", "optimizer"}


def test_two_ranks_load_column_shards(saved) -> None:
    root, _, _ = saved
    step = open_step(root, "off", 1)
    whole = step.tensor("model/2.weight")  # (4, 16)

    def load(rank: int) -> torch.Tensor:
        target = torch.zeros(4, 8)
        step.load({"model": {"2.weight": LocalShard(target, (0, 8 * rank), (4, 16))}}, strict=False, rank=rank)
        return target

    with ThreadPoolExecutor(2) as pool:
        left, right = pool.map(load, range(2))
    assert torch.equal(torch.cat([left, right], 1), whole)


def test_strict_loads_name_what_is_missing(saved) -> None:
    root, _, _ = saved
    with pytest.raises(CheckpointError, match="model/extra_layer"):
        open_step(root, "off").load({"model": {"extra_layer": torch.zeros(2)}})


def test_errors_say_what_to_give(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    with pytest.raises(CheckpointNotFound, match="step 9"):
        open_step(root, "off", 9)
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
        open_step(root, "nothing")
    with pytest.raises(CheckpointError, match="not a directory"):
        list_steps(tmp_path / "absent", "off")
    with pytest.raises(CheckpointError, match="step directory, not a storage root"):
        list_steps(root / "off" / "step-00000001", "off")


def test_a_step_reached_through_a_link_is_not_read(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    fake_root = tmp_path / "root"
    (fake_root).mkdir()
    os.symlink(root / "off", fake_root / "off")
    with pytest.raises((CheckpointError, CheckpointNotFound)):
        open_step(fake_root, "off", 1).state_dict()


def test_targets_off_the_cpu_are_filled_through_host_tensors() -> None:
    """The reader writes host memory only: a GPU target gets a CPU tensor to fill, then a copy."""
    from ckptd.client.reader.fill import Fill
    from ckptd.common.boxes import Box
    from ckptd.offline.reader import host_fills

    on_cpu = Fill(torch.zeros(2, 3), Box.full((2, 3)), [])
    elsewhere = Fill(torch.empty(4, 5, dtype=torch.bfloat16, device="meta"), Box((0, 0), (4, 5)), [])
    on_host, to_device = host_fills([on_cpu, elsewhere])
    assert on_host[0] is on_cpu
    assert on_host[1].target.device.type == "cpu" and on_host[1].target.shape == (4, 5) and on_host[1].target.dtype == torch.bfloat16
    assert on_host[1].want == elsewhere.want and to_device == [(elsewhere.target, on_host[1].target)]


@pytest.mark.gpu
def test_a_model_on_the_gpu_loads_offline(saved) -> None:
    root, _, _ = saved
    step = open_step(root, "off", 1)
    fresh = _model().cuda()
    step.load({"model": fresh})
    for name, expected in step.state_dict("model").items():
        loaded = fresh.state_dict()[name]
        assert loaded.device.type == "cuda" and torch.equal(loaded.cpu(), expected)


def test_several_boxes_of_one_tensor_read_at_once_into_any_target(saved) -> None:
    root, _, _ = saved
    step = open_step(root, "off", 1)
    whole = step.tensor("model/0.weight")  # (16, 8)
    strided = torch.zeros(8, 16).t()  # a non-contiguous (16, 8) view, read into in place
    top, bottom, converted = step.read_boxes(
        [("model/0.weight", (0, 0), (8, 8), None), ("model/0.weight", (8, 0), (8, 8), None), ("model/0.weight", (0, 0), (16, 8), strided)]
    )
    assert torch.equal(torch.cat([top, bottom]), whole)
    assert converted is strided and torch.equal(strided, whole)
    assert torch.equal(step.read_box("model/0.weight", (2, 3), (4, 2), out=torch.zeros(4, 2, dtype=torch.float64)), whole[2:6, 3:5].double())


# issue 30 finding 10: a FIFO or a link planted in place of a step's data file is refused, never
# waited on or followed, for whole tensors and for boxes (whose ranges are advised to the kernel first).
@pytest.mark.parametrize("planted", ["fifo", "link"])
@pytest.mark.parametrize("box", [None, ((1, 0), (2, 4))])
def test_a_fifo_or_a_link_planted_as_a_data_file_is_refused_not_read(tmp_path: Path, planted: str, box) -> None:
    torch.save({"w": torch.arange(16.0).reshape(4, 4)}, tmp_path / "w.pt")
    step_dir = import_checkpoint(tmp_path / "w.pt", tmp_path / "root", "j", 1).step_dir
    (data,) = step_dir.glob("model-*.safetensors")
    data.rename(tmp_path / "moved.safetensors")
    if planted == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to(tmp_path / "moved.safetensors")
    step = open_step(tmp_path / "root", "j")
    outcome: list[BaseException | torch.Tensor] = []

    def read() -> None:
        try:
            outcome.append(step.tensor("model/w") if box is None else step.read_box("model/w", *box))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    waited = reader.is_alive()
    if waited and planted == "fifo":
        os.close(os.open(data, os.O_WRONLY | os.O_NONBLOCK))  # a writer lets the blocked open return
        reader.join(10)
    assert not waited, "the read waited on the FIFO"
    (result,) = outcome
    assert isinstance(result, CheckpointError), result
    assert str(data) in str(result) and ("not a regular file" if planted == "fifo" else "a symbolic link, which ckptd never follows") in str(result)
