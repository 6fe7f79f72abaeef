"""Per provider: when its key window closes, and how long one call may run. Computed here only,
from the provider itself (a plug-in's own ``key_retention``), for the dispatcher and the gauges
alike: computed apart, the two could disagree for a plug-in."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Final

from outbox.config.settings import ConfigError
from outbox.core.durations import format_duration
from outbox.core.policy import KeyWindow
from outbox.providers.base import Provider

# A provider call that outlives its own timeout by this much is cut off: a hung plug-in must
# not hold a lease forever.
CALL_GUARD_MARGIN: Final = 5.0
# The key of action_key_retention that stands for every action not named.
ANY_ACTION: Final = "*"
# Without a provider the failure is permanent and the window is never read; an empty one would
# err towards reconciliation, never towards a resend.
NO_WINDOW: Final = KeyWindow(timedelta(0), timedelta(0))


class ProviderRules:
    def __init__(
        self,
        providers: Mapping[str, Provider],
        retention_margin: timedelta,
        call_timeouts: Mapping[str, timedelta] | None = None,
        margins: Mapping[str, timedelta] | None = None,
    ) -> None:
        """``margins``: a provider's own retention margin, where it has one (a queue that keeps
        keys for minutes); the others take ``retention_margin``."""
        margin = {name: (margins or {}).get(name, retention_margin) for name in providers}
        # A provider's key retention is fixed: each window is made once. A provider may keep
        # the keys of some actions longer or shorter (``action_key_retention``: PayPal's Orders
        # for 6 hours, its Payments for 45 days).
        self._windows = {
            name: KeyWindow(p.key_retention, margin[name]) for name, p in providers.items()
        }
        self._action_windows = {
            (name, action): KeyWindow(retention, margin[name])
            for name, p in providers.items()
            for action, retention in _action_retention(p).items()
        }
        for (name, action), window in self._action_windows.items():
            if window.retention <= window.margin:
                own = margins is not None and name in margins
                setting = f"providers.{name}." if own else "dispatcher."
                raise ConfigError(
                    f"providers.{name}.actions.{action}.key_retention "
                    f"({format_duration(window.retention)}) must be longer than "
                    f"{setting}retention_margin ({format_duration(window.margin)})",
                    key=f"providers.{name}.actions.{action}.key_retention",
                )
        self._call_limits = {
            name: t.total_seconds() + CALL_GUARD_MARGIN for name, t in (call_timeouts or {}).items()
        }

    def window(self, provider: str, action: str | None = None) -> KeyWindow:
        """The key window of ``provider``'s operations of ``action``: the action's own, else
        that of "*" (every action not named), else the provider's."""
        window = self._action_windows.get((provider, action or ANY_ACTION))
        window = window or self._action_windows.get((provider, ANY_ACTION))
        return window or self._windows.get(provider, NO_WINDOW)

    def closes_after(self) -> dict[str, timedelta]:
        """Per provider, how long after the first send its key window closes (the gauges): of a
        provider whose actions differ, the shortest, so that the nearing-expiry gauge warns
        early rather than late."""
        closes = {name: w.retention - w.margin for name, w in self._windows.items()}
        for (name, _), w in self._action_windows.items():
            closes[name] = min(closes[name], w.retention - w.margin)
        return closes

    def call_limit(self, provider: str) -> float | None:
        """Seconds one call may run before the guard cuts it off, or None: no guard."""
        return self._call_limits.get(provider)


def _action_retention(provider: Provider) -> Mapping[str, timedelta]:
    """The provider's ``action_key_retention``, where it declares one (docs/design.md,
    "Provider interface")."""
    declared = getattr(provider, "action_key_retention", None)
    return dict(declared) if isinstance(declared, Mapping) else {}
