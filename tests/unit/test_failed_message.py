"""A Failed's message is bounded whatever the provider said (outbox.providers.base.Failed): it
is stored in every attempt row and logged on every retry."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from outbox.core.model import FailureClass
from outbox.providers.base import MESSAGE_CHARS, Failed, permanent, transient, unknown

MARKER_CHARS = len("… (1,000,000,000 characters cut)")


@given(st.text(max_size=MESSAGE_CHARS))
def test_a_message_within_the_limit_is_kept_as_it_is(message: str) -> None:
    assert transient("x", message).message == message


@given(
    st.integers(min_value=1, max_value=3_000_000), st.sampled_from([transient, permanent, unknown])
)
def test_a_longer_message_keeps_its_start_and_says_how_much_was_cut(
    extra: int, make: Callable[[str, str], Failed]
) -> None:
    message = "said: " + "y" * (MESSAGE_CHARS - 6 + extra)
    kept = make("x", message).message
    assert kept.startswith(message[:MESSAGE_CHARS])
    assert len(kept) <= MESSAGE_CHARS + MARKER_CHARS
    assert kept.endswith(f"({extra:,} characters cut)")


def test_the_direct_constructor_is_bounded_too() -> None:
    failed = Failed(FailureClass.UNKNOWN, "jetstream_error", "z" * 1_048_576)
    assert len(failed.message) <= MESSAGE_CHARS + MARKER_CHARS
