"""Label values for metrics whose labels producers choose: bounded, whatever they enqueue.

A row's ``action`` comes from a producer, and so does its ``provider`` when no provider of that
name is configured. Used as labels as they are, 3,000 distinct actions made 60,075 series and a
12.5 MB ``/metrics``. Here a configured provider keeps its name and any other becomes
UNCONFIGURED; a provider's known actions (a ``Provider.actions`` it declares, such as Stripe's)
keep their names, and so do the first MAX_OTHER_ACTIONS others each process sees per provider;
later ones are counted as OTHER.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final

# The actions per provider that keep their own label without being declared: enough for any
# real set of webhook event names, while a producer making up new names can add at most this
# many series per metric and provider.
MAX_OTHER_ACTIONS: Final = 50
OTHER: Final = "other"
# Not a valid provider name (names start with a letter or digit), so it meets none.
UNCONFIGURED: Final = "_unconfigured"


class Labels:
    """The provider and action labels of one process."""

    def __init__(
        self, actions: Mapping[str, Collection[str] | None], *, max_other: int = MAX_OTHER_ACTIONS
    ) -> None:
        """``actions``: per configured provider, the actions it declares (None: none)."""
        self._known = {name: frozenset(declared or ()) for name, declared in actions.items()}
        self._seen: dict[str, set[str]] = {name: set() for name in actions}
        self._max_other = max_other

    def provider(self, provider: str) -> str:
        return provider if provider in self._known else UNCONFIGURED

    def action(self, provider: str, action: str) -> str:
        known = self._known.get(provider)
        if known is None:
            return OTHER
        if action in known:
            return action
        seen = self._seen[provider]
        if action in seen:
            return action
        if len(seen) < self._max_other:
            seen.add(action)
            return action
        return OTHER
