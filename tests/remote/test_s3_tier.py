"""The object-store tier (`ckptd serve --remote s3://BUCKET/PREFIX`, issue 23 item 2) against a
real S3 server (SeaweedFS, tests/s3_server.py) with real daemons: uploads in the layout of the
disk, restores onto an empty root, copies of unchanged files inside the bucket, the bucket's own
retention, the catch-up after a restart, checksums on both ends, status and metrics, and
credentials from an AWS profile. Every test has its own bucket on one server."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from ckptd.client.errors import CheckpointError
from ckptd.format.index import INDEX_NAME
from ckptd.daemon.tools.verify import verify_step
from metrics_scrape import scrape
from s3_rig import Bucket, Node, StatusPoller, daemon_env, equal_states, remote_status, state_of, uploads_settled, wait_for, zeros_like
from s3_server import S3Server, module_s3_server  # noqa: F401  (the fixture)

JOB = "run-7"


@pytest.fixture
def bucket(module_s3_server: S3Server) -> Bucket:  # noqa: F811
    name = module_s3_server.make_bucket(f"b-{uuid.uuid4().hex[:12]}")
    return Bucket(module_s3_server, name, "ckpt/team")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    made = [Node(tmp_path / f"node{i}") for i in range(3)]
    yield made
    for node in made:
        node.close()


def settle(node: Node) -> dict:
    assert node.daemon is not None
    return wait_for(lambda: uploads_settled(node.daemon.address), 60, "the uploads to settle")


def save(node: Node, *steps: int, nbytes: int = 2 << 20) -> None:
    with node.client(JOB) as ckpt:
        for step in steps:
            ckpt.save(step, state_of(step, nbytes)).wait_durable(60)


def test_committed_steps_are_uploaded_as_on_disk_and_a_fresh_daemon_restores_them_bit_exact(
    module_s3_server: S3Server, bucket: Bucket, nodes: list[Node], tmp_path: Path, port: int  # noqa: F811
) -> None:
    first, fresh = nodes[0], nodes[1]
    env = daemon_env(module_s3_server)
    first.start(bucket.url, env, "--metrics-port", str(port))
    save(first, 1, 2, 3)
    remote = settle(first)
    assert (remote["uploaded_steps"], remote["pending_steps"], remote["failures"], remote["lag_s"]) == (3, 0, 0, 0.0)
    assert remote["location"] == bucket.url and remote["last_uploaded"] == f"job {JOB} step 3"
    poller = StatusPoller(first.daemon.address)  # type: ignore[union-attr]
    try:  # `ckptd status --job`: the job's own uploads; another job sees none of them
        assert poller.status(JOB)["remote"]["last_uploaded"] == f"job {JOB} step 3"
        other = poller.status("another-job")["remote"]
        assert (other["last_uploaded"], other["last_error"], other["pending_steps"]) == ("", "", 0)
    finally:
        poller.close()
    # the same layout as on disk: every file of every local step, same names and sizes, nothing else
    local = {f"{p.parent.name}/{p.name}": p.stat().st_size for p in (first.root / JOB).glob("step-*/*")}
    assert {k.split(f"/{JOB}/", 1)[1]: v for k, v in bucket.keys(f"{JOB}/").items()} == local
    assert bucket.check_all_complete(JOB, tmp_path / "check") == [1, 2, 3]
    metrics = scrape(port)
    assert metrics[f'ckptd_remote_uploaded_steps_total{{job="{JOB}"}}'] == 3
    assert metrics[f'ckptd_remote_uploaded_bytes_total{{job="{JOB}"}}'] == sum(local.values())
    assert metrics["ckptd_remote_pending_steps"] == 0 and metrics["ckptd_remote_lag_seconds"] == 0
    first.stop()

    fresh.start(bucket.url, env)  # an empty root: a new machine after the whole cluster was lost
    with fresh.client(JOB) as ckpt:
        listed = ckpt.list()
        assert [(i.step, i.path) for i in listed] == [(s, f"{bucket.url}/{JOB}/step-{s:08d}") for s in (1, 2, 3)]
        out = zeros_like(state_of(3, 2 << 20))
        assert ckpt.load(out) == 3 and equal_states(out, state_of(3, 2 << 20))
        out = zeros_like(state_of(1, 2 << 20))
        assert ckpt.load(out, step=1) == 1 and equal_states(out, state_of(1, 2 << 20))
        assert [i.step for i in ckpt.list()] == [1, 2, 3]
        assert [i.path.startswith("s3://") for i in ckpt.list()] == [False, True, False]
        with pytest.raises(CheckpointError):
            ckpt.load(zeros_like(state_of(9, 2 << 20)), step=9)  # in neither place
    for step in (1, 3):
        assert verify_step(fresh.root / JOB / f"step-{step:08d}").ok
    assert (fresh.root / JOB / "latest").read_text().strip() == "step-00000003"
    restored = remote_status(fresh.daemon.address)["remote"]
    assert restored["restored_steps"] == 2 and restored["uploaded_steps"] == 0 and restored["pending_steps"] == 0


def test_a_file_unchanged_since_an_uploaded_step_is_copied_inside_the_bucket(
    module_s3_server: S3Server, bucket: Bucket, nodes: list[Node], tmp_path: Path  # noqa: F811
) -> None:
    """An incremental save hard-links the file of frozen weights into the next step: the tier
    copies that object inside the bucket instead of sending its bytes again."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.ModuleDict({"base": nn.Linear(256, 256), "adapter": nn.Linear(256, 4)})
    model["base"].requires_grad_(False)
    opt = torch.optim.Adam(model["adapter"].parameters(), lr=0.1)
    node = nodes[0]
    node.start(bucket.url, daemon_env(module_s3_server))
    with node.client(JOB) as ckpt:
        for step in (1, 2):
            model["adapter"](torch.randn(2, 256)).pow(2).mean().backward()
            opt.step()
            ckpt.save(step, {"model": model, "optimizer": opt}).wait_durable(60)
            remote = settle(node)
    linked = [p for p in (node.root / JOB / "step-00000002").glob("*.safetensors") if p.stat().st_nlink == 2]
    assert linked, "the incremental save linked no file"
    assert remote["copied_bytes"] == sum(p.stat().st_size for p in linked) and remote["uploaded_steps"] == 2
    assert bucket.check_all_complete(JOB, tmp_path / "check") == [1, 2]


