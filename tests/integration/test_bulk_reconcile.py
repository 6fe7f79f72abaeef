"""Bulk everywhere (issue 37): `reconcile resolve` and `reconcile retry` take the bulk filters,
`--dry-run` and `--yes`, one transaction and audit row per operation; `resolve --refs-file` takes
each operation's reference from a file, all or nothing; `resolve --no-effect` records a person's
finding that the provider has no effect, after which `retry` needs no --force."""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg
import pytest

from outbox.cli import bulk, operator
from outbox.core.model import Status
from outbox.oncall import operators
from tests.integration.test_bulk_actions import (
    audit_of,
    away_from_cut,
    quarantine_population,
    random_filters,
    status_of,
)
from tests.support.cli import outbox_cli
from tests.support.dispatch import enqueue_many, rows


def reconciling_population(db_url: str, rng: random.Random, count: int) -> list[dict[str, Any]]:
    """``count`` reconciling operations of random provider, tenant, reason, error and age, each
    last attempted a minute before it entered reconciliation."""
    population = quarantine_population(db_url, rng, count, status="reconciling")
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET last_attempt_at = status_changed_at - interval '1m', "
            "first_sent_at = status_changed_at - interval '1m'"
        )
    return population


def findings(db_url: str) -> dict[int, str | None]:
    return {int(i): f for i, f in rows(db_url, "SELECT id, check_finding FROM outbox.operations")}


def keep_only(db_url: str, population: list[dict[str, Any]]) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "DELETE FROM outbox.operations WHERE NOT (id = ANY(%s))",
            ([op["id"] for op in population],),
        )


@pytest.mark.parametrize("seed", [2, 9, 11, 14])
def test_no_effect_then_retry_act_on_exactly_the_selection_after_a_dry_run_and_with_yes(
    db_url: str, cli_env: dict[str, str], seed: int
) -> None:
    rng = random.Random(seed)
    population = reconciling_population(db_url, rng, 60)
    args, selects = random_filters(rng)
    population = away_from_cut(population, args)
    keep_only(db_url, population)
    expected = sorted(op["id"] for op in population if selects(op))
    others = sorted(op["id"] for op in population if not selects(op))

    for verb in (["resolve", "--no-effect"], ["retry"]):
        before = status_of(db_url), findings(db_url), audit_of(db_url)
        dry = outbox_cli(cli_env, "reconcile", *verb, *args, "--reason", "looked", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        if expected:
            assert f"{len(expected)} reconciling operations match" in dry.stdout
            assert "dry run: nothing changed" in dry.stdout
        unasked = outbox_cli(cli_env, "reconcile", *verb, *args, "--reason", "looked")
        if expected:  # no terminal to ask on, no --yes: refused, nothing done
            assert unasked.returncode == 2 and "add --yes" in unasked.stderr
        assert (status_of(db_url), findings(db_url), audit_of(db_url)) == before

        done = outbox_cli(cli_env, "reconcile", *verb, *args, "--reason", "looked", "--yes")
        assert done.returncode == 0, (done.stdout, done.stderr)
        if verb[0] == "resolve":
            assert all(findings(db_url)[i] == "not_found" for i in expected)
            assert set(status_of(db_url).values()) == {"reconciling"}
            if expected:
                assert "no effect recorded" in done.stdout
        else:
            after = status_of(db_url)
            assert sorted(i for i, s in after.items() if s == "pending") == expected
        # The others are untouched: no finding, still reconciling.
        assert all(findings(db_url)[i] is None for i in others)
        assert all(status_of(db_url)[i] == "reconciling" for i in others)

    assert sorted(audit_of(db_url)) == sorted(
        [(i, "no_effect", "looked", "reconciling", "reconciling") for i in expected]
        + [(i, "retry", "looked", "reconciling", "pending") for i in expected]
    )
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE key_generation = 2") == [
        (len(expected),)
    ]


