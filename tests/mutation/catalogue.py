"""The curated mutants: deliberate bugs in the code that carries outbox's promise.

Each is a small textual change with a name, the property it breaks and the tests that claim to
cover that property. ``python -m tests.mutation.run`` applies each, alone, to a scratch copy of
the tree and runs only its tests there: a mutant the tests do not kill is a hole in the suite.

Add a mutant whenever a bug is found that the suite missed (README, "Tests that fail when the
promise breaks"). An edit's ``find`` must occur exactly once in its file: a catalogue that no
longer matches the code fails the run instead of passing it.
"""

from __future__ import annotations

from dataclasses import dataclass

FENCE_TESTS = ("tests/integration/test_lease_fence.py",)
# Node-id prefixes: each mutant runs the tests that catch it, not its whole file.
LEASE_FENCE = "tests/integration/test_lease_fence.py::"
DISPATCH_TESTS = "tests/integration/test_dispatch.py::"
STRIPE_TESTS = "tests/integration/test_stripe.py::"
FINDINGS_TESTS = "tests/integration/test_reconcile_findings.py::"
RESULTS_TESTS = "tests/integration/test_stripe_results.py::"
SEARCH_TESTS = "tests/integration/test_reconcile_search.py::"
NOT_ACTED_TESTS = "tests/integration/test_stripe_not_acted.py::"
EVERY_ACTION_TESTS = "tests/integration/test_reconcile_every_action.py::"
SEARCH_PATH_TESTS = "tests/integration/test_search_path.py::"
KEY_NAMESPACE_TESTS = "tests/integration/test_key_namespace.py::"
IDENTITY_TESTS = "tests/integration/test_identity_characters.py::"
AUDIT_TESTS = "tests/integration/test_audit_truth.py::"
ALLOW_TESTS = "tests/integration/test_allow_lists.py::"
UNBUILDABLE_TESTS = "tests/integration/test_unbuildable_requests.py::"
SCHEDULED_TESTS = "tests/integration/test_scheduled_claims.py::"
ORDERING_TESTS = "tests/integration/test_ordering.py::"
RLS_TESTS = "tests/integration/test_rls.py::"
HEALTH_TESTS = "tests/integration/test_provider_health.py::"
WITHOUT_CONFIG_TESTS = "tests/integration/test_reconcile_without_config.py::"
HTTP_LOOKUP_TESTS = "tests/integration/test_http_lookups.py::"
WEB_APP = "outbox/web/app.py"
WEB_TESTS = "tests/integration/test_web_console.py::"


@dataclass(frozen=True)
class Edit:
    path: str
    find: str
    replace: str


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  # the property, in the words of docs/design.md
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest paths or node ids that must kill it


def _one(name: str, breaks: str, path: str, find: str, replace: str, *tests: str) -> Mutant:
    return Mutant(name, breaks, (Edit(path, find, replace),), tests)


STATEMENTS = "outbox/db/statements.py"
# The dispatcher's writes to operations and attempts (sql/0040).
DISPATCH_SQL = "sql/0040_the_dispatcher_writes_through_functions.sql"
# record_attempts and rescue_leases since a success at the first attempt stays on its row (0050).
LEDGER_SQL = "sql/0050_a_success_writes_one_row.sql"
LEDGER_TESTS = "tests/integration/test_success_ledger.py::"
# The dispatcher's parts (outbox/dispatch/): one operation's way, and the recording of outcomes.
PIPELINE = "outbox/dispatch/pipeline.py"
RECORDER = "outbox/dispatch/recorder.py"
POLICY = "outbox/core/policy.py"
ISOLATION_TESTS = "tests/integration/test_provider_isolation.py"
# The newest definition of outbox.enqueue (and of publish_contract, PUBLISH_SQL).
ENQUEUE = "sql/0055_contract_aliases.sql"
# Each operation's identity and provider key, apart from its row (sql/0051, issue 41 step C):
# the keys' table and triggers; enqueue's part of it is in ENQUEUE.
KEYS_SQL = "sql/0051_keys_apart_from_the_operation.sql"
KEYS_TESTS = "tests/integration/test_operation_keys.py::"
CHECK_TEXT = "sql/0028_identities_refuse_format_characters.sql"
# Operation contracts: published once, never changed (sql/0052, issue 42); publish_contract's
# newest definition, with the type's requirement (0053) and aliases (0055).
CONTRACTS_SQL = "sql/0052_operation_contracts.sql"
PUBLISH_SQL = ENQUEUE
CONTRACTS_TESTS = "tests/integration/test_contracts.py::"
CONTRACT_DISPATCH_TESTS = "tests/integration/test_contracts_dispatch.py::"
INBOX_CONTRACT_TESTS = "tests/integration/test_inbox_contracts.py::"
# The queue providers' tests against the real brokers (and moto, the Cloud Tasks emulator).
NATS_TESTS = "tests/integration/test_queue_nats.py"
AMQP_TESTS = "tests/integration/test_queue_amqp.py"
SQS_TESTS = "tests/integration/test_queue_sqs.py"
TASKS_TESTS = "tests/integration/test_queue_cloudtasks.py"
STARTUP_TESTS = "tests/integration/test_run_startup.py"
CARRIED = "tests/integration/test_carried_payloads.py::"
ROLES_TESTS = "tests/integration/test_roles.py"
# The inbox (issue 40): its SQL, its middleware, and the tests in process and against the
# example worker under uvicorn.
INBOX_SQL = "sql/0042_inbox.sql"
# inbox_begin, defined again without a subtransaction (sql/0044).
INBOX_BEGIN = "sql/0044_inbox_begin_without_a_subtransaction.sql"
# 0046 creates inbox_begin and inbox_claim again: their mutants live there.
INBOX_ORIGIN = "sql/0046_the_inbox_checks_the_senders_fingerprint.sql"
# 0048 creates them again, with the origin a part of the identity.
INBOX_IDENTITY = "sql/0048_the_origin_is_part_of_the_identity.sql"
# 0049 creates inbox_begin (its admission one test) and inbox_of_operation again.
INBOX_ADMISSION = "sql/0049_a_delivery_costs_less.sql"
# 0056 creates inbox_begin and inbox_claim again, with the contract compared: their mutants
# live there now.
INBOX_CONTRACT = "sql/0056_the_inbox_compares_contracts.sql"
ADMISSION_TESTS = "tests/integration/test_inbox_admission.py::"
ORIGIN_TESTS = "tests/integration/test_inbox_origin.py::"
INBOX_TESTS = "tests/integration/test_inbox.py"
WORKER_TESTS = "tests/integration/test_inbox_worker.py"
JETSTREAM_TESTS = "tests/integration/test_inbox_jetstream.py"
EXTERNAL_TESTS = "tests/integration/test_inbox_external.py"
RABBITMQ_TESTS = "tests/integration/test_inbox_rabbitmq.py"
# What the ASGI and the WSGI middleware share: identity, answers, what is recorded.
ADAPTER = "outbox/inbox/adapter.py"
# The WSGI middleware and its inbox on threads, around Flask under werkzeug's server.
WSGI_TESTS = "tests/integration/test_inbox_wsgi.py"
# A queue consumer stopped mid-work: the drain's logic alone, then real consumer processes on
# JetStream, RabbitMQ and SQS.
STOP_UNIT = "tests/unit/test_inbox_stop.py::"
STOP_TESTS = "tests/integration/test_inbox_queue_stop.py::"
# External-effect mode through the adapters: the example worker's POST /payments, and a queue
# Consumer in Claiming mode.
CLAIMING_TESTS = "tests/integration/test_inbox_worker_external.py::"

