"""The reconciler: asks providers whether a reconciling operation's effect exists.

Found, and the object's state says the effect happened: the operation becomes succeeded with
the provider's reference (and an audit entry). Found, but the provider refused (a declined
PaymentIntent exists too): quarantined, reason provider_declined, with the decline's details.
Found in a state that decides nothing yet, or not found: it stays reconciling, for a person to
decide (`outbox reconcile retry` or `cancel`). A provider without a lookup leaves every decision
to a person.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, LiteralString

import psycopg
import structlog
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderLimits, ProviderSettings
from outbox.core import payloads
from outbox.db import statements
from outbox.db.connect import connection_options, pin_search_path_async
from outbox.db.store import Store
from outbox.dispatch.pauses import LookupPacer
from outbox.errors import SQLSTATE_OPERATOR_REFUSED
from outbox.observability import metrics
from outbox.providers.base import Lookup, LookupRequest, NotFound, Provider, Verdict, asks
from outbox.providers.registry import build_providers, may_look_up
from outbox.runtime import loops

ACTOR: Final = "outbox-reconciler"
# A check rereads an operation at most this often: not-found is the usual answer, and each look
# costs the provider a list call or two.
RECHECK_AFTER: Final = timedelta(hours=1)
# A lookup that failed (the provider down or rate limited) is tried again this much later.
ERROR_RETRY: Final = timedelta(minutes=5)
BATCH: Final = 100
MANUAL_LIMIT: Final = 100_000
# The most one check may take, its provider's pacing included: a provider that answers slowly
# (a header line a second), or a plug-in whose lookup never returns, ends the check as an error,
# tried again after ERROR_RETRY, rather than holding it for good. Each request of the built-in
# lookups has its provider's own timeout besides (outbox/providers/http/lookup.py).
CHECK_DEADLINE: Final = timedelta(minutes=2)

log = structlog.get_logger("outbox.reconciler")


# A found object's verdict, as the finding recorded (sql/0021).
FINDINGS: Final = {
    Verdict.DONE: "found",
    Verdict.REFUSED: "refused",
    Verdict.UNDECIDED: "undecided",
}
RECORDED: Final = frozenset({*FINDINGS.values(), "not_found"})


@dataclass(frozen=True)
class CheckResult:
    operation_id: int
    provider: str
    # found | refused | undecided | not_found | no_lookup | error | stale (the row moved on)
    finding: str
    reference: str | None = None
    duplicates: tuple[str, ...] = ()
    error: str | None = None
    state: str | None = None  # the found object's status word
    # refused/undecided: the object's codes; not_found/incomplete: what was searched, and when
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Reconciler:
    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        providers: Mapping[str, Provider],
        *,
        actor: str = ACTOR,
        limits: Mapping[str, ProviderLimits] | None = None,
        without_lookup: Collection[str] = (),
        check_deadline: timedelta = CHECK_DEADLINE,
    ) -> None:
        self._pool = pool
        self._deadline = check_deadline.total_seconds()
        self._providers = providers
        # Configured, but with no lookup: not built (nor their secrets read); answered no_lookup.
        self._without_lookup = frozenset(without_lookup) - set(providers)
        self._actor = actor
        # Lookups take their provider's rate-limit tokens, as sends do.
        self._pacer = LookupPacer(Store(pool), limits or {})

    async def candidates(
        self,
        operation_id: int | None = None,
        *,
        ids: Sequence[int] | None = None,
        recheck_after: timedelta | None = None,
        limit: int = BATCH,
        askable_only: bool = True,
    ) -> list[dict[str, Any]]:
        """Reconciling operations to check (``operation_id``, ``ids`` or all), ``askable_only``:
        of providers with a lookup."""
        names = [n for n, p in self._providers.items() if asks(p) or not askable_only]
        if not askable_only:
            names += sorted(self._without_lookup)
        # Operations asked for by id are checked whatever their provider: an unconfigured one
        # is then named in the finding rather than leaving an empty table.
        named = operation_id is not None or ids is not None
        chosen = None if named and not askable_only else names
        params = {
            "id": operation_id,
            "ids": None if ids is None else list(ids),
            "recheck_after": recheck_after,
            "limit": limit,
            "providers": chosen,
        }
        return await self._rows(statements.RECONCILING_TO_CHECK, params)

    async def check(
        self,
        row: Mapping[str, Any],
        *,
        dry_run: bool = False,
        recheck_after: timedelta = RECHECK_AFTER,
    ) -> CheckResult:
        """Look one operation up at its provider and, unless ``dry_run``, record the finding."""
        result = await self._look(row)
        if not dry_run and result.finding in RECORDED:
            try:
                result = await self._record(result, row)
            except psycopg.DataError as exc:
                # What the provider answered cannot be stored (a NUL in a detail): this row is
                # tried again later, and the rows behind it are still checked.
                result = dataclasses.replace(result, finding="error", error=type(exc).__name__)
                await self._defer(row, recheck_after)
        elif not dry_run and result.finding == "error":
            await self._defer(row, recheck_after)
        metrics.RECONCILE_CHECKS.labels(result.provider, result.finding).inc()
        log.info(
            "reconciliation check",
            operation_id=result.operation_id,
            provider=result.provider,
            outcome=result.finding,
            error_class=result.error,
            dry_run=dry_run,
        )
        return result

    async def run_once(
        self,
        *,
        recheck_after: timedelta = RECHECK_AFTER,
        on_result: Callable[[CheckResult], None] | None = None,
    ) -> int:
        """Check every reconciling operation not checked since ``recheck_after`` that no other
        replica is checking: each is claimed (marked checked) as it is taken. Each provider's
        operations are checked apart from the others', at once: a slow provider holds up only
        its own."""
        counts = await asyncio.gather(
            *(
                self.run_provider(name, recheck_after=recheck_after, on_result=on_result)
                for name in self._askable()
            )
        )
        return sum(counts)

    async def run_provider(
        self,
        provider: str,
        *,
        recheck_after: timedelta = RECHECK_AFTER,
        on_result: Callable[[CheckResult], None] | None = None,
    ) -> int:
        """One round of one provider's checks: a batch claimed, each checked in turn."""
        rows = await self.claim(recheck_after=recheck_after, limit=BATCH, providers=[provider])
        for row in rows:
            result = await self.check(row, recheck_after=recheck_after)
            if on_result is not None:
                on_result(result)
        return len(rows)

    async def claim(
        self, *, recheck_after: timedelta, limit: int, providers: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """Due checks of providers with a lookup (of ``providers`` among them), marked checked
        as they are taken."""
        names = self._askable() if providers is None else providers
        params = {"providers": list(names), "recheck_after": recheck_after, "limit": limit}
        return await self._rows(statements.CLAIM_CHECKS, params)

    async def run_forever(self, interval: timedelta) -> None:
        """A loop of its own for each provider with a lookup: one whose checks are slow (each
        up to the check's deadline) delays no other provider's round."""

        def round_for(provider: str) -> Callable[[], Awaitable[float]]:
            async def round_() -> float:
                try:
                    await self.run_provider(provider)
                except psycopg.Error as exc:
                    metrics.DB_ERRORS.labels("reconcile").inc()
                    log.warning(
                        "reconciliation pass failed",
                        provider=provider,
                        error_class=type(exc).__name__,
                    )
                return interval.total_seconds()

            return round_

        await asyncio.gather(
            *(loops.forever("reconcile", round_for(name)) for name in self._askable())
        )

    def _askable(self) -> list[str]:
        return [n for n, p in self._providers.items() if asks(p)]

    async def _rows(self, query: LiteralString, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            rows: list[dict[str, Any]] = await (await cur.execute(query, params)).fetchall()
        return rows

    async def _look(self, row: Mapping[str, Any]) -> CheckResult:
        base = {"operation_id": row["id"], "provider": row["provider"]}
        provider = self._providers.get(row["provider"])
        if provider is None:  # not built: configured without a lookup, or not configured
            unknown = row["provider"] not in self._without_lookup
            return CheckResult(
                finding="no_lookup", error="not_configured" if unknown else None, **base
            )
        if not isinstance(provider, Lookup) or not asks(provider, row["action"]):
            return CheckResult(finding="no_lookup", **base)
        deadline = asyncio.timeout(self._deadline)
        try:
            if "payload" not in row:  # listed without it (RECONCILING_TO_CHECK)
                row = {**row, "payload": await self._payload(row["id"])}
            request = _request(row, self._pacer.pace(row["provider"]))
            async with deadline:
                found = await provider.lookup(request)
        except Exception as exc:  # noqa: BLE001 (a failed look proves nothing either way)
            # Past the check's deadline (CHECK_DEADLINE), the provider did not answer in time.
            error = "deadline" if deadline.expired() else type(exc).__name__
            return CheckResult(finding="error", error=error, **base)
        if isinstance(found, NotFound):
            searched = {
                "searched": list(found.sources),
                "since": found.since.isoformat(),
                "until": found.until.isoformat(),
            }
            if found.complete:
                return CheckResult(finding="not_found", details=searched, **base)
            # A search cut short proves nothing: a person decides, and a retry needs --force.
            searched["reason"] = found.reason or "?"
            return CheckResult(
                finding="undecided", state="search incomplete", details=searched, **base
            )
        return CheckResult(
            finding=FINDINGS[found.verdict],
            reference=found.reference,
            duplicates=found.duplicates,
            state=found.state,
            details=dict(found.details),
            **base,
        )

    async def _payload(self, operation_id: int) -> str | None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(statements.CHECK_PAYLOAD, {"id": operation_id})
            found = await cur.fetchone()
        return None if found is None else str(found[0])

    async def _record(self, result: CheckResult, row: Mapping[str, Any]) -> CheckResult:
        details: dict[str, Any] = dict(result.details)
        if result.duplicates:
            details["duplicates"] = list(result.duplicates)
        params = {
            "id": result.operation_id,
            "finding": result.finding,
            "found_ref": result.reference,
            "state": result.state,
            "actor": self._actor,
            "details": json.dumps(details),
            "generation": row["key_generation"],
            "attempts": row["attempts"],
        }
        async with self._pool.connection() as conn:
            try:
                cur = await conn.execute(statements.RECORD_FINDING, params)
                outcome = await cur.fetchone()
            except psycopg.Error as exc:
                if exc.sqlstate != SQLSTATE_OPERATOR_REFUSED:
                    raise
                outcome = ("gone",)  # resolved or cancelled by someone meanwhile
        if result.duplicates:
            log.error(
                "more than one effect carries this operation id",
                provider=result.provider,
                operation_id=result.operation_id,
                duplicates=list(result.duplicates),
            )
        if outcome is not None and outcome[0] in ("stale", "gone"):
            if result.finding != "not_found":
                # An effect exists for an operation someone else settled: a person must know.
                log.error(
                    "effect found for an operation no longer reconciling",
                    reference=result.reference,
                    operation_id=result.operation_id,
                    provider=result.provider,
                )
            return dataclasses.replace(result, finding="stale")
        return result

    async def _defer(self, row: Mapping[str, Any], recheck_after: timedelta) -> None:
        """A failed lookup: due again after ERROR_RETRY, not a whole ``recheck_after``; nothing
        if the operation moved on since ``row`` was read (fenced as _record is)."""
        params = {
            "id": row["id"],
            "recheck_after": recheck_after,
            "retry_in": min(ERROR_RETRY, recheck_after),
            "generation": row["key_generation"],
            "attempts": row["attempts"],
        }
        async with self._pool.connection() as conn:
            await conn.execute(statements.DEFER_CHECK, params)


def _request(row: Mapping[str, Any], pace: Callable[[], Awaitable[None]] | None) -> LookupRequest:
    try:
        payload: Mapping[str, Any] = payloads.decode(row["payload"]) if row["payload"] else {}
    except payloads.InvalidPayload:
        payload = {}  # the lookup goes without its narrowing filters, never without its look
    return LookupRequest(
        action=row["action"],
        operation_id=row["id"],
        idempotency_key=row["idempotency_key"],
        keys=frozenset(row["keys"]),
        first_sent_at=row["first_sent_at"],
        last_attempt_at=row["last_attempt_at"],
        search_until=row["search_until"],
        checked_now=row["checked_now"],
        payload=payload,
        api_version=row["api_version"],
        sent_scope=row["sent_scope"],
        pace=pace,
    )


async def run_checks(
    dsn: str,
    providers: Mapping[str, Provider],
    operation_id: int | None,
    *,
    ids: Sequence[int] | None = None,
    dry_run: bool,
    on_total: Callable[[int], None],
    on_result: Callable[[CheckResult], None],
    limits: Mapping[str, ProviderLimits] | None = None,
    without_lookup: Collection[str] = (),
    actor: str = f"{ACTOR} (manual)",
) -> list[CheckResult]:
    """Check one operation, those of ``ids``, or (with neither) every reconciling one, for
    `outbox reconcile check` and the console (``actor``: who asked, for the audit).
    ``without_lookup``: providers configured but not built, since they have no lookup: their
    operations are answered no_lookup."""
    # prepare_threshold None: `reconcile check --all` may run through a transaction pooler.
    options = {
        "autocommit": True,
        "prepare_threshold": None,
        **connection_options(dsn, "outbox-reconcile"),
    }
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=2, kwargs=options, configure=pin_search_path_async
    ) as pool:
        reconciler = Reconciler(
            pool,
            providers,
            actor=actor,
            limits=limits,
            without_lookup=without_lookup,
        )
        rows = await reconciler.candidates(
            operation_id, ids=ids, limit=MANUAL_LIMIT, askable_only=False
        )
        on_total(len(rows))
        # Each provider's operations in turn, the providers at once: a slow one holds up only
        # its own. The results in the order of the rows.
        by_provider: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
        for n, row in enumerate(rows):
            by_provider.setdefault(row["provider"], []).append((n, row))
        results: dict[int, CheckResult] = {}

        async def check_all(mine: list[tuple[int, Mapping[str, Any]]]) -> None:
            for n, row in mine:
                results[n] = await reconciler.check(row, dry_run=dry_run)
                on_result(results[n])

        await asyncio.gather(*(check_all(mine) for mine in by_provider.values()))
    for provider in providers.values():
        await provider.aclose()
    return [results[n] for n in range(len(rows))]


def providers_to_ask(
    configured: Mapping[str, ProviderSettings], wanted: Collection[str]
) -> tuple[dict[str, Provider], set[str]]:
    """The providers of the operations a check takes, built; and those of them whose settings
    show no lookup, not built: no secret of a provider not asked is read, so a laptop needs only
    the secrets of the providers it checks. Raises ConfigError for a provider that cannot be
    built."""
    chosen = {name: ps for name, ps in configured.items() if name in wanted}
    without_lookup = {name for name, ps in chosen.items() if not may_look_up(ps)}
    built = build_providers({name: ps for name, ps in chosen.items() if name not in without_lookup})
    return built, without_lookup
