"""`ckptd verify`, `inspect` and `export` of a step in the object store, named as `ckptd ls
s3://BUCKET/PREFIX` shows it (s3://BUCKET/PREFIX/JOB/step-N), without a daemon, against the
real S3 server (SeaweedFS, tests/s3_server.py); the same answers as for the step directory the
daemon uploaded it from."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from s3_rig import Bucket, Node, daemon_env, state_of, uploads_settled, wait_for
from s3_server import S3Server, module_s3_server  # noqa: F401  (the fixture)

JOB = "run-3"


@pytest.fixture
def uploaded(module_s3_server: S3Server, tmp_path: Path) -> Iterator[tuple[Bucket, Node, dict[str, str]]]:  # noqa: F811
    """Step 1 of JOB saved by a daemon, uploaded, and the daemon stopped."""
    bucket = Bucket(module_s3_server, module_s3_server.make_bucket(f"t-{uuid.uuid4().hex[:12]}"), "ckpt")
    node = Node(tmp_path / "node")
    env = daemon_env(module_s3_server)
    try:
        node.start(bucket.url, env)
        assert node.daemon is not None
        with node.client(JOB) as ckpt:
            ckpt.save(1, state_of(1, 1 << 20)).wait_durable(60)
        wait_for(lambda: uploads_settled(node.daemon.address), 60, "the upload")  # type: ignore[union-attr]
        node.stop()
        yield bucket, node, env
    finally:
        node.close()


def ckptd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", *args], env=env, capture_output=True, text=True, timeout=120)


def test_verify_inspect_and_export_read_a_step_in_the_bucket_as_its_directory(uploaded: tuple[Bucket, Node, dict[str, str]], tmp_path: Path) -> None:
    bucket, node, env = uploaded
    url, local = f"{bucket.url}/{JOB}/step-00000001", str(node.root / JOB / "step-00000001")

    checked = ckptd(env, "verify", url, "--json")
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    assert report["ok"] and report["step_dir"] == url and report["job"] == JOB and report["step"] == 1
    assert report["files_checked"] == json.loads(ckptd(env, "verify", local, "--json").stdout)["files_checked"] > 0

    shown = ckptd(env, "inspect", url, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == json.loads(ckptd(env, "inspect", local, "--json").stdout)

    exported = ckptd(env, "export", url, str(tmp_path / "from-bucket"))
    assert exported.returncode == 0, exported.stderr
    assert ckptd(env, "export", local, str(tmp_path / "from-disk")).returncode == 0
    names = sorted(p.name for p in (tmp_path / "from-disk").iterdir())
    assert names and sorted(p.name for p in (tmp_path / "from-bucket").iterdir()) == names
    for name in names:
        assert (tmp_path / "from-bucket" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes(), name


def test_verify_of_a_step_in_the_bucket_finds_a_damaged_object_and_refuses_what_is_no_step(uploaded: tuple[Bucket, Node, dict[str, str]]) -> None:
    bucket, _, env = uploaded
    key = f"{bucket.prefix}/{JOB}/step-00000001/model-00001-of-00001.safetensors"
    body = bytearray(bucket.client.get_object(Bucket=bucket.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x80
    bucket.client.put_object(Bucket=bucket.bucket, Key=key, Body=bytes(body))
    damaged = ckptd(env, "verify", f"{bucket.url}/{JOB}/step-00000001")
    assert damaged.returncode == 1 and "model-00001-of-00001.safetensors" in damaged.stdout, damaged.stdout + damaged.stderr

    missing = ckptd(env, "verify", f"{bucket.url}/{JOB}/step-00000002", "--json")
    assert missing.returncode == 1 and "is not a committed checkpoint" in missing.stdout, missing.stdout + missing.stderr
    for bad in (bucket.url, f"{bucket.url}/{JOB}"):  # a location or a job: not a step
        refused = ckptd(env, "verify", bad)
        assert refused.returncode == 2 and "s3://BUCKET/PREFIX/JOB/step-NNNNNNNN" in refused.stderr, refused.stderr
    wrong = ckptd({**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "inspect", f"{bucket.url}/{JOB}/step-00000001")
    assert wrong.returncode == 2 and "AWS_SECRET_ACCESS_KEY" in wrong.stderr, wrong.stderr
