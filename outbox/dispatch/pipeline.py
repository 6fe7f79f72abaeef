"""One operation's way, from its claim to its outcome: check it, send it with no transaction
open, classify the answer, and hand the outcome to the recorder (or set the row aside unsent:
its key window closed, a payload or request that cannot be carried, its provider paused)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Final

from outbox import contracts
from outbox.contracts import Checker
from outbox.core import payloads
from outbox.core.durations import format_duration
from outbox.core.model import Status
from outbox.core.policy import (
    REASON_INDETERMINATE,
    REASON_INTERNAL_ERROR,
    REASON_INVALID_PAYLOAD,
    REASON_KEY_WINDOW,
)
from outbox.db.store import Claimed, ConnectionHeldAcrossSend, assert_no_connection_held
from outbox.dispatch.contracts import Contracts, verdict
from outbox.dispatch.flight import Aside, InFlight, Phase, api_version, release
from outbox.dispatch.leases import LeaseKeeper
from outbox.dispatch.recorder import Recorder
from outbox.dispatch.shared import Shared
from outbox.observability import metrics, tracing
from outbox.providers.base import (
    Failed,
    Intent,
    InvalidRequest,
    Provider,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    unknown,
)
from outbox.runtime import failpoints

# A row naming a provider this process does not know is handed back for this long after its
# enqueue (a deploy adding the provider may be rolling out), then quarantined as a bad row.
UNKNOWN_PROVIDER_GRACE: Final = timedelta(minutes=10)
UNKNOWN_PROVIDER_RETRY: Final = timedelta(seconds=30)
# The payload text whose work (the verdict on it, the decoding a provider's check may ask for)
# one turn of the event loop takes at most, beyond a single row's: at the costliest bytes the
# door lets through, about 50 ns each, some 13 ms (bench/payload_decode.py); ordinary payloads of
# a few hundred bytes never wait for it.
TURN_BYTES: Final = 256 * 1024


class Turns:
    """Spreads the payload work of the rows of a claim over turns of the event loop, which
    reads its sockets between turns. The rows of a claim all start in one turn: 100 payloads
    dense with brackets were seconds of it with no answer read, and calls that had been
    answered were cut off by the call guard as unknown (issue 38, item 2)."""

    def __init__(self, loop: Callable[[], asyncio.AbstractEventLoop], budget: int) -> None:
        self._loop = loop
        self._budget = budget
        self._spent = 0

    def take(self, cost: int) -> bool:
        """Whether ``cost`` bytes of payload work may run in this turn; if so, they are counted
        in it. The first work of a turn always may, however much it is."""
        if self._spent and self._spent + cost > self._budget:
            return False
        if not self._spent and cost:
            self._loop().call_soon(self._next_turn)  # before any waiter's next step
        self._spent += cost
        return True

    async def wait(self, cost: int) -> None:
        """Take the first later turn with room for ``cost`` bytes."""
        while not self.take(cost):  # noqa: ASYNC110 (no event: it waits for the loop's next turn)
            await asyncio.sleep(0)

    def _next_turn(self) -> None:
        self._spent = 0


class Pipeline:
    def __init__(self, shared: Shared, recorder: Recorder, leases: LeaseKeeper) -> None:
        self._shared = shared
        self._providers = shared.providers
        self._store = shared.store
        self._limits = shared.limits
        self._action_pauses = shared.action_pauses
        self._rules = shared.rules
        self._meters = shared.meters
        self._recorder = recorder
        self._leases = leases
        # A send starts only this long before the lease's end at the latest: the request must
        # leave while no other worker can hold the row (local clock: only durations count).
        self._send_margin = shared.settings.lease.total_seconds() / 10
        self._abandoned: set[asyncio.Task[SendResult]] = set()
        self._unknown_told: set[str] = set()  # providers named by rows but not configured here
        self._spans = tracing.Spans()
        self._turns = Turns(shared.running_loop, TURN_BYTES)
        self._contracts = Contracts(shared.store)

    async def process(self, flight: InFlight) -> None:
        # One coroutine for the whole way of every operation, with plain calls where it can:
        # each coroutine more is a frame and an await more per operation, and the dispatcher
        # spends its CPU on such things (bench/README.md, Throughput).
        row = flight.row
        try:
            if failpoints.armed(failpoints.AFTER_CLAIM):
                await failpoints.hit(failpoints.AFTER_CLAIM)
            if failpoints.armed(failpoints.BUG):
                failpoints.bug("dispatch")
            provider = self._providers.get(row.provider)
            if provider is None:
                await self._unknown_provider(flight)
                return
            cost = len(row.payload or "")
            if not self._turns.take(cost):
                await self._turns.wait(cost)
            contract = None
            if self._contracts.needs_check(row):  # a contract's version, never sent
                contract = await self._contracts.checker(row)
            payload = self._to_send(flight, provider, contract)
            if isinstance(payload, Aside):
                await self._set_aside(flight, payload)
                return
            leak = failpoints.take(failpoints.LEAK_TRANSACTION)
            if leak is not None:
                await self._store.leave_transaction_open(row.id, idle_timeout=leak)
            # A bug that kept a transaction open here would hold row locks for the whole call:
            # refuse to send; the lease expires and the rescuer takes the row back.
            assert_no_connection_held()
            if self._spans.active():
                result = await self._traced_send(flight, provider, payload)
            else:
                result = await self._send(flight, provider, payload)
            del row, payload  # the payload is not held while recording (Shared.call_over)
            if failpoints.armed(failpoints.BEFORE_RECORD):
                await failpoints.hit(failpoints.BEFORE_RECORD)
            await self._after_call(flight, result)
        except (asyncio.CancelledError, ConnectionHeldAcrossSend):
            # The guard's refusal ends the task as it is (the lease expires, the rescuer takes
            # the row back): nothing may be written through a connection in that state.
            raise
        except Exception as exc:  # noqa: BLE001 (one operation's bug must not cost its lease)
            await self._after_bug(flight, exc)

    async def _after_call(self, flight: InFlight, result: SendResult) -> None:
        # No local for the row: the recorder drops its payload (Shared.call_over).
        pause = self._limits.observe(flight.row, result)
        if pause is not None:
            await self._limits.throttle(flight.row.provider, pause)
        self._action_pauses.observe(flight.row, result, self._meters.label_pair)
        if isinstance(result, Failed) and result.pause:
            # Refused credentials say nothing about this operation: it keeps its attempt and
            # waits, with the rest of its provider's, behind the breaker.
            await self._recorder.unclaim(flight, Status.PENDING, None)
        elif isinstance(result, Failed) and result.pause_action:
            # Likewise for one action refused permission: it waits with its action's.
            wait = self._action_pauses.wait(flight.row)
            await self._recorder.unclaim(flight, Status.PENDING, None, delay=wait)
        else:
            await self._recorder.finish(flight, result)

    async def _after_bug(self, flight: InFlight, exc: Exception) -> None:
        """outbox itself failed on this operation. Before the send, nothing left this process:
        quarantined now (internal_error), never rescued later as an attempt that may have
        reached the provider. During or after it: recorded as unknown, if it can be. A failed
        record, or a connection held across the send, is left to the lease and the rescuer."""
        metrics.INTERNAL_ERRORS.labels("dispatch").inc()
        flight.log.error("dispatching this operation failed inside outbox", exc_info=exc)
        if flight.phase is Phase.RECORDING:
            return
        sent = flight.phase is not Phase.CLAIMED
        message = f"outbox failed {'after' if sent else 'before'} sending: {type(exc).__name__}"
        failure = (unknown if sent else permanent)("internal_error", message)
        try:
            await self._recorder.finish(flight, failure, sent=sent, reason=REASON_INTERNAL_ERROR)
        except Exception:
            # The rescuer takes the row back when the lease ends.
            flight.log.exception("recording the failure failed too; the lease will expire")

    async def _traced_send(
        self, flight: InFlight, provider: Provider, payload: Mapping[str, Any]
    ) -> SendResult:
        with tracing.attempt_span(flight.row.traceparent, _span_attributes(flight.row)) as span:
            result = await self._send(flight, provider, payload)
            if span is not None:
                span.set_attribute("outbox.outcome", _outcome(result))
        return result

    def _to_send(
        self, flight: InFlight, provider: Provider, contract: Checker | Aside | None
    ) -> Mapping[str, Any] | Aside:
        """The payload to send, or where the row goes instead of the provider. ``contract``:
        what the payload is checked against before its first send (Contracts.checker)."""
        row = flight.row
        # Never sent before (the common case): no window to close, no clock to read.
        window = self._rules.window(row.provider, row.action)
        if row.first_sent_at is not None and window.has_passed(row.first_sent_at, flight.db_now()):
            return Aside(Status.RECONCILING, REASON_KEY_WINDOW)
        if row.first_sent_at is not None and not _resends(provider, row.action):
            # It may have reached a provider that keeps no answer but a success under the key
            # (a crash after sending, then the lease taken back): reconciliation decides.
            return Aside(Status.RECONCILING, REASON_INDETERMINATE)
        payload, problem = _decoded(row)
        if payload is None:
            failure = permanent("invalid_payload", problem or "the payload cannot be read")
            return Aside(Status.QUARANTINED, REASON_INVALID_PAYLOAD, failure)
        if contract is not None:
            refused = contract if isinstance(contract, Aside) else verdict(contract, payload)
            if refused is not None:
                return refused
        problem = _check(provider, row.action, payload, row.idempotency_key)
        if problem is not None:
            return Aside(Status.QUARANTINED, None, permanent("invalid_request", problem))
        return self._held_back(flight) or payload

    def _held_back(self, flight: InFlight) -> Aside | None:
        """Back to pending unsent, its attempt unspent, or None: send it."""
        if self._shared.stopping or not self._limits.may_send(flight.row):
            # Stopping, or the provider's breaker opened since the claim.
            return Aside(Status.PENDING, None)
        paused = self._action_pauses.wait(flight.row)
        if paused is not None:  # its action was refused permission: back until the pause ends
            return Aside(Status.PENDING, None, delay=paused)
        if time.monotonic() >= flight.lease_deadline - self._send_margin:
            # Frozen since the claim (SIGSTOP, a stalled host): the lease may have run out and
            # another worker sent the row, or the next one of its ordering key. A send now would
            # overtake theirs on the wire. Handed back unsent (fenced: a no-op if taken).
            flight.log.warning("the lease ran out before the send; handing the row back unsent")
            return Aside(Status.PENDING, None)
        return None

    async def _set_aside(self, flight: InFlight, aside: Aside) -> None:
        if aside.failure is not None:  # recorded as an attempt that never left
            await self._recorder.finish(flight, aside.failure, sent=False, reason=aside.reason)
        else:  # handed back without an attempt
            await self._recorder.unclaim(flight, aside.status, aside.reason, delay=aside.delay)

    async def _unknown_provider(self, flight: InFlight) -> None:
        row = flight.row
        if flight.db_now() - row.created_at < UNKNOWN_PROVIDER_GRACE:
            # Likely a rolling deploy that added the provider: a newer replica will take it.
            if row.provider not in self._unknown_told:  # once per provider and process
                self._unknown_told.add(row.provider)
                flight.log.warning(
                    "an operation names a provider this process does not have: it waits for a "
                    "replica that has it, and is quarantined as unknown_provider "
                    f"{format_duration(UNKNOWN_PROVIDER_GRACE)} after its enqueue"
                )
            await self._recorder.unclaim(flight, Status.PENDING, None, delay=UNKNOWN_PROVIDER_RETRY)
            return
        failure = permanent("unknown_provider", f"no provider named {row.provider!r} is configured")
        await self._recorder.finish(flight, failure, sent=False)

    async def _send(
        self, flight: InFlight, provider: Provider, payload: Mapping[str, Any]
    ) -> SendResult:
        row = flight.row
        request = SendRequest(
            operation_id=row.id,
            tenant_id=row.tenant_id,
            operation_type=row.operation_type,
            operation_key=row.operation_key,
            action=row.action,
            payload=payload,
            idempotency_key=row.idempotency_key,
            correlation_id=row.correlation_id,
            attempt=row.attempts,
            payload_json=row.payload,
            api_version=api_version(row, provider),
            traceparent=row.traceparent,
            intent=_intent(row),
        )
        flight.scope = _scope(provider, row.action, payload)
        flight.phase = Phase.SENDING
        loop = self._shared.running_loop()
        send = flight.send_task = loop.create_task(provider.send(request))
        if isinstance(payload, payloads.Decoded):
            # Callbacks run in order: this one after the task's first step, in which a provider
            # builds its request from the payload (one that reads it later decodes it again). A
            # call in flight then holds its request, not a decoded payload too (up to ~13 MB).
            loop.call_soon(payload.release)
        waiter = flight.waiter = loop.create_future()
        send.add_done_callback(functools.partial(release, waiter))
        limit = self._rules.call_limit(row.provider)
        if limit is not None:
            flight.guard_at = loop.time() + limit
            self._leases.guard(loop, flight.guard_at)
        started = time.perf_counter()
        try:
            # Not `await send`: a call that ignores cancellation would then hold this slot and
            # its lease for ever. The waiter ends with the call or at the guard's deadline.
            await waiter
            if not send.done():
                # A call that ignores cancellation must not keep this slot or its lease: let it
                # go (held here so it is not garbage-collected mid-flight) and move on.
                send.cancel()
                self._abandoned.add(send)
                send.add_done_callback(self._abandoned.discard)
                return unknown("call_guard", "the provider call outlived its timeout; abandoned")
            if send.cancelled():
                return unknown("shutdown", "the call was cut off at shutdown")
            return send.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (a provider must not raise; if it does, it may have sent)
            return unknown("provider_error", f"the provider raised {type(exc).__name__}")
        finally:
            flight.waiter = flight.guard_at = None
            self._meters.of(row).duration.observe(time.perf_counter() - started)


def _scope(provider: Provider | None, action: str, payload: Mapping[str, Any]) -> str | None:
    scope = getattr(provider, "scope", None)
    return None if scope is None else str(scope(action, payload))


def _decoded(row: Claimed) -> tuple[Mapping[str, Any] | None, str | None]:
    """The row's payload object, or None and why it cannot be carried. Never raises."""
    if row.payload is None:
        return None, (
            f"the payload is {row.payload_bytes} bytes of JSON; the claim hands over "
            f"at most {row.payload_limit} (outbox.limits.max_payload_bytes)"
        )
    try:
        return payloads.carried(row.payload), None
    except payloads.InvalidPayload as exc:
        return None, str(exc)


