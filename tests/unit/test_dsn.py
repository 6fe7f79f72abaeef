from __future__ import annotations

import pytest

from outbox.db.dsn import REDACTED, has_password, redact, scrub


@pytest.mark.parametrize(
    "dsn",
    ["postgresql://app:hunter2@db.internal:5432/app", "host=db.internal user=app password=hunter2"],
)
def test_a_password_is_found_and_masked(dsn: str) -> None:
    assert has_password(dsn)
    shown = redact(dsn)
    assert "hunter2" not in shown and REDACTED in shown and "db.internal" in shown


def test_no_password_no_mask() -> None:
    assert not has_password("postgresql://app@db/app")
    assert REDACTED not in redact("postgresql://app@db/app")


def test_scrub_masks_the_password_anywhere_in_a_message() -> None:
    message = "failed for postgresql://app:hunter2@db/app (hunter2)"
    assert "hunter2" not in scrub(message, "postgresql://app:hunter2@db/app")


def test_an_unparseable_dsn_is_not_quoted_back() -> None:
    with pytest.raises(ValueError, match="cannot be parsed") as caught:
        has_password("host=db password='hunter2")
    assert "hunter2" not in str(caught.value)
