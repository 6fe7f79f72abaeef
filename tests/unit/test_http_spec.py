"""The `http` provider's parts that need no server: pointers, templates, key forms, the reading
of its configuration and of answers."""

from __future__ import annotations

import re
import tomllib
import urllib.parse
from datetime import timedelta
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.durations import parse_duration
from outbox.core.json_pointer import MISSING, Pointer, PointerError
from outbox.core.model import FailureClass
from outbox.providers.base import Failed, InvalidRequest, Succeeded
from outbox.providers.http.config import http_options
from outbox.providers.http.provider import HttpProvider, _classify
from outbox.providers.http.spec import Template
from outbox.providers.kit import KeyForm, KeySpec
from outbox.providers.registry import build_providers
from tests.support.recipes import DOC, built, provider_table, recipes, secret_variables

DERIVED = "ob1_" + "ab" * 32


def settings(**options: Any) -> ProviderSettings:
    base: dict[str, Any] = {
        "base_url": "https://api.example.com",
        "actions": {"pay": {"path": "/v1/pay"}},
    }
    retention = parse_duration(options.pop("key_retention", "24h"))
    return ProviderSettings(
        name="api", type="http", key_retention=retention, options={**base, **options}
    )


def provider(**options: Any) -> HttpProvider:
    return HttpProvider("api", http_options(settings(**options), {}, concurrency=4))


def test_pointers_read_rfc_6901_and_never_raise() -> None:
    doc = {"a/b": {"m~n": [10, {"id": "x"}]}, "": 1}
    assert Pointer.parse("/a~1b/m~0n/1/id").read(doc) == "x"
    assert Pointer.parse("").read(doc) is doc
    assert Pointer.parse("/").read(doc) == 1
    for missing in ("/nope", "/a~1b/m~0n/2", "/a~1b/m~0n/01", "/a~1b/m~0n/-1", "/a~1b/m~0n/x/y"):
        assert Pointer.parse(missing).read(doc) is MISSING
    for bad in ("id", "/a~2", "/~"):
        with pytest.raises(PointerError):
            Pointer.parse(bad)


@given(st.text(min_size=1, max_size=60))
def test_no_payload_value_can_leave_its_path_segment(value: str) -> None:
    """Whatever a producer writes, the rendered target keeps the template's host, path steps
    and query: the value is one percent-encoded segment, or the request is refused."""
    template = Template.parse("/v2/orders/{/id}/capture?x=1")
    try:
        target = template.render({"id": value}, key="k", operation_id=1)
    except InvalidRequest:
        steps = re.split(r"[/\\]", value)
        assert any(s in (".", "..") for s in steps) or len(value) > 1024
        return
    url = httpx.URL("https://api.example.com" + target)
    assert url.host == "api.example.com"
    assert url.raw_path.decode().split("?")[0].split("/")[:3] == ["", "v2", "orders"]
    assert url.raw_path.decode().endswith("/capture?x=1")
    middle = target[len("/v2/orders/") : -len("/capture?x=1")]
    assert "/" not in middle and "?" not in middle and "#" not in middle
    assert urllib.parse.unquote(middle) == value


def test_a_template_cannot_name_another_host_or_unknown_placeholders() -> None:
    for bad in ("v1/pay", "//evil.example/x", "/a b", "/x/{nope}", "/x#frag", "/a\\b"):
        with pytest.raises(ValueError, match=re.escape(repr(bad)[1:-1]) + "|no placeholder"):
            Template.parse(bad)
    template = Template.parse("/effects?key={key}&op={operation_id}")
    assert template.uses_key
    assert template.render({}, key="a/b?c", operation_id=7) == "/effects?key=a%2Fb%3Fc&op=7"


def test_payload_values_a_url_cannot_take_are_refused() -> None:
    template = Template.parse("/orders/{/order/id}")
    for payload in (
        {},
        {"order": {"id": True}},
        {"order": {"id": {"x": 1}}},
        {"order": {"id": ""}},
    ):
        with pytest.raises(InvalidRequest):
            template.render(payload, key="k", operation_id=1)
    assert template.render({"order": {"id": 42}}, key="k", operation_id=1) == "/orders/42"


@given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1))
def test_key_forms_are_stable_distinct_and_fit(stored: str) -> None:
    uuid = KeySpec(form=KeyForm.UUID, max_length=36, characters="0-9a-f-")
    sha = KeySpec(form=KeyForm.SHA256, max_length=64, characters="0-9a-f")
    for spec in (uuid, sha):
        wire = spec.wire(stored)
        assert wire == spec.wire(stored)  # every attempt carries the same key
        assert spec.wire(stored + ":r2") != wire  # each generation its own
        assert spec.problem(wire) is None
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid.wire(stored)
    )