def _resends(provider: Provider, action: str) -> bool:
    """Whether the provider's key makes a resend of ``action`` safe inside the key window
    (``retries_unknown``, docs/design.md "Provider interface"; true where undeclared)."""
    retries = getattr(provider, "retries_unknown", None)
    return True if retries is None else bool(retries(action))


def _check(provider: Provider, action: str, payload: Mapping[str, Any], key: str) -> str | None:
    """Why this row can never be sent, or None. Never raises. A provider may also declare
    ``check_key(action, key)``, refusing a key it would refuse (too long for it)."""
    check_key = getattr(provider, "check_key", None)
    try:
        provider.check(action, payload)
        if check_key is not None:
            check_key(action, key)
    except InvalidRequest as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 (a bad row must not stop the line)
        return f"the provider's check raised {type(exc).__name__}"
    return None


def _span_attributes(row: Claimed) -> dict[str, Any]:
    return {
        "outbox.operation_id": row.id,
        "outbox.attempt": row.attempts,
        "outbox.provider": row.provider,
        "outbox.action": row.action,
        "outbox.tenant_id": row.tenant_id,
    }


def _outcome(result: SendResult) -> str:
    return "succeeded" if isinstance(result, Succeeded) else result.failure.value


def _intent(row: Claimed) -> Intent | None:
    """What the delivery carries for its receiver to check (sql/0045); None from a claim of an
    older schema's shape, which has neither."""
    if row.fingerprint is None or row.origin is None:
        return None
    contract = None
    if row.contract_version is not None:
        contract = contracts.label(row.operation_type, row.contract_version)
    return Intent(str(row.origin), row.fingerprint, row.provider, row.ordering_key, contract)
