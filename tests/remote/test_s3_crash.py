"""Crash at every object-store request of an upload (issue 23 "Must show", in the spirit of
tests/integration/test_crash_every_event.py): the daemon kills itself (SIGKILL, no cleanup, no
abort of the multipart upload in flight) just before its N-th request to the object store
(ckptd.daemon.faults.objects: CKPTD_FAULT_S3_KILL_AT, counted once CKPTD_FAULT_S3_ARM_FILE exists),
for every N of the upload of a step: its data file in parts (a kill between two parts), the small
files, node 0's check that every file is there, the index, and the bucket's retention. The
default run kills at every other N and at the first and last request of each kind (kill_points);
`pytest -m long` at every N.

After each kill, and again after each restart:
- every step visible in the bucket (its index present) is complete: each file it lists is there
  and verifies against it (downloaded by an independent client and `ckptd verify`);
After each restart, once the catch-up is done:
- the interrupted step is in the bucket (the upload completed), and the bucket holds exactly the
  steps its retention keeps;
- at the end, no unfinished multipart upload is left (swept at start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.client.errors import CheckpointError
from ckptd.daemon.faults.objects import ARM_FILE_ENV, KILL_AT_ENV, LOG_ENV
from s3_rig import Bucket, Node, daemon_env, save_steps, uploads_settled, wait_for
from s3_server import running_s3_server

JOB = "crash"
# One stream: the requests of an upload come in the same order in every run, so the N-th request
# of a kill run is the N-th of the counting run (with two, a part and a small file raced, and the
# kills could miss a kind of request the counting run made).
ARGS = ("--remote-part-bytes", "5MiB", "--remote-streams", "1", "--keep-last", "2", "--remote-keep-last", "2")
NBYTES = 11 << 20  # one data file of three parts
MIN_EVENTS = 12  # get index, put-file, its part reads, 3 small files, list, index, retention: a hook that stops counting fails here


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def kill_points(counted: list[dict], every: int) -> list[int]:
    """The requests to kill at (1-based): every `every`-th, and always the first and the last of
    each kind (the first part and the last, the index's put, the list, the retention's delete)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for e in counted:
        first.setdefault(e["kind"], e["n"])
        last[e["kind"]] = e["n"]
    ends = set(first.values()) | set(last.values())
    return [n for n in range(1, len(counted) + 1) if (n - 1) % every == 0 or n in ends]


def test_the_kill_points_are_every_kth_request_and_the_first_and_last_of_each_kind() -> None:
    kinds = ["get", "put-file", "put-part", "put-part", "put-part", "put-part", "put", "put", "put", "list", "delete", "delete"]
    counted = [{"n": i + 1, "kind": k} for i, k in enumerate(kinds)]
    assert kill_points(counted, 3) == [1, 2, 3, 4, 6, 7, 9, 10, 11, 12]
    assert kill_points(counted, 1) == list(range(1, 13))


# The default run kills at every other request and at the first and last of each kind; `pytest -m
# long` at every request.
@pytest.mark.slow
@pytest.mark.parametrize("every", [2, pytest.param(1, marks=pytest.mark.long)])
def test_a_daemon_killed_at_every_request_of_an_upload_leaves_complete_steps_only(tmp_path: Path, every: int) -> None:
    node = Node(tmp_path / "node")
    try:
        with running_s3_server() as server:
            bucket = Bucket(server, server.make_bucket("crash-every-request"), "ckpt")
            env = daemon_env(server)

            def settled_check(expected: list[int]) -> None:
                wait_for(lambda: uploads_settled(node.daemon.address), 60, "the catch-up after a restart")
                assert bucket.steps(JOB) == expected, (bucket.steps(JOB), expected)
                assert bucket.check_all_complete(JOB, tmp_path / "check") == expected

            # the steady state (the bucket full to its retention), then the counting run
            count_log, arm = tmp_path / "count.jsonl", tmp_path / "arm-count"
            node.start(bucket.url, {**env, LOG_ENV: str(count_log), ARM_FILE_ENV: str(arm)}, *ARGS)
            save_steps(node, JOB, [1, 2], NBYTES)
            settled_check([1, 2])
            arm.touch()
            save_steps(node, JOB, [3], NBYTES)
            settled_check([2, 3])
            node.stop()
            counted = events(count_log)
            kinds = {e["kind"] for e in counted}
            assert len(counted) >= MIN_EVENTS and {"put-file", "put-part", "put", "list", "delete"} <= kinds, counted

            step = 3
            killed, unacknowledged = [], []
            for n in kill_points(counted, every):
                log, arm = tmp_path / f"kill{n}.jsonl", tmp_path / f"arm{n}"
                node.start(bucket.url, {**env, KILL_AT_ENV: str(n), LOG_ENV: str(log), ARM_FILE_ENV: str(arm)}, *ARGS)
                settled_check([step - 1, step])  # the previous kill's step was uploaded after the restart
                arm.touch()
                step += 1
                try:  # committed here before any request (the upload follows the commit), but the
                    save_steps(node, JOB, [step], NBYTES)  # daemon may die before its answer reaches the rank:
                except CheckpointError as exc:  # the next settled_check finds the step uploaded all the same
                    unacknowledged.append((n, str(exc)))
                node.daemon.popen.wait(60)
                assert events(log)[-1]["n"] == n, f"kill at request {n}: the daemon did not die there"
                killed.append(events(log)[-1]["kind"])
                bucket.check_all_complete(JOB, tmp_path / "check")  # whatever the kill left: complete steps only
            node.start(bucket.url, env, *ARGS)
            settled_check([step - 1, step])
            assert bucket.unfinished_uploads() == []
            assert sorted(set(killed)) == sorted(kinds)
            # Only kills early in the upload race the commit's answer (3 at most on a quiet machine); a
            # loaded one delays the answer past more requests, so the bound is loose: most saves are answered.
            assert len(unacknowledged) <= len(counted) // 2, unacknowledged
    finally:
        node.close()