def test_a_key_form_the_provider_would_refuse_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match="derived keys would be refused: the idempotency key is 68"
    ):
        http_options(settings(key={"max_length": 64}), {}, concurrency=1)
    with pytest.raises(ConfigError, match="characters the provider does not take"):
        http_options(settings(key={"characters": "a-z0-9-"}), {}, concurrency=1)
    ok = http_options(settings(key={"max_length": 64, "form": "uuid"}), {}, concurrency=1)
    assert ok.actions["pay"].key.form == "uuid"


def test_an_applications_own_key_the_provider_refuses_is_refused_before_sending() -> None:
    p = provider(key={"max_length": 80})
    p.check_key("pay", DERIVED)
    with pytest.raises(InvalidRequest, match="81 characters; the provider takes at most 80"):
        p.check_key("pay", "k" * 81)
    with pytest.raises(InvalidRequest, match="no action 'refund'"):
        p.check("refund", {})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"base_url": "ftp://x"}, "base_url must be an http"),
        ({"base_url": "https://x/?a=1"}, "no query"),
        ({"base_url": "https://u:p@x"}, "holds credentials"),
        ({"actions": {}}, "at least one action"),
        ({"actions": {"pay": {}}}, "path is required"),
        ({"actions": {"pay": {"path": "/x", "method": "TRACE"}}}, "method must be one of"),
        ({"actions": {"pay": {"path": "/x", "method": "GET", "body": ""}}}, "carries no body"),
        ({"actions": {"pay": {"path": "/x", "reference": "id"}}}, "JSON pointer"),
        ({"actions": {"pay": {"path": "/x", "key": {"field": "/k"}, "body": False}}}, "no body"),
        ({"actions": {"pay": {"path": "/x", "key": {"header": "A", "field": "/k"}}}}, "not both"),
        ({"actions": {"pay": {"path": "/x", "status": {"done": [999]}}}}, "100 to 599"),
        ({"actions": {"pay": {"path": "/x", "status": {"done": [409], "in_use": [409]}}}}, "both"),
        ({"actions": {"pay": {"path": "/x", "status": {"maybe": [409]}}}}, "no setting here"),
        ({"actions": {"pay": {"path": "/x", "lookup": {"path": "/y"}}}}, "same object"),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/{key}", "method": "DELETE"}}}},
            "one of GET",
        ),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/{key}", "not_found": [503]}}}},
            "proves nothing absent",
        ),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/{key}", "not_found": [429]}}}},
            "proves nothing absent",
        ),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/{key}", "done": ["ok"]}}}},
            "need a state",
        ),
        (
            {
                "actions": {
                    "pay": {
                        "path": "/x",
                        "lookup": {"path": "/{key}", "state": "/s", "done": ["a"], "absent": ["a"]},
                    }
                }
            },
            "both done and absent",
        ),
        (
            {"actions": {"pay": {"path": "/x", "status": {"transient": [503]}}}},
            "cannot say the provider did not",
        ),
        (
            {"actions": {"pay": {"path": "/x", "status": {"in_use": [202]}}}},
            "cannot say the provider did not",
        ),
        (
            {"actions": {"pay": {"path": "/x", "status": {"permanent": [500]}}}},
            "cannot end the operation",
        ),
        (
            {
                "actions": {
                    "pay": {
                        "path": "/x",
                        "status": {"done": [{"status": 422, "at": "/a", "is": []}]},
                    }
                }
            },
            "never match",
        ),
        ({"base_url": "https://x/prefix#"}, "no query or fragment"),
        ({"headers": {"Content-Length": "3"}}, "frames the request"),
        ({"headers": {"Idempotency-Key": "fixed"}}, "carries (or looks like) the idempotency key"),
        ({"key": {"header": "Authorization"}}, "cannot carry the idempotency key"),
        ({"key": {"max_length": 71}}, "derived keys would be refused"),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/y/{key}", "state": "/s"}}}},
            "done must",
        ),
        (
            {"actions": {"pay": {"path": "/x", "lookup": {"path": "/y", "not_found": [200]}}}},
            "both found and not found",
        ),
        ({"actions": {"pay": {"path": "/x", "key_retention": "soon"}}}, "must be a duration"),
        ({"headers": {"Authorization": "Bearer x"}}, "looks like a secret"),
        ({"colour": "blue"}, "not a http provider setting"),
    ],
)
def test_every_mistake_in_the_table_names_its_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_providers({"api": settings(**options)}, {})


