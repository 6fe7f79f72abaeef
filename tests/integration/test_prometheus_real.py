"""A real Prometheus scrapes a real `outbox run` every second and evaluates the alert rules of
deploy/prometheus/outbox-alerts.yml (issue 21): quarantines from the first one show as an
increase, a database that refuses connections raises OutboxDatabaseUnreachable, and refused
credentials page once, as OutboxProviderPaused. Everything is read back through Prometheus's
HTTP API, as an on-call's Alertmanager would see it."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Final

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox.observability import metrics
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cluster import free_port
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import enqueue_many, statuses
from tests.support.tools import require_tool

pytestmark = pytest.mark.slow

RULES: Final = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "outbox-alerts.yml"
# Prometheus scrapes and evaluates every second; the waits below are many of these.
TICK: Final = "1s"
WAIT: Final = 30.0
# The rules are the file's own, expressions and all, except for two rewrites that let each alert
# fire within seconds: every `for:` becomes one second, and the age threshold two seconds.
FOR_SHORT: Final = "1s"
AGE_RULE: Final = "          ) > 300\n          unless on (provider) ("
AGE_THRESHOLD: Final = 2


def fast_rules(path: Path) -> Path:
    """A copy of RULES with only the rewrites above (the test fails if one finds nothing)."""
    text, durations = re.subn(
        r"^(\s+for: )\S+$", rf"\g<1>{FOR_SHORT}", RULES.read_text(), flags=re.MULTILINE
    )
    assert durations >= 8, "the rules' `for:` lines moved: update fast_rules"
    assert text.count(AGE_RULE) == 1, "OutboxOldestPendingTooOld changed: update AGE_RULE"
    path.write_text(text.replace(AGE_RULE, AGE_RULE.replace("300", str(AGE_THRESHOLD))))
    return path


class Prometheus:
    """One `prometheus` process on a free loopback port, scraping one target as job "outbox"."""

    def __init__(self, binary: str, directory: Path, target: str) -> None:
        directory.mkdir()
        rules = fast_rules(directory / "rules.yml")
        config = {  # JSON is YAML
            "global": {"scrape_interval": TICK, "evaluation_interval": TICK},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": "outbox",
                    "scrape_interval": TICK,
                    "scrape_timeout": TICK,
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        (directory / "prometheus.yml").write_text(json.dumps(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = directory / "prometheus.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until(self._ready, timeout=WAIT, what="Prometheus to be ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log_path.read_text()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:  # noqa: S310 (loopback)
                return bool(answer.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=5) as answer:  # noqa: S310 (loopback)
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant vector: each series (its labels, as JSON) and its value."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {
            json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in data["result"]
        }

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert pending or firing, with its labels and state."""
        return list(self.api("alerts")["alerts"])

    def firing(self, alertname: str) -> list[dict[str, str]]:
        return [
            a["labels"]
            for a in self.alerts()
            if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        ]

    def alert_rules(self) -> dict[str, dict[str, Any]]:
        groups = self.api("rules", type="alert")["groups"]
        return {r["name"]: r for g in groups for r in g["rules"]}

    def wait_evaluations(self, count: int) -> None:
        """Until the rules were evaluated ``count`` more times from now."""
        seen: set[str] = set()

        def evaluated() -> bool:
            seen.add(self.alert_rules()["OutboxProviderPaused"]["lastEvaluation"])
            return len(seen) > count

        wait_until(evaluated, timeout=WAIT, what=f"{count} rule evaluations", interval=0.2)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        try:
            wait_until(predicate, timeout=WAIT, what=what, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; alerts: {self.alerts()}") from None


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return require_tool("prometheus", "prometheus")


def outbox_config(tmp_path: Path, receiver: FakeWebhookReceiver) -> Path:
    return write_config(
        tmp_path / "outbox.toml",
        # A breaker open one second: its probes are refused too while the test watches.
        providers={
            "hook": {
                "type": "webhook",
                "url": receiver.url,
                "timeout": "5s",
                "breaker_open_for": "1s",
            }
        },
        poll_interval="200ms",
        gauge_interval="500ms",
        backoff_base="50ms",
        backoff_max="200ms",
        shutdown_grace="1s",
    )


@contextmanager
def watched(
    binary: str, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> Iterator[tuple[OutboxProcess, Prometheus, str]]:
    """`outbox run` and a Prometheus scraping it, once the first scrape reached it; and the
    target's address, Prometheus's `instance` label."""
    proc = OutboxProcess(
        db_url, outbox_config(tmp_path, receiver), tmp_path / "run.log", metrics_addr="127.0.0.1:0"
    )
    try:
        target = proc.metrics_url().removeprefix("http://")
        prom = Prometheus(binary, tmp_path / "prometheus", target)
        try:
            alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
            prom.wait_for(lambda: set(prom.alert_rules()) == alerts, "every rule loaded")
            prom.wait_for(lambda: prom.query('up{job="outbox"}') != {}, "the first scrape")
            yield proc, prom, target
        finally:
            prom.stop()
    finally:
        proc.stop()


def test_quarantines_from_the_first_show_as_an_increase_and_open_a_ticket(
    prometheus_binary: str, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """Issue 21, case 5: a configured provider's counters are scraped at 0 before its first
    event, so ten quarantines are an increase() that OutboxQuarantineGrowing sees."""
    with watched(prometheus_binary, db_url, receiver, tmp_path) as (_proc, prom, _target):
        zeros = dict.fromkeys(metrics.QUARANTINE_REASONS, 0.0)
        prom.wait_for(
            lambda: (
                {
                    json.loads(k)["reason"]: v
                    for k, v in prom.query('outbox_quarantined_total{provider="hook"}').items()
                }
                == zeros
            ),
            "every reason's counter at 0",
        )
        # Two scrapes at 0: an increase() of 0, and nothing pending.
        prom.wait_for(
            lambda: prom.query("sum(increase(outbox_quarantined_total[1h]))") == {"{}": 0.0},
            "an increase of 0",
        )
        assert prom.alerts() == []
        receiver.inject(WebhookFault.status(422), times=10)  # permanent: quarantined at once
        enqueue_many(db_url, 10)
        wait_until(
            lambda: statuses(db_url) == {"quarantined": 10}, timeout=WAIT, what="ten quarantines"
        )
        prom.wait_for(
            lambda: bool(prom.firing("OutboxQuarantineGrowing")), "OutboxQuarantineGrowing to fire"
        )
        increase = prom.query("sum(increase(outbox_quarantined_total[1h]))")["{}"]
        assert increase >= 10  # extrapolated over the window, never below what happened
        assert prom.query('outbox_quarantined_total{reason="permanent_failure"} == 10') != {}


def test_a_database_that_refuses_connections_pages_as_unreachable(
    prometheus_binary: str,
    pg_server: str,
    db_url: str,
    receiver: FakeWebhookReceiver,
    tmp_path: Path,
) -> None:
    """The test's own database stops taking connections and loses the ones it had, while
    `outbox run` keeps running and serving /metrics: OutboxDatabaseUnreachable fires for its
    instance, and OutboxDispatcherDown does not; it resolves once connections are allowed again."""
    name = str(conninfo_to_dict(db_url)["dbname"])
    database = sql.Identifier(name)
    with (
        watched(prometheus_binary, db_url, receiver, tmp_path) as (proc, prom, target),
        psycopg.connect(pg_server, autocommit=True) as admin,
    ):
        prom.wait_for(lambda: prom.query("outbox_database_up == 1") != {}, "the database up")
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            prom.wait_for(
                lambda: (
                    prom.firing("OutboxDatabaseUnreachable")
                    == [
                        {
                            "alertname": "OutboxDatabaseUnreachable",
                            "instance": target,
                            "severity": "page",
                        }
                    ]
                ),
                "OutboxDatabaseUnreachable to fire",
            )
            assert proc.proc.poll() is None, proc.log_text()
            assert prom.query('up{job="outbox"}') == {
                json.dumps(
                    {"__name__": "up", "instance": target, "job": "outbox"}, sort_keys=True
                ): 1.0
            }
            assert not prom.firing("OutboxDispatcherDown")
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        # It reconnects by itself, and the alert resolves.
        prom.wait_for(lambda: prom.alerts() == [], "the alert to resolve")
        assert prom.query("outbox_database_up == 1") != {}
        # Not "claim failed" in the log: a claim may spend the whole outage waiting for a pool
        # connection and never fail. What must hold is the probe's account of the outage and a
        # dispatcher that claims and delivers again once it is over.
        log_text = proc.log_text()
        lost = log_text.find('"database lost: no writable primary answers"')
        assert lost >= 0, log_text
        assert '"database reachable: a writable primary answers"' in log_text[lost:], log_text
        enqueue_many(db_url, 5, prefix="after")
        wait_until(
            lambda: statuses(db_url) == {"succeeded": 5},
            timeout=WAIT,
            what="the operations enqueued after the outage to be delivered",
        )
        assert receiver.effect_count() == 5


def test_refused_credentials_page_once_as_provider_paused(
    prometheus_binary: str, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """The receiver answers 401: OutboxProviderPaused fires. The conditions of
    OutboxProviderCircuitOpen (the breaker open or half-open) and OutboxOldestPendingTooOld
    (the backlog older than its threshold) hold in Prometheus too, for several evaluations,
    yet neither is pending or firing: their `unless` clauses hold them back."""
    receiver.inject(WebhookFault.status(401), times=10_000)
    with watched(prometheus_binary, db_url, receiver, tmp_path) as (_proc, prom, _target):
        enqueue_many(db_url, 3)
        prom.wait_for(
            lambda: [a["provider"] for a in prom.firing("OutboxProviderPaused")] == ["hook"],
            "OutboxProviderPaused to fire",
        )
        # The two alerts' conditions before their `unless`, held at each second of the last
        # four (a subquery): the evaluations waited for below all saw them hold.
        circuit = (
            "min_over_time((max by (provider) "
            '(outbox_provider_state{state=~"open|half_open"}))[4s:1s]) == 1'
        )
        age = (
            'min_over_time(max(outbox_provider_oldest_pending_age_seconds{provider="hook"})'
            f"[4s:1s]) > {AGE_THRESHOLD}"
        )
        prom.wait_for(
            lambda: prom.query(circuit) != {} and prom.query(age) != {},
            "the circuit's and the age's conditions",
        )
        prom.wait_evaluations(3)
        assert prom.query(circuit) != {} and prom.query(age) != {}
        assert [(a["labels"]["alertname"], a["state"]) for a in prom.alerts()] == [
            ("OutboxProviderPaused", "firing")
        ]
        rules = prom.alert_rules()
        assert rules["OutboxProviderCircuitOpen"]["state"] == "inactive"
        assert rules["OutboxOldestPendingTooOld"]["state"] == "inactive"
    # Nothing spent or settled: pending, or the probe in flight when the process was killed.
    assert set(statuses(db_url)) <= {"pending", "in_flight"}
    assert sum(r.status == 401 for r in receiver.received) >= 2  # the first call and a probe
    assert receiver.effect_count() == 0
