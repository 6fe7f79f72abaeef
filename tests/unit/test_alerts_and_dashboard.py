"""The alert rules load and fire as their unit tests say, every alert's runbook link lands on a
section, and the dashboard asks only for metrics outbox exports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import prometheus_client

from outbox.observability import metrics
from tests.support.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus"


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    path = require_tool("promtool", "prometheus")
    return subprocess.run(
        [path, *args],
        cwd=RULES,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_rules_check_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", "outbox-alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "outbox-alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_and_a_runbook_section() -> None:
    rules = (RULES / "outbox-alerts.yml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    assert len(alerts) >= 6
    tests = (RULES / "outbox-alerts.test.yml").read_text()
    runbook_sections = {
        heading.lower()
        for heading in re.findall(
            r"^## (\S+)", (REPO / "docs" / "runbook.md").read_text(), re.MULTILINE
        )
    }
    for alert in alerts:
        assert f"alertname: {alert}" in tests, alert
        assert f"runbook.md#{alert.lower()}" in rules, alert
        assert alert.lower() in runbook_sections, alert


SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
    "gauge": ("",),
}


def exported_names() -> set[str]:
    """Every series name outbox's metrics can export, with or without samples yet."""
    return {
        metric.name + suffix
        for metric in prometheus_client.REGISTRY.collect()
        if metric.name.startswith("outbox_")
        for suffix in SUFFIXES[metric.type]
    }


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(
        (REPO / "deploy" / "grafana" / "outbox-dashboard.json").read_text()
    )
    return loaded


def test_the_dashboard_asks_only_for_exported_metrics() -> None:
    panels = dashboard()["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\boutbox_\w+", expr)}
    assert used <= exported_names(), used - exported_names()
    # What on-call looks for when an alert fires (docs/runbook.md).
    assert {
        "outbox_database_up",
        "outbox_action_paused",
        "outbox_ordering_blocked",
        "outbox_internal_errors_total",
        "outbox_provider_oldest_pending_age_seconds",
        "outbox_reconcile_checks_total",
    } <= used
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("throughput", "latency", "status", "oldest", "paused"):
        assert topic in titles


def test_the_dashboard_panels_have_their_own_ids_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]  # 24 columns
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_a_scrape_passes_promtool_check_metrics() -> None:
    metrics.DISPATCH.labels("p", "a", "succeeded").inc()
    metrics.BUILD_INFO.info({"version": "test"})
    checked = promtool("check", "metrics", stdin=prometheus_client.generate_latest().decode())
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""


def test_the_exposition_has_no_created_series() -> None:
    # A fresh interpreter: the switch is process-wide, so only importing
    # outbox.observability.metrics there shows that the import turns it off (not another test,
    # nor the environment).
    script = (
        "import prometheus_client\n"
        "from outbox.observability import metrics\n"
        "metrics.start_at_zero(['p'])\n"
        "metrics.DISPATCH.labels('p', 'a', 'succeeded').inc()\n"
        "metrics.DISPATCH_DURATION.labels('p', 'a').observe(0.1)\n"
        "print(prometheus_client.generate_latest().decode())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_DISABLE_CREATED_SERIES"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=REPO,
    )
    assert "outbox_dispatch_total{" in done.stdout
    assert "outbox_dispatch_duration_seconds_bucket{" in done.stdout
    assert "_created" not in done.stdout
