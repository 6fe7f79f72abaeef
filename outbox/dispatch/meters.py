"""The labelled metric children of each (provider, action), looked up once: a ``.labels()``
lookup takes a lock and builds a key, several times per operation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.db.store import Claimed
from outbox.observability import metrics
from outbox.observability.metric_labels import Labels


@dataclass(slots=True)
class Children:
    duration: Any  # outbox_dispatch_duration_seconds{provider,action}
    end_to_end: Any  # outbox_end_to_end_seconds{provider}
    outcomes: dict[str, Any]  # outcome -> outbox_dispatch_total{provider,action,outcome}


class Meters:
    def __init__(self, labels: Labels) -> None:
        self.labels = labels
        self._children: dict[tuple[str, str], Children] = {}

    def of(self, row: Claimed) -> Children:
        children = self._children.get((row.provider, row.action))
        if children is None:
            # Keyed by the labels too: the actions a producer makes up share the "other" meters,
            # and this cache cannot grow past the bounded labels (metric_labels).
            provider, action = self.label_pair(row)
            children = self._children.get((provider, action))
            if children is None:
                children = self._children[provider, action] = Children(
                    duration=metrics.DISPATCH_DURATION.labels(provider, action),
                    end_to_end=metrics.END_TO_END.labels(provider),
                    outcomes={},
                )
        return children

    def outcome(self, row: Claimed, outcome: str) -> Any:
        outcomes = self.of(row).outcomes
        counter = outcomes.get(outcome)
        if counter is None:
            counter = outcomes[outcome] = metrics.DISPATCH.labels(*self.label_pair(row), outcome)
        return counter

    def label_pair(self, row: Claimed) -> tuple[str, str]:
        return self.labels.provider(row.provider), self.labels.action(row.provider, row.action)