def test_the_bucket_keeps_steps_by_its_own_retention(module_s3_server: S3Server, bucket: Bucket, nodes: list[Node]) -> None:  # noqa: F811
    node = nodes[0]
    node.start(bucket.url, daemon_env(module_s3_server), "--keep-last", "1", "--remote-keep-last", "2", "--remote-keep-every", "2")
    for step in (1, 2, 3, 4, 5):
        save(node, step, nbytes=1 << 16)
        settle(node)
    assert bucket.steps(JOB) == [2, 4, 5]  # the newest 2, and every second step
    assert sorted(p.name for p in (node.root / JOB).glob("step-*")) == ["step-00000005"]
    assert not any("/step-00000001/" in k or "/step-00000003/" in k for k in bucket.keys(f"{JOB}/"))  # files too, not just the index


def test_a_restart_uploads_what_the_bucket_lacks_and_a_damaged_local_file_is_never_uploaded(
    module_s3_server: S3Server, bucket: Bucket, nodes: list[Node], tmp_path: Path  # noqa: F811
) -> None:
    node = nodes[0]
    from ckptd.demo.process import start_daemon

    # committed while the daemon ran without the tier (or died before uploading): found at the next start
    plain = start_daemon(node.root, node.sock_dir / "d.sock", ["--shm-dir", str(node.shm)], env=daemon_env(module_s3_server))
    node.daemon = plain
    save(node, 1, 2, 3, nbytes=1 << 18)
    plain.stop()
    damaged = node.root / JOB / "step-00000002" / "model-00001-of-00001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x01  # a bit flipped on this node's disk after the commit
    damaged.write_bytes(bytes(data))

    node.start(bucket.url, daemon_env(module_s3_server))
    remote = settle(node)
    assert bucket.steps(JOB) == [1, 3]
    assert remote["failures"] == 1 and "do not match their checksum" in remote["last_error"] and "step 2" in remote["last_error"]
    assert not any("/step-00000002/" in k for k in bucket.keys(f"{JOB}/"))
    bucket.check_all_complete(JOB, tmp_path / "check")
    node.stop()
    node.start(bucket.url, daemon_env(module_s3_server))  # once more: nothing to do
    assert settle(node)["uploaded_steps"] == 0