MUTANTS: tuple[Mutant, ...] = (
    # --- the lease fence, in every path that writes after a provider call ----------------------
    _one(
        "record-fence",
        "a worker whose lease expired records over another worker's attempt",
        LEDGER_SQL,
        "          AND o.lease_token = i.lease_token\n          AND o.attempts = i.attempt\n",
        "",
        LEASE_FENCE + "test_a_zombies_grouped_records_change_only_the_rows_it_still_holds",
        LEASE_FENCE + "test_a_zombies_single_record_changes_nothing",
    ),
    _one(
        "release-fence",
        "a worker whose lease expired hands back a row another worker holds",
        DISPATCH_SQL,
        "WHERE o.id = p_id AND o.lease_token = p_lease_token AND o.status = 'in_flight'",
        "WHERE o.id = p_id AND o.status = 'in_flight'",
        LEASE_FENCE + "test_a_zombies_release_changes_nothing",
    ),
    _one(
        "heartbeat-fence",
        "a worker whose lease expired renews the lease of another worker",
        DISPATCH_SQL,
        "WHERE o.id = held.id AND o.lease_token = held.token AND o.status = 'in_flight'",
        "WHERE o.id = held.id AND o.status = 'in_flight'",
        LEASE_FENCE + "test_a_zombies_heartbeat_renews_no_lease_it_lost",
        LEASE_FENCE
        + "test_a_zombie_whose_call_returns_while_another_worker_holds_the_row_changes_nothing",
    ),
    Mutant(
        "rescue-live-lease",
        "the rescuer takes back a row whose lease is still live",
        (
            Edit(
                LEDGER_SQL,
                "        WHERE status = 'in_flight' AND lease_expires_at < now()\n",
                "        WHERE status = 'in_flight'\n",
            ),
            Edit(
                LEDGER_SQL,
                "o.status = 'in_flight' AND o.lease_expires_at < now()",
                "o.status = 'in_flight'",
            ),
        ),
        (LEASE_FENCE + "test_the_rescuer_takes_no_lease_that_is_still_live",),
    ),
    _one(
        "recorded-before-counts-the-rescue",
        "a worker whose record failed takes the rescuer's attempt row for its own record",
        STATEMENTS,
        "  AND error_class IS DISTINCT FROM 'lease_expired'\n",
        "",
        LEASE_FENCE + "test_the_attempt_the_rescuer_recorded_is_not_the_zombies_record",
    ),
    _one(
        "check-fence",
        "a reconciler's late finding is written over a newer episode",
        "sql/0023_lookups_say_what_they_searched.sql",
        "IF op.key_generation <> expected_generation OR op.attempts <> expected_attempts THEN",
        "IF false THEN",
        LEASE_FENCE + "test_a_reconcilers_late_finding_and_deferral_change_nothing",
    ),
    _one(
        "defer-fence",
        "a reconciler's late deferral postpones the check of a newer episode",
        DISPATCH_SQL,
        "          AND o.key_generation = defer_check.expected_generation\n"
        "          AND o.attempts = defer_check.expected_attempts\n",
        "",
        LEASE_FENCE + "test_a_reconcilers_late_finding_and_deferral_change_nothing",
    ),
    _one(
        "send-after-lease",
        "a worker frozen past its lease sends when it wakes",
        PIPELINE,
        "if time.monotonic() >= flight.lease_deadline - self._send_margin:",
        "if False:",
        "tests/integration/test_run_process.py::"
        "test_a_dispatcher_frozen_between_its_claim_and_its_send_does_not_send_when_it_wakes",
    ),
    # --- the key window: never a blind resend once the provider may have forgotten the key ---
    _one(
        "policy-key-window",
        "a failure past the key window is retried instead of reconciled",
        POLICY,
        "    if closes is not None and now >= closes:\n"
        "        return Next(Status.RECONCILING, REASON_KEY_WINDOW)",
        "    if False:\n        return Next(Status.RECONCILING, REASON_KEY_WINDOW)",
        "tests/unit/test_policy.py",
    ),
    _one(
        "send-key-window",
        "a row past its key window is sent instead of reconciled",
        PIPELINE,
        "if row.first_sent_at is not None and window.has_passed("
        "row.first_sent_at, flight.db_now()):",
        "if False and window.has_passed(row.first_sent_at, flight.db_now()):",
        "tests/integration/test_dispatch.py::"
        "test_the_key_window_decides_between_resending_and_reconciling",
    ),
    _one(
        "record-window-start",
        "an attempt that may have reached the provider starts no window",
        LEDGER_SQL,
        "first_sent_at = CASE WHEN i.sent THEN coalesce(o.first_sent_at, o.last_attempt_at)\n"
        "                                 ELSE o.first_sent_at END,",
        "first_sent_at = o.first_sent_at,",
        DISPATCH_TESTS
        + "test_a_timeout_after_the_provider_acted_is_retried_with_the_same_key_once",
        DISPATCH_TESTS + "test_a_503_may_have_acted_so_it_starts_the_key_window_and_keeps_the_key",
    ),
    _one(
        "unknown-not-sent",
        "a call that may have reached the provider counts as never sent",
        RECORDER,
        "reached = result.may_have_reached_provider if sent is None else sent",
        "reached = False",
        DISPATCH_TESTS
        + "test_a_timeout_after_the_provider_acted_is_retried_with_the_same_key_once",
        DISPATCH_TESTS + "test_a_503_may_have_acted_so_it_starts_the_key_window_and_keeps_the_key",
    ),
    _one(
        "rescue-not-sent",
        "the rescuer forgets that the dead worker's call may have been sent",
        LEDGER_SQL,
        "            first_sent_at = coalesce(o.first_sent_at, o.last_attempt_at),\n"
        "            last_error = 'lease expired",
        "            last_error = 'lease expired",
        "tests/integration/test_dispatch.py::"
        "test_a_dead_workers_lease_is_rescued_as_unknown_and_sent_once",
    ),
    # --- one effect per operation: the key, and what makes two enqueues the same operation ---
    _one(
        "stripe-key",
        "Stripe calls go out without the operation's idempotency key",
        "outbox/providers/stripe/provider.py",
        '"idempotency_key": request.idempotency_key,',
        '"idempotency_key": None,',
        STRIPE_TESTS + "test_each_operation_creates_one_object_carrying_its_id_and_key",
        STRIPE_TESTS + "test_a_timeout_after_stripe_acted_is_retried_with_the_same_key_once",
    ),
    _one(
        "webhook-key",
        "webhook and http calls carry another key than the operation's",
        "outbox/providers/http/provider.py",
        "headers[spec.key.header] = spec.key.header_value(wire)",
        'headers[spec.key.header] = spec.key.header_value(f"{wire}:{request.attempt}")',
        DISPATCH_TESTS + "test_each_operation_makes_one_effect_and_keeps_its_reference",
        DISPATCH_TESTS
        + "test_a_timeout_after_the_provider_acted_is_retried_with_the_same_key_once",
    ),
    _one(
        "fingerprint-payload",
        "an enqueue with another payload is taken for a duplicate",
        ENQUEUE,
        "action || E'\\n' || v_payload_text\n",
        "action || E'\\n'\n",
        "tests/integration/test_enqueue.py::"
        "test_same_identity_other_content_is_a_conflict_and_changes_nothing",
    ),
    _one(
        "retry-key-generation",
        "`reconcile retry` sends again under the key it gave up on",
        "sql/0009_stricter_retry_checks_and_audit.sql",
        "idempotency_key = new_key,\n        key_generation = o.key_generation + 1,",
        "idempotency_key = o.idempotency_key,\n        key_generation = o.key_generation,",
        "tests/integration/test_reconcile.py::"
        "test_an_effect_stripe_never_applied_is_recorded_missing_then_retried_once",
    ),
    # --- reconciliation: a found object is not a found effect ---------------------------------
    _one(
        "found-state-ignored",
        "every object the reconciler finds makes its operation succeeded, a declined charge too",
        "outbox/oncall/reconciler.py",
        "finding=FINDINGS[found.verdict]",
        'finding="found"',
        FINDINGS_TESTS + "test_a_declined_charge_sent_to_reconciliation_is_quarantined_as_declined",
        FINDINGS_TESTS
        + "test_a_decline_whose_answer_was_lost_is_quarantined_by_the_periodic_check",
        FINDINGS_TESTS
        + "test_a_payment_awaiting_the_customer_stays_reconciling_until_its_state_decides",
    ),
    _one(
        "decline-is-done",
        "a PaymentIntent whose confirmation was declined counts as paid",
        "outbox/providers/stripe/states.py",
        "        return Verdict.REFUSED  # a confirmation was declined: no payment happened",
        "        return Verdict.DONE",
        "tests/unit/test_stripe_states.py",
        FINDINGS_TESTS + "test_a_declined_charge_sent_to_reconciliation_is_quarantined_as_declined",
    ),
    _one(
        "refused-to-reconciling",
        "a refused finding leaves the operation reconciling instead of quarantined",
        "sql/0023_lookups_say_what_they_searched.sql",
        "SET status = 'quarantined', status_reason = 'provider_declined',",
        "SET status = 'reconciling', status_reason = 'provider_declined',",
        FINDINGS_TESTS + "test_a_declined_charge_sent_to_reconciliation_is_quarantined_as_declined",
        FINDINGS_TESTS
        + "test_a_decline_whose_answer_was_lost_is_quarantined_by_the_periodic_check",
    ),
    _one(
        "stripe-5xx-permanent",
        "a Stripe 5xx that says not to retry is quarantined, though Stripe may have acted",
        "outbox/providers/stripe/provider.py",
        "    if status is not None and status >= 500 and should_retry is False:\n",
        "    if False:\n",
        "tests/integration/test_stripe.py::test_the_error_map",
    ),
    _one(
        "client-secret-kept",
        "a PaymentIntent's client_secret is stored in the operation's result",
        "outbox/providers/stripe/provider.py",
        "REDACTED if k in fields and v is not None else",
        "v if k in fields and v is not None else",
        RESULTS_TESTS + "test_decimal_fields_are_kept_and_the_client_secret_is_not",
        RESULTS_TESTS + "test_redact_fields_names_more_fields_at_any_depth",
    ),
    _one(
        "lookup-misses-hashed-generations",
        "the lookup of a long key's later generation misses the first generation's object",
        "outbox/providers/stripe/lookup.py",
        'return frozenset({first, "ob1_" + hashlib.sha256(first.encode()).hexdigest()})',
        "return frozenset({first})",
        FINDINGS_TESTS + "test_every_generation_of_a_long_key_finds_the_first_generations_object",
    ),
    _one(
        "check-window-from-current-generation",
        "after reconcile retry, a manual check searches only from the new generation's send",
        STATEMENTS,
        "       least(coalesce(first_sent_at, created_at),\n"
        "             (SELECT min(a.started_at) FROM outbox.attempts a\n"
        "              WHERE a.operation_id = o.id AND a.sent)) AS first_sent_at,",
        "       coalesce(first_sent_at, created_at) AS first_sent_at,",
        FINDINGS_TESTS
        + "test_after_reconcile_retry_the_check_still_finds_what_generation_1_made_hours_ago",
    ),
    _one(
        "claim-checks-window-from-current-generation",
        "after reconcile retry, the daemon's check searches only from the new generation's send",
        DISPATCH_SQL,
        "              least(coalesce(o.first_sent_at, o.created_at),\n"
        "                    (SELECT min(a.started_at) FROM outbox.attempts a\n"
        "                     WHERE a.operation_id = o.id AND a.sent)),",
        "              coalesce(o.first_sent_at, o.created_at),",
        FINDINGS_TESTS
        + "test_after_reconcile_retry_the_check_still_finds_what_generation_1_made_hours_ago",
    ),
    _one(
        "lookup-without-events",
        "a deleted customer is reported not found, so a person creates it again",
        "outbox/providers/stripe/provider.py",
        "            if events.matches:\n",
        "            if False:\n",
        SEARCH_TESTS + "test_a_deleted_customer_is_found_by_the_event_of_its_creation",
        SEARCH_TESTS + "test_a_deleted_draft_invoice_is_undecided_and_never_not_found",
    ),
    _one(
        "lookup-pages-unbounded",
        "a lookup reads a list that never ends for ever, and a capped search says not found",
        "outbox/providers/stripe/lookup.py",
        "    for _ in range(LOOKUP_MAX_PAGES):\n",
        "    for _ in range(10**6):\n",
        SEARCH_TESTS + "test_a_search_stopped_by_its_page_cap_is_undecided_with_the_reason",
    ),
    _one(
        "capped-search-not-found",
        "a search cut short by its page cap is recorded as not found",
        "outbox/providers/stripe/lookup.py",
        "    if objects.complete or events_whole:\n",
        "    if True:\n",
        SEARCH_TESTS + "test_a_search_stopped_by_its_page_cap_is_undecided_with_the_reason",
        SEARCH_TESTS + "test_a_list_that_never_ends_costs_a_bounded_number_of_requests",
    ),
    _one(
        "check-window-never-grows",
        "a re-check searches the same window as the first check, however late Stripe dated it",
        DISPATCH_SQL,
        "                       CASE WHEN due.checked_before IS NOT NULL\n"
        "                            THEN least(due.checked_before, now()) END),",
        "                       NULL),",
        SEARCH_TESTS + "test_each_recheck_searches_up_to_the_check_before_it",
    ),
    _one(
        "lookup-without-filters",
        "a lookup scans every object of its type instead of the payload's list filters",
        "outbox/providers/stripe/lookup.py",
        "    params = {**dict(searchable.always), **narrowing}\n",
        "    params = dict(searchable.always)\n",
        SEARCH_TESTS + "test_the_payloads_list_filters_narrow_the_search_past_the_crowd",
    ),
    _one(
        "not-acted-spends-budget",
        "a long rate-limit episode quarantines operations that never reached Stripe",
        LEDGER_SQL,
        "            attempt_base = o.attempt_base + CASE WHEN i.unspent THEN 1 ELSE 0 END,\n",
        "",
        NOT_ACTED_TESTS + "test_a_long_episode_of_answers_that_did_not_act_never_quarantines",
    ),
    _one(
        "not-acted-free-for-ever",
        "a rate limit that never lifts keeps an operation retrying for ever",
        RECORDER,
        "and flight.db_now() - row.created_at < UNSPENT_FOR\n",
        "and True\n",
        NOT_ACTED_TESTS + "test_answers_that_did_not_act_spend_the_budget_once_the_ceiling_passed",
    ),
    _one(
        "paused-action-sent",
        "operations of an action the provider refused permission are sent again and again",
        PIPELINE,
        "        paused = self._action_pauses.wait(flight.row)\n",
        "        paused = None\n",
        NOT_ACTED_TESTS + "test_a_403_on_one_action_pauses_that_action_and_not_the_provider",
    ),
    _one(
        "403-pauses-provider",
        "a 403 on one action stops every action of the provider",
        "outbox/providers/stripe/provider.py",
        "message, pause_action=True, request_only=True,",
        "message, pause=True, request_only=True,",
        NOT_ACTED_TESTS + "test_a_403_on_one_action_pauses_that_action_and_not_the_provider",
    ),
    _one(
        "retry-in-the-new-version",
        "a retry after a config or SDK upgrade is sent in another API version than its first send",
        "outbox/providers/stripe/provider.py",
        "                version = request.api_version or self._options.stripe_version\n",
        "                version = self._options.stripe_version\n",
        "tests/integration/test_stripe_version.py",
    ),
    _one(
        "first-version-forgotten",
        "the API version of an operation's first send is not kept for its retries",
        LEDGER_SQL,
        "            api_version = coalesce(o.api_version, CASE WHEN i.sent THEN i.api_version "
        "END),\n",
        "",
        "tests/integration/test_stripe_version.py",
    ),
    _one(
        "hostile-decline-codes-kept",
        "a provider's answer writes escapes and newlines into last_error, shown on a terminal",
        "outbox/providers/stripe/provider.py",
        "if isinstance(value, str) and _WORD.fullmatch(value)\n",
        "if isinstance(value, str)\n",
        RESULTS_TESTS + "test_a_hostile_card_error_writes_nothing_of_its_own_into_last_error",
    ),
    _one(
        "lookup-ignores-where-it-was-sent",
        "a check after the account or key mode changed searches the wrong place: not found",
        "outbox/providers/stripe/provider.py",
        "        if request.sent_scope is None or request.sent_scope == here:\n",
        "        if True:\n",
        "tests/integration/test_stripe_connect.py::"
        "test_a_check_after_the_account_or_the_keys_mode_changed_says_where_it_was_sent",
    ),
    _one(
        "operation-accounts-always-allowed",
        "a producer sends on another connected account's behalf without the operator's leave",
        "outbox/providers/stripe/provider.py",
        "        if not self._options.operation_accounts:\n",
        "        if False:\n",
        "tests/integration/test_stripe_connect.py::"
        "test_an_account_per_operation_is_refused_unless_the_provider_allows_it",
    ),
    _one(
        "lookups-bypass-rate-limit",
        "reconciliation lookups push the provider's calls past its rate limit",
        "outbox/providers/stripe/lookup.py",
        "    async def list(self, service: str, params: dict[str, Any]) -> Any:\n"
        "        await self._paced()\n",
        "    async def list(self, service: str, params: dict[str, Any]) -> Any:\n",
        SEARCH_TESTS + "test_lookups_go_through_the_providers_rate_limit",
    ),
    _one(
        "change-found-whatever-its-state",
        "a state change whose target says it never happened is marked succeeded",
        "outbox/providers/stripe/provider.py",
        "    if decided is None:\n        return NotFound(",
        "    if False:\n        return NotFound(",
        EVERY_ACTION_TESTS + "test_a_change_that_did_not_happen_is_not_found_and_may_be_retried",
    ),
    _one(
        "change-target-unchecked",
        "a change is sent to whatever object the payload names, of any kind",
        "outbox/providers/stripe/actions.py",
        "        if not isinstance(value, str) or not re.fullmatch(pattern, value):\n",
        "        if not isinstance(value, str):\n",
        EVERY_ACTION_TESTS
        + "test_a_change_without_its_own_kind_of_target_is_refused_before_sending",
    ),
    _one(
        "dispatcher-search-path-unpinned",
        "a function planted in public takes over a call of the dispatcher's",
        "outbox/db/connect.py",
        '    "search_path": statements.SEARCH_PATH,\n',
        "",
        SEARCH_PATH_TESTS
        + "test_migrate_with_the_roles_dispatch_and_the_cli_never_run_a_planted_function",
    ),
    _one(
        "migrate-search-path-unpinned",
        "migrations and role scripts resolve names through public, under the migrator's rights",
        "outbox/db/migrations.py",
        "    cur.execute(statements.PIN_SEARCH_PATH)\n",
        "",
        SEARCH_PATH_TESTS + "test_every_migration_runs_with_the_pinned_search_path",
    ),
    _one(
        "caller-takes-derived-key",
        "a producer occupies the derived key of another tenant's operation before it exists",
        ENQUEUE,
        "    IF idempotency_key ~* '^ob[0-9]+_' OR idempotency_key ~* ':r[0-9]+$' THEN\n",
        "    IF false THEN\n",
        KEY_NAMESPACE_TESTS + "test_nobody_can_occupy_another_tenants_derived_key_in_advance",
        KEY_NAMESPACE_TESTS + "test_the_forms_outbox_makes_are_refused_as_caller_keys",
    ),
    _one(
        "derived-key-without-secret",
        "a derived key is computed from the public identity alone (issue 38, 3i): whoever may "
        "publish beside outbox takes an operation's key first, and two databases collide",
        ENQUEUE,
        "        v_key := 'ob2_' || encode(sha256(v_secret || sha256(v_secret || convert_to(\n",
        "        v_key := 'ob2_' || encode(sha256(sha256(convert_to(\n",
        KEY_NAMESPACE_TESTS + "test_nobody_can_occupy_another_tenants_derived_key_in_advance",
        KEY_NAMESPACE_TESTS + "test_two_databases_derive_different_keys_and_old_rows_keep_theirs",
    ),
    _one(
        "caller-takes-new-derived-form",
        "a producer takes a key of the ob2_ form outbox derives since sql/0041",
        ENQUEUE,
        "    IF idempotency_key ~* '^ob[0-9]+_' OR",
        "    IF idempotency_key ~* '^ob1_' OR",
        "tests/integration/test_key_namespace.py::test_the_forms_outbox_makes_are_refused_as_caller_keys",
    ),
    _one(
        "key-collision-reveals-tenant",
        "a key collision tells a producer another tenant's operation id",
        ENQUEUE,
        "                      DETAIL = CASE WHEN v_holder_tenant = tenant_id\n",
        "                      DETAIL = CASE WHEN true\n",
        KEY_NAMESPACE_TESTS + "test_two_tenants_with_one_caller_key_are_told_at_enqueue",
    ),
    # --- the keys apart from the operation (sql/0051) ------------------------------------------
    _one(
        "keys-provider-key-per-operation",
        "two operations of one provider take the same caller key: the provider answers the second "
        "with the first's result, or refuses it",
        KEYS_SQL,
        "    ADD CONSTRAINT operation_keys_provider_key UNIQUE (provider, idempotency_key);\n",
        "    ADD CONSTRAINT operation_keys_provider_key UNIQUE (provider, idempotency_key, "
        "operation_id);\n",
        KEY_NAMESPACE_TESTS + "test_two_tenants_with_one_caller_key_are_told_at_enqueue",
        KEYS_TESTS + "test_producers_at_once_with_colliding_identities_and_keys",
    ),
    _one(
        "keys-outlive-their-operation",
        "a pruned or deleted operation keeps its identity and key: enqueuing it again is answered "
        "'duplicate' of an operation that no longer exists",
        KEYS_SQL,
        "AND k.operation_key = g.operation_key AND k.operation_id = g.id;\n",
        "AND k.operation_key = g.operation_key AND k.operation_id = -g.id;\n",
        KEYS_TESTS + "test_retry_moves_the_key_and_prune_frees_the_identity",
        KEYS_TESTS + "test_a_hand_delete_and_a_truncate_take_the_keys_along",
    ),
    _one(
        "keys-stay-behind-on-retry",
        "`reconcile retry`'s next key is not guarded: the keys still name the key given up",
        KEYS_SQL,
        "    SET idempotency_key = CASE WHEN NOT NEW.key_shared THEN NEW.idempotency_key END\n",
        "    SET idempotency_key = CASE WHEN NOT NEW.key_shared THEN OLD.idempotency_key END\n",
        KEYS_TESTS + "test_retry_moves_the_key_and_prune_frees_the_identity",
    ),
    _one(
        "key-holder-hidden-by-isolation",
        "under tenant isolation enqueue cannot see that another tenant holds the caller's key "
        "(the holder read through outbox.operations, which FORCE filters)",
        ENQUEUE,
        "        FROM outbox.operation_keys k\n        WHERE k.provider = provider",
        "        FROM outbox.operation_keys k JOIN outbox.operations o ON o.id = k.operation_id\n"
        "        WHERE k.provider = provider",
        KEYS_TESTS + "test_another_tenants_key_is_refused_under_forced_isolation",
    ),
    _one(
        "keys-migration-takes-shared-keys",
        "a database whose operations share a key (sql/0024) cannot be migrated: the copy puts the "
        "shared key into the unique index twice",
        KEYS_SQL,
        "       CASE WHEN NOT o.key_shared THEN o.idempotency_key END\n",
        "       o.idempotency_key\n",
        "tests/integration/test_migrations.py::"
        "test_0051_moves_every_operations_keys_and_keeps_them_unique",
    ),
    _one(
        "identity-format-characters-fast-path",
        "an identity holding a bidi override or a line separator is enqueued (the usual path)",
        ENQUEUE,
        "            || coalesce(correlation_id, '') || coalesce(ordering_key, ''))\n"
        "            !~ '[",
        "            || coalesce(correlation_id, '') || coalesce(ordering_key, ''))\n"
        "            !~ '[[:cntrl:]]' AND '' !~ '[",
        IDENTITY_TESTS + "test_sql_enqueue_refuses_every_such_character_in_each_field",
        IDENTITY_TESTS + "test_python_enqueue_refuses_every_such_character_in_each_field",
    ),
    _one(
        "identity-format-characters-check-text",
        "an identity holding a bidi override or a line separator is enqueued (check_text)",
        CHECK_TEXT,
        "    v_bad := substring(value from '[",
        "    v_bad := substring(value from '[[:cntrl:]]');\n    PERFORM substring(value from '[",
        IDENTITY_TESTS + "test_check_text_refuses_each_one_naming_the_character",
    ),
    _one(
        "identity-edge-spaces",
        "an identity ending in a no-break space is enqueued, and looks like another tenant's or "
        "operation's",
        "sql/0036_identities_refuse_spaces_at_their_ends.sql",
        "    IF value IS NULL THEN\n",
        "    IF true THEN\n",
        "tests/integration/test_identity_ends.py::"
        "test_sql_enqueue_refuses_a_space_at_either_end_of_each_field",
        "tests/integration/test_identity_ends.py::"
        "test_python_enqueue_refuses_a_space_at_either_end_of_each_field",
    ),
    _one(
        "payload-values-unbounded",
        "a payload of 260,000 empty arrays under 1 MiB is enqueued, and each costs the dispatcher "
        "a fifth of a second of its event loop and 19 MB to decode",
        ENQUEUE,
        "    IF v_bytes > 4096 AND v_bytes >= 2 * v_max_values\n",
        "    IF false\n",
        "tests/integration/test_bad_input.py::"
        "test_a_payload_of_more_values_than_the_limit_is_refused_naming_both",
    ),
    # --- a provider that sends the stored text never builds the object (issue 38, item 2) -----
    _one(
        "carried-decodes",
        "a provider that sends the stored text has the payload object built all the same: a "
        "payload dense with brackets costs the webhook 0.1 s of the event loop and 6 to 19 MB",
        "outbox/core/payloads.py",
        "        raise InvalidPayload(problem)\n    return Decoded(text)\n",
        "        raise InvalidPayload(problem)\n    return decode(text)\n",
        CARRIED + "test_the_webhook_sends_dense_payloads_at_the_limits_without_building_them",
        CARRIED + "test_the_verdict_on_a_dense_text_builds_nothing",
    ),
    _one(
        "verdict-counts-digits-in-strings",
        "a payload with a long run of digits in a string (an account number, a token) is "
        "quarantined as holding a number of 1e100 or more",
        "outbox/core/payloads.py",
        "_LONG_INTEGER.search(_STRING.sub('\"\"', text))",
        "_LONG_INTEGER.search(text)",
        CARRIED + "test_the_verdict_from_the_text_is_decodes_on_every_text_postgresql_writes",
    ),
    _one(
        "payload-held-in-flight",
        "every call in flight holds its decoded payload until it ends: 300 calls of dense "
        "payloads hold 300 objects of up to 13 MB",
        PIPELINE,
        "            loop.call_soon(payload.release)\n",
        "            pass\n",
        CARRIED + "test_a_call_in_flight_holds_no_decoded_payload",
    ),
    _one(
        "payload-work-one-turn",
        "the payload work of a claim's rows runs in one turn of the event loop: no socket is read "
        "for seconds, and answered calls are cut off as unknown",
        PIPELINE,
        "            if not self._turns.take(cost):\n"
        "                await self._turns.wait(cost)\n",
        "",
        CARRIED + "test_the_rows_of_a_claim_do_their_payload_work_a_turn_apart",
    ),
    _one(
        "table-cells-unescaped",
        "a reason or a provider's answer draws fake rows or drives the terminal in the CLI",
        "outbox/oncall/text_tables.py",
        'return "-" if value is None else printable(str(value))',
        'return "-" if value is None else str(value)',
        AUDIT_TESTS
        + "test_show_names_the_database_user_beside_the_claimed_actor_and_escapes_the_text",
        AUDIT_TESTS + "test_a_table_has_one_line_per_row_whatever_its_cells",
    ),
    _one(
        "reason-unbounded",
        "an operator action takes a reason of any size into the audit",
        "sql/0025_an_audit_that_tells_the_truth.sql",
        "    IF char_length(reason) > 2000 THEN\n",
        "    IF false THEN\n",
        AUDIT_TESTS + "test_a_reason_is_bounded_and_a_refusal_changes_nothing",
    ),
    _one(
        "allow-list-ignored",
        "a tenant enqueues an action the allow-list does not give it (payouts on a shared key)",
        ENQUEUE,
        "        PERFORM outbox.require_allowance(tenant_id, provider, action);\n",
        "",
        ALLOW_TESTS + "test_once_filled_the_list_refuses_what_no_rule_allows",
    ),
    _one(
        "allow-list-like-wildcards",
        "an allow-list rule for one tenant admits others whose ids differ where the rule has a _ "
        "or a % (acme_eu admits acme-eu)",
        "sql/0035_allowances_match_the_tenant_exactly.sql",
        "    SELECT replace(replace(replace(replace(pattern, '\\', '\\\\'), '%', '\\%'), "
        "'_', '\\_'), "
        "'*', '%')\n",
        "    SELECT replace(pattern, '*', '%')\n",
        ALLOW_TESTS + "test_a_pattern_is_the_tenant_id_itself_where_only_a_star_is_a_wildcard",
    ),
    _one(
        "webhook-credentials-quarantine",
        "a webhook that refuses outbox's credentials quarantines the whole backlog",
        "outbox/providers/http/wire.py",
        '    if status in REFUSED_CREDENTIALS:\n        return "credentials"',
        '    if False:\n        return "credentials"',
        "tests/integration/test_webhook_credentials.py::"
        "test_refused_credentials_pause_the_provider_and_quarantine_nothing",
    ),
    _one(
        "unbuilt-request-counted-sent",
        "a request that could not be built is recorded as one that may have reached the provider",
        "outbox/providers/base.py",
        "return not self.not_sent and self.failure is not FailureClass.TRANSIENT",
        "return self.failure is not FailureClass.TRANSIENT",
        UNBUILDABLE_TESTS
        + "test_a_webhook_row_whose_key_no_request_can_carry_is_quarantined_unsent",
        UNBUILDABLE_TESTS
        + "test_a_failure_of_the_sdk_before_it_hands_over_its_request_is_not_sent",
    ),
    _one(
        "webhook-identity-header-unencoded",
        'a webhook operation of tenant "acme " (a space h11 refuses) is never delivered',
        "outbox/providers/kit.py",
        'and "%" not in value and value.strip(" ") == value:',
        ":",
        UNBUILDABLE_TESTS
        + "test_identities_a_header_cannot_carry_as_they_are_travel_percent_encoded",
    ),
    _one(
        "stripe-unwritable-head-unknown",
        "a Stripe request whose head h11 refuses to write is taken for one that reached Stripe",
        "outbox/providers/stripe/provider.py",
        "        except building.NOT_WRITTEN as exc:\n            raise building.Unbuilt",
        "        except ZeroDivisionError as exc:\n            raise building.Unbuilt",
        UNBUILDABLE_TESTS + "test_a_stripe_version_no_header_can_carry_is_quarantined_unsent",
    ),
    # --- what is claimed, and in what order ---------------------------------------------------
    _one(
        "stage-before-due",
        "a scheduled operation is claimed before it is due",
        DISPATCH_SQL,
        "        WHERE o.scheduled AND o.available_at <= now()\n",
        "        WHERE o.scheduled\n",
        SCHEDULED_TESTS
        + "test_a_due_tenant_sorting_after_1000_tenants_of_tomorrows_is_claimed_at_once",
    ),
    _one(
        "claim-before-due",
        "the fair claim takes a row that is not due, if it is not marked scheduled",
        DISPATCH_SQL,
        # The share of a group whose first row is due. (The filter of `ready` only keeps groups
        # with nothing due from taking shares: removing it costs fairness, not correctness.)
        "              AND o.available_at <= now()\n"
        "            ORDER BY o.available_at, o.id\n"
        "            LIMIT r.share\n",
        "            ORDER BY o.available_at, o.id\n            LIMIT r.share\n",
        SCHEDULED_TESTS + "test_a_row_not_due_is_not_claimed_even_if_it_is_not_marked_scheduled",
    ),
    _one(
        "claim-one-group-before-due",
        "the one-group claim takes a row that is not due",
        DISPATCH_SQL,
        "              AND o.available_at <= now()\n"
        "            ORDER BY o.available_at, o.id\n"
        "            LIMIT greatest(least(p_limit, lone.cap), 0)",
        "            ORDER BY o.available_at, o.id\n"
        "            LIMIT greatest(least(p_limit, lone.cap), 0)",
        SCHEDULED_TESTS + "test_a_row_not_due_is_not_claimed_even_if_it_is_not_marked_scheduled",
    ),
    _one(
        "claim-room-over-cap",
        "a claim takes more rows of a provider than its cap allows",
        DISPATCH_SQL,
        "(sum(count(*)) OVER (PARTITION BY provider))::integer AS provider_k",
        "sum(count(*)) OVER (PARTITION BY provider) AS provider_k",
        "tests/integration/test_scheduled_claims.py::"
        "test_claims_leave_nothing_claimable_behind_when_they_come_back_short",
    ),
    _one(
        "claim-leaves-spare-room",
        "a claim comes back short with due rows left, and sleeps",
        DISPATCH_SQL,
        "SELECT id FROM first UNION SELECT id FROM more UNION SELECT id FROM rest",
        "SELECT id FROM first UNION SELECT id FROM more",
        "tests/integration/test_scheduled_claims.py::"
        "test_claims_leave_nothing_claimable_behind_when_they_come_back_short",
    ),
    _one(
        "ordering-promotion",
        "an ordering key's next operation goes out before its head settled",
        "sql/0015_ordering_keys.sql",
        "        IF outbox.ordering_has_head(tenant_id, ordering_key, 0) THEN\n"
        "            RETURN NULL;\n        END IF;\n        SELECT o.id INTO v_next",
        "        SELECT o.id INTO v_next",
        ORDERING_TESTS
        + "test_a_quarantined_operation_blocks_its_key_until_replayed_then_the_rest_follow",
        ORDERING_TESTS
        + "test_a_producer_enqueuing_several_of_one_key_in_one_transaction_makes_one_head",
    ),
    _one(
        "ordering-blocked-at-enqueue",
        "a second operation of a key is claimable beside its head",
        "sql/0019_limits_schedule_and_key_locks.sql",
        "NEW.ordering_blocked := outbox.ordering_has_head(NEW.tenant_id, NEW.ordering_key, "
        "NEW.id);",
        "NEW.ordering_blocked := false;",
        ORDERING_TESTS + "test_in_mode_skip_the_key_goes_on_and_a_replay_rejoins_the_line",
    ),
    # --- tenants, failures and their destinations ---------------------------------------------
    _one(
        "rls-tenant-binding",
        "a producer bound to one tenant reads another tenant's operations",
        "sql/roles_tenant_rls.sql",
        "                'USING (tenant_id = %s) WITH CHECK (tenant_id = %s)',\n"
        "                t.name || '_bound_tenant', t.name, bound, bound);\n",
        "                'USING (true) WITH CHECK (tenant_id = %s)',\n"
        "                t.name || '_bound_tenant', t.name, bound);\n",
        RLS_TESTS + "test_force_binds_a_non_superuser_owner_and_its_definer_functions",
        RLS_TESTS + "test_a_role_reading_the_table_sees_no_tenant_through_a_session_binding",
    ),
    _one(
        "rls-session-binding",
        "a tenant bound with SET for the session is taken as the binding of later transactions: "
        "a pooled connection carries one request's tenant into the next, unbound, request",
        "sql/0044_inbox_begin_without_a_subtransaction.sql",
        "    RETURN CASE WHEN current_setting('outbox.tenant_bound_at', true)\n"
        "                     = to_char(transaction_timestamp() AT TIME ZONE 'UTC', "
        "'YYYYMMDDHH24MISSUS')\n",
        "    RETURN CASE WHEN true\n",
        RLS_TESTS + "test_a_session_level_binding_binds_no_later_transaction",
        RLS_TESTS + "test_a_binding_copied_into_the_session_binds_only_its_own_transaction",
    ),
    _one(
        "permanent-retried",
        "a permanent failure is retried instead of quarantined",
        POLICY,
        "    if failure is FailureClass.PERMANENT:\n",
        "    if False:\n",
        "tests/unit/test_policy.py",
        "tests/integration/test_dispatch.py::test_a_permanent_answer_quarantines_after_one_attempt",
    ),
    _one(
        "wait-swallows-cancel",
        "a background loop cancelled at shutdown in the turn its wait ends goes on for ever: "
        "`outbox run` hangs at SIGTERM (asyncio.wait_for on Python 3.11)",
        "outbox/runtime/loops.py",
        "        async with asyncio.timeout(seconds):\n            await event.wait()",
        "        await asyncio.wait_for(event.wait(), seconds)",
        "tests/unit/test_loops.py",
    ),
    # --- provider health: a sick provider is not sick operations (issue 37) -------------------
    _one(
        "breaker-lone-failure-counts",
        "an operation that fails alone while its neighbours succeed weighs on its provider's "
        "breaker, and a few such operations close the provider to every other",
        "outbox/dispatch/breaker.py",
        "        if earlier is None or earlier == self._successes:\n            return True",
        "        if True:\n            return True",
        "tests/unit/test_provider_limits.py",
        ISOLATION_TESTS
        + "::test_operations_that_fail_alone_spend_their_own_attempts_and_the_rest_is_delivered",
    ),
    _one(
        "probe-picks-failed-row",
        "a half-open breaker's probe is an operation that just failed, so a payload that fails "
        "alone is every probe and the provider stays shut",
        DISPATCH_SQL,
        "            ORDER BY near.failed, CASE",
        "            ORDER BY NOT near.failed, CASE",
        ISOLATION_TESTS + "::test_the_probe_is_an_operation_that_has_not_failed",
        ISOLATION_TESTS + "::test_probes_go_round_the_tenants_and_take_failed_operations_last",
    ),
    _one(
        "probe-oldest-first",
        "a half-open breaker's probe is taken from the oldest rows, where the burst of bad "
        "payloads that opened it is: the good rows behind never get through",
        DISPATCH_SQL,
        "                     near.newest DESC, near.handed_back DESC, near.n, random()",
        "                     near.newest, near.handed_back DESC, near.n, random()",
        ISOLATION_TESTS + "::test_healthy_rows_queued_behind_a_burst_of_bad_ones_are_delivered",
    ),
    _one(
        "tenant-failures-shut-all",
        "one tenant's flood of failing operations opens its provider's breaker for every tenant",
        "outbox/dispatch/breaker.py",
        "        if len(sick) == 1 and self._another_tenant_succeeded(next(iter(sick))):",
        "        if False:",
        ISOLATION_TESTS
        + "::test_one_tenant_s_flood_of_failures_does_not_shut_the_provider_to_the_others",
    ),
    _one(
        "breaker-forgotten-on-restart",
        "a dispatcher restarting in a crash loop forgets that its provider is down and sends it "
        "a burst each time",
        "outbox/dispatch/health.py",
        "        for breaker in left:",
        "        for breaker in left[:0]:",
        HEALTH_TESTS + "test_a_breaker_another_process_left_open_stays_open_and_a_reset_since_wins",
        HEALTH_TESTS + "test_a_crash_loop_does_not_send_a_burst_at_a_provider_that_is_down",
    ),
    # --- wake-ups (sql/0029) --------------------------------------------------------------
    _one(
        "wake-sleeps-on-a-commit-in-flight",
        "a dispatcher sleeps while a commit that did not see its mark becomes visible: a lost "
        "wake-up, the row waits for the next poll",
        STATEMENTS,
        "SELECT outbox.try_wake_gate() AS quiet,\n",
        "SELECT true AS quiet,\n",
        "tests/integration/test_wakeups.py::"
        "test_a_commit_still_becoming_visible_keeps_the_dispatcher_claiming",
    ),
    _one(
        "wake-lock-anyone-can-take",
        "a role that can connect holds the wake-up lock and keeps every idle dispatcher polling "
        "and every commit notifying (0029's advisory key)",
        "sql/0039_a_wake_gate_only_outbox_can_hold.sql",
        "    LOCK TABLE outbox.wake_gate IN SHARE MODE NOWAIT;\n    RETURN true;\n",
        "    RETURN pg_try_advisory_xact_lock(1869968504, 0);\n",
        "tests/integration/test_wakeups.py::test_no_other_role_can_take_the_wake_lock",
    ),
    _one(
        "failover-stale-leases-kept",
        "after a failover, rows this process finished on the old primary stay in flight on the "
        "new one under its own lease until the lease expires",
        "outbox/dispatch/maintenance.py",
        "stray = await self._store.expire_stray_leases(self._shared.worker, held, since)\n",
        "stray: list[int] = []\n",
        "tests/integration/test_failover.py::"
        "test_a_failover_keeps_the_promise_in_both_replication_modes[asynchronous]",
    ),
    _one(
        "attempts-unbounded",
        "an operation that never succeeds is retried for ever",
        POLICY,
        "    if attempt >= max_attempts:\n",
        "    if False:\n",
        "tests/unit/test_policy.py",
    ),
    # --- `reconcile check` builds only what it asks (issue 37) -------------------------------
    _one(
        "check-builds-every-provider",
        "`reconcile check` builds every configured provider: a laptop needs every secret to check "
        "one provider's operations",
        "outbox/oncall/reconciler.py",
        "    chosen = {name: ps for name, ps in configured.items() if name in wanted}\n",
        "    chosen = dict(configured)\n",
        WITHOUT_CONFIG_TESTS + "test_a_check_builds_only_the_providers_of_what_it_checks",
    ),
    _one(
        "check-builds-a-webhook-without-lookup",
        "`reconcile check` builds a provider that has no lookup, and needs its secrets, to answer "
        "no_lookup",
        "outbox/providers/registry.py",
        '    if ps.type == "webhook":\n        return "lookup" in ps.options\n',
        '    if ps.type == "webhook":\n        return True\n',
        WITHOUT_CONFIG_TESTS + "test_a_check_builds_only_the_providers_of_what_it_checks",
        "tests/unit/test_registry.py",
    ),
    # --- bulk everywhere (issue 37): reconcile resolve and retry in bulk ----------------------
    _one(
        "bulk-ignores-dry-run",
        "a bulk action's --dry-run acts (bulk retry resends what the person only meant to count)",
        "outbox/cli/bulk.py",
        "    if dry_run:\n",
        "    if False:\n",
        "tests/integration/test_bulk_reconcile.py::"
        "test_no_effect_then_retry_act_on_exactly_the_selection_after_a_dry_run_and_with_yes",
    ),
    _one(
        "bulk-retry-takes-unchecked",
        "a bulk retry without --force takes operations no check found missing: each one refused, "
        "reported as changed meanwhile, instead of left alone and named",
        "outbox/cli/bulk.py",
        "            ids = _narrow(conn, ids, only, heading, verb)\n",
        "            pass\n",
        "tests/integration/test_bulk_reconcile.py::"
        "test_a_retry_without_force_takes_only_what_was_found_missing_and_names_the_rest",
    ),
    _one(
        "refs-file-resolves-around-a-bad-line",
        "a references file with a malformed line still resolves its good lines",
        "outbox/cli/bulk.py",
        "    if bad:\n",
        "    if False:\n",
        "tests/integration/test_bulk_reconcile.py::"
        "test_a_file_with_a_bad_line_resolves_nothing_and_names_every_bad_line",
    ),
    _one(
        "refs-file-resolves-before-checking-every-status",
        "a references file naming an operation that is not reconciling still resolves the others",
        "outbox/cli/bulk.py",
        "        if wrong:\n",
        "        if False:\n",
        "tests/integration/test_bulk_reconcile.py::"
        "test_a_file_with_a_bad_line_resolves_nothing_and_names_every_bad_line",
    ),
    _one(
        "no-effect-records-no-finding",
        "`resolve --no-effect` records no not_found finding: retry still needs --force",
        "sql/0034_no_effect_after_the_last_attempt.sql",
        "    SET checked_at = now(), check_finding = 'not_found', check_state = NULL,",
        "    SET checked_at = now(), check_finding = 'undecided', check_state = NULL,",
        "tests/integration/test_bulk_reconcile.py::"
        "test_one_operation_found_without_effect_is_retried_without_force",
    ),
    _one(
        "no-effect-too-soon",
        "a person's `no effect` is recorded within 30 s of the last attempt, where the provider "
        "may not show its effect yet",
        "sql/0034_no_effect_after_the_last_attempt.sql",
        "    IF op.last_attempt_at > now() - interval '30 seconds' THEN",
        "    IF false THEN",
        "tests/integration/test_bulk_reconcile.py::"
        "test_no_effect_waits_thirty_seconds_after_the_last_attempt",
    ),
    _one(
        "retry-no-effect-forces",
        "`retry --no-effect` retries on no finding at all (as --force does): the person's finding "
        "is never recorded",
        "outbox/oncall/operators.py",
        "        record_no_effect(conn, operation_id, reason=reason, actor=actor)\n"
        "        return retry(conn, operation_id, reason=reason, actor=actor)\n",
        "        return retry(conn, operation_id, reason=reason, actor=actor, force=True)\n",
        "tests/integration/test_bulk_reconcile.py::"
        "test_retry_no_effect_records_the_finding_and_retries_in_one_go",
        "tests/integration/test_on_call_exercise.py",
    ),
    # --- seen: the failing pending operations (issue 37) -------------------------------------
    _one(
        "pending-failures-read-the-whole-table",
        "`outbox status` and `pending list` read every pending row of the table for the failing "
        "ones: slow on a big table, when on-call needs it",
        "sql/0033_pending_failures.sql",
        "    WHERE status = 'pending' AND last_error_class IS NOT NULL;",
        "    WHERE status = 'cancelled';",
        "tests/integration/test_query_plans.py::"
        "test_the_failing_pending_operations_are_read_from_their_own_index",
    ),
    _one(
        "pending-list-takes-the-untried",
        "`pending list` lists operations never tried among the failing ones",
        STATEMENTS,
        "FROM outbox.operations o\nWHERE status = 'pending' AND last_error_class IS NOT NULL",
        "FROM outbox.operations o\nWHERE status = 'pending' AND true",
        "tests/integration/test_pending_failures.py",
    ),
    _one(
        "failing-count-reads-the-newest",
        "`outbox status` counts a provider's newest failing operations past its limit, not the "
        "oldest it says it counted",
        STATEMENTS,
        "    ORDER BY o.status_changed_at, o.id\n    LIMIT %(count_limit)s::integer",
        "    ORDER BY o.status_changed_at DESC, o.id DESC\n    LIMIT %(count_limit)s::integer",
        "tests/integration/test_pending_failures.py::"
        "test_the_count_of_a_provider_stops_at_its_limit",
    ),
    # --- one cause, one status (issue 37): in doubt goes to reconciliation ----------------------
    _one(
        "exhausted-unknown-quarantined",
        "an operation out of attempts that may have reached the provider is quarantined, where a "
        "replay resends it on a person's word alone",
        POLICY,
        "    if first_sent_at is not None:\n        return Next(Status.RECONCILING, REASON_INDET",
        "    if False:\n        return Next(Status.RECONCILING, REASON_INDET",
        "tests/unit/test_policy.py",
        "tests/integration/test_one_cause.py::"
        "test_operations_that_time_out_all_end_reconciling_whichever_ran_out_first",
    ),
    _one(
        "rescue-exhausted-quarantined",
        "the rescuer quarantines an operation whose last attempt's lease expired: in doubt, it "
        "belongs in reconciliation",
        LEDGER_SQL,
        "                          THEN 'reconciling' ELSE 'pending' END,",
        "                          THEN 'quarantined' ELSE 'pending' END,",
        "tests/integration/test_one_cause.py::"
        "test_a_lease_that_expires_on_the_last_attempt_goes_to_reconciliation",
    ),
    # --- the http provider (issue 24) --------------------------------------------------------
    _one(
        "http-lookup-trusts-a-forgotten-key",
        "a lookup by key says a complete not-found after the provider may have forgotten the key: "
        "a person resends an operation that acted",
        "outbox/providers/http/lookup.py",
        "    if retention is not None and request.checked_now - request.first_sent_at "
        "> _trusted(retention):\n",
        "    if False:\n",
        HTTP_LOOKUP_TESTS + "test_a_forgotten_key_proves_nothing_once_past_the_lookups_retention",
    ),
    _one(
        "http-lookup-takes-anothers-effect",
        "a list endpoint that ignores its filter hands another operation's payment over as this "
        "one's",
        "outbox/providers/http/lookup.py",
        "    if lookup.match_at is None or lookup.match is None:\n",
        "    if True:\n",
        HTTP_LOOKUP_TESTS
        + "test_a_list_that_ignores_its_filter_hands_over_no_other_operations_effect",
    ),
    _one(
        "http-path-value-unescaped",
        "a payload value can add path steps or a query to an http request's URL",
        "outbox/providers/http/spec.py",
        'out.append(urllib.parse.quote(value, safe="") if escape else value)',
        "out.append(value)",
        "tests/unit/test_http_spec.py",
    ),
    _one(
        "http-retry-after-unknown-anyway",
        "a provider that keeps only successes under a key gets a retry after a 500 that followed "
        "the effect: a second payment",
        "outbox/providers/http/provider.py",
        "if not spec.retry_unknown and isinstance(result, Failed) and _unknown(result):",
        "if False:",
        HTTP_LOOKUP_TESTS + "test_retry_unknown_false_sends_what_may_have_acted_to_reconciliation",
    ),
    _one(
        "http-resend-after-crash-anyway",
        "after a crash between sending and recording, an operation of such a provider is sent "
        "again instead of reconciled",
        PIPELINE,
        "if row.first_sent_at is not None and not _resends(provider, row.action):",
        "if False:",
        "tests/integration/test_recipes.py::test_the_recipe_keeps_the_promise[checkout]",
    ),
    _one(
        "action-window-ignored",
        "an action whose keys the provider keeps for another time gets the provider's window",
        "outbox/dispatch/rules.py",
        "window = self._action_windows.get((provider, action or ANY_ACTION))\n        window = "
        "window or self._action_windows.get((provider, ANY_ACTION))",
        "window = None",
        "tests/unit/test_dispatch_parts.py",
    ),
    _one(
        "http-lookup-ignores-its-doubts",
        "a list lookup whose filter was ignored, or that read one page of many, says a complete "
        "not-found",
        "outbox/providers/http/lookup.py",
        "    if answers.doubts:\n",
        "    if False:\n",
        HTTP_LOOKUP_TESTS
        + "test_a_list_that_ignores_its_filter_hands_over_no_other_operations_effect",
        HTTP_LOOKUP_TESTS + "test_a_page_of_a_longer_list_proves_nothing",
    ),
    # --- the queue providers (issue 25): the key travels, the repeat is recognised ----------
    _one(
        "nats-no-msg-id",
        "a JetStream publish without the stored key as Nats-Msg-Id: a retry after a lost "
        "PubAck is a second message in the stream",
        "outbox/providers/nats/provider.py",
        "headers[MSG_ID] = wire",
        'headers["Outbox-Not-Msg-Id"] = wire',
        NATS_TESTS
        + "::test_a_dispatcher_killed_between_publish_and_record_makes_no_second_message",
    ),
    _one(
        "nats-window-unchecked",
        "a key_retention longer than the stream's duplicate_window is taken: retries go on after "
        "the stream has forgotten the id",
        "outbox/providers/nats/link.py",
        "        queue_kit.check_window(self._ps, windows[stream], f\"the stream {stream}'s "
        'duplicate_window")\n',
        "",
        NATS_TESTS + "::test_start_is_refused_when_key_retention_outlasts_the_duplicate_window",
    ),
    _one(
        "failed-message-unbounded",
        "a provider's failure message is kept whole: a hostile provider's megabyte of error text "
        "is stored in every attempt row and logged on every retry",
        "outbox/providers/base.py",
        "if len(self.message) > MESSAGE_CHARS:",
        "if False:",
        "tests/unit/test_failed_message.py",
    ),
    _one(
        "nats-duplicate-unchecked",
        "a JetStream duplicate is taken as ours without reading the kept message: another "
        "producer's message under the same Nats-Msg-Id is recorded as this operation's",
        "outbox/providers/nats/faults.py",
        "and kept_body == body:",
        "or True:",
        NATS_TESTS + "::test_a_message_id_another_producer_holds_is_quarantined_not_taken_as_ours",
    ),
    _one(
        "nats-vanished-unchecked",
        "a JetStream duplicate whose sequence holds no message is accepted without asking how "
        "far the stream got: a broker naming a sequence never stored passes a lost publish off "
        "as delivered",
        "outbox/providers/nats/faults.py",
        "if seq <= last_seq:",
        "if True:",
        "tests/unit/test_nats_queue.py",
    ),
    _one(
        "amqp-no-message-id",
        "a RabbitMQ message without the stored key as its message_id: consumers cannot drop the "
        "copy a lost confirmation makes",
        "outbox/providers/amqp/provider.py",
        "        message_id=wire,\n",
        "        message_id=None,\n",
        AMQP_TESTS + "::test_a_kill_between_publish_and_record_gives_copies_consumers_can_drop",
    ),
    _one(
        "amqp-not-mandatory",
        "an unroutable RabbitMQ message is dropped by the broker and recorded as delivered",
        "outbox/providers/amqp/provider.py",
        "message, route.routing_key, mandatory=route.mandatory",
        "message, route.routing_key, mandatory=False",
        AMQP_TESTS + "::test_an_unroutable_message_is_quarantined_and_the_others_delivered",
    ),
    _one(
        "sqs-dedup-id-per-attempt",
        "an SQS FIFO retry carries a deduplication id of its own: the repeat is a second message",
        "outbox/providers/sqs/provider.py",
        'params["MessageDeduplicationId"] = wire',
        'params["MessageDeduplicationId"] = f"{wire[:120]}-{request.attempt}"',
        SQS_TESTS + "::test_a_kill_between_publish_and_record_is_deduplicated_by_the_queue",
    ),
    _one(
        "cloudtasks-name-per-attempt",
        "a Cloud Tasks retry names a task of its own: a repeat is a second task, a second call",
        "outbox/providers/cloudtasks/config.py",
        'return f"{self.queue}/tasks/{TASK_ID.wire(idempotency_key)}"',
        "return f\"{self.queue}/tasks/{__import__('uuid').uuid4().hex}\"",
        TASKS_TESTS + "::test_a_kill_between_publish_and_record_repeats_the_same_task_name",
    ),
    _one(
        "cloudtasks-repeat-not-success",
        "a Cloud Tasks ALREADY_EXISTS, the repeat recognised, is not taken as the success it is",
        "outbox/providers/cloudtasks/provider.py",
        "        except gexc.AlreadyExists:\n            return Succeeded(reference=task.name)",
        '        except gexc.AlreadyExists:\n            return unknown("x", "the repeat")',
        TASKS_TESTS + "::test_a_kill_between_publish_and_record_repeats_the_same_task_name",
    ),
    # --- `outbox run` says at once why the database does not answer (issue 38) --------------
    _one(
        "startup-reason-unsaid",
        "`outbox run` waits for a database that does not answer without saying why until "
        "database.startup_wait has passed (a closed port was silent for a minute)",
        "outbox/daemon/startup.py",
        "                    reason=why,\n",
        "",
        STARTUP_TESTS + "::test_a_closed_port_says_why_at_once_then_waits_and_starts_when_it_opens",
    ),
    _one(
        "startup-lasting-refusal-waited",
        "a refusal that waiting will not change (no such database or role) is waited out for "
        "database.startup_wait before `outbox run` exits",
        "outbox/daemon/startup.py",
        "            if will_not_change(exc):\n",
        "            if False:\n",
        STARTUP_TESTS + "::test_a_refusal_that_waiting_will_not_change_ends_the_run_at_once",
    ),
    # --- the dispatcher's credential cannot rewrite history (issue 38, item 1; sql/0040) ------
    _one(
        "dispatcher-inserts-attempts",
        "the dispatcher's credential invents attempts outside a record under its lease",
        "sql/roles.sql",
        "GRANT SELECT ON outbox.attempts, outbox.attempt_log TO outbox_dispatcher;",
        "GRANT SELECT ON outbox.attempts TO outbox_dispatcher;\n"
        "GRANT SELECT, INSERT ON outbox.attempt_log TO outbox_dispatcher;",
        ROLES_TESTS + "::test_the_dispatchers_credential_cannot_rewrite_history",
    ),
    _one(
        "dispatcher-records-any-status",
        "a record gives a status that is not the dispatcher's to give (cancelled, in_flight)",
        LEDGER_SQL,
        "                     WHEN i.status IS NULL\n"
        "                          OR i.status NOT IN ('pending', 'succeeded', 'quarantined', "
        "'reconciling')\n",
        "                     WHEN false\n",
        ROLES_TESTS + "::test_the_dispatchers_credential_cannot_rewrite_history",
    ),
    _one(
        "dispatcher-throttles-for-ever",
        "a provider's bucket is pushed into debt for a thousand years",
        DISPATCH_SQL,
        "           outbox.check_between('pause', throttle_bucket.pause, interval '0', "
        "interval '1 day');\n",
        "           NULL;\n",
        ROLES_TESTS + "::test_the_dispatchers_credential_cannot_rewrite_history",
    ),
    # --- the inbox: one recorded outcome per delivery identity (issue 40; sql/0042) -------------
    _one(
        "inbox-unbounded-wait",
        "a duplicate waits for the first delivery's transaction for as long as it runs, holding "
        'a connection, instead of hearing "in progress" after `wait`',
        INBOX_ORIGIN,
        "greatest(1, ceil(extract(epoch FROM wait) * 1000))::bigint || 'ms',\n",
        "'0',\n",
        INBOX_TESTS + "::test_a_duplicate_waits_at_most_wait_then_hears_in_progress",
    ),
    _one(
        "inbox-fast-path-unlocked",
        "a delivery skips the identity's advisory lock, so a duplicate's INSERT waits on the "
        "first one's uncommitted record with no bound",
        INBOX_CONTRACT,
        "    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN  -- 2828 = 0x0B0C\n",
        "    IF false THEN\n",
        INBOX_TESTS + "::test_a_duplicate_waits_at_most_wait_then_hears_in_progress",
    ),
    _one(
        "inbox-no-conflict-check",
        "the same identity with another body replays the first outcome instead of a conflict",
        INBOX_CONTRACT,
        "        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint\n"
        "           OR r.contract <> inbox_begin.contract THEN\n",
        "        IF false THEN\n",
        INBOX_TESTS + "::test_any_spelling_of_the_same_json_replays_and_any_change_conflicts",
        WORKER_TESTS
        + "::test_the_same_key_with_other_input_is_a_conflict_and_the_first_invoice_stays",
    ),
    _one(
        "inbox-conflicts-unbounded",
        "a sender that changes its body on every try grows a record's conflicts by a row each",
        "sql/0043_inbox_conflicts_bounded.sql",
        "        v_digest := '\\x'::bytea;  -- the overflow row: 'other bodies'\n",
        "        NULL;\n",
        INBOX_TESTS + "::test_a_flood_of_other_bodies_under_one_key_keeps_a_bounded_count",
    ),
    _one(
        "inbox-completion-unfenced",
        "a transaction completes a record it did not begin",
        INBOX_SQL,
        "    WHERE i.id = inbox_complete.inbox_id AND i.token = inbox_complete.token\n",
        "    WHERE i.id = inbox_complete.inbox_id\n",
        INBOX_TESTS + "::test_the_workers_role_records_deliveries_and_can_do_nothing_else",
    ),
    _one(
        "inbox-skips-tenant",
        "an external claim's transaction is not bound to its delivery's tenant (inbox_begin binds "
        "its own since 0049: inbox-fast-path-skips-tenant)",
        INBOX_SQL,
        "    PERFORM outbox.bind_tenant(tenant_id);\n",
        "",
        INBOX_TESTS + "::test_the_workers_role_records_deliveries_and_can_do_nothing_else",
    ),
    _one(
        "inbox-fast-path-skips-tenant",
        "a delivery admitted by inbox_begin's one test leaves its transaction unbound, so under "
        "row-level security its record cannot be completed and its handler sees no tenant",
        INBOX_CONTRACT,
        "        PERFORM set_config('outbox.tenant_id', tenant_id, true),\n"
        "                set_config('outbox.tenant_bound_at', v_stamp, true);\n",
        "        NULL;\n",
        INBOX_TESTS + "::test_the_workers_role_records_deliveries_and_can_do_nothing_else",
    ),
    _one(
        "inbox-fast-path-admits-a-bad-handler",
        "inbox_begin's one test admits a handler name the helpers refuse (one that starts with "
        "a dot or a dash), which then names metrics, logs and records",
        INBOX_CONTRACT,
        "AND handler ~ '^[a-z0-9][a-z0-9._-]*$'",
        "AND handler ~ '^[a-z0-9._-]*$'",
        ADMISSION_TESTS
        + "test_the_fast_admission_refuses_what_the_helpers_refuse_and_binds_as_they_do",
    ),
    _one(
        "inbox-fast-path-admits-a-control-character",
        "inbox_begin's one test looks for control and format characters in the key only: a "
        "tenant with a bidi override reaches operators' terminals",
        INBOX_CONTRACT,
        "AND (tenant_id || key) !~ ",
        "AND key !~ ",
        ADMISSION_TESTS
        + "test_the_fast_admission_refuses_what_the_helpers_refuse_and_binds_as_they_do",
    ),
    _one(
        "inbox-fast-path-unbounded-body",
        "inbox_begin's one test admits a body past 16 MiB that the helpers refuse",
        INBOX_CONTRACT,
        "coalesce(octet_length(body_json), octet_length(body_raw)) <= 16777216",
        "true",
        ADMISSION_TESTS + "test_the_fast_admission_bounds_the_body_as_the_helpers_do",
    ),
    _one(
        "inbox-prune-unexpired",
        "the prune deletes records the sender may still redeliver, which then run again",
        INBOX_SQL,
        "                 WHERE i.expires_at < now() AND i.state = 'completed'\n",
        "                 WHERE i.state = 'completed'\n",
        INBOX_TESTS + "::test_prune_deletes_only_completed_records_past_their_retention",
    ),
    _one(
        "inbox-records-5xx",
        "a failure is recorded, so every redelivery is answered with it and the work never runs",
        ADAPTER,
        "    return 200 <= status < 400 or status in record_statuses\n",
        "    return 200 <= status < 600 or status in record_statuses\n",
        INBOX_TESTS + "::test_a_5xx_or_a_raise_records_nothing_and_undoes_the_handlers_writes",
        WSGI_TESTS + "::test_a_raise_or_a_5xx_records_nothing_and_the_redelivery_creates_once",
    ),
    _one(
        "inbox-acks-a-failed-handler",
        "a handler that raised is answered with success, so the sender drops work that never "
        "committed",
        ADAPTER,
        'problem(500, "handler failed"',
        'problem(200, "handler failed"',
        INBOX_TESTS + "::test_a_5xx_or_a_raise_records_nothing_and_undoes_the_handlers_writes",
        WSGI_TESTS + "::test_a_raise_or_a_5xx_records_nothing_and_the_redelivery_creates_once",
    ),
    _one(
        "inbox-in-progress-acks",
        "a delivery still in its first transaction is answered as done",
        ADAPTER,
        '            409, "in progress",',
        '            200, "in progress",',
        INBOX_TESTS + "::test_a_duplicate_waits_at_most_wait_then_hears_in_progress",
        WORKER_TESTS + "::test_dozens_of_duplicates_at_once_make_one_invoice_and_agree",
        WSGI_TESTS + "::test_a_duplicate_waits_at_most_wait_then_hears_in_progress",
    ),
    _one(
        "inbox-stores-cookies",
        "a recorded response keeps a Set-Cookie, replayed to whoever delivers the key again",
        "outbox/inbox/http.py",
        '        "set-cookie",\n',
        "",
        INBOX_TESTS + "::test_a_replay_keeps_no_cookie_or_credential_even_when_asked_to",
    ),
    _one(
        "inbox-answers-before-commit",
        "the answer is decided before COMMIT succeeds: a commit that fails is answered as done, "
        "and the sender drops work that was never recorded",
        "outbox/inbox/core.py",
        "            await asyncio.shield(_finish(conn, delivery))\n",
        "            with suppress(psycopg.Error):\n"
        "                await asyncio.shield(_finish(conn, delivery))\n",
        INBOX_TESTS + "::test_a_commit_that_fails_is_never_answered_as_success",
    ),
    _one(
        "inbox-identity-by-wire-key",
        "an outbox delivery is known by the key it travels under, so a reconcile retry (key "
        "generation :r2) of an operation the worker recorded runs it a second time",
        "outbox/inbox/http.py",
        '            operation = headers.get("outbox-operation-id")\n',
        '            operation = None if "idempotency-key" in headers else headers.get("x")\n',
        WORKER_TESTS + "::test_every_key_generation_of_one_operation_finds_its_one_record",
    ),
    _one(
        "inbox-queue-acks-a-failure",
        "a queue message whose handler failed is acknowledged: the work is gone, never done",
        "outbox/inbox/queues.py",
        'Settled(Verdict.RETRY, "failed", self.retry_after, error=error)',
        'Settled(Verdict.ACK, "failed", self.retry_after, error=error)',
        JETSTREAM_TESTS + "::test_a_failing_handler_gets_its_message_again_and_converges",
    ),
    _one(
        "inbox-queue-conflict-retried",
        "a message that conflicts with a recorded one is given back, and comes again for ever",
        "outbox/inbox/queues.py",
        "return Settled(Verdict.DROP, Decision.CONFLICT.value)",
        "return Settled(Verdict.RETRY, Decision.CONFLICT.value, 0.1)",
        JETSTREAM_TESTS + "::test_copies_conflicts_and_refusals_settle_once_each",
    ),
    _one(
        "inbox-refusal-keeps-writes",
        "a refused message keeps what its handler wrote before refusing",
        "outbox/inbox/queues.py",
        "            async with d.conn.transaction():\n",
        "            if d.conn:\n",
        JETSTREAM_TESTS + "::test_copies_conflicts_and_refusals_settle_once_each",
    ),
    _one(
        "inbox-downstream-key-per-claim",
        "each claim of one delivery hands the handler another downstream key, so a call retried "
        "after an ambiguous timeout is a second effect",
        INBOX_IDENTITY,
        "    SELECT 'ib1_' || encode(",
        "    SELECT 'ib1_' || gen_random_uuid() || encode(",
        EXTERNAL_TESTS + "::test_an_ambiguous_timeout_retried_under_the_same_key_is_one_effect",
    ),
    _one(
        "inbox-reclaims-live-lease",
        "a claim whose lease still runs is taken by a second delivery: the handler runs twice",
        INBOX_CONTRACT,
        "        IF r.lease_expires_at > now() THEN\n",
        "        IF false THEN\n",
        EXTERNAL_TESTS + "::test_claims_at_once_run_the_handler_once",
    ),
    _one(
        "inbox-no-abandon",
        "a delivery whose workers keep dying is claimed for ever, never shown to a person",
        INBOX_CONTRACT,
        "        IF r.lease_expires_at IS NOT NULL AND r.claims >= max_claims THEN\n",
        "        IF false THEN\n",
        EXTERNAL_TESTS + "::test_a_claim_taken_too_often_is_abandoned_until_released",
    ),
    _one(
        "inbox-rabbitmq-requeues-the-final",
        "a RabbitMQ message that can never succeed (a conflict, a refusal) is requeued instead of "
        "dead-lettered, and comes back for ever",
        "outbox/inbox/rabbitmq.py",
        "        await message.reject(requeue=False)\n",
        "        await message.nack(requeue=True)\n",
        RABBITMQ_TESTS + "::test_copies_conflicts_and_refusals_settle_once_each",
    ),
    _one(
        "inbox-sqs-deletes-a-retry",
        "an SQS message whose handler failed is deleted instead of made visible again later",
        "outbox/inbox/sqs.py",
        "    if settled.verdict is Verdict.RETRY:\n",
        "    if False:\n",
        "tests/integration/test_inbox_sqs.py"
        "::test_a_failing_handler_gets_its_message_again_and_converges",
    ),
    _one(
        "inbox-handles-a-part",
        "a delivery whose sender hung up mid-body is decided and handled on the part that came",
        "outbox/inbox/asgi.py",
        "            raise CutShort\n",
        "            break\n",
        INBOX_TESTS + "::test_a_delivery_cut_short_is_never_decided_or_handled",
    ),
    _one(
        "inbox-pointer-unescaped-in-the-wrong-order",
        'a key pointer unescapes "~0" before "~1", so "/a~01b" reads the member "a/b" instead '
        'of "a~1b": another event\'s id, or none',
        "outbox/core/json_pointer.py",
        'p.replace("~1", "/").replace("~0", "~")',
        'p.replace("~0", "~").replace("~1", "/")',
        "tests/unit/test_inbox_keys.py",
    ),
    _one(
        "inbox-span-unlinked",
        "a delivery's span is not linked to the traceparent it carries: the worker's trace "
        "never leads back to the sender's",
        "outbox/observability/tracing.py",
        "            links=sender_links(headers),\n",
        "            links=[],\n",
        "tests/integration/test_inbox_tracing.py",
    ),
    # --- the inbox's WSGI twin: SyncInbox (sync.py) and InboxWSGIMiddleware (wsgi.py) ----------
    _one(
        "inbox-wsgi-answers-before-commit",
        "a WSGI delivery's answer does not wait for COMMIT to succeed: a commit that fails is "
        "answered as done, and the sender drops work that was never recorded",
        "outbox/inbox/sync.py",
        "            _finish(conn, delivery)\n",
        "            with suppress(psycopg.Error):\n                _finish(conn, delivery)\n",
        WSGI_TESTS + "::test_a_commit_that_fails_is_never_answered_as_success",
    ),
    _one(
        "inbox-wsgi-duplicates-hold-connections",
        "duplicates in one WSGI process take a pooled connection before they wait for the first "
        "delivery, so a burst of them exhausts the pool and the deliveries hear 503",
        "outbox/inbox/sync.py",
        "            self._flight(identity) as left,\n"
        "            self.pool.connection() as conn,\n",
        "            self.pool.connection() as conn,\n"
        "            self._flight(identity) as left,\n",
        WSGI_TESTS + "::test_duplicates_wait_for_the_first_without_holding_a_pooled_connection",
    ),
    _one(
        "inbox-wsgi-unbounded-wait",
        "a duplicate in one WSGI process waits for the first delivery for as long as it runs, "
        'instead of hearing "in progress" after `wait`',
        "outbox/inbox/sync.py",
        "            first.wait(self.wait.total_seconds())\n",
        "            first.wait()\n",
        WSGI_TESTS + "::test_a_duplicate_waits_at_most_wait_then_hears_in_progress",
    ),
    _one(
        "inbox-wsgi-handles-a-part",
        "a WSGI delivery whose input ended before its Content-Length is decided and handled on "
        "the part that came",
        "outbox/inbox/wsgi.py",
        "    if length and len(body) < length:\n",
        "    if False:\n",
        WSGI_TESTS + "::test_a_body_cut_short_is_never_decided_or_handled",
    ),
    _one(
        "inbox-queue-stop-acks-the-cut-short",
        "a message that a stop cut short, rolled back, is acknowledged instead of given back: "
        "the work is gone, never done",
        "outbox/inbox/draining.py",
        "        await _given_back(consumer.handler, give_back)\n",
        '        await answer(Settled(Verdict.ACK, "cut_short"))\n',
        STOP_UNIT + "test_a_stop_lets_work_finish_within_the_grace_and_gives_back_the_rest",
        STOP_TESTS + "test_a_sigterm_drains_acks_what_committed_and_gives_back_what_it_cut_short",
    ),
    _one(
        "inbox-queue-stop-without-grace",
        "a stop cuts short every message under way at once, instead of letting them finish "
        "within the grace: work that was about to commit is rolled back and done again",
        "outbox/inbox/draining.py",
        "                await asyncio.wait(set(self._tasks), timeout=grace)\n",
        "                await asyncio.wait(set(self._tasks), timeout=0)\n",
        STOP_UNIT + "test_a_stop_lets_work_finish_within_the_grace_and_gives_back_the_rest",
        STOP_TESTS + "test_a_sigterm_drains_acks_what_committed_and_gives_back_what_it_cut_short",
    ),
    _one(
        "inbox-external-answer-unrecorded",
        "an External route answers its handler's response without recording it: the writes on "
        "the claim's transaction roll back, and every redelivery runs the handler again",
        "outbox/inbox/asgi.py",
        "                await c.settle()\n",
        "                await c.discard()\n",
        CLAIMING_TESTS + "test_a_call_that_timed_out_after_the_provider_acted_is_one_payment",
    ),
    _one(
        "inbox-external-commits-after-the-lease-was-lost",
        "a claim taken over by another delivery still commits its handler's final writes "
        "(its fenced completion refused): the business effect is written twice",
        "outbox/inbox/external.py",
        "        except BaseException as exc:\n            await self._close(exc)\n",
        "        except BaseException:\n            await self._close(None)\n",
        CLAIMING_TESTS
        + "test_a_claiming_consumer_whose_claim_was_taken_over_keeps_nothing_and_retries",
    ),
    _one(
        "inbox-claiming-consumer-acks-a-lost-lease",
        "a queue consumer whose claim was taken over acknowledges its message, though nothing "
        "of its work committed",
        "outbox/inbox/queues.py",
        "            return Settled(Verdict.RETRY, Decision.IN_PROGRESS.value, self.retry_",
        "            return Settled(Verdict.ACK, Decision.IN_PROGRESS.value, self.retry_",
        CLAIMING_TESTS
        + "test_a_claiming_consumer_whose_claim_was_taken_over_keeps_nothing_and_retries",
    ),
    _one(
        "inbox-claiming-refusal-keeps-its-writes",
        "a queue handler in external-effect mode that refuses its message keeps what it wrote "
        "before the refusal",
        "outbox/inbox/queues.py",
        "                    await c.discard()  # a refusal keeps none of the handler's writes\n",
        "                    pass\n",
        CLAIMING_TESTS
        + "test_a_claiming_consumers_refusal_keeps_none_of_its_writes_and_drops_every_copy",
    ),
    _one(
        "inbox-wsgi-external-answer-unrecorded",
        "a WSGI External route answers its handler's response without recording it: the writes "
        "on the claim's transaction roll back, and the redelivery runs the handler again",
        "outbox/inbox/wsgi.py",
        "                c.settle()\n",
        "                c.discard()\n",
        CLAIMING_TESTS + "test_a_wsgi_route_in_external_mode_retries_a_timeout_as_one_payment",
    ),
    _one(
        "inbox-claim-two-final-transactions",
        "two of a handler's tasks asking for the claim's final transaction at once each open "
        "one: the outcome commits with one, and the other's writes are lost with its connection",
        "outbox/inbox/external.py",
        "        async with self._opening:\n",
        "        if True:\n",
        CLAIMING_TESTS + "test_a_handlers_tasks_asking_at_once_share_one_final_transaction",
    ),
    _one(
        "delivery-fingerprint-without-its-ordering-key",
        "a delivery's fingerprint travels without the ordering key it was computed over: no "
        "receiver could check the body against it",
        "outbox/providers/kit.py",
        "        if intent.ordering_key is not None:\n",
        "        if intent.ordering_key is None:\n",
        "tests/integration/test_http_send.py::"
        "test_each_delivery_carries_its_origin_and_enqueues_fingerprint",
    ),
    _one(
        "delivery-fingerprint-on-a-body-built-from-the-payload",
        "an http action whose body is a part of the payload sends the fingerprint of the whole: "
        "a receiver that checks it refuses every such delivery",
        "outbox/providers/kit.py",
        "    if body_is_payload:\n",
        "    if True:\n",
        "tests/integration/test_http_send.py::"
        "test_each_delivery_carries_its_origin_and_enqueues_fingerprint",
    ),
    _one(
        "inbox-ignores-the-origin",
        "operations of two databases with one id are one delivery to the inbox: the second is "
        "replayed the first's answer and its effect is lost",
        "outbox/inbox/http.py",
        '    origin = origin_of(headers) if key.startswith("op:") else None\n',
        "    origin = None\n",
        ORIGIN_TESTS + "test_operations_of_two_databases_with_one_id_are_two_deliveries",
    ),
    _one(
        "inbox-no-crossing-an-upgrade",
        "a redelivery from the other side of a sender's upgrade (with its origin where the "
        "record has none, or the other way round) misses the record and runs again",
        INBOX_ADMISSION,
        "               AND (i.origin = outbox.unnamed_origin())\n",
        "               AND false AND (i.origin = outbox.unnamed_origin())\n",
        ORIGIN_TESTS
        + "test_a_record_from_either_side_of_an_upgrade_answers_the_other_sides_redelivery",
    ),
    _one(
        "inbox-crosses-to-another-body",
        "a record of another database's operation with the same id, from before the upgrade, "
        "answers for this one whatever its body: the operation is refused or its effect lost",
        INBOX_ADMISSION,
        "           OR (i.body_digest = digest\n",
        "           OR (true\n",
        ORIGIN_TESTS + "test_another_databases_operation_from_before_the_upgrade_is_not_this_one",
    ),
    _one(
        "inbox-renewal-takes-back-a-failed-claim",
        'a renewal after inbox_fail sets a lease again: the next delivery hears "in progress" '
        "until it runs out, though no worker holds the claim",
        "sql/0047_a_failed_claim_stays_handed_back.sql",
        "      AND i.lease_expires_at IS NOT NULL;",
        "      AND true;",
        EXTERNAL_TESTS + "::test_a_claim_handed_back_is_not_taken_back_by_a_late_renewal",
    ),
    _one(
        "inbox-lock-per-origin",
        "a delivery that names its origin locks its own origin's identity, not the key's: it "
        "misses an older sender's delivery still in its transaction and runs a second time",
        INBOX_CONTRACT,
        "    v_lock := hashtext(tenant_id || E'\\n' || handler || E'\\n' || key);\n    -- Nested",
        "    v_lock := hashtext(tenant_id || E'\\n' || handler || E'\\n' || key || v_origin);\n"
        "    -- Nested",
        ORIGIN_TESTS + "test_a_delivery_with_its_origin_waits_for_one_without_it_in_flight",
    ),
    _one(
        "inbox-takes-a-body-unlike-its-fingerprint",
        "a body that is not the one the sender enqueued (re-encoded on its way) is run and "
        "recorded as if it were",
        INBOX_IDENTITY,
        "    IF v_computed IS DISTINCT FROM fingerprint THEN\n",
        "    IF false THEN\n",
        ORIGIN_TESTS + "test_the_body_enqueued_is_taken_and_another_is_refused_unrecorded",
    ),
    _one(
        "inbox-downstream-key-ignores-the-origin",
        "two databases' operation 7 call downstream under one key: the provider takes the "
        "second for a repeat of the first, and its effect is lost",
        INBOX_IDENTITY,
        "               CASE WHEN inbox_downstream_key.origin = outbox.unnamed_origin()\n",
        "               CASE WHEN true\n",
        ORIGIN_TESTS
        + "test_a_claim_keeps_its_downstream_key_across_an_upgrade_and_two_databases_have_two",
    ),
    _one(
        "inbox-reclaim-hands-the-deliverys-downstream-key",
        "a claim of a record from before the upgrade hands the key of the delivery's origin, "
        "not the record's: the call retried downstream is a second effect",
        INBOX_CONTRACT,
        "        downstream_key := outbox.inbox_downstream_key(r.tenant_id, r.handler, r.key, "
        "r.origin);\n",
        "        downstream_key := outbox.inbox_downstream_key(r.tenant_id, r.handler, r.key, "
        "v_origin);\n",
        ORIGIN_TESTS
        + "test_a_claim_keeps_its_downstream_key_across_an_upgrade_and_two_databases_have_two",
    ),
    # --- a success at the first attempt writes one row (issue 41; sql/0050) ---------------------
    _one(
        "ledger-hides-inline-success",
        "a success kept on its operation is missing from outbox.attempts: show, the question "
        "'was my record committed?' and the history lose the attempt that acted",
        LEDGER_SQL,
        "WHERE o.success_worker IS NOT NULL;\n",
        "WHERE false;\n",
        LEDGER_TESTS + "test_a_first_attempt_success_is_one_row_of_the_view_and_none_of_the_log",
    ),
    _one(
        "ledger-inlines-any-success",
        "a success after failed attempts is kept on the row as attempt 1, beside the log's own "
        "attempt 1: the history shows one attempt twice and the success under the wrong number",
        LEDGER_SQL,
        "coalesce(i.outcome = 'succeeded' AND i.attempt = 1 AND i.sent, false) AS inline",
        "coalesce(i.outcome = 'succeeded' AND i.sent, false) AS inline",
        LEDGER_TESTS + "test_a_success_after_a_failure_keeps_every_attempt_in_the_log",
    ),
    _one(
        "ledger-logs-nothing",
        "a failed attempt writes no row of attempt_log: its key, its class and that it may have "
        "been sent are lost to reconciliation and to show",
        LEDGER_SQL,
        "        FROM recorded\n        WHERE NOT inline\n",
        "        FROM recorded\n        WHERE false\n",
        LEDGER_TESTS + "test_a_success_after_a_failure_keeps_every_attempt_in_the_log",
    ),
    # --- a claim overlaps the last batch's record (issue 41) -------------------------------------
    _one(
        "claims-wait-for-records",
        "rows being recorded still hold their call slots: each claim waits for the last "
        "batch's record, and the dispatcher idles between them",
        "outbox/dispatch/claims.py",
        "        calls = leased - self._shared.recording\n",
        "        calls = leased\n",
        "tests/integration/test_dispatcher_noop.py::"
        "test_a_claim_overlaps_the_last_batchs_record_within_twice_concurrency",
    ),
    _one(
        "leases-unbounded",
        "a database slow to record lets a process lease without bound: rows pile up in its "
        "memory, leased, while their records wait",
        "outbox/dispatch/claims.py",
        "        return min(concurrency - calls, LEASED_PER_SLOT * concurrency - leased)\n",
        "        return concurrency - calls\n",
        "tests/integration/test_dispatcher_noop.py::"
        "test_a_claim_overlaps_the_last_batchs_record_within_twice_concurrency",
    ),
    # --- operation contracts (issue 42; sql/0052) ------------------------------------------
    _one(
        "contract-content-changes",
        "a published contract's schema can be rewritten in place: operations checked against "
        "one version and received against another",
        CONTRACTS_SQL,
        "    IF (NEW.operation_type, NEW.version, NEW.canonical, NEW.digest, NEW.published_at,\n",
        "    IF (NEW.operation_type, NEW.version, OLD.canonical, NEW.digest, NEW.published_at,\n",
        CONTRACTS_TESTS + "test_states_move_audited_and_a_published_row_never_changes",
    ),
    _one(
        "contract-push-overwrites-quietly",
        "a push of other content under a published version is taken as unchanged: the files "
        "and the database disagree and nobody is told",
        PUBLISH_SQL,
        "publish_contract.version;\n    IF v_held = v_digest THEN\n",
        "publish_contract.version;\n    IF v_held IS NOT NULL THEN\n",
        CONTRACTS_TESTS
        + "test_other_content_under_a_published_version_is_refused_with_the_difference",
    ),
    _one(
        "contract-work-unbounded",
        "a schema whose references fan out is published: one payload can hold a process for "
        "minutes",
        "outbox/contracts/bounds.py",
        "        if paths and _most_on_one_value(paths) > MAX_PER_LEVEL:\n",
        "        if paths and _most_on_one_value(paths) > 10 * MAX_PER_LEVEL:\n",
        "tests/unit/test_contracts_files.py::test_the_bound_counts_what_lands_on_one_value",
    ),
    _one(
        "codegen-loses-enums",
        "generated classes type an enum member as Any: a producer's value outside the contract "
        "passes the type checker and is found only at enqueue",
        "outbox/contracts/codegen.py",
        "    return f\"Literal[{', '.join(repr(v) for v in usable)}]\"\n",
        '    return "Any"\n',
        CONTRACTS_TESTS + "test_codegen_writes_classes_a_type_checker_holds_producers_to",
    ),
    _one(
        "enqueue-skips-contract-check",
        "a payload that breaks its contract is written: the typo reaches the provider or the "
        "worker hours later, after the business transaction committed",
        "outbox/producer.py",
        "    if checker is None:\n        return  # not published",
        "    if checker is not None:\n        return  # not published",
        "tests/integration/test_contracts_enqueue.py::"
        "test_a_violation_is_refused_before_the_row_exists_naming_path_and_rule",
    ),
    _one(
        "enqueue-takes-any-version",
        "enqueue takes a version never published, or none for a type that requires one: "
        "nothing can check the operation against the contract its producer meant",
        ENQUEUE,
        "        IF v_contract IS NULL THEN\n",
        "        IF false THEN\n",
        "tests/integration/test_contracts_enqueue.py::"
        "test_versions_are_checked_by_the_database_whoever_enqueues",
    ),
    _one(
        "dispatcher-skips-contract-check",
        "a row written past enqueue's check (the SQL function, a hand INSERT) that breaks its "
        "contract is sent: the typo reaches the provider",
        "outbox/dispatch/pipeline.py",
        "            if self._contracts.needs_check(row):",
        "            if False:",
        CONTRACT_DISPATCH_TESTS
        + "test_a_row_forced_past_enqueues_check_is_quarantined_unsent_naming_path_and_rule",
    ),
    _one(
        "claims-lose-the-contract-version",
        "the claim hands the dispatcher no contract version: nothing is checked before the send",
        "sql/0054_the_dispatcher_checks_contracts.sql",
        "           o.contract_version\n",
        "           NULL::integer\n",
        CONTRACT_DISPATCH_TESTS
        + "test_a_row_forced_past_enqueues_check_is_quarantined_unsent_naming_path_and_rule",
    ),
    _one(
        "contract-violation-follows-member-order",
        "the producer and the dispatcher name different violations of one payload (the first "
        "in the members' order, which jsonb changes): an operator chases two causes",
        "outbox/contracts/checks.py",
        "iter_errors(_jsonb_order(payload))",
        "iter_errors(payload)",
        "tests/integration/test_contracts_enqueue.py::"
        "test_the_producers_check_and_the_dispatchers_check_always_agree",
        "tests/integration/test_contracts_enqueue.py::"
        "test_over_schemas_and_payloads_the_three_checks_name_the_same_violation",
    ),
    _one(
        "contract-check-after-a-send",
        "a row that may have reached the provider is quarantined as a contract violation "
        "recorded not sent: the history lies, and no key window guards what was sent",
        "outbox/dispatch/contracts.py",
        "return row.contract_version is not None and row.first_sent_at is None",
        "return row.contract_version is not None",
        CONTRACT_DISPATCH_TESTS
        + "test_a_row_that_may_have_reached_the_provider_is_not_checked_again",
    ),
    _one(
        "deliveries-lose-their-contract",
        "a delivery does not say which contract its payload was written to: the receiver "
        "cannot check the body against the version its producer meant",
        "outbox/providers/kit.py",
        "        if intent.contract is not None:\n",
        "        if False:\n",
        CONTRACT_DISPATCH_TESTS
        + "test_a_row_forced_past_enqueues_check_is_quarantined_unsent_naming_path_and_rule",
        "tests/integration/test_queue_sqs.py::"
        "test_a_message_with_every_attribute_outbox_sends_stays_within_sqss_ten",
    ),
    _one(
        "inbox-ignores-the-contract",
        "the inbox runs a handler on a body that breaks the contract its sender names: the "
        "typo reaches the worker's business write",
        "outbox/inbox/http.py",
        "fingerprint_of(headers), contract_of(headers))",
        "fingerprint_of(headers))",
        INBOX_CONTRACT_TESTS
        + "test_a_body_that_breaks_its_contract_is_refused_before_anything_is_decided",
    ),
    _one(
        "inbox-claims-skip-the-contract",
        "an External route claims a body that breaks its contract and calls out with it",
        "outbox/inbox/core.py",
        "            contracts=self.contracts,\n",
        "",
        INBOX_CONTRACT_TESTS
        + "test_a_body_that_breaks_its_contract_is_refused_before_anything_is_decided",
    ),
    _one(
        "inbox-drops-unknown-contracts",
        "a delivery whose contract the receiver has not published yet is refused for good "
        "(422, dropped from its queue): the receiver's deploy order loses work",
        "outbox/inbox/adapter.py",
        "        if isinstance(exc, ContractBreach):\n",
        "        if True:\n",
        INBOX_CONTRACT_TESTS
        + "test_a_contract_the_receivers_database_has_not_published_is_tried_later",
    ),
    _one(
        "alias-rewrites-history",
        "a type is aliased to one whose versions say something else: operations enqueued under "
        "the old name are checked against schemas they were never written to",
        ENQUEUE,
        "    IF v_differs IS NOT NULL THEN\n",
        "    IF false THEN\n",
        "tests/integration/test_contract_aliases.py::"
        "test_an_alias_is_refused_while_the_histories_differ_and_is_kept_for_ever",
    ),
    _one(
        "enqueue-ignores-aliases",
        "a renamed type's old name is refused the versions its new name publishes, or escapes "
        "their requirement",
        ENQUEUE,
        "        v_contract_type := coalesce((SELECT a.operation_type"
        " FROM outbox.contract_aliases a\n"
        "                                     WHERE a.alias = operation_type), operation_type);\n",
        "        v_contract_type := operation_type;\n",
        "tests/integration/test_contract_aliases.py::"
        "test_the_old_name_reads_the_new_names_contracts_everywhere_at_enqueue",
    ),
    _one(
        "contract-lookup-failure-quarantines",
        "a database that does not answer for a contract quarantines the row: a blip sets good "
        "work aside for an operator",
        "outbox/dispatch/contracts.py",
        "            return Aside(Status.PENDING, None, delay=LOOKUP_RETRY)\n",
        '            return _refused(f"contract {named} could not be read")\n',
        CONTRACT_DISPATCH_TESTS
        + "test_a_contract_the_database_does_not_answer_for_hands_the_row_back_unsent",
    ),
    _one(
        "inbox-requirement-ignored",
        "a handler that requires a contract runs a delivery that names none: a sender passes any "
        "body unchecked by leaving the header out",
        "outbox/inbox/contracts.py",
        "        if required is None or (contract is not None and contract[0] in required):\n",
        "        if True:\n",
        INBOX_CONTRACT_TESTS
        + "test_a_handler_that_requires_a_contract_refuses_deliveries_naming_none_or_another",
    ),
    _one(
        "alias-requirement-not-mirrored",
        "a renamed type's old name escapes its new name's requirement: producers still naming it "
        "enqueue without a version, unchecked",
        ENQUEUE,
        "       OR t.operation_type IN (SELECT a.alias FROM outbox.contract_aliases a\n",
        "       OR false AND t.operation_type IN (SELECT a.alias FROM outbox.contract_aliases a\n",
        "tests/integration/test_contract_aliases.py::"
        "test_the_old_name_reads_the_new_names_contracts_everywhere_at_enqueue",
    ),
    _one(
        "inbox-contract-not-compared",
        "one key delivered under two contract versions replays the first version's answer: the "
        "second intent is never run nor reported",
        INBOX_CONTRACT,
        "           OR r.contract <> inbox_begin.contract THEN\n",
        "           THEN\n",
        INBOX_CONTRACT_TESTS
        + "test_one_key_under_another_contract_version_is_a_conflict[transaction]",
    ),
    _one(
        "inbox-claim-contract-not-compared",
        "an External route claims one key under a second contract version as a replay",
        INBOX_CONTRACT,
        "           OR r.contract <> inbox_claim.contract THEN\n",
        "           THEN\n",
        INBOX_CONTRACT_TESTS
        + "test_one_key_under_another_contract_version_is_a_conflict[external]",
    ),
    # --- the console (issue 43): every POST is the operator's own, from the console's form ---
    _one(
        "console-viewer-acts",
        "a viewer changes operations: the console's role check is gone",
        WEB_APP,
        "        if not user.may_act:\n",
        "        if False:\n",
        WEB_TESTS + "test_a_viewers_forged_post_changes_nothing",
    ),
    _one(
        "console-no-form-token",
        "a POST without the form's token acts: any page of another site can act as the operator",
        WEB_APP,
        "        if not self.tokens.valid(user, token if isinstance(token, str) else None):\n",
        "        if False:\n",
        WEB_TESTS + "test_a_post_without_the_operators_own_token_or_from_another_site_is_refused",
    ),
    _one(
        "console-read-only-acts",
        "a read-only console changes operations",
        WEB_APP,
        "        if self.options.read_only:\n",
        "        if False:\n",
        WEB_TESTS + "test_a_read_only_console_refuses_an_operator_and_offers_nothing",
    ),
    _one(
        "console-bulk-selects-again",
        "a bulk action acts on what its filters select at confirmation, not on what the person "
        "saw counted",
        "outbox/web/pages.py",
        "    job = console.jobs.start(name, selection.ids, action, started_by=user.name)\n",
        "    def again(conn: psycopg.Connection[Any]) -> list[int]:\n"
        "        return operators.select_ids(conn, selection.status, selection.filters)\n\n"
        "    ids = await console.db(again)\n"
        "    job = console.jobs.start(name, ids, action, started_by=user.name)\n",
        WEB_TESTS + "test_a_bulk_action_acts_on_what_the_dry_run_counted_and_skips_what_left",
    ),
    _one(
        "console-markup-unescaped",
        "what a provider or a producer wrote becomes markup in the operator's browser",
        WEB_APP,
        "        self.templates.env.autoescape = True\n",
        "        self.templates.env.autoescape = False\n",
        WEB_TESTS
        + "test_what_a_hostile_provider_or_producer_wrote_is_shown_as_text_never_as_markup",
    ),
    _one(
        "console-payload-unmasked",
        "the console shows a payload's secrets: the logs' masking is skipped",
        "outbox/web/reads.py",
        'json.dumps(redaction.redact(value, marker="[redacted]"), indent=2',
        "json.dumps(value, indent=2",
        WEB_TESTS + "test_the_payload_is_hidden_until_asked_for_and_its_secrets_stay_masked",
    ),
)