def response(status: int, body: Any = None, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


def test_overrides_decide_before_the_defaults_and_match_body_values() -> None:
    p = provider(
        actions={
            "capture": {
                "path": "/c",
                "status": {
                    "done": [
                        {"status": 422, "at": "/details/0/issue", "is": ["ORDER_ALREADY_CAPTURED"]}
                    ],
                    "refused": [{"status": 200, "at": "/resultCode", "is": ["Refused"]}],
                    "in_use": [{"status": 422, "at": "/errorCode", "is": ["704"]}],
                    "unknown": [400],
                },
            }
        }
    )
    spec = p.spec("capture")
    assert spec is not None
    done = _classify(spec, response(422, {"details": [{"issue": "ORDER_ALREADY_CAPTURED"}]}), "k")
    assert isinstance(done, Succeeded) and done.reference == "k"
    other = _classify(spec, response(422, {"details": [{"issue": "INVALID"}]}), "k")
    assert isinstance(other, Failed) and other.failure is FailureClass.PERMANENT
    refused = _classify(spec, response(200, {"resultCode": "Refused", "id": "psp1"}), "k")
    assert isinstance(refused, Failed) and refused.reason == "provider_declined"
    assert refused.reference == "psp1" and refused.failure is FailureClass.PERMANENT
    ok = _classify(spec, response(200, {"resultCode": "Authorised", "id": "psp2"}), "k")
    assert isinstance(ok, Succeeded) and ok.reference == "psp2"
    busy = _classify(spec, response(422, {"errorCode": "704"}), "k")
    assert isinstance(busy, Failed) and busy.failure is FailureClass.TRANSIENT and busy.request_only
    maybe = _classify(spec, response(400), "k")
    assert isinstance(maybe, Failed) and maybe.failure is FailureClass.UNKNOWN


def test_per_action_key_retention_is_declared_for_the_key_window() -> None:
    p = provider(
        key_retention="6h",
        actions={"order": {"path": "/o"}, "capture": {"path": "/c", "key_retention": "45d"}},
    )
    assert p.key_retention == timedelta(hours=6)
    assert p.action_key_retention == {"order": timedelta(hours=6), "capture": timedelta(days=45)}
    assert p.actions == frozenset({"order", "capture"})


def test_a_lookup_by_key_proves_nothing_past_the_keys_retention_by_default() -> None:
    p = provider(
        key_retention="7d",
        actions={
            "pay": {"path": "/p", "lookup": {"path": "/p?key={key}"}},
            "by_ref": {"path": "/q", "lookup": {"path": "/q/{/ref}"}},
        },
    )
    pay, by_ref = p.spec("pay"), p.spec("by_ref")
    assert pay is not None and pay.lookup is not None and by_ref is not None
    assert pay.lookup.retention == timedelta(days=7)
    assert by_ref.lookup is not None and by_ref.lookup.retention is None
    assert p.looks_up("pay") and p.looks_up(None) and not p.looks_up("other")


def test_every_recipe_of_the_docs_builds_and_names_its_key_window() -> None:
    found = recipes()
    assert set(found) == {"paypal", "adyen", "checkout", "square", "internal"}
    for recipe in found:
        name, table = provider_table(recipe)
        assert "key_retention" in table, f"recipe {recipe} leaves its key window to the default"
        built_provider = built(name, table, secret_variables(table), {"retention_margin": "1h"})
        assert built_provider.actions, recipe
        for action in built_provider.actions:
            spec = built_provider.spec(action)
            assert spec is not None
            # outbox's derived keys (68 characters) fit every recipe's provider as configured.
            assert spec.key.problem(spec.key.wire(DERIVED + ":r2")) is None, (recipe, action)


def test_the_documented_example_of_the_http_type_builds() -> None:
    """docs/providers.md's first example and its lookup example, as one provider."""
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.DOTALL)
    example = next(b for b in blocks if b.startswith("[providers.ledger]\ntype"))
    lookup = next(b for b in blocks if b.startswith("[providers.ledger.actions.transfer.lookup]"))
    document = tomllib.loads(example + "\n" + lookup)
    name, table = "ledger", document["providers"]["ledger"]
    p = built(name, table, {"LEDGER_TOKEN": "Bearer x"}, {"retention_margin": "1h"})
    spec = p.spec("transfer")
    assert spec is not None and spec.lookup is not None and spec.lookup.total is not None