def test_a_damaged_object_is_refused_on_restore_and_leaves_nothing_behind(
    module_s3_server: S3Server, bucket: Bucket, nodes: list[Node]  # noqa: F811
) -> None:
    first, fresh = nodes[0], nodes[1]
    env = daemon_env(module_s3_server)
    first.start(bucket.url, env)
    save(first, 1, nbytes=1 << 18)
    settle(first)
    first.stop()
    key = f"{bucket.prefix}/{JOB}/step-00000001/model-00001-of-00001.safetensors"
    body = bytearray(bucket.client.get_object(Bucket=bucket.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x80
    bucket.client.put_object(Bucket=bucket.bucket, Key=key, Body=bytes(body))

    fresh.start(bucket.url, env)
    with fresh.client(JOB) as ckpt, pytest.raises(CheckpointError, match="do not match their checksum"):
        ckpt.load(zeros_like(state_of(1, 1 << 18)))
    assert not (fresh.root / JOB).exists() or not list((fresh.root / JOB).glob("step-*"))


def test_credentials_come_from_an_aws_profile(module_s3_server: S3Server, bucket: Bucket, nodes: list[Node], tmp_path: Path) -> None:  # noqa: F811
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(
        f"[training]\naws_access_key_id = {module_s3_server.access_key_id}\naws_secret_access_key = {module_s3_server.secret_access_key}\n"
    )
    config = tmp_path / "aws-config"
    config.write_text(f"[profile training]\nregion = {module_s3_server.region}\nendpoint_url = {module_s3_server.endpoint_url}\n")
    env = {k: v for k, v in daemon_env(module_s3_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")}
    env.update(AWS_PROFILE="training", AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_CONFIG_FILE=str(config))
    node = nodes[0]
    node.start(bucket.url, env)
    save(node, 1, nbytes=1 << 16)
    assert settle(node)["uploaded_steps"] == 1 and bucket.steps(JOB) == [1]
    assert "(profile training)" in node.daemon.log_text()
    assert INDEX_NAME in "".join(bucket.keys(f"{JOB}/"))


@pytest.mark.parametrize("shared_root", [False, True], ids=["own-roots", "shared-root"])
def test_each_node_uploads_its_own_files_and_new_nodes_restore_the_step(
    module_s3_server: S3Server, bucket: Bucket, tmp_path: Path, shared_root: bool  # noqa: F811
) -> None:
    """Two nodes with their own roots: each uploads the data files it wrote, node 0 the small
    files and, once every file is in the bucket, the index (a root shared by both: node 0
    uploads everything). Two new nodes on empty roots download the step (each its own copy, or
    from a peer that has it already; sharing a root: node 0 downloads it, node 1 waits for it) and
    load it, bit-exact."""
    from concurrent.futures import ThreadPoolExecutor

    from daemon_rig import PEER_TOKEN, free_port

    env = daemon_env(module_s3_server, CKPTD_PEER_TOKEN=PEER_TOKEN)

    def cluster(name: str) -> list[Node]:
        peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
        made = [Node(tmp_path / (name if shared_root else f"{name}{i}")) for i in range(2)]
        for i, node in enumerate(made):
            node.start(bucket.url, env, "--node-rank", str(i), "--peers", peers)
        return made

    def on_every_rank(nodes: list[Node], work) -> list:
        def rank(r: int) -> object:
            with nodes[r].client(JOB, rank=r, world_size=2) as ckpt:
                return work(ckpt)
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(rank, range(2)))

    first = cluster("old")
    try:
        for step in (1, 2):
            on_every_rank(first, lambda ckpt: ckpt.save(step, state_of(step, 1 << 20)).wait_durable(60))
        member = settle(first[1])
        coordinator = settle(first[0])
        assert (coordinator["uploaded_steps"], member["uploaded_steps"]) == (2, 0)
        assert (member["uploaded_bytes"] == 0) == shared_root  # with a shared root node 0 uploads every file
        index = bucket.check_complete(JOB, 2, tmp_path / "check")
        assert {f.node for f in index.files if f.name.endswith(".safetensors")} == {0, 1}  # each node wrote a part
    finally:
        for node in first:
            node.close()

    fresh = cluster("new")
    try:
        outs = on_every_rank(fresh, lambda ckpt: (ckpt.load(out := zeros_like(state_of(2, 1 << 20))), out))
        assert all(step == 2 and equal_states(out, state_of(2, 1 << 20)) for step, out in outs)
        restored = [remote_status(node.daemon.address)["remote"]["restored_steps"] for node in fresh]
        # own roots: each node downloads the whole step, unless a peer had it first (the peers
        # come before the bucket); a shared root: node 0 downloads, node 1 waits for it
        assert restored == [1, 0] if shared_root else sum(restored) >= 1
        assert all(verify_step(node.root / JOB / "step-00000002").ok for node, got in zip(fresh, restored) if got)
    finally:
        for node in fresh:
            node.close()


def test_a_graceful_stop_does_not_wait_for_an_upload_and_the_next_start_finishes_it(
    module_s3_server: S3Server, bucket: Bucket, nodes: list[Node]  # noqa: F811
) -> None:
    import time

    node = nodes[0]
    env = daemon_env(module_s3_server)
    node.start(bucket.url, env, "--remote-streams", "1", "--remote-part-bytes", "5MiB")
    save(node, 1, nbytes=64 << 20)
    wait_for(lambda: any("/step-00000001/" in key for key in bucket.unfinished_uploads()), 30, "the multipart upload", poll_s=0.01)
    started = time.monotonic()
    node.stop()  # SIGTERM in the middle of the upload
    assert time.monotonic() - started < 15 and bucket.steps(JOB) == []
    node.start(bucket.url, env)
    assert settle(node)["uploaded_steps"] == 1 and bucket.steps(JOB) == [1] and bucket.unfinished_uploads() == []


def ckptd_ls(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "ls", *args], env=env, capture_output=True, text=True, timeout=60)


def test_ckptd_ls_lists_the_buckets_steps_without_a_daemon(module_s3_server: S3Server, bucket: Bucket, nodes: list[Node]) -> None:  # noqa: F811
    """`ckptd ls s3://BUCKET/PREFIX [JOB]`: what a new machine sees after a full-cluster loss,
    with the same credentials as the daemon's; a step's objects without its index are listed
    only with --all, as uncommitted; bad input is refused with what to fix."""
    env = daemon_env(module_s3_server)
    nodes[0].start(bucket.url, env)
    save(nodes[0], 1, 2)
    settle(nodes[0])
    nodes[0].stop()  # no daemon runs from here on
    bucket.client.put_object(Bucket=bucket.bucket, Key=f"{bucket.prefix}/{JOB}/step-00000009/model-00001-of-00001.safetensors", Body=b"x")
    bucket.client.put_object(Bucket=bucket.bucket, Key=f"{bucket.prefix}/other/step-00000004/{INDEX_NAME}", Body=b"{}")  # damaged: skipped

    listed = ckptd_ls(env, bucket.url, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["job"], r["step"], r["state"], r["latest"]) for r in rows] == [(JOB, 1, "committed", False), (JOB, 2, "committed", True)]
    assert rows[1]["path"] == f"{bucket.url}/{JOB}/step-00000002" and rows[1]["tensors"] == 4 and rows[1]["size_bytes"] > 2 << 20

    listed = ckptd_ls(env, bucket.url, JOB, "--all")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 4 and "(latest)" in lines[2] and f"{bucket.url}/{JOB}/step-00000009" in lines[3] and "uncommitted" in lines[3], lines

    wrong = ckptd_ls({**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}, bucket.url)
    assert wrong.returncode == 2 and bucket.url in wrong.stderr and "AWS_SECRET_ACCESS_KEY" in wrong.stderr, wrong.stderr
    missing = ckptd_ls(env, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")
    assert missing.returncode == 2 and "bucket" in missing.stderr, missing.stderr
    bad = ckptd_ls(env, "s3://Bad_Bucket/x")
    assert bad.returncode == 2 and "not a valid S3 bucket name" in bad.stderr, bad.stderr
    bad_job = ckptd_ls(env, bucket.url, "../etc")
    assert bad_job.returncode == 2 and "../etc" in bad_job.stderr, bad_job.stderr
