"""Faults of the object-store tier (issue 23 item 2): refused credentials, no credentials, a missing
bucket and a missing client library stop `ckptd serve --remote` at start with a message that says
what to fix (the daemon never runs silently without the tier it was told to use); a server
killed in the middle of an upload is retried with backoff while training goes on, the step is
uploaded once the server is back, and the bucket never shows a half step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from ckptd.client import CheckpointError
from s3_rig import Bucket, Node, RestartableS3, daemon_env, equal_states, remote_status, save_steps, state_of, uploads_settled, wait_for, zeros_like
from s3_server import S3Server, module_s3_server  # noqa: F401  (the fixture)

JOB = "faults"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "node")
    yield made
    made.close()


def refused(node: Node, remote: str, env: dict[str, str]) -> str:
    """Run `ckptd serve --remote` expecting it to refuse to start; its output."""
    result = node.run(remote, env)
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    return result.stdout + result.stderr


@pytest.mark.parametrize(("variable", "value", "code"), [("AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch"),
                                                          ("AWS_ACCESS_KEY_ID", "AKIDUNKNOWN", "InvalidAccessKeyId")])
def test_refused_credentials_stop_the_daemon_at_start_naming_the_bucket_and_the_variable(
    module_s3_server: S3Server, node: Node, variable: str, value: str, code: str  # noqa: F811
) -> None:
    bucket = module_s3_server.make_bucket(f"c-{uuid.uuid4().hex[:12]}")
    out = refused(node, f"s3://{bucket}/ckpt", daemon_env(module_s3_server, **{variable: value}))
    assert "cannot serve" in out and f"s3://{bucket}/ckpt" in out and f"bucket '{bucket}'" in out
    assert code in out and "AWS_ACCESS_KEY_ID" in out and "AWS_SECRET_ACCESS_KEY" in out and "AWS_PROFILE" in out


def test_no_credentials_at_all_stop_the_daemon_at_start(module_s3_server: S3Server, node: Node) -> None:  # noqa: F811
    env = {k: v for k, v in daemon_env(module_s3_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    out = refused(node, "s3://any-bucket/ckpt", env)
    assert "no AWS credentials found" in out and "AWS_ACCESS_KEY_ID" in out


def test_a_missing_bucket_stops_the_daemon_at_start(module_s3_server: S3Server, node: Node) -> None:  # noqa: F811
    out = refused(node, "s3://no-such-bucket-here/ckpt", daemon_env(module_s3_server))
    assert "the bucket 'no-such-bucket-here' does not exist" in out and "create it" in out and module_s3_server.endpoint_url in out


def test_without_obstore_the_daemon_runs_and_only_remote_asks_for_the_extra(module_s3_server: S3Server, node: Node, tmp_path: Path) -> None:  # noqa: F811
    hide = tmp_path / "hide"
    (hide / "obstore").mkdir(parents=True)
    (hide / "obstore" / "__init__.py").write_text("raise ImportError('obstore is not installed (hidden by the test)')\n")
    env = daemon_env(module_s3_server, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]))
    out = refused(node, "s3://some-bucket/ckpt", env)
    assert "pip install 'ckptd[s3]'" in out
    probe = ("import sys; from pathlib import Path; from ckptd.daemon.config import DaemonConfig; from ckptd.daemon.service import CheckpointService; "
             "CheckpointService(DaemonConfig(root=Path(sys.argv[1]), socket=Path('/tmp/x.sock'))); "
             "assert 'obstore' not in sys.modules and 'boto3' not in sys.modules, sorted(m for m in sys.modules if 'boto' in m or 'obstore' in m)")
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "root")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_server_killed_mid_upload_is_retried_with_backoff_and_the_bucket_never_shows_a_half_step(node: Node, tmp_path: Path) -> None:
    server = RestartableS3()
    try:
        bucket = Bucket(server.server, server.server.make_bucket("outage"), "ckpt")
        env = daemon_env(server.server, CKPTD_FAULT_S3_RETRY_S="1")  # one request is retried 1 s: the step-level retries show
        node.start(bucket.url, env, "--remote-part-bytes", "5MiB", "--remote-streams", "2")
        save_steps(node, JOB, [1], nbytes=1 << 16)
        wait_for(lambda: uploads_settled(node.daemon.address), 30, "step 1 uploaded")
        save_steps(node, JOB, [2], nbytes=48 << 20)  # ten parts, two in flight
        wait_for(lambda: any("/step-00000002/" in key for key in bucket.unfinished_uploads()), 30, "the multipart upload of step 2", poll_s=0.01)
        server.kill()  # in the middle of that upload
        save_steps(node, JOB, [3], nbytes=1 << 16)  # training goes on while the object store is down
        remote = wait_for(lambda: (r := remote_status(node.daemon.address)["remote"])["failures"] >= 2 and r, 60, "retried attempts")
        assert remote["state"] == "retrying" and remote["pending_steps"] == 2 and remote["lag_s"] > 0
        delays = [float(d) for d in re.findall(r"failed \(attempt \d+\), retrying in (\d+) s", node.daemon.log_text())]
        assert delays[:2] == [1.0, 2.0], delays  # exponential backoff
        server.restart()
        remote = wait_for(lambda: uploads_settled(node.daemon.address), 90, "the uploads after the server came back")
        assert remote["uploaded_steps"] == 3 and bucket.steps(JOB) == [1, 2, 3]
        assert bucket.check_all_complete(JOB, tmp_path / "check") == [1, 2, 3]
        # issue 30 finding 11: the same daemon, no restart: its retry aborted the multipart upload
        # the failed attempt abandoned (the test below, under `long`, shows it alone)
        assert bucket.unfinished_uploads() == []
        assert re.search(r"aborted \d+ unfinished multipart upload\(s\) of \S+/step-00000002/\S+ that a failed attempt left", node.daemon.log_text())
        node.stop()
        node.start(bucket.url, env)  # the next start sweeps what the interrupted multipart uploads left
        wait_for(lambda: uploads_settled(node.daemon.address), 30, "the catch-up")
        assert bucket.unfinished_uploads() == []
    finally:
        server.close()



# issue 30 finding 11: the multipart upload a failed attempt abandoned (the server went away in the
# middle of it) is aborted by the next attempt, not left stored and billed until a restart.
# long: the test above checks the same abort after the same kill in the default run.
@pytest.mark.slow
@pytest.mark.long
def test_a_retried_upload_aborts_the_multipart_upload_its_failed_attempt_abandoned(node: Node, tmp_path: Path) -> None:
    server = RestartableS3()
    try:
        bucket = Bucket(server.server, server.server.make_bucket("abandoned"), "ckpt")
        env = daemon_env(server.server, CKPTD_FAULT_S3_RETRY_S="1")
        node.start(bucket.url, env, "--remote-part-bytes", "5MiB", "--remote-streams", "2")
        save_steps(node, JOB, [1], nbytes=48 << 20)  # ten parts, two in flight
        wait_for(lambda: any("/step-00000001/" in key for key in bucket.unfinished_uploads()), 30, "the multipart upload of step 1", poll_s=0.01)
        server.kill()
        wait_for(lambda: remote_status(node.daemon.address)["remote"]["failures"] >= 1, 60, "a failed attempt")
        server.restart()
        remote = wait_for(lambda: uploads_settled(node.daemon.address), 90, "the upload after the server came back")
        assert remote["uploaded_steps"] == 1 and bucket.check_all_complete(JOB, tmp_path / "check") == [1]
        assert bucket.unfinished_uploads() == []  # the same daemon, no restart: its retry aborted what it left
        assert re.search(r"aborted 1 unfinished multipart upload\(s\) of \S+/step-00000001/\S+ that a failed attempt left", node.daemon.log_text())
    finally:
        server.close()


# issue 30 finding 11: the bucket's newest index lists files the bucket no longer holds: a load of
# the newest step says which files are gone and which complete step to load instead.
def test_a_load_of_the_newest_step_names_the_complete_step_to_load_when_the_buckets_newest_lacks_files(
    module_s3_server: S3Server, node: Node, tmp_path: Path,  # noqa: F811
) -> None:
    bucket = Bucket(module_s3_server, module_s3_server.make_bucket(f"gaps-{uuid.uuid4().hex[:8]}"), "ckpt")
    env = daemon_env(module_s3_server)
    node.start(bucket.url, env)
    save_steps(node, JOB, [1, 2, 3], nbytes=1 << 16)
    wait_for(lambda: uploads_settled(node.daemon.address), 60, "the uploads")
    gone = next(k for k in bucket.keys(f"{JOB}/step-00000003/") if k.endswith(".safetensors"))
    bucket.client.delete_object(Bucket=bucket.bucket, Key=gone)  # deleted by hand, or by a lifecycle rule
    node.stop()
    fresh = Node(tmp_path / "fresh")  # a new machine: an empty root, the bucket its only source
    try:
        fresh.start(bucket.url, env)
        with fresh.client(JOB) as ckpt:
            with pytest.raises(CheckpointError) as info:
                ckpt.load(zeros_like(state_of(3, 1 << 16)))
            message = str(info.value)
            assert info.value.code == "FAILED_PRECONDITION" and "step 3" in message and gone.rsplit("/", 1)[1] in message, message
            assert "load it with `load(state, step=2)`" in message, message
            state = zeros_like(state_of(2, 1 << 16))
            assert ckpt.load(state, step=2) == 2 and equal_states(state, state_of(2, 1 << 16))
        assert not (fresh.root / JOB / "step-00000003").exists()  # nothing of the incomplete step was written
    finally:
        fresh.close()