def test_a_retry_without_force_takes_only_what_was_found_missing_and_names_the_rest(
    db_url: str, cli_env: dict[str, str]
) -> None:
    population = reconciling_population(db_url, random.Random(21), 6)
    ids = [op["id"] for op in sorted(population, key=lambda op: -op["hours_ago"])]
    fresh, also_fresh, too_soon, undecided, never, never_too = ids
    with psycopg.connect(db_url) as conn:
        for op in (fresh, also_fresh, too_soon):
            conn.execute("SELECT outbox.record_no_effect(%s, 'looked', 'alice')", (op,))
        # Checked, then attempted again 10 s before the check: that check proves nothing.
        conn.execute(
            "UPDATE outbox.operations SET last_attempt_at = checked_at - interval '10 seconds' "
            "WHERE id = %s",
            (too_soon,),
        )
        conn.execute(
            "UPDATE outbox.operations SET check_finding = 'undecided', checked_at = now() "
            "WHERE id = %s",
            (undecided,),
        )

    done = outbox_cli(cli_env, "reconcile", "retry", "--all", "--reason", "r", "--yes")
    assert done.returncode == 0, done.stderr
    assert "4 of the 6 that match are left alone" in done.stdout
    assert f"({too_soon}, {undecided}, {never}, {never_too})" in done.stdout
    assert "retry: 2 of 2 (2 now pending)" in done.stdout
    assert sorted(i for i, s in status_of(db_url).items() if s == "pending") == sorted(
        [fresh, also_fresh]
    )
    # What is left cannot be retried without --force: refused, exit 2, nothing changed.
    again = outbox_cli(cli_env, "reconcile", "retry", "--all", "--reason", "r", "--yes")
    assert again.returncode == 2 and "applies to none of them" in again.stderr, again.stderr
    forced = outbox_cli(cli_env, "reconcile", "retry", "--all", "--force", "--reason", "r", "--yes")
    assert forced.returncode == 0, forced.stderr
    assert set(status_of(db_url).values()) == {"pending"}
    assert rows(
        db_url,
        "SELECT details->>'forced', count(*) FROM outbox.audit WHERE action = 'retry' "
        "GROUP BY 1 ORDER BY 1",
    ) == [("false", 2), ("true", 4)]


def test_one_operation_found_without_effect_is_retried_without_force(
    db_url: str, cli_env: dict[str, str]
) -> None:
    (op,) = (p["id"] for p in reconciling_population(db_url, random.Random(4), 1))
    refused = outbox_cli(cli_env, "reconcile", "retry", str(op), "--reason", "r")
    assert refused.returncode == 2 and "--force" in refused.stderr
    marked = outbox_cli(
        cli_env, "reconcile", "resolve", str(op), "--no-effect", "--reason", "not in the log"
    )
    assert marked.returncode == 0, marked.stderr
    assert f"operation {op}: reconciling" in marked.stdout and "retry" in marked.stdout
    shown = outbox_cli(cli_env, "reconcile", "show", str(op), "--json")
    assert json.loads(shown.stdout)["check_finding"] == "not_found"
    retried = outbox_cli(cli_env, "reconcile", "retry", str(op), "--reason", "r")
    assert retried.returncode == 0, retried.stderr
    assert rows(
        db_url, "SELECT action, reason, details->>'forced' FROM outbox.audit ORDER BY id"
    ) == [("no_effect", "not in the log", None), ("retry", "r", "false")]


REFS = """id,reference
# found in the receiver's log, 2026-12-04
{a},wh_1

{b}, "wh_2,with a comma"
{c},wh_3
"""


