"""The options each built-in provider type reads, besides the keys every provider has
(ProviderSettings), gathered from each family's options.py (the options of a provider live with
the provider). outbox.config.loader reads a provider's table with them, outbox.config.reference
documents them, and each type's factory checks and reads its own.

Apart from outbox.config.settings so that outbox.config, which plug-ins import, loads no
provider family: a family's options.py imports outbox.config.schema, which loads outbox.config.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from outbox.config.schema import (
    Setting,
)
from outbox.providers.amqp import options as amqp_options
from outbox.providers.cloudtasks import options as cloudtasks_options
from outbox.providers.http import options as http_options
from outbox.providers.nats import options as nats_options
from outbox.providers.sqs import options as sqs_options
from outbox.providers.stripe import options as stripe_options

# The options each built-in provider type reads (besides the keys of ProviderSettings), which
# its factory (outbox.providers.registry) checks and reads; a plug-in's type takes any options.
# On loading, only the values that are not text are read (so that the environment's text reads
# as the file would give it); the rest stay as written.
PROVIDER_OPTIONS: Final[Mapping[str, tuple[Setting, ...]]] = MappingProxyType(
    {
        "webhook": http_options.WEBHOOK_OPTIONS,
        "http": http_options.OPTIONS,
        "stripe": stripe_options.OPTIONS,
        "noop": (),
        "nats": nats_options.OPTIONS,
        "amqp": amqp_options.OPTIONS,
        "sqs": sqs_options.OPTIONS,
        "cloudtasks": cloudtasks_options.OPTIONS,
    }
)
