"""The options of `type = "cloudtasks"` (docs/providers.md, "Queues").

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options
puts ``OPTIONS`` into PROVIDER_OPTIONS, so this module stays pure, declarations only, no client
library; config.py beside it reads a provider's table by them."""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Opaque, Setting

OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "project",
        Opaque("text (a Google Cloud project id)"),
        "The project of the queues: every task name starts with projects/<project>.",
    ),
    Setting(
        "location",
        Opaque("text (a Cloud Tasks location, such as europe-west1)"),
        "The location of the queues (the region they were created in).",
    ),
    Setting(
        "endpoint",
        Opaque("`host:port`"),
        "Where the Cloud Tasks API answers. A loopback host (127.0.0.1, localhost, ::1) is "
        "an emulator: plain gRPC, no credentials. Any other host is the real API (a regional "
        "or Private Service Connect endpoint) over TLS with Google's default credentials.",
        default=None,
        default_doc="cloudtasks.googleapis.com:443, with Google's default credentials "
        "(GOOGLE_APPLICATION_CREDENTIALS or the metadata server)",
    ),
    Setting(
        "unroutable",
        Opaque('"quarantine" or "retry"'),
        "What a task for a queue that does not exist leads to: quarantine at once (a "
        "misspelt queue id), or retry until max_attempts (a queue that is being created, or "
        "one dormant for 30 days, which Cloud Tasks may report missing for a few minutes).",
        default="quarantine",
    ),
    Setting(
        "actions",
        Opaque(
            "table of tables: per action (or `*`), `queue`, `url`, and optionally `method`, "
            "`headers`, `oidc_service_account`, `oidc_audience`"
        ),
        "Where each action's tasks go: the queue id, and the HTTP target the task calls.",
        env=False,
    ),
)