@pytest.mark.parametrize("from_stdin", [False, True])
def test_resolve_takes_each_reference_from_a_file(
    db_url: str, cli_env: dict[str, str], tmp_path: Any, from_stdin: bool
) -> None:
    population = reconciling_population(db_url, random.Random(5), 5)
    a, b, c, d, e = (op["id"] for op in population)
    text = REFS.format(a=a, b=b, c=c)
    path = tmp_path / "refs.csv"
    path.write_text(text)
    source = ["--refs-file", "-"] if from_stdin else ["--refs-file", str(path)]
    stdin = text if from_stdin else None

    def resolve(*more: str) -> Any:
        return outbox_cli(cli_env, "reconcile", "resolve", *source, *more, stdin=stdin)

    dry = resolve("--reason", "found", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "3 reconciling operations to resolve" in dry.stdout and "wh_2,with a comma" in dry.stdout
    assert audit_of(db_url) == [] and set(status_of(db_url).values()) == {"reconciling"}
    done = resolve("--reason", "found", "--yes")
    assert done.returncode == 0, done.stderr
    assert "resolve: 3 of 3 (3 now succeeded)" in done.stdout
    assert rows(db_url, "SELECT id, status, provider_ref FROM outbox.operations ORDER BY id") == [
        (a, "succeeded", "wh_1"),
        (b, "succeeded", "wh_2,with a comma"),
        (c, "succeeded", "wh_3"),
        (d, "reconciling", None),
        (e, "reconciling", None),
    ]
    assert rows(
        db_url, "SELECT operation_id, action, details->>'provider_ref' FROM outbox.audit ORDER BY 1"
    ) == [(a, "resolve", "wh_1"), (b, "resolve", "wh_2,with a comma"), (c, "resolve", "wh_3")]


def test_a_file_with_a_bad_line_resolves_nothing_and_names_every_bad_line(
    db_url: str, cli_env: dict[str, str], tmp_path: Any
) -> None:
    population = reconciling_population(db_url, random.Random(6), 3)
    a, b, c = (op["id"] for op in population)
    (pending,) = enqueue_many(db_url, 1, prefix="p")
    before = status_of(db_url)
    cases = {
        f"{a},wh_1\n{b},wh_2,extra\nabc,wh_3\n{c},\n{a},wh_9\n-4,x\n": [
            "line 2: 3 field(s), not 2",
            "line 3: 'abc' is not an operation id",
            "line 4: no reference",
            "line 5: operation " + str(a) + " is on line 1 too",
            "line 6: '-4' is not an operation id",
        ],
        f"{a},wh_1\n{pending},wh_2\n99999,wh_3\n": [
            f"line 2: operation {pending} is pending, not reconciling",
            "line 3: no operation 99999",
        ],
        "id,reference\n# nothing\n\n": ["has no `id,reference` line"],
    }
    for text, said in cases.items():
        path = tmp_path / "refs.csv"
        path.write_text(text)
        out = outbox_cli(
            cli_env, "reconcile", "resolve", "--refs-file", str(path), "--reason", "x", "--yes"
        )
        assert out.returncode == 2, (text, out.stderr)
        for words in said:
            assert words in out.stderr, (words, out.stderr)
        assert "nothing was resolved" in out.stderr or "has no" in out.stderr
        assert status_of(db_url) == before and audit_of(db_url) == []
    (tmp_path / "latin1.csv").write_bytes(f"{a},caf\xe9\n".encode("latin-1"))
    latin = outbox_cli(
        cli_env, "reconcile", "resolve", "--refs-file", str(tmp_path / "latin1.csv"),
        "--reason", "x", "--yes",
    )  # fmt: skip
    assert latin.returncode == 2 and "not UTF-8" in latin.stderr, latin.stderr
    assert status_of(db_url) == before and audit_of(db_url) == []


def test_resolve_takes_exactly_one_way_and_each_its_own_selection(
    cli_env: dict[str, str], tmp_path: Any
) -> None:
    path = tmp_path / "refs.csv"
    path.write_text("1,wh_1\n")
    wrong = [
        ["7", "--reason", "x"],  # no way
        ["7", "--provider-ref", "wh", "--no-effect", "--reason", "x"],
        ["--provider-ref", "wh", "--all", "--reason", "x", "--yes"],
        ["--refs-file", str(path), "--provider", "hook", "--reason", "x"],
        ["7", "--refs-file", str(path), "--reason", "x"],
        ["--no-effect", "--reason", "x"],  # neither an ID nor a selection
        ["7", "--no-effect", "--all", "--reason", "x"],
    ]
    for args in wrong:
        out = outbox_cli(cli_env, "reconcile", "resolve", *args)
        assert out.returncode == 2, (args, out.stderr)


def test_a_retry_that_finds_an_operation_retried_meanwhile_skips_it_and_exits_3(
    db_url: str,
) -> None:
    population = reconciling_population(db_url, random.Random(8), 4)
    ids = [op["id"] for op in sorted(population, key=lambda op: -op["hours_ago"])]
    with psycopg.connect(db_url, autocommit=True) as conn:
        for op in ids:
            operators.record_no_effect(conn, op, reason="looked", actor="alice")

    def retry(conn: psycopg.Connection[Any], operation_id: int) -> Status:
        if operation_id == ids[0]:  # someone else retries one of the selection meanwhile
            with psycopg.connect(db_url, autocommit=True) as other:
                operators.retry(other, ids[2], reason="by hand", actor="bob")
        return operators.retry(conn, operation_id, reason="bulk", actor="alice")

    with pytest.raises(SystemExit) as exited:
        bulk.run(
            db_url,
            Status.RECONCILING,
            operators.Filters(),
            verb="retry",
            action=retry,
            dry_run=False,
            yes=True,
            only=operator.RETRY_ONLY,
        )
    assert exited.value.code == 3
    assert rows(
        db_url,
        "SELECT actor, count(*) FROM outbox.audit WHERE action = 'retry' GROUP BY 1 ORDER BY 1",
    ) == [("alice", 3), ("bob", 1)]
    assert set(status_of(db_url).values()) == {"pending"}


def test_retry_no_effect_records_the_finding_and_retries_in_one_go(
    db_url: str, cli_env: dict[str, str]
) -> None:
    population = reconciling_population(db_url, random.Random(12), 8)
    hook = sorted(op["id"] for op in population if op["provider"] == "hook")
    both = outbox_cli(
        cli_env, "reconcile", "retry", "--all", "--force", "--no-effect", "--reason", "x"
    )
    assert both.returncode == 2, both.stderr
    done = outbox_cli(
        cli_env, "reconcile", "retry", "--provider", "hook", "--no-effect",
        "--reason", "not in the receiver's log", "--yes",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(i for i, s in status_of(db_url).items() if s == "pending") == hook
    assert sorted(audit_of(db_url)) == sorted(
        [(i, "no_effect", "not in the receiver's log", "reconciling", "reconciling") for i in hook]
        + [(i, "retry", "not in the receiver's log", "reconciling", "pending") for i in hook]
    )
    assert rows(
        db_url, "SELECT DISTINCT details->>'forced' FROM outbox.audit WHERE action = 'retry'"
    ) == [("false",)]


def test_no_effect_waits_thirty_seconds_after_the_last_attempt(
    db_url: str, cli_env: dict[str, str]
) -> None:
    """What the provider shows may not have an effect that young: a person's "no effect" is
    refused within 30 s of the last attempt, as a check's finding would prove nothing."""
    population = reconciling_population(db_url, random.Random(3), 4)
    young, *settled = sorted(op["id"] for op in population)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET last_attempt_at = now() - interval '5 seconds' "
            "WHERE id = %s",
            (young,),
        )
    one = outbox_cli(cli_env, "reconcile", "resolve", str(young), "--no-effect", "--reason", "x")
    assert one.returncode == 2 and "less than 30 s ago" in one.stderr, one.stderr
    many = outbox_cli(
        cli_env, "reconcile", "retry", "--all", "--no-effect", "--reason", "x", "--yes"
    )
    assert many.returncode == 0, many.stderr
    assert "1 of the 4 that match are left alone" in many.stdout
    assert status_of(db_url) == {
        young: "reconciling",
        **dict.fromkeys(settled, "pending"),
    }
    assert findings(db_url)[young] is None
    assert rows(db_url, "SELECT count(*) FROM outbox.audit WHERE operation_id = %s", (young,)) == [
        (0,)
    ]
