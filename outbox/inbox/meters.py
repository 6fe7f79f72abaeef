"""The inbox's metrics (docs/design.md, "Metrics"). ``handler`` comes only from declared routes,
so its values are bounded; no tenant label."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

DELIVERIES: Final = Counter(
    "outbox_inbox_deliveries",
    "Deliveries by handler and decision: new, replayed, conflict, in_progress, and the ones "
    "nothing was recorded for (invalid, contract_violation, contract_unknown, failed, "
    "unavailable).",
    ["handler", "decision"],
)
HANDLER_SECONDS: Final = Histogram(
    "outbox_inbox_handler_duration_seconds",
    "A new delivery's handler, from its start to its outcome (committed or rolled_back).",
    ["handler", "outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# Database-wide, refreshed by outbox.inbox.gauges.watch: the same on every process that reads
# them (aggregate with max(), never sum()).
IN_PROGRESS: Final = Gauge(
    "outbox_inbox_in_progress",
    "External claims in progress under a lease, by handler (database-wide).",
    ["handler"],
)
OLDEST_IN_PROGRESS: Final = Gauge(
    "outbox_inbox_oldest_in_progress_age_seconds",
    "The age of the oldest external claim in progress, by handler; 0: none (database-wide).",
    ["handler"],
)
ABANDONED: Final = Gauge(
    "outbox_inbox_abandoned",
    "Records abandoned after repeated lapsed claims, waiting for `outbox inbox release` "
    "(database-wide).",
    ["handler"],
)
# This process's own: whether its last read of the gauges above succeeded. While it is 0 they
# keep their last values, so the alerts that read them leave this process out (as
# outbox_database_up does for the dispatcher's gauges).
DATABASE_UP: Final = Gauge(
    "outbox_inbox_database_up",
    "1 when this process's last read of the inbox's gauges succeeded, 0 when its database did "
    "not answer (the gauges then keep their last values); NaN in a process that never reads "
    "them (outbox run, or a worker without gauges.watch).",
)
# NaN, not 0, until the first read: every process that imports the inbox exports this gauge,
# and `outbox run` never reads the inbox's gauges; a 0 there would page as a database down.
DATABASE_UP.set(float("nan"))
