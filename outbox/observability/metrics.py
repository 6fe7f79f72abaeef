"""Every metric outbox exports, defined once. Names follow docs/design.md ("Metrics") and Prometheus
conventions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import Counter, Gauge, Histogram, Info, disable_created_metrics

# prometheus_client adds a _created series beside every counter and histogram child: one more
# series each for Prometheus to store, which no rule or panel reads. Off, for the whole process.
disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it untyped

# Provider calls take from a few milliseconds (loopback) to the longest configured timeout.
_CALL_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
# Enqueue to success spans a NOTIFY wake-up (milliseconds) to retries over a day.
_END_TO_END_BUCKETS: Final = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    900,
    3600,
    4 * 3600,
    86400,
)
_CLAIM_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)

DISPATCH: Final = Counter(
    "outbox_dispatch", "Attempts by outcome.", ["provider", "action", "outcome"]
)
DISPATCH_DURATION: Final = Histogram(
    "outbox_dispatch_duration_seconds",
    "Provider call time.",
    ["provider", "action"],
    buckets=_CALL_BUCKETS,
)
END_TO_END: Final = Histogram(
    "outbox_end_to_end_seconds", "Enqueue to success.", ["provider"], buckets=_END_TO_END_BUCKETS
)
DATABASE_UP: Final = Gauge(
    "outbox_database_up",
    "1 while a writable primary answers this process's probe (every second); 0 while none does.",
)
GAUGES_REFRESHED: Final = Gauge(
    "outbox_gauges_refreshed_timestamp_seconds",
    "When the database-wide gauges (outbox_operations, the oldest ages) were last read; they keep "
    "their last values while the database cannot be reached, so alert on this going stale.",
)
IN_FLIGHT: Final = Gauge("outbox_in_flight", "Operations this process holds a lease on.")
RETRIES: Final = Counter("outbox_retries", "Attempts scheduled for retry.", ["provider"])
QUARANTINED: Final = Counter(
    "outbox_quarantined", "Operations sent to quarantine.", ["provider", "reason"]
)
RECONCILIATION_ROUTED: Final = Counter(
    "outbox_reconciliation_routed", "Operations routed to reconciliation.", ["provider", "reason"]
)
LEASE_EXPIRED: Final = Counter("outbox_lease_expired", "Expired leases this process rescued.")
LEASE_LOST: Final = Counter(
    "outbox_lease_lost", "Records or renewals that found the lease taken: nothing was changed."
)
RECORD_ROW_MISSING: Final = Counter(
    "outbox_record_row_missing",
    "Records or hand-backs whose operation no longer exists in this database (a failover to a "
    "standby that lacked it): the provider may have acted on an operation the database lost.",
)
CLAIM_DURATION: Final = Histogram(
    "outbox_claim_duration_seconds", "Time of one claim query.", buckets=_CLAIM_BUCKETS
)
DB_ERRORS: Final = Counter("outbox_db_errors", "Database errors, by operation.", ["operation"])
INTERNAL_ERRORS: Final = Counter(
    "outbox_internal_errors",
    "Exceptions a loop of outbox run survived (a bug, or a failure nobody foresaw), by loop.",
    ["loop"],
)
STAGED: Final = Counter(
    "outbox_staged", "Scheduled operations that came due and joined the claim (sql/0019)."
)
PROVIDER_PAUSED: Final = Gauge(
    "outbox_provider_paused",
    "1 while a provider's breaker is open because its credentials were refused.",
    ["provider"],
)
ACTION_PAUSED: Final = Gauge(
    "outbox_action_paused",
    "1 while one action of a provider is paused because the provider refused it permission "
    "(a restricted key without it): its operations wait, the provider's others go on.",
    ["provider", "action"],
)
PROVIDER_STATE: Final = Gauge(
    "outbox_provider_state",
    "A provider's circuit breaker in this process: 1 for its state, 0 for the others.",
    ["provider", "state"],
)
PROVIDER_FAILING_ALONE: Final = Gauge(
    "outbox_provider_failing_alone",
    "Operations this process found failing alone (they failed again after the provider had "
    "succeeded for others): their failures no longer weigh on the provider's breaker.",
    ["provider"],
)
PROVIDER_TRANSITIONS: Final = Counter(
    "outbox_provider_transitions",
    "Circuit breaker transitions, by the state entered.",
    ["provider", "state"],
)
PROVIDER_THROTTLED: Final = Counter(
    "outbox_provider_throttled",
    "429 answers that emptied a rate-limited provider's shared bucket.",
    ["provider"],
)
RECONCILE_CHECKS: Final = Counter(
    "outbox_reconcile_checks",
    "Reconciliation look-ups, by what they found.",
    ["provider", "finding"],
)
# Database-wide: every replica reports the same values, so aggregate with max(), not sum().
OPERATIONS: Final = Gauge("outbox_operations", "Operations by status, database-wide.", ["status"])
OLDEST_PENDING_AGE: Final = Gauge(
    "outbox_oldest_pending_age_seconds", "Age of the oldest due pending operation (0: none)."
)
# Per provider (configured ones by name, any other as _unconfigured), from the same query: the
# age alert leaves out a provider whose credentials are refused, which pages as paused instead.
PROVIDER_OLDEST_PENDING_AGE: Final = Gauge(
    "outbox_provider_oldest_pending_age_seconds",
    "Age of the provider's oldest due pending operation (0: none).",
    ["provider"],
)
OLDEST_RECONCILING_AGE: Final = Gauge(
    "outbox_oldest_reconciling_age_seconds", "Time the oldest reconciling operation has waited."
)
ORDERING_BLOCKED: Final = Gauge(
    "outbox_ordering_blocked",
    "Operations waiting for an earlier one with their ordering key, by the status of the one they "
    "wait for; 'none' means no earlier one is left and a dispatcher's repair is due.",
    ["behind"],
)
NEARING_KEY_EXPIRY: Final = Gauge(
    "outbox_operations_nearing_key_expiry",
    "Pending operations whose key window closes within the hour.",
    ["provider"],
)
BUILD_INFO: Final = Info("outbox_build", "The running outbox version.")


# The label values outbox itself writes (outbox.core.policy's reasons, the reconciler's findings,
# the breaker's states, the loops that count database errors), for start_at_zero.
QUARANTINE_REASONS: Final = (
    "permanent_failure",
    "attempts_exhausted",
    "invalid_payload",
    "internal_error",
    "provider_declined",
    "unencodable_request",
    "contract_violation",
    # The queues' (issue 25): no stream, queue or route takes the message; a message over the
    # queue's size limit; a message id another producer holds (JetStream).
    "unroutable",
    "message_too_large",
    "key_collision",
)
ROUTED_REASONS: Final = ("key_window_passed", "indeterminate_provider_error")
CHECK_FINDINGS: Final = (
    "found",
    "refused",
    "undecided",
    "not_found",
    "no_lookup",
    "error",
    "stale",
)
BREAKER_STATES: Final = ("open", "half_open", "closed")
DB_OPERATIONS: Final = (
    "claim",
    "record",
    "unclaim",
    "heartbeat",
    "rescue",
    "stage",
    "gauges",
    "listen",
    "reconcile",
    "ordering_repair",
    "take_tokens",
    "throttle_bucket",
    "health",
)


def start_at_zero(providers: Iterable[str]) -> None:
    """Every label set outbox knows of, present at 0 from start-up. A series that first
    appears at 10 shows Prometheus no increase() (there is no earlier sample), so the first
    quarantines of a new provider paged no one (issue 21)."""
    for provider in providers:
        for reason in QUARANTINE_REASONS:
            QUARANTINED.labels(provider, reason)
        for reason in ROUTED_REASONS:
            RECONCILIATION_ROUTED.labels(provider, reason)
        for finding in CHECK_FINDINGS:
            RECONCILE_CHECKS.labels(provider, finding)
        for state in BREAKER_STATES:
            PROVIDER_TRANSITIONS.labels(provider, state)
        RETRIES.labels(provider)
        PROVIDER_THROTTLED.labels(provider)
    for operation in DB_OPERATIONS:
        DB_ERRORS.labels(operation)
