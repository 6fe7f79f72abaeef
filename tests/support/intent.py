"""What a delivery must carry of its operation (sql/0045): the sender database's origin and
enqueue's fingerprint, read back from the database the way a receiver reads the headers."""

from __future__ import annotations

import base64
import re
import urllib.parse

from tests.support.dispatch import rows

_ITEM = re.compile(r':([A-Za-z0-9+/=]*):((?:;[a-z-]+="(?:[^"\\]|\\["\\])*")*)')
_PARAM = re.compile(r';([a-z-]+)="((?:[^"\\]|\\["\\])*)"')


def parse_fingerprint(value: str) -> tuple[bytes, dict[str, str]]:
    """An Outbox-Fingerprint header: the digest and its parameters, unescaped and
    percent-decoded (written independently of outbox.inbox's own reader)."""
    match = _ITEM.fullmatch(value)
    assert match is not None, value
    params = {
        name: urllib.parse.unquote(re.sub(r"\\(.)", r"\1", raw))
        for name, raw in _PARAM.findall(match.group(2))
    }
    return base64.b64decode(match.group(1)), params


def expected_intent(db_url: str, operation_id: int) -> tuple[str, bytes, dict[str, str]]:
    """The origin, fingerprint and fingerprint parameters the operation's delivery must carry."""
    ((origin, fingerprint, provider, ordering_key),) = rows(
        db_url,
        "SELECT outbox.origin()::text, fingerprint, provider, ordering_key"
        " FROM outbox.operations WHERE id = %s",
        (operation_id,),
    )
    params = {"provider": provider}
    if ordering_key is not None:
        params["ordering-key"] = ordering_key
    return origin, bytes(fingerprint), params


def expected_contract(db_url: str, operation_id: int) -> str | None:
    """The Outbox-Contract the operation's delivery must carry: its type and version."""
    ((contract,),) = rows(
        db_url,
        "SELECT operation_type || '/v' || contract_version FROM outbox.operations WHERE id = %s",
        (operation_id,),
    )
    return None if contract is None else str(contract)


def assert_carries_intent(db_url: str, operation_id: int, headers: dict[str, str]) -> None:
    """``headers`` (any case) carry exactly the operation's origin and fingerprint, and its
    contract where it was enqueued under one (and none where it was not)."""
    lower = {name.lower(): value for name, value in headers.items()}
    origin, fingerprint, params = expected_intent(db_url, operation_id)
    assert lower["outbox-origin"] == origin
    assert parse_fingerprint(lower["outbox-fingerprint"]) == (fingerprint, params)
    contract = lower.get("outbox-contract")
    assert (None if contract is None else urllib.parse.unquote(contract)) == expected_contract(
        db_url, operation_id
    )
