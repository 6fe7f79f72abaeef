"""The inbox's metrics (docs/design.md, "Metrics"). ``handler`` comes only from declared routes,
so its values are bounded; no tenant label."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

DELIVERIES: Final = Counter(
    "outbox_inbox_deliveries",
    "Deliveries by handler and decision: new, replayed, conflict, in_progress, and the ones "
    "nothing was recorded for (invalid, failed, unavailable).",
    ["handler", "decision"],
)
HANDLER_SECONDS: Final = Histogram(
    "outbox_inbox_handler_duration_seconds",
    "A new delivery's handler, from its start to its outcome (committed or rolled_back).",
    ["handler", "outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
