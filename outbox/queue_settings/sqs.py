"""The options of `type = "sqs"` (docs/providers.md, "Queues")."""

from __future__ import annotations

from typing import Final

from outbox.settings_schema import Setting

OPTIONS: Final[tuple[Setting, ...]] = ()
