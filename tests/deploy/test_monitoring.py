"""deploy/prometheus and deploy/grafana (issue 22 item 8): the alerting rules pass `promtool
check rules` and their unit tests (`promtool test rules`), the PrometheusRule manifest holds the
same groups, and every metric the rules and the dashboard query is one the daemon exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from ckptd.daemon.metrics import LiveState, Metrics

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "ckptd-alerts.yaml"
OPERATOR_RULES = REPO / "deploy" / "prometheus" / "ckptd-prometheusrule.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "ckptd-dashboard.json"
RULE_TESTS = Path(__file__).with_name("ckptd-alerts-test.yaml")
METRIC = re.compile(r"\b(ckptd_[a-z_]+)")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def exported_series() -> set[str]:
    """Every series name the daemon's /metrics can show (counters with _total, histograms' parts)."""
    metrics = Metrics(0)
    metrics.watch(lambda: LiveState(queue_depth={"j": 1}, open_saves={"j": 1}))
    for family in ("stall", "commit_latency"):
        getattr(metrics, family).labels("j").observe(0.1)
    for name in ("bytes_written", "commits", "skipped", "refused_no_space", "retention_deleted"):
        getattr(metrics, name).labels("j").inc()
    metrics.throughput.labels("j").set(1)
    metrics.last_commit.labels("j").set(1)
    metrics.last_step.labels("j").set(1)
    metrics.failures.labels("timeout").inc()
    metrics.loads.labels("disk").inc()
    metrics.info.labels("0.1.0", "0").set(1)
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ckptd_")}


def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([tool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=120, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_the_prometheusrule_manifest_holds_the_same_rules() -> None:
    manifest = yaml.safe_load(OPERATOR_RULES.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_the_rules_and_the_dashboard_query_only_metrics_the_daemon_exports() -> None:
    exported = exported_series()
    rules = yaml.safe_load(RULES.read_text())
    queried = {m for group in rules["groups"] for rule in group["rules"] for m in METRIC.findall(rule["expr"])}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried |= {m for e in exprs for m in METRIC.findall(e)}
    assert queried and sorted(queried - exported) == []


def test_the_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "ckptd" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] and p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
