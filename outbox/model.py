"""Where plug-ins import FailureClass from (docs/providers.md, "The interface"): the model itself
lives in outbox.core.model."""

from outbox.core.model import FailureClass

__all__ = ["FailureClass"]
