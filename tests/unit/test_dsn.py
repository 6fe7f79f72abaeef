from __future__ import annotations

import pytest

from outbox.db import schema_dump
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


@pytest.mark.parametrize(
    "dsn",
    ["postgresql://app:hunter2@db.internal:5432/app", "host=db.internal user=app password=hunter2"],
)
def test_schema_dump_refuses_a_password_on_its_command_line(
    dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As every outbox command does (outbox/cli/common.py): a command line is readable by every
    user of the machine. Refused before any connection, and the password is not echoed."""
    monkeypatch.setattr(schema_dump, "scratch_dump", _no_connection)
    with pytest.raises(SystemExit) as exited:
        schema_dump.main(["--dsn", dsn])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "password on the command line" in err and "hunter2" not in err


def test_schema_dump_takes_a_password_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[str] = []

    def dump(dsn: str) -> str:
        seen.append(dsn)
        return "-- x\n"

    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:hunter2@db.internal/app")
    monkeypatch.setattr(schema_dump, "scratch_dump", dump)
    assert schema_dump.main([]) == 0
    assert seen == ["postgresql://app:hunter2@db.internal/app"]
    assert capsys.readouterr().out == "-- x\n"


def _no_connection(dsn: str) -> str:
    raise AssertionError("schema_dump connected with a password from its command line")
