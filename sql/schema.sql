-- sql/schema.sql: the outbox schema as the migrations of sql/ leave it
-- (every migration up to 0056_the_inbox_compares_contracts).
--
-- GENERATED FILE: DO NOT EDIT IT BY HAND. It is regenerated, after adding a migration, by
--     python -m outbox.db.schema_dump --dsn postgresql://postgres@127.0.0.1:5432/postgres --output sql/schema.sql
-- (--dsn: any database of a server where you may CREATE DATABASE; the command makes a scratch
-- database there, migrates it, reads its catalogs and drops it). The numbered migrations remain
-- the source of truth: `outbox migrate` applies them, never this file, and
-- tests/integration/test_schema_file.py fails when the two disagree.
--
-- Read it for the current definition of anything: where a later migration replaced a function
-- or a trigger, this file has the one in force. It is not a script to run: objects are grouped
-- for reading (each table with its columns, constraints, indexes, triggers, comments and
-- privileges; then the functions alphabetically), not in the order PostgreSQL needs them.
-- The `-- history:` line of each object names the migration that created it and those
-- that changed it since: the files whose comments say why it is the way it is.
--
-- Left out: rows (0019 writes the one row of outbox.limits; outbox.schema_migrations records
-- the migrations applied); the roles of sql/roles.sql and sql/roles_tenant_rls.sql and their
-- grants, policies and row-level security (optional, cluster-wide, applied per deployment by
-- `outbox migrate --with-roles`); owner names: every object belongs to the owner of schema
-- outbox, the role that ran the migrations, unless its `-- owner:` line says otherwise.

-- =================================================================================================
-- schema outbox
-- history: created by outbox migrate itself (outbox/db/migrations.py), before 0001

CREATE SCHEMA outbox;
-- privileges: the owner's only

-- =================================================================================================
-- type outbox.claimed_row
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE TYPE outbox.claimed_row AS (
    id bigint,
    tenant_id text,
    operation_type text,
    operation_key text,
    provider text,
    action text,
    payload text,
    payload_bytes integer,
    payload_limit integer,
    idempotency_key text,
    correlation_id text,
    traceparent text,
    attempts integer,
    attempt_base integer,
    max_attempts integer,
    lease_token uuid,
    first_sent_at timestamp with time zone,
    created_at timestamp with time zone,
    claimed_at timestamp with time zone,
    api_version text
);
-- privileges: the owner's, and PUBLIC USAGE

-- =================================================================================================
-- sequence outbox.unnotified_commits
-- history: created by 0029_one_wakeup_per_idle_period

CREATE SEQUENCE outbox.unnotified_commits
    AS bigint
    INCREMENT BY 1
    MINVALUE 1
    MAXVALUE 9223372036854775807
    START WITH 1
    CACHE 1
    CYCLE;
COMMENT ON SEQUENCE outbox.unnotified_commits IS 'Commits that woke no dispatcher: read by a dispatcher marking itself waiting (sql/0029).';
-- privileges: the owner's only

-- =================================================================================================
-- table outbox.attempt_log
-- history: created by 0050_a_success_writes_one_row

CREATE TABLE outbox.attempt_log (
    operation_id        bigint NOT NULL,
    attempt             integer NOT NULL,
    idempotency_key     text NOT NULL,
    worker              text NOT NULL,
    started_at          timestamp with time zone NOT NULL,
    finished_at         timestamp with time zone DEFAULT now() NOT NULL,
    outcome             text NOT NULL,
    sent                boolean NOT NULL,
    error_class         text,
    error_message       text,
    http_status         integer,
    provider_request_id text,
    CONSTRAINT attempts_pkey PRIMARY KEY (operation_id, attempt),
    CONSTRAINT attempts_operation_id_fkey FOREIGN KEY (operation_id) REFERENCES outbox.operations(id) ON DELETE CASCADE,
    CONSTRAINT attempts_number_valid CHECK ((attempt >= 1)),
    CONSTRAINT attempts_outcome_valid CHECK ((outcome = ANY (ARRAY['succeeded'::text, 'transient'::text, 'permanent'::text, 'unknown'::text])))
);

COMMENT ON TABLE outbox.attempt_log IS 'Every attempt but a success at the first, which stays on its operation; outbox.attempts shows both (sql/0050).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.audit
-- history: created by 0003_audit; changed by 0009_stricter_retry_checks_and_audit,
--     0025_an_audit_that_tells_the_truth

CREATE TABLE outbox.audit (
    id           bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    operation_id bigint,
    at           timestamp with time zone DEFAULT now() NOT NULL,
    actor        text NOT NULL,
    action       text NOT NULL,
    reason       text NOT NULL,
    from_status  text,
    to_status    text,
    details      jsonb DEFAULT '{}'::jsonb NOT NULL,
    db_user      text DEFAULT SESSION_USER,
    CONSTRAINT audit_pkey PRIMARY KEY (id)
);

COMMENT ON TABLE outbox.audit IS 'Operator actions on operations; append-only.';

CREATE INDEX audit_operation ON outbox.audit USING btree (operation_id, at);
CREATE TRIGGER audit_append_only BEFORE UPDATE ON outbox.audit FOR EACH ROW EXECUTE FUNCTION outbox.audit_is_append_only();
CREATE TRIGGER audit_no_delete BEFORE DELETE ON outbox.audit FOR EACH ROW EXECUTE FUNCTION outbox.audit_is_kept();
CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON outbox.audit FOR EACH STATEMENT EXECUTE FUNCTION outbox.audit_is_kept();

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.contract_aliases
-- history: created by 0055_contract_aliases

CREATE TABLE outbox.contract_aliases (
    alias          text NOT NULL,
    operation_type text NOT NULL,
    created_at     timestamp with time zone DEFAULT now() NOT NULL,
    created_by     text NOT NULL,
    CONSTRAINT contract_aliases_pkey PRIMARY KEY (alias),
    CONSTRAINT contract_aliases_not_itself CHECK ((alias <> operation_type))
);

COMMENT ON TABLE outbox.contract_aliases IS 'A renamed operation type''s old name (alias), whose contract look-ups read the new name''s (sql/0055). Kept for ever.';

CREATE TRIGGER contract_aliases_kept BEFORE DELETE OR UPDATE ON outbox.contract_aliases FOR EACH ROW EXECUTE FUNCTION outbox.contract_aliases_kept();
CREATE TRIGGER contract_aliases_no_truncate BEFORE TRUNCATE ON outbox.contract_aliases FOR EACH STATEMENT EXECUTE FUNCTION outbox.contract_aliases_kept();

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.contract_types
-- history: created by 0053_contracts_at_enqueue

CREATE TABLE outbox.contract_types (
    operation_type    text NOT NULL,
    versions_required boolean DEFAULT true NOT NULL,
    changed_at        timestamp with time zone DEFAULT now() NOT NULL,
    changed_by        text NOT NULL,
    CONSTRAINT contract_types_pkey PRIMARY KEY (operation_type)
);

COMMENT ON TABLE outbox.contract_types IS 'Per operation type with contracts: whether enqueue requires a contract_version (sql/0053).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.contracts
-- history: created by 0052_operation_contracts

CREATE TABLE outbox.contracts (
    operation_type   text NOT NULL,
    version          integer NOT NULL,
    canonical        text NOT NULL,
    digest           text NOT NULL,
    document         jsonb GENERATED ALWAYS AS ((canonical)::jsonb) STORED,
    state            text DEFAULT 'active'::text NOT NULL,
    published_at     timestamp with time zone DEFAULT now() NOT NULL,
    published_by     text NOT NULL,
    state_changed_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT contracts_pkey PRIMARY KEY (operation_type, version),
    CONSTRAINT contracts_digest_valid CHECK ((digest = encode(sha256(convert_to(canonical, 'UTF8'::name)), 'hex'::text))),
    CONSTRAINT contracts_state_valid CHECK ((state = ANY (ARRAY['active'::text, 'deprecated'::text, 'retired'::text]))),
    CONSTRAINT contracts_version_valid CHECK ((version >= 1))
);

COMMENT ON TABLE outbox.contracts IS 'Published operation contracts (issue 42): one JSON Schema per operation type and version, never changed once published; state active, deprecated or retired.';

CREATE TRIGGER contracts_keep_published BEFORE DELETE OR UPDATE ON outbox.contracts FOR EACH ROW EXECUTE FUNCTION outbox.contracts_keep_published();
CREATE TRIGGER contracts_no_truncate BEFORE TRUNCATE ON outbox.contracts FOR EACH STATEMENT EXECUTE FUNCTION outbox.contracts_keep_published();

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.enqueue_allowances
-- history: created by 0026_enqueue_allow_lists; changed by 0035_allowances_match_the_tenant_exactly

CREATE TABLE outbox.enqueue_allowances (
    tenant_pattern text NOT NULL,
    provider       text NOT NULL,
    action         text DEFAULT '*'::text NOT NULL,
    note           text,
    created_at     timestamp with time zone DEFAULT now() NOT NULL,
    created_by     text DEFAULT SESSION_USER NOT NULL,
    CONSTRAINT enqueue_allowances_pkey PRIMARY KEY (tenant_pattern, provider, action),
    CONSTRAINT enqueue_allowances_not_blank CHECK (((btrim(tenant_pattern) <> ''::text) AND (btrim(provider) <> ''::text) AND (btrim(action) <> ''::text)))
);

COMMENT ON TABLE outbox.enqueue_allowances IS 'What each tenant may enqueue: tenant_pattern the tenant id exactly, * any run of characters (sql/0035); provider; action exactly or *. Empty: everything.';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.inbox
-- history: created by 0042_inbox; changed by 0046_the_inbox_checks_the_senders_fingerprint,
--     0048_the_origin_is_part_of_the_identity, 0049_a_delivery_costs_less,
--     0056_the_inbox_compares_contracts

CREATE TABLE outbox.inbox (
    id               bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    tenant_id        text NOT NULL,
    handler          text NOT NULL,
    key              text NOT NULL,
    mode             text DEFAULT 'transaction'::text NOT NULL,
    state            text NOT NULL,
    body_digest      bytea NOT NULL,
    token            uuid NOT NULL,
    response_status  smallint,
    response_headers jsonb,
    response_body    bytea,
    lease_expires_at timestamp with time zone,
    claims           integer DEFAULT 1 NOT NULL,
    last_error       text,
    abandoned_at     timestamp with time zone,
    created_at       timestamp with time zone DEFAULT now() NOT NULL,
    completed_at     timestamp with time zone,
    expires_at       timestamp with time zone NOT NULL,
    fingerprint      bytea,
    origin           uuid DEFAULT '00000000-0000-0000-0000-000000000000'::uuid NOT NULL,
    contract         text,
    CONSTRAINT inbox_pkey PRIMARY KEY (id),
    CONSTRAINT inbox_identity UNIQUE (tenant_id, handler, key, origin),
    CONSTRAINT inbox_never_5xx CHECK (((response_status >= 200) AND (response_status <= 499)))
) WITH (fillfactor=80);

COMMENT ON TABLE outbox.inbox IS 'One record per delivery identity a worker handled, committed with its business writes (sql/0042).';
COMMENT ON COLUMN outbox.inbox.contract IS 'The contract the delivery named (Outbox-Contract, "<type>/v<N>"); NULL: none (sql/0056).';

CREATE INDEX inbox_abandoned ON outbox.inbox USING btree (abandoned_at) WHERE (abandoned_at IS NOT NULL);
CREATE INDEX inbox_expiry ON outbox.inbox USING btree (expires_at);
CREATE INDEX inbox_leases ON outbox.inbox USING btree (lease_expires_at) WHERE (lease_expires_at IS NOT NULL);
CREATE CONSTRAINT TRIGGER inbox_outcome_before_commit AFTER INSERT ON outbox.inbox DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ((new.mode = 'transaction'::text)) EXECUTE FUNCTION outbox.inbox_outcome_before_commit();

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.inbox_conflicts
-- history: created by 0042_inbox

CREATE TABLE outbox.inbox_conflicts (
    inbox_id      bigint NOT NULL,
    body_digest   bytea NOT NULL,
    seen          integer DEFAULT 1 NOT NULL,
    first_seen_at timestamp with time zone DEFAULT now() NOT NULL,
    last_seen_at  timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT inbox_conflicts_pkey PRIMARY KEY (inbox_id, body_digest),
    CONSTRAINT inbox_conflicts_inbox_id_fkey FOREIGN KEY (inbox_id) REFERENCES outbox.inbox(id) ON DELETE CASCADE
);

COMMENT ON TABLE outbox.inbox_conflicts IS 'Deliveries that came under a recorded identity with another body (sql/0042).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.installation
-- history: created by 0041_derived_keys_hold_a_secret; changed by
--     0045_deliveries_carry_their_origin_and_fingerprint

CREATE TABLE outbox.installation (
    singleton  boolean DEFAULT true NOT NULL,
    key_secret bytea NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    origin     uuid DEFAULT gen_random_uuid() NOT NULL,
    CONSTRAINT installation_pkey PRIMARY KEY (singleton),
    CONSTRAINT installation_key_secret_length CHECK ((octet_length(key_secret) >= 16)),
    CONSTRAINT installation_one_row CHECK (singleton)
);

COMMENT ON TABLE outbox.installation IS 'This database''s secret, mixed into derived idempotency keys (sql/0041), and its public id, origin, which every delivery carries (sql/0045). The schema owner''s alone; never granted.';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.limits
-- history: created by 0019_limits_schedule_and_key_locks; changed by
--     0037_payloads_bounded_in_values

CREATE TABLE outbox.limits (
    one                  boolean DEFAULT true NOT NULL,
    max_payload_bytes    integer DEFAULT 1048576 NOT NULL,
    max_payload_elements integer DEFAULT 100000 NOT NULL,
    CONSTRAINT limits_pkey PRIMARY KEY (one),
    CONSTRAINT limits_max_payload_bytes_check CHECK (((max_payload_bytes >= 4096) AND (max_payload_bytes <= 67108864))),
    CONSTRAINT limits_max_payload_elements_check CHECK (((max_payload_elements >= 10000) AND (max_payload_elements <= 50000000))),
    CONSTRAINT limits_one_check CHECK (one)
);

COMMENT ON TABLE outbox.limits IS 'Limits only the schema owner may change: max_payload_bytes (bytes of the JSON text of a payload, 4096 to 67108864; enqueue refuses larger payloads, the claim hands none over) and max_payload_elements (JSON values in a payload, itself included, 10000 to 50000000; enqueue refuses more, sql/0037).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.operation_keys
-- history: created by 0051_keys_apart_from_the_operation

CREATE TABLE outbox.operation_keys (
    tenant_id       text NOT NULL,
    operation_type  text NOT NULL,
    operation_key   text NOT NULL,
    operation_id    bigint NOT NULL,
    provider        text NOT NULL,
    idempotency_key text,
    CONSTRAINT operation_keys_identity PRIMARY KEY (tenant_id, operation_type, operation_key),
    CONSTRAINT operation_keys_provider_key UNIQUE (provider, idempotency_key)
);

COMMENT ON TABLE outbox.operation_keys IS 'Each operation''s identity and provider key, written once by enqueue; unique across tenants (sql/0051).';
COMMENT ON COLUMN outbox.operation_keys.idempotency_key IS 'The key the operation sends now (reconcile retry moves it); NULL for an operation that shares its key with older ones (operations.key_shared).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.operations
-- history: created by 0001_operations; changed by 0005_operator, 0008_gauges,
--     0010_immutable_operations, 0012_wake_only_idle_dispatchers, 0014_fair_claims,
--     0015_ordering_keys, 0018_operations_fillfactor, 0019_limits_schedule_and_key_locks,
--     0021_findings_carry_the_state, 0023_lookups_say_what_they_searched,
--     0024_keys_name_one_operation, 0033_pending_failures, 0050_a_success_writes_one_row,
--     0051_keys_apart_from_the_operation, 0053_contracts_at_enqueue

CREATE TABLE outbox.operations (
    id                  bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    tenant_id           text NOT NULL,
    operation_type      text NOT NULL,
    operation_key       text NOT NULL,
    fingerprint         bytea NOT NULL,
    provider            text NOT NULL,
    action              text NOT NULL,
    payload             jsonb NOT NULL,
    idempotency_key     text NOT NULL,
    key_generation      integer DEFAULT 1 NOT NULL,
    correlation_id      text,
    traceparent         text,
    status              text DEFAULT 'pending'::text NOT NULL,
    status_reason       text,
    attempts            integer DEFAULT 0 NOT NULL,
    max_attempts        integer,
    available_at        timestamp with time zone DEFAULT now() NOT NULL,
    lease_owner         text,
    lease_token         uuid,
    lease_expires_at    timestamp with time zone,
    first_sent_at       timestamp with time zone,
    last_attempt_at     timestamp with time zone,
    provider_ref        text,
    result              jsonb,
    last_error          text,
    last_error_class    text,
    created_at          timestamp with time zone DEFAULT now() NOT NULL,
    updated_at          timestamp with time zone DEFAULT now() NOT NULL,
    status_changed_at   timestamp with time zone DEFAULT now() NOT NULL,
    finished_at         timestamp with time zone,
    attempt_base        integer DEFAULT 0 NOT NULL,
    checked_at          timestamp with time zone,
    check_finding       text,
    ordering_key        text,
    ordering_blocked    boolean DEFAULT false NOT NULL,
    scheduled           boolean DEFAULT false NOT NULL,
    payload_bytes       integer,
    cancel_requested_at timestamp with time zone,
    check_state         text,
    check_details       jsonb,
    api_version         text,
    sent_scope          text,
    key_shared          boolean DEFAULT false NOT NULL,
    success_worker      text,
    success_http_status integer,
    success_request_id  text,
    contract_version    integer,
    CONSTRAINT operations_pkey PRIMARY KEY (id),
    CONSTRAINT operations_attempt_base_valid CHECK (((attempt_base >= 0) AND (attempt_base <= attempts))),
    CONSTRAINT operations_attempts_valid CHECK ((attempts >= 0)),
    CONSTRAINT operations_blocked_only_pending CHECK (((NOT ordering_blocked) OR (status = 'pending'::text))),
    CONSTRAINT operations_check_finding_valid CHECK ((check_finding = ANY (ARRAY['found'::text, 'not_found'::text, 'refused'::text, 'undecided'::text]))),
    CONSTRAINT operations_error_class_valid CHECK ((last_error_class = ANY (ARRAY['transient'::text, 'permanent'::text, 'unknown'::text]))),
    CONSTRAINT operations_key_generation_valid CHECK ((key_generation >= 1)),
    CONSTRAINT operations_lease_only_in_flight CHECK (((status = 'in_flight'::text) = ((lease_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT operations_max_attempts_valid CHECK (((max_attempts IS NULL) OR (max_attempts > 0))),
    CONSTRAINT operations_scheduled_only_pending CHECK (((NOT scheduled) OR (status = 'pending'::text))),
    CONSTRAINT operations_status_valid CHECK ((status = ANY (ARRAY['pending'::text, 'in_flight'::text, 'succeeded'::text, 'quarantined'::text, 'reconciling'::text, 'cancelled'::text]))),
    CONSTRAINT operations_succeeded_has_ref CHECK (((status <> 'succeeded'::text) OR (provider_ref IS NOT NULL)))
) WITH (fillfactor=80);

COMMENT ON TABLE outbox.operations IS 'Operations recorded by producers through outbox.enqueue and delivered by outbox run.';
COMMENT ON COLUMN outbox.operations.success_worker IS 'The worker of a success at the first attempt, kept here instead of a row of attempt_log; set exactly for such a success (sql/0050).';
COMMENT ON COLUMN outbox.operations.contract_version IS 'The version of its type''s contract (outbox.contracts) the operation was enqueued under; NULL for a type without contracts (sql/0053).';

CREATE INDEX operations_attention ON outbox.operations USING btree (status, status_changed_at) WHERE (status = ANY (ARRAY['reconciling'::text, 'quarantined'::text]));
CREATE INDEX operations_cancelled ON outbox.operations USING btree (status_changed_at) WHERE (status = 'cancelled'::text);
CREATE INDEX operations_claim_group ON outbox.operations USING btree (provider, tenant_id, available_at, id) WHERE ((status = 'pending'::text) AND (NOT ordering_blocked) AND (NOT scheduled));
CREATE INDEX operations_lease ON outbox.operations USING btree (lease_expires_at) WHERE (status = 'in_flight'::text);
CREATE INDEX operations_ordering_blocked ON outbox.operations USING btree (tenant_id, ordering_key, id) WHERE ordering_blocked;
CREATE INDEX operations_ordering_heads ON outbox.operations USING btree (tenant_id, ordering_key) WHERE ((ordering_key IS NOT NULL) AND (NOT ordering_blocked) AND (status = ANY (ARRAY['pending'::text, 'in_flight'::text, 'quarantined'::text, 'reconciling'::text])));
CREATE INDEX operations_pending_failed ON outbox.operations USING btree (provider, status_changed_at, id) WHERE ((status = 'pending'::text) AND (last_error_class IS NOT NULL));
CREATE INDEX operations_scheduled ON outbox.operations USING btree (available_at, id) INCLUDE (provider, first_sent_at, ordering_blocked) WHERE scheduled;
CREATE TRIGGER operations_cancel_when_attempt_ends BEFORE UPDATE OF status ON outbox.operations FOR EACH ROW WHEN (((old.status = 'in_flight'::text) AND (old.cancel_requested_at IS NOT NULL) AND (new.status <> 'in_flight'::text))) EXECUTE FUNCTION outbox.cancel_when_attempt_ends();
CREATE TRIGGER operations_forget_keys AFTER DELETE ON outbox.operations REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION outbox.operation_keys_follow_deletes();
CREATE TRIGGER operations_immutable BEFORE UPDATE OF tenant_id, operation_type, operation_key, provider, action, payload, fingerprint, idempotency_key, key_generation, ordering_key, contract_version ON outbox.operations FOR EACH ROW EXECUTE FUNCTION outbox.operations_keep_immutable();
CREATE TRIGGER operations_move_key AFTER UPDATE OF idempotency_key, key_shared ON outbox.operations FOR EACH ROW WHEN (((old.idempotency_key IS DISTINCT FROM new.idempotency_key) OR (old.key_shared IS DISTINCT FROM new.key_shared))) EXECUTE FUNCTION outbox.operation_keys_follow_key();
CREATE TRIGGER operations_pass_turn AFTER UPDATE OF status ON outbox.operations FOR EACH ROW WHEN (((new.ordering_key IS NOT NULL) AND (old.status IS DISTINCT FROM new.status) AND (new.status = ANY (ARRAY['succeeded'::text, 'cancelled'::text, 'quarantined'::text, 'reconciling'::text])))) EXECUTE FUNCTION outbox.pass_turn();
CREATE TRIGGER operations_rejoin_line BEFORE UPDATE OF status ON outbox.operations FOR EACH ROW WHEN (((new.ordering_key IS NOT NULL) AND (new.status = 'pending'::text) AND (old.status = ANY (ARRAY['quarantined'::text, 'reconciling'::text])))) EXECUTE FUNCTION outbox.rejoin_line();
CREATE CONSTRAINT TRIGGER operations_take_turn AFTER INSERT ON outbox.operations DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ((new.ordering_key IS NOT NULL)) EXECUTE FUNCTION outbox.take_turn();
CREATE TRIGGER operations_truncate_keys AFTER TRUNCATE ON outbox.operations FOR EACH STATEMENT EXECUTE FUNCTION outbox.operation_keys_follow_deletes();
CREATE CONSTRAINT TRIGGER operations_wake_dispatchers AFTER INSERT ON outbox.operations DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION outbox.wake_dispatchers();

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.ordering_keys
-- history: created by 0019_limits_schedule_and_key_locks

CREATE TABLE outbox.ordering_keys (
    tenant_id    text NOT NULL,
    ordering_key text NOT NULL,
    CONSTRAINT ordering_keys_pkey PRIMARY KEY (tenant_id, ordering_key)
);

COMMENT ON TABLE outbox.ordering_keys IS 'The lock of each ordering key: producers lock it at COMMIT, settlers try it (sql/0019).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.ordering_modes
-- history: created by 0015_ordering_keys

CREATE TABLE outbox.ordering_modes (
    operation_type text NOT NULL,
    on_failure     text NOT NULL,
    updated_at     timestamp with time zone DEFAULT now() NOT NULL,
    updated_by     text NOT NULL,
    CONSTRAINT ordering_modes_pkey PRIMARY KEY (operation_type),
    CONSTRAINT ordering_modes_on_failure_check CHECK ((on_failure = ANY (ARRAY['block'::text, 'skip'::text])))
);

COMMENT ON TABLE outbox.ordering_modes IS 'Per operation type: block (default) or skip the later operations of an ordering key while an earlier one is quarantined or reconciling. Set with outbox.set_ordering_mode.';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.ordering_repairs
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks

CREATE TABLE outbox.ordering_repairs (
    tenant_id    text NOT NULL,
    ordering_key text NOT NULL,
    noted_at     timestamp with time zone DEFAULT now() NOT NULL
);

CREATE INDEX ordering_repairs_noted ON outbox.ordering_repairs USING btree (noted_at);

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.ordering_turns
-- history: created by 0019_limits_schedule_and_key_locks

CREATE UNLOGGED TABLE outbox.ordering_turns (
    xid          xid8 NOT NULL,
    tenant_id    text NOT NULL,
    ordering_key text NOT NULL,
    CONSTRAINT ordering_turns_pkey PRIMARY KEY (xid, tenant_id, ordering_key)
);

COMMENT ON TABLE outbox.ordering_turns IS 'Ordering keys enqueued by transactions in progress; emptied by their COMMIT (take_turn).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.provider_actions
-- history: created by 0031_provider_health

CREATE TABLE outbox.provider_actions (
    id       bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    provider text NOT NULL,
    action   text NOT NULL,
    at       timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT provider_actions_pkey PRIMARY KEY (id),
    CONSTRAINT provider_actions_action_valid CHECK ((action = ANY (ARRAY['reset'::text, 'probe'::text])))
);

COMMENT ON TABLE outbox.provider_actions IS 'Operators'' requests to reset a provider''s breakers or probe it now; every dispatcher acts on those newer than its start.';

CREATE INDEX provider_actions_at ON outbox.provider_actions USING btree (at);

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.provider_buckets
-- history: created by 0016_provider_buckets

CREATE TABLE outbox.provider_buckets (
    provider    text NOT NULL,
    rate        double precision NOT NULL,
    burst       double precision NOT NULL,
    tokens      double precision NOT NULL,
    refilled_at timestamp with time zone NOT NULL,
    taken       integer DEFAULT 0 NOT NULL,
    CONSTRAINT provider_buckets_pkey PRIMARY KEY (provider),
    CONSTRAINT provider_buckets_burst_check CHECK ((burst >= (1)::double precision)),
    CONSTRAINT provider_buckets_rate_check CHECK ((rate > (0)::double precision))
);

COMMENT ON TABLE outbox.provider_buckets IS 'One token bucket per rate-limited provider, shared by every dispatcher (0016).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.provider_health
-- history: created by 0031_provider_health

CREATE TABLE outbox.provider_health (
    provider      text NOT NULL,
    worker        text NOT NULL,
    state         text NOT NULL,
    reason        text,
    failure_rate  real DEFAULT 0 NOT NULL,
    calls         integer DEFAULT 0 NOT NULL,
    failing_alone integer DEFAULT 0 NOT NULL,
    opened_at     timestamp with time zone,
    next_probe_at timestamp with time zone,
    open_for      interval,
    updated_at    timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT provider_health_pkey PRIMARY KEY (provider, worker),
    CONSTRAINT provider_health_state_valid CHECK ((state = ANY (ARRAY['closed'::text, 'open'::text, 'half_open'::text])))
);

COMMENT ON TABLE outbox.provider_health IS 'Each dispatcher''s circuit breaker of each provider, as it last wrote it (issue 37).';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.schema_migrations
-- history: created by outbox migrate itself (outbox/db/migrations.py), before 0001

CREATE TABLE outbox.schema_migrations (
    version    integer NOT NULL,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    applied_by text DEFAULT CURRENT_USER NOT NULL,
    CONSTRAINT schema_migrations_pkey PRIMARY KEY (version)
);

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.waiting_dispatchers
-- history: created by 0012_wake_only_idle_dispatchers; changed by 0029_one_wakeup_per_idle_period

CREATE UNLOGGED TABLE outbox.waiting_dispatchers (
    worker  text NOT NULL,
    seen_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT waiting_dispatchers_pkey PRIMARY KEY (worker)
);

COMMENT ON TABLE outbox.waiting_dispatchers IS 'Dispatchers idle and LISTENing. The first producer to commit while one is here deletes the marks and notifies; the dispatchers mark themselves again when next idle (sql/0029). Marks older than 10 minutes (a dispatcher that died waiting) are ignored.';

-- privileges: the owner's only

-- =================================================================================================
-- table outbox.wake_gate
-- history: created by 0039_a_wake_gate_only_outbox_can_hold

CREATE TABLE outbox.wake_gate (

);

COMMENT ON TABLE outbox.wake_gate IS 'No rows: its lock is the wake-up lock. Producers hold ROW EXCLUSIVE from the wake-up check at COMMIT until their rows are visible; a dispatcher marking itself waiting tries SHARE (outbox.try_wake_gate). Only outbox''s functions lock it (sql/0039).';

-- privileges: the owner's only

-- =================================================================================================
-- view outbox.attempts
-- history: created by 0050_a_success_writes_one_row

CREATE VIEW outbox.attempts WITH (security_invoker=true) AS
 SELECT l.operation_id,
    l.attempt,
    l.idempotency_key,
    l.worker,
    l.started_at,
    l.finished_at,
    l.outcome,
    l.sent,
    l.error_class,
    l.error_message,
    l.http_status,
    l.provider_request_id
   FROM outbox.attempt_log l
UNION ALL
 SELECT o.id AS operation_id,
    1 AS attempt,
    o.idempotency_key,
    o.success_worker AS worker,
    o.last_attempt_at AS started_at,
    o.finished_at,
    'succeeded'::text AS outcome,
    true AS sent,
    NULL::text AS error_class,
    NULL::text AS error_message,
    o.success_http_status AS http_status,
    o.success_request_id AS provider_request_id
   FROM outbox.operations o
  WHERE o.success_worker IS NOT NULL;
COMMENT ON VIEW outbox.attempts IS 'The delivery history of every operation, one row per attempt: attempt_log, and the success at the first attempt kept on its operation (sql/0050).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.audit_is_append_only()
-- history: created by 0003_audit; changed by 0011_security_definer
-- fired by trigger audit_append_only ON outbox.audit

CREATE OR REPLACE FUNCTION outbox.audit_is_append_only()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'outbox.audit is append-only: rows are never updated'
        USING ERRCODE = 'OB003', TABLE = 'audit', SCHEMA = 'outbox';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.audit_is_kept()
-- history: created by 0009_stricter_retry_checks_and_audit; changed by 0011_security_definer
-- fired by trigger audit_no_delete ON outbox.audit
-- fired by trigger audit_no_truncate ON outbox.audit

CREATE OR REPLACE FUNCTION outbox.audit_is_kept()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'outbox.audit keeps every row: % is refused', TG_OP
        USING ERRCODE = 'OB003', TABLE = 'audit', SCHEMA = 'outbox';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.bind_tenant(text)
-- history: created by 0038_bindings_end_with_their_transaction

CREATE OR REPLACE FUNCTION outbox.bind_tenant(tenant_id text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF tenant_id IS NULL OR btrim(tenant_id) = '' THEN
        RAISE EXCEPTION 'tenant_id is required' USING ERRCODE = 'OB002', COLUMN = 'tenant_id';
    END IF;
    PERFORM set_config('outbox.tenant_id', tenant_id, true);
    PERFORM set_config('outbox.tenant_bound_at',
                       to_char(transaction_timestamp() AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS'),
                       true);
END;
$function$;
COMMENT ON FUNCTION outbox.bind_tenant(text) IS 'Binds this transaction, and only it, to a tenant under tenant isolation (sql/0038).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.bound_tenant()
-- history: created by 0011_security_definer; changed by 0038_bindings_end_with_their_transaction,
--     0044_inbox_begin_without_a_subtransaction

CREATE OR REPLACE FUNCTION outbox.bound_tenant()
 RETURNS text
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN CASE WHEN current_setting('outbox.tenant_bound_at', true)
                     = to_char(transaction_timestamp() AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS')
                THEN nullif(current_setting('outbox.tenant_id', true), '') END;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.cancel_operation(bigint,text,text)
-- history: created by 0005_operator; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.cancel_operation(operation_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'cancel', ARRAY['reconciling', 'quarantined']);
    UPDATE outbox.operations o
    SET status = 'cancelled', status_reason = 'cancelled by operator', updated_at = now(),
        status_changed_at = now(), finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'cancel', reason, 'cancelled', '{}'::jsonb);
    RETURN 'cancelled';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.cancel_when_attempt_ends()
-- history: created by 0019_limits_schedule_and_key_locks
-- fired by trigger operations_cancel_when_attempt_ends ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.cancel_when_attempt_ends()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF NEW.status = 'succeeded' THEN
        PERFORM outbox.write_audit(OLD, 'outbox', 'cancel_not_applied',
            'the attempt under way when the cancel was requested succeeded', 'succeeded',
            jsonb_build_object('requested_at', OLD.cancel_requested_at));
        RETURN NEW;
    END IF;
    IF NEW.first_sent_at IS NOT NULL THEN
        PERFORM outbox.write_audit(OLD, 'outbox', 'cancel_to_reconciliation',
            'cancel requested while the operation was in flight; its attempts may have reached '
            'the provider, so reconciliation decides', 'reconciling',
            jsonb_build_object('requested_at', OLD.cancel_requested_at,
                               'instead_of', NEW.status));
        NEW.status := 'reconciling';
        NEW.status_reason := 'cancel_requested';
        NEW.scheduled := false;
        NEW.finished_at := NULL;
        RETURN NEW;
    END IF;
    PERFORM outbox.write_audit(OLD, 'outbox', 'cancel',
        'cancel requested while the operation was in flight; applied when its attempt ended',
        'cancelled', jsonb_build_object('requested_at', OLD.cancel_requested_at,
                                        'instead_of', NEW.status));
    NEW.status := 'cancelled';
    NEW.status_reason := 'cancelled by operator';
    NEW.scheduled := false;
    NEW.finished_at := now();
    RETURN NEW;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_between(text,interval,interval,interval)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.check_between(name text, value interval, low interval, high interval)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_count(text,bigint,bigint,bigint)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.check_count(name text, value bigint, low bigint, high bigint)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_ends(text,text)
-- history: created by 0036_identities_refuse_spaces_at_their_ends

CREATE OR REPLACE FUNCTION outbox.check_ends(field text, value text)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_bad text;
    v_at  integer;
    v_hex text;
BEGIN
    IF value IS NULL THEN
        RETURN;
    END IF;
    v_bad := substring(value from '^[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]');
    v_at := 1;
    IF v_bad IS NULL THEN
        v_bad := substring(value from '[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]$');
        v_at := char_length(value);
    END IF;
    IF v_bad IS NOT NULL THEN
        v_hex := upper(to_hex(ascii(v_bad)));
        RAISE EXCEPTION '% must not begin or end with a space (U+% at character %)',
            field, lpad(v_hex, 4, '0'), v_at
            USING ERRCODE = 'OB002', COLUMN = field,
                  HINT = 'a space at either end (U+0020, U+00A0 and the other Unicode spaces) '
                         'makes a value that looks like another';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_number(text,double precision,double precision,double precision)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.check_number(name text, value double precision, low double precision, high double precision)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- NaN sorts above every number, infinity above every finite one: both are refused.
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_text(text,text,integer,boolean)
-- history: created by 0004_enqueue; changed by 0011_security_definer,
--     0028_identities_refuse_format_characters

CREATE OR REPLACE FUNCTION outbox.check_text(field text, value text, max_length integer, required boolean DEFAULT true)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_bad text;
    v_hex text;
BEGIN
    IF value IS NULL THEN
        IF required THEN
            RAISE EXCEPTION '% is required', field USING ERRCODE = 'OB002', COLUMN = field;
        END IF;
        RETURN;
    END IF;
    IF btrim(value) = '' THEN
        RAISE EXCEPTION '% must not be empty', field USING ERRCODE = 'OB002', COLUMN = field;
    END IF;
    IF char_length(value) > max_length THEN
        RAISE EXCEPTION '% is % characters long; at most % are allowed',
            field, char_length(value), max_length
            USING ERRCODE = 'OB002', COLUMN = field;
    END IF;
    -- Identities end up in log lines, HTTP headers and operators' terminals. The class is
    -- Cc, Cf, Zl and Zp (above); enqueue's usual path matches the very same one.
    v_bad := substring(value from '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]');
    IF v_bad IS NOT NULL THEN
        v_hex := upper(to_hex(ascii(v_bad)));
        RAISE EXCEPTION '% must not contain control characters (U+% at character %)',
            field, lpad(v_hex, greatest(4, length(v_hex)), '0'), strpos(value, v_bad)
            USING ERRCODE = 'OB002', COLUMN = field,
                  HINT = 'control, format (bidi, zero-width) and line or paragraph separator '
                         'characters are refused';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.check_worker(text)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.check_worker(worker text)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF worker IS NULL OR length(worker) NOT BETWEEN 1 AND 400 THEN
        RAISE EXCEPTION 'a worker name is 1 to 400 characters' USING ERRCODE = '22023';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_checks(text[],interval,integer)
-- history: created by 0013_claim_checks; changed by 0022_lookups_cover_every_generation,
--     0023_lookups_say_what_they_searched, 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.claim_checks(providers text[], recheck_after interval, max_rows integer)
 RETURNS TABLE(id bigint, provider text, action text, idempotency_key text, key_generation integer, attempts integer, first_sent_at timestamp with time zone, last_attempt_at timestamp with time zone, keys text[], payload text, search_until timestamp with time zone, checked_now timestamp with time zone, api_version text, sent_scope text)
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.check_between('recheck_after', claim_checks.recheck_after, interval '0',
                                interval '366 days'),
           outbox.check_count('max_rows', claim_checks.max_rows, 0, 10000);
    WITH due AS MATERIALIZED (
        SELECT o.id, o.checked_at AS checked_before
        FROM outbox.operations o
        WHERE o.status = 'reconciling'
          AND o.provider = ANY (claim_checks.providers)
          AND (o.checked_at IS NULL OR o.checked_at < now() - claim_checks.recheck_after)
        ORDER BY o.status_changed_at, o.id
        LIMIT claim_checks.max_rows
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.operations o SET checked_at = now()
    FROM due
    WHERE o.id = due.id
    RETURNING o.id, o.provider, o.action, o.idempotency_key, o.key_generation, o.attempts,
              least(coalesce(o.first_sent_at, o.created_at),
                    (SELECT min(a.started_at) FROM outbox.attempts a
                     WHERE a.operation_id = o.id AND a.sent)),
              coalesce(o.last_attempt_at, o.created_at),
              ARRAY(SELECT k FROM (SELECT a.idempotency_key FROM outbox.attempts a
                                   WHERE a.operation_id = o.id AND a.sent
                                   UNION SELECT o.idempotency_key) AS ks (k) ORDER BY k),
              o.payload::text,
              -- least() would take now() for a NULL: never checked, the last attempt it is.
              greatest(coalesce(o.last_attempt_at, o.created_at),
                       CASE WHEN due.checked_before IS NOT NULL
                            THEN least(due.checked_before, now()) END),
              now(), o.api_version, o.sent_scope
$function$;
COMMENT ON FUNCTION outbox.claim_checks(text[],interval,integer) IS 'Reconciling operations due for a provider lookup, marked checked as they are taken (SKIP LOCKED): one replica per check. With every key that may have reached the provider and the window to search.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_fair(text,interval,integer,text[],integer[],text,text,integer)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.claim_fair(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text, p_max_groups integer)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
BEGIN
    PERFORM outbox.check_worker(p_worker);
    PERFORM outbox.check_between('lease', p_lease, interval '1 millisecond', interval '1 day');
    PERFORM outbox.check_count('limit', p_limit, 0, 100000);
    PERFORM outbox.check_count('max_groups', p_max_groups, 1, 200000);
    WITH RECURSIVE
    limits AS (
        -- Per provider, the most rows this claim may take (0: none); absent: no cap.
        SELECT * FROM unnest(p_cap_providers::text[], p_caps::integer[]) AS l(provider, cap)
    ),
    groups (provider, tenant_id, available_at, cap, wrapped, n, pn) AS (
        -- A loose index scan: one probe per group, each giving the group's earliest row. n counts
        -- the groups visited that may give rows (a provider capped at 0 is a probe, not a visit:
        -- with a claim of one row and two paused providers, they once took up the whole visit);
        -- pn the groups of this provider visited in a row.
        SELECT f.provider, f.tenant_id, f.available_at, c.cap, f.wrapped, (c.cap > 0)::integer, 1
        FROM (
            (SELECT o.provider, o.tenant_id, o.available_at, false AS wrapped
             FROM outbox.operations o
             WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
               AND (o.provider, o.tenant_id) > (p_after_provider::text, p_after_tenant::text)
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            UNION ALL
            (SELECT o.provider, o.tenant_id, o.available_at, true
             FROM outbox.operations o
             WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            LIMIT 1
        ) f
        CROSS JOIN LATERAL (
            SELECT coalesce((SELECT l.cap FROM limits l WHERE l.provider = f.provider), p_limit)
        ) AS c(cap)
        UNION ALL
        SELECT nx.provider, nx.tenant_id, nx.available_at, c.cap, nx.wrapped,
               g.n + (c.cap > 0)::integer, CASE WHEN nx.provider = g.provider THEN g.pn + 1 ELSE 1 END
        FROM groups g
        CROSS JOIN LATERAL (
            -- The next group. Past a provider capped at 0, or one with as many groups visited as
            -- rows it may give (each group in the index has a due row: the scheduled ones are
            -- elsewhere, 0019), its other tenants are jumped over: a provider with a small cap and
            -- a thousand tenants must not take up the whole visit while the next provider's rows
            -- wait. At the end, around to the first group. UNION ALL ... LIMIT 1 stops at the first
            -- branch that finds one, and each branch's condition on g is checked before its scan.
            (SELECT o.provider, o.tenant_id, o.available_at, g.wrapped AS wrapped
             FROM outbox.operations o
             WHERE g.cap > 0 AND g.pn < g.cap
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
               AND (o.provider, o.tenant_id) > (g.provider, g.tenant_id)
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            UNION ALL
            (SELECT o.provider, o.tenant_id, o.available_at, g.wrapped
             FROM outbox.operations o
             WHERE (g.cap <= 0 OR g.pn >= g.cap)
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
               AND o.provider > g.provider
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            UNION ALL
            (SELECT o.provider, o.tenant_id, o.available_at, true
             FROM outbox.operations o
             WHERE NOT g.wrapped
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            LIMIT 1
        ) nx
        CROSS JOIN LATERAL (
            SELECT coalesce((SELECT l.cap FROM limits l WHERE l.provider = nx.provider), p_limit)
        ) AS c(cap)
        WHERE g.n < p_max_groups
          -- Once around, stop where the visit began.
          AND NOT (nx.wrapped
                   AND (nx.provider, nx.tenant_id) > (p_after_provider::text, p_after_tenant::text))
    ),
    ready AS MATERIALIZED (
        -- The groups with a due row, each with its share of the batch and of its provider's cap:
        -- an even split, the remainder to the groups first in line, so shares never add up to more.
        SELECT provider, tenant_id, n,
               least(p_limit / count(*) OVER ()
                       + (row_number() OVER (ORDER BY n) <= p_limit % count(*) OVER ())::integer,
                     cap / count(*) OVER (PARTITION BY provider)
                       + (row_number() OVER (PARTITION BY provider ORDER BY n)
                          <= cap % count(*) OVER (PARTITION BY provider))::integer) AS share,
               cap
        FROM groups
        WHERE cap > 0 AND available_at <= now()
    ),
    first AS MATERIALIZED (
        SELECT r.provider, r.tenant_id, pick.id
        FROM ready r
        CROSS JOIN LATERAL (
            SELECT o.id FROM outbox.operations o
            WHERE o.provider = r.provider AND o.tenant_id = r.tenant_id
              AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              AND o.available_at <= now()
            ORDER BY o.available_at, o.id
            LIMIT r.share
            FOR UPDATE SKIP LOCKED
        ) pick
        LIMIT p_limit
    ),
    taken AS (
        -- Integers: sum() of bigints is numeric, and the room below, divided as numeric and then
        -- rounded, once gave a provider capped at 3 two rows more than its cap.
        SELECT provider, tenant_id, count(*)::integer AS k,
               (sum(count(*)) OVER (PARTITION BY provider))::integer AS provider_k
        FROM first GROUP BY provider, tenant_id
    ),
    busy AS MATERIALIZED (
        -- Groups that filled their share may have more: they split what is left of their
        -- provider's cap the same way, visited in the same order.
        SELECT r.provider, r.tenant_id, r.share, r.n, r.cap, t.provider_k,
               ((r.cap - t.provider_k) / count(*) OVER (PARTITION BY r.provider)
                + (row_number() OVER (PARTITION BY r.provider ORDER BY r.n)
                   <= (r.cap - t.provider_k) % count(*) OVER (PARTITION BY r.provider))::integer
               )::integer AS room
        FROM ready r JOIN taken t USING (provider, tenant_id)
        WHERE t.k = r.share
        ORDER BY r.n
    ),
    more AS MATERIALIZED (
        SELECT b.provider, b.tenant_id, pick.id
        FROM busy b
        CROSS JOIN LATERAL (
            -- Past the rows of the first pass. Should a concurrent claim have moved them, a row
            -- may come twice (the UNION below drops it) or be left for the next claim.
            SELECT o.id FROM outbox.operations o
            WHERE o.provider = b.provider AND o.tenant_id = b.tenant_id
              AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              AND o.available_at <= now()
            ORDER BY o.available_at, o.id
            OFFSET b.share LIMIT greatest(b.room, 0)
            FOR UPDATE SKIP LOCKED
        ) pick
        LIMIT greatest(p_limit - (SELECT count(*) FROM first), 0)
    ),
    got AS (
        SELECT provider, tenant_id, count(*)::integer AS k FROM more GROUP BY provider, tenant_id
    ),
    provider_got AS (
        SELECT provider, count(*)::integer AS k FROM more GROUP BY provider
    ),
    spare AS MATERIALIZED (
        -- A group with fewer rows than its room leaves some of its provider's cap unused; without
        -- this pass a claim came back short with rows left in the groups that used all of theirs,
        -- and the dispatcher slept on them. Those groups take the rest, in visiting order.
        SELECT b.provider, b.tenant_id, b.n, b.share + b.room AS skip,
               b.cap - b.provider_k - coalesce(pg.k, 0) AS room
        FROM busy b
        LEFT JOIN got g USING (provider, tenant_id)
        LEFT JOIN provider_got pg USING (provider)
        WHERE coalesce(g.k, 0) = greatest(b.room, 0)
          AND b.cap - b.provider_k - coalesce(pg.k, 0) > 0
          -- Nothing to add to a claim that is full already.
          AND (SELECT count(*) FROM first) + (SELECT count(*) FROM more) < p_limit
    ),
    rest AS MATERIALIZED (
        SELECT ranked.id
        FROM (
            SELECT pick.id, s.n, s.room,
                   row_number() OVER (PARTITION BY s.provider ORDER BY s.n, pick.available_at,
                                                                       pick.id) AS k
            FROM spare s
            CROSS JOIN LATERAL (
                SELECT o.id, o.available_at FROM outbox.operations o
                WHERE o.provider = s.provider AND o.tenant_id = s.tenant_id
                  AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
                  AND o.available_at <= now()
                ORDER BY o.available_at, o.id
                OFFSET s.skip LIMIT greatest(s.room, 0)
                FOR UPDATE SKIP LOCKED
            ) pick
        ) ranked
        WHERE ranked.k <= ranked.room
        ORDER BY ranked.n, ranked.k
        LIMIT greatest(p_limit - (SELECT count(*) FROM first) - (SELECT count(*) FROM more), 0)
    ),
    due AS (
        SELECT id FROM first UNION SELECT id FROM more UNION SELECT id FROM rest
    )
    SELECT array_agg(id) INTO v_ids FROM due;
    RETURN QUERY SELECT * FROM outbox.lease_claimed(v_ids, p_worker, p_lease);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_fair_v2(text,interval,integer,text[],integer[],text,text,integer)
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE OR REPLACE FUNCTION outbox.claim_fair_v2(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text, p_max_groups integer)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_fair(p_worker, p_lease, p_limit, p_cap_providers, p_caps,
                           p_after_provider, p_after_tenant, p_max_groups) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_fair_v3(text,interval,integer,text[],integer[],text,text,integer)
-- history: created by 0054_the_dispatcher_checks_contracts

CREATE OR REPLACE FUNCTION outbox.claim_fair_v3(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text, p_max_groups integer)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid, contract_version integer)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_fair(p_worker, p_lease, p_limit, p_cap_providers, p_caps,
                           p_after_provider, p_after_tenant, p_max_groups) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_one_group(text,interval,integer,text[],integer[])
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.claim_one_group(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[])
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
BEGIN
    PERFORM outbox.check_worker(p_worker);
    PERFORM outbox.check_between('lease', p_lease, interval '1 millisecond', interval '1 day');
    PERFORM outbox.check_count('limit', p_limit, 0, 100000);
    WITH
    lone AS (
        SELECT a.provider, a.tenant_id,
               coalesce((SELECT l.cap
                         FROM unnest(p_cap_providers::text[], p_caps::integer[]) AS l(provider, cap)
                         WHERE l.provider = a.provider), p_limit) AS cap
        FROM (SELECT o.provider, o.tenant_id FROM outbox.operations o
              WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1) a
        JOIN (SELECT o.provider, o.tenant_id FROM outbox.operations o
              WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              ORDER BY o.provider DESC, o.tenant_id DESC, o.available_at DESC, o.id DESC
              LIMIT 1) b USING (provider, tenant_id)
    ),
    due AS (
        SELECT pick.id
        FROM lone
        CROSS JOIN LATERAL (
            SELECT o.id FROM outbox.operations o
            WHERE o.provider = lone.provider AND o.tenant_id = lone.tenant_id
              AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              AND o.available_at <= now()
            ORDER BY o.available_at, o.id
            LIMIT greatest(least(p_limit, lone.cap), 0)
            FOR UPDATE SKIP LOCKED
        ) pick
    )
    SELECT array_agg(id) INTO v_ids FROM due;
    RETURN QUERY SELECT * FROM outbox.lease_claimed(v_ids, p_worker, p_lease);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_one_group_v2(text,interval,integer,text[],integer[])
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE OR REPLACE FUNCTION outbox.claim_one_group_v2(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[])
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_one_group(p_worker, p_lease, p_limit, p_cap_providers, p_caps) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_one_group_v3(text,interval,integer,text[],integer[])
-- history: created by 0054_the_dispatcher_checks_contracts

CREATE OR REPLACE FUNCTION outbox.claim_one_group_v3(p_worker text, p_lease interval, p_limit integer, p_cap_providers text[], p_caps integer[])
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid, contract_version integer)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_one_group(p_worker, p_lease, p_limit, p_cap_providers, p_caps) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_probe(text,text,interval,text)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.claim_probe(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
BEGIN
    PERFORM outbox.check_worker(p_worker);
    PERFORM outbox.check_between('lease', p_lease, interval '1 millisecond', interval '1 day');
    WITH RECURSIVE
    tenants (tenant_id, n, wrapped) AS (
        SELECT t.tenant_id, 1, t.wrapped FROM (
            (SELECT o.tenant_id, false AS wrapped FROM outbox.operations o
             WHERE o.provider = p_provider AND o.tenant_id > p_after_tenant
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            UNION ALL
            (SELECT o.tenant_id, true FROM outbox.operations o
             WHERE o.provider = p_provider
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            LIMIT 1) t
        UNION ALL
        SELECT nx.tenant_id, t.n + 1, nx.wrapped
        FROM tenants t
        CROSS JOIN LATERAL (
            (SELECT o.tenant_id, t.wrapped AS wrapped FROM outbox.operations o
             WHERE o.provider = p_provider AND o.tenant_id > t.tenant_id
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            UNION ALL
            (SELECT o.tenant_id, true FROM outbox.operations o
             WHERE NOT t.wrapped AND o.provider = p_provider
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
             ORDER BY o.provider, o.tenant_id, o.available_at, o.id LIMIT 1)
            LIMIT 1) nx
        -- Up to five tenants, and once around at most.
        WHERE t.n < 5 AND NOT (nx.wrapped AND nx.tenant_id > p_after_tenant)
    ),
    near AS (
        SELECT DISTINCT ON (c.id) c.id, t.n, c.failed, c.newest, c.handed_back, c.last_attempt_at
        FROM tenants t
        CROSS JOIN LATERAL (
            (SELECT x.* FROM (
                 SELECT o.id, o.attempts > o.attempt_base AS failed, true AS newest,
                        o.last_attempt_at IS NOT NULL AS handed_back, o.last_attempt_at
                 FROM outbox.operations o
                 WHERE o.provider = p_provider AND o.tenant_id = t.tenant_id
                   AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
                   AND o.available_at <= now()
                 ORDER BY o.available_at DESC, o.id DESC LIMIT 200) x
             -- Retries come due after their backoff, so the newest by due time are often rows
             -- that just failed: the ten newest that have not.
             WHERE NOT x.failed LIMIT 10)
            UNION ALL
            (SELECT o.id, o.attempts > o.attempt_base, false, o.last_attempt_at IS NOT NULL,
                    o.last_attempt_at
             FROM outbox.operations o
             WHERE o.provider = p_provider AND o.tenant_id = t.tenant_id
               AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
               AND o.available_at <= now()
             ORDER BY o.available_at, o.id LIMIT 10)
        ) c
    ),
    picked AS (
        SELECT ARRAY(
            SELECT near.id FROM near
            ORDER BY near.failed, CASE WHEN near.failed THEN near.last_attempt_at END NULLS FIRST,
                     near.newest DESC, near.handed_back DESC, near.n, random()
            LIMIT 20) AS ids
    ),
    due AS (
        SELECT o.id FROM outbox.operations o, picked
        WHERE o.id = ANY (picked.ids)
          AND o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
        ORDER BY array_position(picked.ids, o.id)
        LIMIT 1
        FOR UPDATE OF o SKIP LOCKED
    )
    SELECT array_agg(id) INTO v_ids FROM due;
    RETURN QUERY SELECT * FROM outbox.lease_claimed(v_ids, p_worker, p_lease);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_probe_v2(text,text,interval,text)
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE OR REPLACE FUNCTION outbox.claim_probe_v2(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_probe(p_worker, p_provider, p_lease, p_after_tenant) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.claim_probe_v3(text,text,interval,text)
-- history: created by 0054_the_dispatcher_checks_contracts

CREATE OR REPLACE FUNCTION outbox.claim_probe_v3(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid, contract_version integer)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_rows outbox.claimed_row[];
BEGIN
    SELECT array_agg((c.id, c.tenant_id, c.operation_type, c.operation_key, c.provider, c.action,
                      c.payload, c.payload_bytes, c.payload_limit, c.idempotency_key,
                      c.correlation_id, c.traceparent, c.attempts, c.attempt_base,
                      c.max_attempts, c.lease_token, c.first_sent_at, c.created_at, c.claimed_at,
                      c.api_version)::outbox.claimed_row ORDER BY c.n) INTO v_rows
    FROM outbox.claim_probe(p_worker, p_provider, p_lease, p_after_tenant) WITH ORDINALITY AS c (
        id, tenant_id, operation_type, operation_key, provider, action, payload, payload_bytes,
        payload_limit, idempotency_key, correlation_id, traceparent, attempts, attempt_base,
        max_attempts, lease_token, first_sent_at, created_at, claimed_at, api_version, n);
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.contract_aliases_kept()
-- history: created by 0055_contract_aliases
-- fired by trigger contract_aliases_kept ON outbox.contract_aliases
-- fired by trigger contract_aliases_no_truncate ON outbox.contract_aliases

CREATE OR REPLACE FUNCTION outbox.contract_aliases_kept()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'a contract alias is kept: the operations enqueued under it read its contracts'
        USING ERRCODE = 'OB005';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.contract_type_of(text)
-- history: created by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.contract_type_of(operation_type text)
 RETURNS text
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT coalesce((SELECT a.operation_type FROM outbox.contract_aliases a
                     WHERE a.alias = contract_type_of.operation_type),
                    contract_type_of.operation_type)
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.contracts_keep_published()
-- history: created by 0052_operation_contracts
-- fired by trigger contracts_keep_published ON outbox.contracts
-- fired by trigger contracts_no_truncate ON outbox.contracts

CREATE OR REPLACE FUNCTION outbox.contracts_keep_published()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'published contracts are kept: retire them instead'
            USING ERRCODE = 'OB005';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'a published contract is kept: retire it instead (%/v%)',
            OLD.operation_type, OLD.version USING ERRCODE = 'OB005';
    END IF;
    IF (NEW.operation_type, NEW.version, NEW.canonical, NEW.digest, NEW.published_at,
        NEW.published_by)
       IS DISTINCT FROM (OLD.operation_type, OLD.version, OLD.canonical, OLD.digest,
                         OLD.published_at, OLD.published_by) THEN
        RAISE EXCEPTION 'a published contract never changes (%/v%): publish a new version',
            OLD.operation_type, OLD.version USING ERRCODE = 'OB005';
    END IF;
    RETURN NEW;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.defer_check(bigint,interval,interval)
-- history: created by 0013_claim_checks; changed by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.defer_check(operation_id bigint, recheck_after interval, retry_in interval)
 RETURNS void
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.check_between('recheck_after', defer_check.recheck_after, interval '0',
                                interval '366 days'),
           outbox.check_between('retry_in', defer_check.retry_in, interval '0',
                                interval '31 days');
    UPDATE outbox.operations o
    SET checked_at = now() - defer_check.recheck_after + defer_check.retry_in
    WHERE o.id = defer_check.operation_id AND o.status = 'reconciling';
$function$;
COMMENT ON FUNCTION outbox.defer_check(bigint,interval,interval) IS 'After a failed lookup: the operation is due for another check after retry_in.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.defer_check(bigint,interval,interval,integer,integer)
-- history: created by 0020_fenced_defer_check; changed by
--     0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.defer_check(operation_id bigint, recheck_after interval, retry_in interval, expected_generation integer, expected_attempts integer)
 RETURNS boolean
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.check_between('recheck_after', defer_check.recheck_after, interval '0',
                                interval '366 days'),
           outbox.check_between('retry_in', defer_check.retry_in, interval '0',
                                interval '31 days');
    WITH deferred AS (
        UPDATE outbox.operations o
        SET checked_at = now() - defer_check.recheck_after + defer_check.retry_in
        WHERE o.id = defer_check.operation_id AND o.status = 'reconciling'
          AND o.key_generation = defer_check.expected_generation
          AND o.attempts = defer_check.expected_attempts
        RETURNING 1
    )
    SELECT EXISTS (SELECT FROM deferred)
$function$;
COMMENT ON FUNCTION outbox.defer_check(bigint,interval,interval,integer,integer) IS 'After a failed lookup: the operation is due for another check after retry_in, if it is still in the episode the check was taken in (then true).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.derive_idempotency_key(text,text,text)
-- history: created by 0004_enqueue; changed by 0011_security_definer,
--     0041_derived_keys_hold_a_secret

CREATE OR REPLACE FUNCTION outbox.derive_idempotency_key(tenant_id text, operation_type text, operation_key text)
 RETURNS text
 LANGUAGE sql
 STABLE STRICT
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT 'ob2_' || encode(sha256(i.key_secret || sha256(i.key_secret || convert_to(
               jsonb_build_array(tenant_id, operation_type, operation_key)::text, 'UTF8'))),
               'hex')
    FROM outbox.installation i
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.enqueue(text,text,text,text,text,jsonb,text,text,timestamp with time zone,integer,text,text,integer)
-- history: created by 0053_contracts_at_enqueue; changed by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.enqueue(tenant_id text, operation_type text, operation_key text, provider text, action text, payload jsonb, correlation_id text DEFAULT NULL::text, idempotency_key text DEFAULT NULL::text, available_at timestamp with time zone DEFAULT NULL::timestamp with time zone, max_attempts integer DEFAULT NULL::integer, traceparent text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract_version integer DEFAULT NULL::integer)
 RETURNS TABLE(operation_id bigint, outcome text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
DECLARE
    v_payload_text text;
    v_bytes        integer;
    v_max_bytes    integer;
    v_max_values   integer;
    v_values       integer;
    v_available_at timestamptz;
    v_fingerprint  bytea;
    v_id           bigint;
    v_existing     bytea;
    v_existing_version integer;
    v_contract     text;
    v_contract_type text;
    v_isolated     boolean;
    v_key          text;
    v_secret       bytea;
    v_new          bigint;
    v_holder_tenant text;
BEGIN
    -- The tenant check (require_tenant, 0011), as in 0017: skipped for the tenant this
    -- transaction bound (bound_tenant(), 0038: a value from an earlier transaction is none).
    IF (CASE WHEN current_setting('outbox.tenant_bound_at', true)
                  = to_char(transaction_timestamp() AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS')
             THEN nullif(current_setting('outbox.tenant_id', true), '') END)
           IS DISTINCT FROM tenant_id
       AND btrim(tenant_id) <> '' THEN
        SELECT c.relrowsecurity INTO v_isolated FROM pg_catalog.pg_class c
        WHERE c.oid = 'outbox.operations'::regclass;
        IF v_isolated THEN
            PERFORM outbox.require_tenant(tenant_id);  -- raises its 42501
        END IF;
    END IF;

    -- check_text's conditions on every text field at once, as in 0017; the characters no
    -- identity may hold (check_text, above) by one match over all seven fields together.
    IF (    tenant_id IS NOT NULL AND btrim(tenant_id) <> '' AND char_length(tenant_id) <= 128
        AND operation_type IS NOT NULL AND btrim(operation_type) <> ''
            AND char_length(operation_type) <= 128
        AND operation_key IS NOT NULL AND btrim(operation_key) <> ''
            AND char_length(operation_key) <= 255
        AND provider IS NOT NULL AND btrim(provider) <> '' AND char_length(provider) <= 64
        AND action IS NOT NULL AND btrim(action) <> '' AND char_length(action) <= 128
        AND (correlation_id IS NULL
             OR (btrim(correlation_id) <> '' AND char_length(correlation_id) <= 255))
        AND (ordering_key IS NULL
             OR (btrim(ordering_key) <> '' AND char_length(ordering_key) <= 255))
        -- No space of any kind (Unicode's Zs) at either end of a field: between the fields'
        -- ends, U+0001 (refused in any field, so no field holds it here).
        AND (E'\x01' || tenant_id || E'\x01' || operation_type || E'\x01' || operation_key
             || E'\x01' || provider || E'\x01' || action || E'\x01'
             || coalesce(correlation_id, '') || E'\x01' || coalesce(ordering_key, '') || E'\x01')
            !~ '\x01[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]|[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]\x01'
        AND (tenant_id || operation_type || operation_key || provider || action
             || coalesce(correlation_id, '') || coalesce(ordering_key, ''))
            !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]'
       ) IS NOT TRUE THEN
        PERFORM outbox.check_text('tenant_id', tenant_id, 128);
        PERFORM outbox.check_text('operation_type', operation_type, 128);
        PERFORM outbox.check_text('operation_key', operation_key, 255);
        PERFORM outbox.check_text('provider', provider, 64);
        PERFORM outbox.check_text('action', action, 128);
        PERFORM outbox.check_text('correlation_id', correlation_id, 255, false);
        PERFORM outbox.check_text('ordering_key', ordering_key, 255, false);
        PERFORM outbox.check_ends('tenant_id', tenant_id);
        PERFORM outbox.check_ends('operation_type', operation_type);
        PERFORM outbox.check_ends('operation_key', operation_key);
        PERFORM outbox.check_ends('provider', provider);
        PERFORM outbox.check_ends('action', action);
        PERFORM outbox.check_ends('correlation_id', correlation_id);
        PERFORM outbox.check_ends('ordering_key', ordering_key);
    END IF;

    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload is required' USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    IF jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object, not %', jsonb_typeof(payload)
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    v_payload_text := payload::text;
    v_bytes := octet_length(v_payload_text);
    -- outbox.limits is read only for a payload over the least limit it can hold (4 KiB).
    IF v_bytes > 4096 THEN
        SELECT l.max_payload_bytes, l.max_payload_elements INTO v_max_bytes, v_max_values
        FROM outbox.limits l;
        v_max_bytes := coalesce(v_max_bytes, 1048576);  -- the row deleted: the defaults
        v_max_values := coalesce(v_max_values, 100000);
        IF v_bytes > v_max_bytes THEN
            RAISE EXCEPTION 'payload is % bytes of JSON; at most % are allowed',
                v_bytes, v_max_bytes
                USING ERRCODE = 'OB002', COLUMN = 'payload',
                      HINT = 'the limit is outbox.limits.max_payload_bytes, set by the owner '
                             'of the outbox schema';
        END IF;
    END IF;
    -- What the dispatcher could not carry (outbox/payloads.py): first the depth, so that the
    -- number check never walks a document nested absurdly deep.
    IF jsonb_path_exists(payload,
                         'strict $.**{64} ? (@.type() == "object" || @.type() == "array")') THEN
        RAISE EXCEPTION 'payload nests objects and arrays deeper than 64 levels'
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    -- Its values, the payload object included (0037). Each takes two bytes of the text at the
    -- least ("0," and "[]" alike; PostgreSQL writes ", " between them), so only a payload of
    -- twice the limit's bytes can hold too many. Of those, only one whose commas and opening
    -- brackets outnumber the limit is counted (each value but the first of its container
    -- follows a comma; a container's first, its bracket); the rest are ordinary data.
    IF v_bytes > 4096 AND v_bytes >= 2 * v_max_values
       AND v_bytes - octet_length(translate(v_payload_text, ',[{', '')) >= v_max_values THEN
        v_values := jsonb_array_length(jsonb_path_query_array(payload, 'strict $.**.type()'));
        IF v_values > v_max_values THEN
            RAISE EXCEPTION 'payload holds % JSON values (objects, arrays, strings, numbers, '
                            'booleans and nulls, itself included); at most % are allowed',
                v_values, v_max_values
                USING ERRCODE = 'OB002', COLUMN = 'payload',
                      HINT = 'the limit is outbox.limits.max_payload_elements, set by the owner '
                             'of the outbox schema';
        END IF;
    END IF;
    IF jsonb_path_exists(payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 1e100 || @ <= -1e100))')
    THEN
        RAISE EXCEPTION 'payload holds a number of 1e100 or more in magnitude; at most 100 '
                        'digits before the decimal point are allowed'
            USING ERRCODE = 'OB002', COLUMN = 'payload',
                  HINT = 'send such a value as a string';
    END IF;
    -- Visible ASCII only: the key travels in an HTTP header and Stripe allows 255 characters.
    IF idempotency_key IS NOT NULL AND idempotency_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'idempotency_key must be 1 to 255 visible ASCII characters without spaces'
            USING ERRCODE = 'OB002', COLUMN = 'idempotency_key';
    END IF;
    -- outbox's own keys: derived ones (ob1_ and a hash anyone can compute of an identity,
    -- before 0041; ob2_ since, and any ob<N>_ to come), and the later generations of any key
    -- (:r2...). A caller taking one would occupy the key of an operation not enqueued yet, or
    -- of a reconcile retry. In any case (0036): a provider that compares keys without regard
    -- to case takes OB1_... for ob1_....
    IF idempotency_key ~* '^ob[0-9]+_' OR idempotency_key ~* ':r[0-9]+$' THEN
        RAISE EXCEPTION 'idempotency_key may not begin with ob<digits>_ (ob1_, ob2_) or end '
                        'with :r and a number, '
                        'in any case: outbox keeps those forms for the keys it makes'
            USING ERRCODE = 'OB002', COLUMN = 'idempotency_key';
    END IF;
    -- The derived key mixes in this installation's secret (0041): no one who knows only the
    -- identity can compute it, and two databases never derive the same key.
    IF idempotency_key IS NULL THEN
        SELECT i.key_secret INTO v_secret FROM outbox.installation i;
        IF v_secret IS NULL THEN
            RAISE EXCEPTION 'outbox.installation has no key secret'
                USING ERRCODE = '55000',
                      HINT = 'the schema owner restores its row from a backup of this database '
                             '(docs/operations.md, "Derived keys")';
        END IF;
        v_key := 'ob2_' || encode(sha256(v_secret || sha256(v_secret || convert_to(
                     jsonb_build_array(tenant_id, operation_type, operation_key)::text,
                     'UTF8'))), 'hex');
    ELSE
        v_key := idempotency_key;
    END IF;
    IF max_attempts IS NOT NULL AND max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts must be at least 1, not %', max_attempts
            USING ERRCODE = 'OB002', COLUMN = 'max_attempts';
    END IF;
    IF max_attempts > 1000 THEN
        RAISE EXCEPTION 'max_attempts may be at most 1000, not %', max_attempts
            USING ERRCODE = 'OB002', COLUMN = 'max_attempts';
    END IF;
    IF available_at IS NOT NULL
       AND (NOT isfinite(available_at) OR available_at > now() + interval '10 years') THEN
        RAISE EXCEPTION 'available_at must be a finite time at most 10 years ahead, not %',
            available_at
            USING ERRCODE = 'OB002', COLUMN = 'available_at';
    END IF;
    v_available_at := greatest(coalesce(available_at, now()), now());
    IF traceparent IS NOT NULL
       AND traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION 'traceparent must be a W3C trace context header value'
            USING ERRCODE = 'OB002', COLUMN = 'traceparent';
    END IF;

    -- What this tenant may enqueue, where an operator said so (enqueue_allowances).
    IF EXISTS (SELECT FROM outbox.enqueue_allowances) THEN
        PERFORM outbox.require_allowance(tenant_id, provider, action);
    END IF;

    -- The contract (sql/0052, 0053): a type with contracts names a published version that is
    -- not retired. The payload's check against the schema is the Python API's before the row
    -- exists and the dispatcher's before the first send: this server has no JSON Schema. A
    -- renamed type's old name reads the new name's contracts (contract_aliases, 0055); its
    -- requirement is mirrored under its own name, so an enqueue without a version reads one
    -- row, as before aliases.
    IF contract_version IS NULL THEN
        IF EXISTS (SELECT FROM outbox.contract_types t
                   WHERE t.operation_type = operation_type AND t.versions_required) THEN
            RAISE EXCEPTION 'operation type % has contracts: name its contract_version',
                operation_type
                USING ERRCODE = 'OB009', COLUMN = 'contract_version';
        END IF;
    ELSE
        v_contract_type := coalesce((SELECT a.operation_type FROM outbox.contract_aliases a
                                     WHERE a.alias = operation_type), operation_type);
        SELECT c.state INTO v_contract FROM outbox.contracts c
        WHERE c.operation_type = v_contract_type AND c.version = contract_version;
        IF v_contract IS NULL THEN
            RAISE EXCEPTION 'no contract %/v% is published', operation_type, contract_version
                USING ERRCODE = 'OB009', COLUMN = 'contract_version',
                      HINT = 'publish it first: outbox contracts push DIR';
        END IF;
        IF v_contract = 'retired' THEN
            RAISE EXCEPTION 'contract %/v% is retired: enqueue under an active version',
                operation_type, contract_version
                USING ERRCODE = 'OB009', COLUMN = 'contract_version';
        END IF;
    END IF;

    v_fingerprint := sha256(convert_to(provider || E'\n' || action || E'\n' || v_payload_text
                                       || coalesce(E'\n' || ordering_key, ''), 'UTF8'));

    -- The keys row first (sql/0051): its ON CONFLICT answers both rules, the identity and the
    -- provider's key (operation_keys_provider_key), before the operation exists. Bounded: a
    -- holder that vanishes between the insert and the look-up (deleted) is looked for again
    -- twice, then the caller retries (40001), rather than spinning here.
    FOR v_round IN 1..3 LOOP
        v_new := nextval('outbox.operations_id_seq');
        INSERT INTO outbox.operation_keys AS k (
            tenant_id, operation_type, operation_key, operation_id, provider, idempotency_key
        ) VALUES (tenant_id, operation_type, operation_key, v_new, provider, v_key)
        ON CONFLICT DO NOTHING
        RETURNING k.operation_id INTO v_id;

        IF v_id IS NOT NULL THEN
            INSERT INTO outbox.operations AS o (
                id, tenant_id, operation_type, operation_key, fingerprint, provider, action,
                payload, idempotency_key, correlation_id, traceparent, max_attempts,
                available_at, scheduled, payload_bytes, ordering_key, ordering_blocked,
                contract_version
            ) OVERRIDING SYSTEM VALUE VALUES (
                v_id, tenant_id, operation_type, operation_key, v_fingerprint, provider, action,
                payload, v_key, correlation_id, traceparent, max_attempts, v_available_at,
                -- Not due yet: out of the claim index until a dispatcher stages it.
                v_available_at > now(), v_bytes,
                ordering_key, ordering_key IS NOT NULL, contract_version
            );
            IF ordering_key IS NOT NULL THEN
                -- Its turn is taken at COMMIT, with this transaction's other keys (take_turn).
                INSERT INTO outbox.ordering_turns AS t (xid, tenant_id, ordering_key)
                VALUES (pg_current_xact_id(), tenant_id, ordering_key) ON CONFLICT DO NOTHING;
            END IF;
            operation_id := v_id;
            outcome := 'accepted';
            RETURN NEXT;
            RETURN;
        END IF;

        -- This identity's operation: the same tenant's, so visible under row-level security.
        SELECT k.operation_id, o.fingerprint, o.contract_version
        INTO v_id, v_existing, v_existing_version
        FROM outbox.operation_keys k
        JOIN outbox.operations o ON o.id = k.operation_id
        WHERE k.tenant_id = tenant_id
          AND k.operation_type = operation_type
          AND k.operation_key = operation_key;

        IF v_id IS NOT NULL THEN
            IF v_existing <> v_fingerprint THEN
                RAISE EXCEPTION 'operation %/%/% already exists with another provider, action or payload',
                    tenant_id, operation_type, operation_key
                    USING ERRCODE = 'OB001',
                          DETAIL = format('existing operation id: %s', v_id),
                          HINT = 'a different intent needs its own operation_key';
            END IF;
            IF v_existing_version IS DISTINCT FROM contract_version THEN
                RAISE EXCEPTION 'operation %/%/% already exists under contract version %',
                    tenant_id, operation_type, operation_key,
                    coalesce(v_existing_version::text, 'none')
                    USING ERRCODE = 'OB001', COLUMN = 'contract_version',
                          DETAIL = format('existing operation id: %s', v_id),
                          HINT = 'the same key under another version is another intent';
            END IF;
            operation_id := v_id;
            outcome := 'duplicate';
            RETURN NEXT;
            RETURN;
        END IF;

        -- Not this identity: its key names another operation at the provider, whose answers
        -- this one would be given (or refused with). Read from the keys, which row-level
        -- security does not hide: the holder may be another tenant's. Its id only to the same
        -- tenant.
        SELECT k.operation_id, k.tenant_id INTO v_id, v_holder_tenant
        FROM outbox.operation_keys k
        WHERE k.provider = provider AND k.idempotency_key = v_key;
        IF v_id IS NOT NULL THEN
            RAISE EXCEPTION 'idempotency_key % already names another operation of provider %',
                v_key, provider
                USING ERRCODE = 'OB001', COLUMN = 'idempotency_key',
                      DETAIL = CASE WHEN v_holder_tenant = tenant_id
                                    THEN format('existing operation id: %s', v_id)
                                    ELSE 'it belongs to another tenant' END,
                      HINT = 'a key is sent to the provider as it is: each operation needs its own';
        END IF;
    END LOOP;
    RAISE EXCEPTION 'operation %/%/% conflicted with an operation that was deleted meanwhile, '
                    'three times', tenant_id, operation_type, operation_key
        USING ERRCODE = '40001', HINT = 'retry the transaction';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.expire_stray_leases(text,uuid[],timestamp with time zone)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.expire_stray_leases(p_worker text, p_held uuid[], p_since timestamp with time zone)
 RETURNS SETOF bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM outbox.check_worker(p_worker);
    RETURN QUERY
    UPDATE outbox.operations AS o
    SET lease_expires_at = now() - interval '1 millisecond'
    WHERE o.status = 'in_flight' AND o.lease_owner = p_worker
      AND o.lease_token <> ALL (p_held)
      AND o.last_attempt_at < p_since
    RETURNING o.id;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.get_contract(text,integer)
-- history: created by 0052_operation_contracts; changed by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.get_contract(operation_type text, version integer)
 RETURNS TABLE(canonical text, digest text, state text)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT c.canonical, c.digest, c.state FROM outbox.contracts c
    WHERE c.operation_type = outbox.contract_type_of(get_contract.operation_type)
      AND c.version = get_contract.version
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.get_operation(text,text,text)
-- history: created by 0004_enqueue; changed by 0011_security_definer,
--     0051_keys_apart_from_the_operation, 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.get_operation(tenant_id text, operation_type text, operation_key text)
 RETURNS TABLE(operation_id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, status text, status_reason text, attempts integer, provider_ref text, result jsonb, last_error text, last_error_class text, idempotency_key text, correlation_id text, created_at timestamp with time zone, updated_at timestamp with time zone, available_at timestamp with time zone, finished_at timestamp with time zone, contract_version integer)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.require_tenant(get_operation.tenant_id);
    SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action, o.status,
           o.status_reason, o.attempts, o.provider_ref, o.result, o.last_error, o.last_error_class,
           o.idempotency_key, o.correlation_id, o.created_at, o.updated_at, o.available_at,
           o.finished_at, o.contract_version
    FROM outbox.operation_keys k
    JOIN outbox.operations o ON o.id = k.operation_id
    WHERE k.tenant_id = get_operation.tenant_id
      AND k.operation_type = get_operation.operation_type
      AND k.operation_key = get_operation.operation_key
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_admit(text,text,text,text,bytea)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_admit(tenant_id text, handler text, key text, body_json text, body_raw bytea)
 RETURNS bytea
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_bound text := outbox.bound_tenant();
BEGIN
    PERFORM outbox.check_text('tenant_id', tenant_id, 128);
    PERFORM outbox.check_text('key', key, 512);
    IF handler IS NULL OR handler !~ '^[a-z0-9][a-z0-9._-]{0,127}$' THEN
        RAISE EXCEPTION 'handler must be 1 to 128 of a-z, 0-9, ".", "_" and "-", starting with a '
                        'letter or digit' USING ERRCODE = 'OB002', COLUMN = 'handler';
    END IF;
    IF (body_json IS NULL) = (body_raw IS NULL) THEN
        RAISE EXCEPTION 'exactly one of body_json and body_raw is given' USING ERRCODE = '22023';
    END IF;
    IF coalesce(octet_length(body_json), octet_length(body_raw)) > 16777216 THEN
        RAISE EXCEPTION 'a body may be at most 16 MiB' USING ERRCODE = '22023';
    END IF;
    IF v_bound IS NOT NULL AND v_bound <> tenant_id THEN
        RAISE EXCEPTION 'this transaction is bound to another tenant'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    PERFORM outbox.bind_tenant(tenant_id);
    RETURN CASE WHEN body_json IS NOT NULL
                THEN sha256(convert_to(body_json::jsonb::text, 'UTF8'))
                ELSE sha256(body_raw) END;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_begin(text,text,text,text,bytea,interval,interval,uuid,bytea,text,text,text,text)
-- history: created by 0056_the_inbox_compares_contracts

CREATE OR REPLACE FUNCTION outbox.inbox_begin(tenant_id text, handler text, key text, body_json text, body_raw bytea, wait interval, retention interval, origin uuid DEFAULT NULL::uuid, fingerprint bytea DEFAULT NULL::bytea, provider text DEFAULT NULL::text, action text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract text DEFAULT NULL::text, OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer, OUT response_headers jsonb, OUT response_body bytea)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    -- bind_tenant's and bound_tenant's mark of this transaction (0038).
    v_stamp       text := to_char(transaction_timestamp() AT TIME ZONE 'UTC',
                                  'YYYYMMDDHH24MISSUS');
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    -- The common case in one test (the header says why and that it matches the helpers).
    IF coalesce(wait BETWEEN interval '0' AND interval '60 seconds'
                AND retention BETWEEN interval '1 hour' AND interval '400 days'
                AND btrim(tenant_id) <> '' AND char_length(tenant_id) <= 128
                AND btrim(key) <> '' AND char_length(key) <= 512
                AND char_length(handler) <= 128 AND handler ~ '^[a-z0-9][a-z0-9._-]*$'
                AND (body_json IS NULL) <> (body_raw IS NULL)
                AND coalesce(octet_length(body_json), octet_length(body_raw)) <= 16777216
                AND (tenant_id || key) !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]'
                AND (current_setting('outbox.tenant_bound_at', true) IS DISTINCT FROM v_stamp
                     OR coalesce(nullif(current_setting('outbox.tenant_id', true), ''), tenant_id)
                        = tenant_id),
                false) THEN
        PERFORM set_config('outbox.tenant_id', tenant_id, true),
                set_config('outbox.tenant_bound_at', v_stamp, true);
        v_digest := CASE WHEN body_json IS NOT NULL
                         THEN sha256(convert_to(body_json::jsonb::text, 'UTF8'))
                         ELSE sha256(body_raw) END;
    ELSE
        -- Raises what is wrong, in the order 0042 checked it.
        PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
        PERFORM outbox.check_between('retention', retention, interval '1 hour',
                                     interval '400 days');
        v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    END IF;
    IF contract IS NOT NULL THEN  -- "<type>/v<N>", as outbox.inbox.http reads Outbox-Contract
        PERFORM outbox.check_text('contract', contract, 160);
    END IF;
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key, body_raw);
    END IF;
    -- The lock of the key, whatever the origin: a delivery from a sender that names it and one
    -- from a sender that does not must not both miss the other's uncommitted record.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || key);
    -- Nested, not AND: SQL does not promise to evaluate the cheap test first.
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN  -- 2828 = 0x0B0C
        IF NOT outbox.inbox_wait_lock(v_lock, wait) THEN
            -- The first delivery's transaction still holds the identity.
            decision := 'in_progress';
            RETURN;
        END IF;
    END IF;

    -- A record deleted between the INSERT and the SELECT (pruned or forgotten): try again.
    FOR attempt IN 1..3 LOOP
        IF left(key, 3) = 'op:' THEN  -- only an operation's record crosses origins
            r := outbox.inbox_of_operation(tenant_id, handler, key, v_origin, v_digest, false);
        END IF;
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, origin, state, body_digest,
                                           fingerprint, contract, token, expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'in_progress', v_digest, v_fingerprint,
                    contract, gen_random_uuid(), now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token INTO inbox_id, token;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_begin.tenant_id AND i.handler = inbox_begin.handler
              AND i.key = inbox_begin.key AND i.origin = v_origin;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        -- Another contract is another intent, where both name one (as with fingerprints).
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint
           OR r.contract <> inbox_begin.contract THEN
            PERFORM outbox.inbox_count_conflict(r.id, v_digest);
            decision := 'conflict';
            RETURN;
        END IF;
        IF r.state = 'completed' THEN
            decision := 'replayed';
            response_status := r.response_status;
            response_headers := r.response_headers;
            response_body := r.response_body;
            RETURN;
        END IF;
        -- An external claim: still leased, or abandoned for a person.
        decision := CASE WHEN r.state = 'abandoned' THEN 'abandoned' ELSE 'in_progress' END;
        RETURN;
    END LOOP;
    decision := 'in_progress';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_claim(text,text,text,text,bytea,interval,integer,interval,uuid,bytea,text,text,text,text)
-- history: created by 0056_the_inbox_compares_contracts

CREATE OR REPLACE FUNCTION outbox.inbox_claim(tenant_id text, handler text, key text, body_json text, body_raw bytea, lease interval, max_claims integer, retention interval, origin uuid DEFAULT NULL::uuid, fingerprint bytea DEFAULT NULL::bytea, provider text DEFAULT NULL::text, action text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract text DEFAULT NULL::text, OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT claims integer, OUT downstream_key text, OUT retry_after interval, OUT response_status integer, OUT response_headers jsonb, OUT response_body bytea)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    PERFORM outbox.check_count('max_claims', max_claims, 1, 100);
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    IF contract IS NOT NULL THEN  -- "<type>/v<N>", as outbox.inbox.http reads Outbox-Contract
        PERFORM outbox.check_text('contract', contract, 160);
    END IF;
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key, body_raw);
    END IF;
    -- Claims hold it for their one statement: a minute is far past any of them.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || key);
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN
        IF NOT outbox.inbox_wait_lock(v_lock, interval '1 minute') THEN
            decision := 'in_progress';
            retry_after := interval '1 second';
            RETURN;
        END IF;
    END IF;

    FOR attempt IN 1..3 LOOP
        r := outbox.inbox_of_operation(tenant_id, handler, key, v_origin, v_digest, true);
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, origin, mode, state,
                                           body_digest, fingerprint, contract, token,
                                           lease_expires_at, expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'external', 'in_progress', v_digest,
                    v_fingerprint, contract, gen_random_uuid(), now() + lease, now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token, i.claims INTO inbox_id, token, claims;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                downstream_key := outbox.inbox_downstream_key(tenant_id, handler, key, v_origin);
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_claim.tenant_id AND i.handler = inbox_claim.handler
              AND i.key = inbox_claim.key AND i.origin = v_origin
            FOR UPDATE;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        claims := r.claims;
        downstream_key := outbox.inbox_downstream_key(r.tenant_id, r.handler, r.key, r.origin);
        -- Another contract is another intent, where both name one (as with fingerprints).
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint
           OR r.contract <> inbox_claim.contract THEN
            PERFORM outbox.inbox_count_conflict(r.id, v_digest);
            decision := 'conflict';
            RETURN;
        END IF;
        IF r.state = 'completed' THEN
            decision := 'replayed';
            response_status := r.response_status;
            response_headers := r.response_headers;
            response_body := r.response_body;
            RETURN;
        END IF;
        IF r.state = 'abandoned' THEN
            decision := 'abandoned';
            RETURN;
        END IF;
        IF r.lease_expires_at > now() THEN
            decision := 'in_progress';
            retry_after := r.lease_expires_at - now();
            RETURN;
        END IF;
        -- Only a lease that ran out counts toward abandoning (0042).
        IF r.lease_expires_at IS NOT NULL AND r.claims >= max_claims THEN
            UPDATE outbox.inbox i SET state = 'abandoned', abandoned_at = now(),
                   lease_expires_at = NULL
            WHERE i.id = r.id;
            decision := 'abandoned';
            RETURN;
        END IF;
        UPDATE outbox.inbox i
        SET claims = CASE WHEN r.lease_expires_at IS NULL THEN greatest(r.claims, 1)
                          ELSE r.claims + 1 END,
            token = gen_random_uuid(), lease_expires_at = now() + lease
        WHERE i.id = r.id
        RETURNING i.token, i.claims INTO token, claims;
        decision := 'reclaimed';
        RETURN;
    END LOOP;
    decision := 'in_progress';
    retry_after := interval '1 second';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_complete(bigint,uuid,integer,jsonb,bytea)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_complete(inbox_id bigint, token uuid, status integer, headers jsonb, body bytea)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF status IS NULL OR status NOT BETWEEN 200 AND 499 THEN
        RAISE EXCEPTION 'only a 2xx, 3xx or 4xx outcome is recorded, not %', status
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(headers) IS DISTINCT FROM 'array' OR jsonb_array_length(headers) > 64
       OR octet_length(headers::text) > 16384
       OR EXISTS (SELECT FROM jsonb_array_elements(headers) h
                  WHERE jsonb_typeof(h) <> 'array' OR jsonb_array_length(h) <> 2
                     OR jsonb_typeof(h -> 0) <> 'string' OR jsonb_typeof(h -> 1) <> 'string') THEN
        RAISE EXCEPTION 'headers are at most 64 [name, value] pairs of strings, 16 KiB in all'
            USING ERRCODE = '22023';
    END IF;
    IF body IS NULL OR octet_length(body) > 1048576 THEN
        RAISE EXCEPTION 'a recorded body is given and at most 1 MiB' USING ERRCODE = '22023';
    END IF;
    -- The tenant too, explicitly: an owner that is a superuser or BYPASSRLS skips the
    -- policies of roles_tenant_rls.sql (as 0011 says of enqueue).
    UPDATE outbox.inbox i
    SET state = 'completed', completed_at = now(), response_status = status,
        response_headers = headers, response_body = body, lease_expires_at = NULL
    WHERE i.id = inbox_complete.inbox_id AND i.token = inbox_complete.token
      AND i.state = 'in_progress' AND i.tenant_id = outbox.bound_tenant();
    RETURN FOUND;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_count_conflict(bigint,bytea)
-- history: created by 0042_inbox; changed by 0043_inbox_conflicts_bounded

CREATE OR REPLACE FUNCTION outbox.inbox_count_conflict(inbox_id bigint, digest bytea)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest bytea := digest;
BEGIN
    IF NOT EXISTS (SELECT FROM outbox.inbox_conflicts c
                   WHERE c.inbox_id = inbox_count_conflict.inbox_id AND c.body_digest = digest)
       AND (SELECT count(*) FROM (SELECT FROM outbox.inbox_conflicts c
                                  WHERE c.inbox_id = inbox_count_conflict.inbox_id
                                  LIMIT 32) AS kept) >= 32 THEN
        v_digest := '\x'::bytea;  -- the overflow row: 'other bodies'
    END IF;
    INSERT INTO outbox.inbox_conflicts AS c (inbox_id, body_digest)
    VALUES (inbox_count_conflict.inbox_id, v_digest)
    ON CONFLICT ON CONSTRAINT inbox_conflicts_pkey
    DO UPDATE SET seen = c.seen + 1, last_seen_at = now();
END;
$function$;
COMMENT ON FUNCTION outbox.inbox_count_conflict(bigint,bytea) IS 'Counts a conflicting delivery against its record: at most 32 distinct bodies, then one overflow row (sql/0043).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_downstream_key(text,text,text,uuid)
-- history: created by 0048_the_origin_is_part_of_the_identity

CREATE OR REPLACE FUNCTION outbox.inbox_downstream_key(tenant_id text, handler text, key text, origin uuid)
 RETURNS text
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT 'ib1_' || encode(sha256(s.key_secret || sha256(s.key_secret || convert_to(
               -- Qualified: outbox.installation has an origin of its own (0045).
               CASE WHEN inbox_downstream_key.origin = outbox.unnamed_origin()
                    THEN jsonb_build_array(tenant_id, handler, key)
                    ELSE jsonb_build_array(tenant_id, handler, key,
                                           inbox_downstream_key.origin::text) END::text,
               'UTF8'))), 'hex')
    FROM outbox.installation s
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_fail(bigint,uuid,text)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_fail(inbox_id bigint, token uuid, error text)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    UPDATE outbox.inbox i SET lease_expires_at = NULL, last_error = left(error, 200)
    WHERE i.id = inbox_fail.inbox_id AND i.token = inbox_fail.token
      AND i.state = 'in_progress' AND i.mode = 'external';
    RETURN FOUND;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_fingerprint(text,bytea,text,text,text,bytea)
-- history: created by 0048_the_origin_is_part_of_the_identity

CREATE OR REPLACE FUNCTION outbox.inbox_fingerprint(body_json text, fingerprint bytea, provider text, action text, ordering_key text, body_raw bytea)
 RETURNS bytea
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_computed bytea;
BEGIN
    IF fingerprint IS NULL THEN
        RETURN NULL;
    END IF;
    IF provider IS NOT NULL AND action IS NOT NULL AND body_json IS NOT NULL THEN
        v_computed := sha256(convert_to(provider || E'\n' || action || E'\n'
                                        || body_json::jsonb::text
                                        || coalesce(E'\n' || ordering_key, ''), 'UTF8'));
    ELSIF provider IS NOT NULL AND action IS NOT NULL AND body_raw IS NOT NULL THEN
        v_computed := sha256(convert_to(provider || E'\n' || action || E'\n', 'UTF8')
                             || body_raw
                             || convert_to(coalesce(E'\n' || ordering_key, ''), 'UTF8'));
    END IF;
    IF v_computed IS DISTINCT FROM fingerprint THEN
        RAISE EXCEPTION 'the body is not the one its sender enqueued: its fingerprint differs'
            USING ERRCODE = 'OB007',
                  HINT = 'A proxy may have re-encoded the body; outbox sends it as stored.';
    END IF;
    RETURN fingerprint;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_forget(bigint,text,text,boolean)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_forget(inbox_id bigint, reason text, actor text, force boolean)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    r outbox.inbox;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    SELECT * INTO r FROM outbox.inbox i WHERE i.id = inbox_forget.inbox_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox record % does not exist', inbox_id USING ERRCODE = 'no_data_found';
    END IF;
    IF r.response_status < 300 AND NOT coalesce(force, false) THEN
        RAISE EXCEPTION 'inbox record % recorded a success (%): its effect exists, and the next '
                        'delivery would make another', r.id, r.response_status
            USING ERRCODE = 'OB004', HINT = 'forget it anyway with force (--force)';
    END IF;
    DELETE FROM outbox.inbox i WHERE i.id = r.id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, actor, 'inbox_forget', reason,
            jsonb_build_object('inbox_id', r.id, 'tenant_id', r.tenant_id, 'handler', r.handler,
                               'key', r.key, 'state', r.state,
                               'response_status', r.response_status, 'force', force));
    RETURN 'forgotten';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_gauges()
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_gauges()
 RETURNS TABLE(handler text, in_progress bigint, oldest_in_progress interval, abandoned bigint)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT i.handler,
           count(*) FILTER (WHERE i.lease_expires_at IS NOT NULL),
           max(now() - i.created_at) FILTER (WHERE i.lease_expires_at IS NOT NULL),
           count(*) FILTER (WHERE i.abandoned_at IS NOT NULL)
    FROM outbox.inbox i
    WHERE i.lease_expires_at IS NOT NULL OR i.abandoned_at IS NOT NULL
    GROUP BY i.handler
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_of_operation(text,text,text,uuid,bytea,boolean)
-- history: created by 0048_the_origin_is_part_of_the_identity; changed by
--     0049_a_delivery_costs_less

CREATE OR REPLACE FUNCTION outbox.inbox_of_operation(tenant_id text, handler text, key text, origin uuid, digest bytea, for_update boolean)
 RETURNS outbox.inbox
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    r outbox.inbox;
BEGIN
    IF left(key, 3) <> 'op:' THEN
        RETURN NULL;  -- the INSERT finds this origin's record; only operations cross over
    END IF;
    SELECT * INTO r FROM outbox.inbox i
    WHERE i.tenant_id = inbox_of_operation.tenant_id
      AND i.handler = inbox_of_operation.handler AND i.key = inbox_of_operation.key
      AND (i.origin = inbox_of_operation.origin
           OR (i.body_digest = digest
               AND (i.origin = outbox.unnamed_origin())
                   <> (inbox_of_operation.origin = outbox.unnamed_origin())))
    ORDER BY i.origin <> inbox_of_operation.origin, i.id
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF for_update THEN
        -- Locked, then read again: the version another transaction committed while this one
        -- waited for the lock.
        SELECT * INTO r FROM outbox.inbox i WHERE i.id = r.id FOR UPDATE;
    END IF;
    RETURN r;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_outcome_before_commit()
-- history: created by 0042_inbox
-- fired by trigger inbox_outcome_before_commit ON outbox.inbox

CREATE OR REPLACE FUNCTION outbox.inbox_outcome_before_commit()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF EXISTS (SELECT FROM outbox.inbox i WHERE i.id = NEW.id AND i.state = 'in_progress') THEN
        RAISE EXCEPTION 'inbox record % has no outcome at commit', NEW.id
            USING ERRCODE = 'OB006',
                  HINT = 'call outbox.inbox_complete before COMMIT, or roll back';
    END IF;
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_prune(integer)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_prune(batch integer)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_count integer;
BEGIN
    PERFORM outbox.check_count('batch', batch, 1, 10000);
    DELETE FROM outbox.inbox
    WHERE id IN (SELECT i.id FROM outbox.inbox i
                 WHERE i.expires_at < now() AND i.state = 'completed'
                 ORDER BY i.expires_at LIMIT batch FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_release(bigint,text,text)
-- history: created by 0042_inbox

CREATE OR REPLACE FUNCTION outbox.inbox_release(inbox_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    r outbox.inbox;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    SELECT * INTO r FROM outbox.inbox i WHERE i.id = inbox_release.inbox_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox record % does not exist', inbox_id USING ERRCODE = 'no_data_found';
    END IF;
    IF NOT (r.state = 'abandoned' OR (r.state = 'in_progress' AND r.mode = 'external'
                                      AND coalesce(r.lease_expires_at <= now(), true))) THEN
        RAISE EXCEPTION 'inbox record % is %: only an abandoned claim, or one whose lease '
                        'expired, is released', r.id, r.state USING ERRCODE = 'OB004';
    END IF;
    UPDATE outbox.inbox i SET state = 'in_progress', claims = 0, abandoned_at = NULL,
           lease_expires_at = NULL, token = gen_random_uuid()
    WHERE i.id = r.id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, actor, 'inbox_release', reason,
            jsonb_build_object('inbox_id', r.id, 'tenant_id', r.tenant_id, 'handler', r.handler,
                               'key', r.key, 'state', r.state, 'claims', r.claims));
    RETURN 'released';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_renew(bigint,uuid,interval)
-- history: created by 0042_inbox; changed by 0047_a_failed_claim_stays_handed_back

CREATE OR REPLACE FUNCTION outbox.inbox_renew(inbox_id bigint, token uuid, lease interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    UPDATE outbox.inbox i SET lease_expires_at = now() + lease
    WHERE i.id = inbox_renew.inbox_id AND i.token = inbox_renew.token
      AND i.state = 'in_progress' AND i.mode = 'external'
      AND i.lease_expires_at IS NOT NULL;  -- handed back by inbox_fail: not this caller's now
    RETURN FOUND;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.inbox_wait_lock(integer,interval)
-- history: created by 0046_the_inbox_checks_the_senders_fingerprint

CREATE OR REPLACE FUNCTION outbox.inbox_wait_lock(lock integer, wait interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_old text;
BEGIN
    v_old := current_setting('lock_timeout');
    BEGIN
        -- lock_timeout 0 would mean "wait for ever": a wait of 0 is one millisecond.
        PERFORM set_config('lock_timeout',
                           greatest(1, ceil(extract(epoch FROM wait) * 1000))::bigint || 'ms',
                           true);
        PERFORM pg_advisory_xact_lock(2828, lock);
        PERFORM set_config('lock_timeout', v_old, true);
    EXCEPTION WHEN lock_not_available THEN
        -- Another transaction still holds the identity: rolled back to here, lock_timeout
        -- included.
        RETURN false;
    END;
    RETURN true;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.key_for_generation(text,integer)
-- history: created by 0005_operator; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.key_for_generation(first_key text, generation integer)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE STRICT
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT CASE
        WHEN generation = 1 THEN first_key
        WHEN octet_length(first_key) + octet_length(':r' || generation) <= 255
            THEN first_key || ':r' || generation
        -- Too long for Stripe's 255 characters with a suffix: a hash of it, still deterministic.
        ELSE 'ob1_' || encode(sha256(convert_to(first_key, 'UTF8')), 'hex') || ':r' || generation
    END
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.lease_claimed(bigint[],text,interval)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.lease_claimed(p_ids bigint[], p_worker text, p_lease interval)
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text)
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE outbox.operations AS o
    SET status = 'in_flight',
        lease_owner = p_worker,
        -- A fresh token per claim fences every later write to this attempt.
        lease_token = gen_random_uuid(),
        lease_expires_at = now() + p_lease::interval,
        attempts = o.attempts + 1,
        last_attempt_at = now(),
        updated_at = now(),
        status_changed_at = now()
    -- The limit of outbox.limits (0019; its default should the owner have deleted the row).
    FROM (SELECT coalesce((SELECT l.max_payload_bytes FROM outbox.limits l), 1048576) AS max) AS lim
    -- An array, not a join: the planner cannot misjudge it into a scan of the whole table.
    WHERE o.id = ANY (p_ids) AND o.status = 'pending'
    -- The payload as PostgreSQL's own text, never decoded here: the dispatcher decodes each row on
    -- its own, so one row it cannot decode is quarantined alone (outbox/payloads.py). One whose
    -- text is past the limit is not handed over at all (NULL): payload_bytes is its size as enqueue
    -- measured it; a row written some other way is measured here.
    RETURNING o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action,
              CASE WHEN coalesce(o.payload_bytes, octet_length(o.payload::text)) <= lim.max
                   THEN o.payload::text END AS payload,
              coalesce(o.payload_bytes, octet_length(o.payload::text)) AS payload_bytes,
              lim.max AS payload_limit,
              o.idempotency_key, o.correlation_id, o.traceparent, o.attempts, o.attempt_base,
              o.max_attempts, o.lease_token, o.first_sent_at, o.created_at, now() AS claimed_at,
              o.api_version;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.lock_for_action(bigint,text,text[])
-- history: created by 0005_operator; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.lock_for_action(operation_id bigint, action text, allowed text[])
 RETURNS outbox.operations
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    SELECT * INTO op FROM outbox.operations o WHERE o.id = lock_for_action.operation_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no operation with id %', lock_for_action.operation_id
            USING ERRCODE = 'no_data_found';
    END IF;
    IF NOT op.status = ANY (allowed) THEN
        RAISE EXCEPTION '% applies to % operations; operation % is %',
            action, array_to_string(allowed, ' or '), op.id, op.status
            USING ERRCODE = 'OB004';
    END IF;
    RETURN op;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.lock_ordering_key(text,text)
-- history: created by 0019_limits_schedule_and_key_locks

CREATE OR REPLACE FUNCTION outbox.lock_ordering_key(tenant_id text, ordering_key text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
BEGIN
    LOOP
        PERFORM 1 FROM outbox.ordering_keys k
        WHERE k.tenant_id = tenant_id AND k.ordering_key = ordering_key FOR UPDATE;
        EXIT WHEN FOUND;
        -- A new key, or one pruned a moment ago. Inserted: ours until we commit. Inserted by
        -- another transaction meanwhile: locked on the next round.
        INSERT INTO outbox.ordering_keys AS k (tenant_id, ordering_key)
        VALUES (tenant_id, ordering_key) ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.next_generation_key(text,integer)
-- history: created by 0010_immutable_operations; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.next_generation_key(current_key text, generation integer)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE STRICT
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.key_for_generation(
        CASE WHEN generation = 1 THEN current_key
             ELSE left(current_key, length(current_key) - length(':r' || generation)) END,
        generation + 1)
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.operation_keys_follow_deletes()
-- history: created by 0051_keys_apart_from_the_operation
-- fired by trigger operations_forget_keys ON outbox.operations
-- fired by trigger operations_truncate_keys ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.operation_keys_follow_deletes()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE outbox.operation_keys;
    ELSE
        DELETE FROM outbox.operation_keys k USING gone g
        WHERE k.tenant_id = g.tenant_id AND k.operation_type = g.operation_type
          AND k.operation_key = g.operation_key AND k.operation_id = g.id;
    END IF;
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.operation_keys_follow_key()
-- history: created by 0051_keys_apart_from_the_operation
-- fired by trigger operations_move_key ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.operation_keys_follow_key()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    UPDATE outbox.operation_keys k
    SET idempotency_key = CASE WHEN NOT NEW.key_shared THEN NEW.idempotency_key END
    WHERE k.tenant_id = NEW.tenant_id AND k.operation_type = NEW.operation_type
      AND k.operation_key = NEW.operation_key AND k.operation_id = NEW.id;
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.operations_keep_immutable()
-- history: created by 0010_immutable_operations; changed by 0011_security_definer,
--     0015_ordering_keys, 0053_contracts_at_enqueue
-- fired by trigger operations_immutable ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.operations_keep_immutable()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    changed text;
BEGIN
    changed := CASE
        WHEN NEW.tenant_id IS DISTINCT FROM OLD.tenant_id THEN 'tenant_id'
        WHEN NEW.operation_type IS DISTINCT FROM OLD.operation_type THEN 'operation_type'
        WHEN NEW.operation_key IS DISTINCT FROM OLD.operation_key THEN 'operation_key'
        WHEN NEW.provider IS DISTINCT FROM OLD.provider THEN 'provider'
        WHEN NEW.action IS DISTINCT FROM OLD.action THEN 'action'
        WHEN NEW.payload IS DISTINCT FROM OLD.payload THEN 'payload'
        WHEN NEW.fingerprint IS DISTINCT FROM OLD.fingerprint THEN 'fingerprint'
        WHEN NEW.ordering_key IS DISTINCT FROM OLD.ordering_key THEN 'ordering_key'
        WHEN NEW.contract_version IS DISTINCT FROM OLD.contract_version THEN 'contract_version'
    END;
    IF changed IS NULL
       AND (NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
            OR NEW.key_generation IS DISTINCT FROM OLD.key_generation)
       AND NOT (OLD.status = 'reconciling' AND NEW.status = 'pending'
                AND NEW.key_generation = OLD.key_generation + 1
                AND NEW.idempotency_key
                    = outbox.next_generation_key(OLD.idempotency_key, OLD.key_generation)) THEN
        changed := CASE WHEN NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
                        THEN 'idempotency_key' ELSE 'key_generation' END;
    END IF;
    IF changed IS NOT NULL THEN
        RAISE EXCEPTION 'operation %: % never changes after enqueue', OLD.id, changed
            USING ERRCODE = 'OB005', COLUMN = changed, TABLE = 'operations', SCHEMA = 'outbox',
                  HINT = 'a different request is a new operation; only `outbox reconcile retry` '
                         'moves the idempotency key to its next generation';
    END IF;
    RETURN NEW;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.ordering_has_head(text,text,bigint)
-- history: created by 0015_ordering_keys

CREATE OR REPLACE FUNCTION outbox.ordering_has_head(tenant_id text, ordering_key text, except_id bigint)
 RETURNS boolean
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT EXISTS (
        SELECT 1 FROM outbox.operations o
        WHERE o.tenant_id = ordering_has_head.tenant_id
          AND o.ordering_key = ordering_has_head.ordering_key
          AND NOT o.ordering_blocked
          AND o.status IN ('pending', 'in_flight', 'quarantined', 'reconciling')
          AND o.id <> ordering_has_head.except_id
          AND (o.status IN ('pending', 'in_flight')
               OR outbox.ordering_mode(o.operation_type) = 'block'))
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.ordering_mode(text)
-- history: created by 0015_ordering_keys

CREATE OR REPLACE FUNCTION outbox.ordering_mode(operation_type text)
 RETURNS text
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT coalesce((SELECT m.on_failure FROM outbox.ordering_modes m
                     WHERE m.operation_type = ordering_mode.operation_type), 'block')
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.origin()
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE OR REPLACE FUNCTION outbox.origin()
 RETURNS uuid
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT i.origin FROM outbox.installation i $function$;
COMMENT ON FUNCTION outbox.origin() IS 'The public id of this database, which every delivery of its operations carries as Outbox-Origin (sql/0045).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.pass_turn()
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks
-- fired by trigger operations_pass_turn ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.pass_turn()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF OLD.ordering_blocked
       OR (NEW.status IN ('quarantined', 'reconciling')
           AND outbox.ordering_mode(NEW.operation_type) = 'block') THEN
        RETURN NULL;  -- it was not the head, or it still is
    END IF;
    IF outbox.try_lock_ordering_key(NEW.tenant_id, NEW.ordering_key) THEN
        PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    ELSE
        INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
        VALUES (NEW.tenant_id, NEW.ordering_key);
    END IF;
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.promote_next(text,text)
-- history: created by 0015_ordering_keys

CREATE OR REPLACE FUNCTION outbox.promote_next(tenant_id text, ordering_key text)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
DECLARE
    v_next bigint;
BEGIN
    LOOP
        IF outbox.ordering_has_head(tenant_id, ordering_key, 0) THEN
            RETURN NULL;
        END IF;
        SELECT o.id INTO v_next FROM outbox.operations o
        WHERE o.tenant_id = tenant_id AND o.ordering_key = ordering_key AND o.ordering_blocked
        ORDER BY o.id LIMIT 1;
        IF v_next IS NULL THEN
            RETURN NULL;
        END IF;
        -- Re-checked under the row lock; if it changed meanwhile, look again.
        UPDATE outbox.operations o SET ordering_blocked = false, updated_at = now()
        WHERE o.id = v_next AND o.ordering_blocked AND o.status = 'pending';
        IF FOUND THEN
            -- An idle dispatcher would otherwise find it only at its next poll (see 0012).
            IF EXISTS (SELECT 1 FROM outbox.waiting_dispatchers
                       WHERE seen_at > now() - interval '10 minutes') THEN
                PERFORM pg_notify('outbox_enqueue', '');
            END IF;
            RETURN v_next;
        END IF;
    END LOOP;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.publish_contract(text,integer,text,text,text,boolean)
-- history: created by 0053_contracts_at_enqueue; changed by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.publish_contract(operation_type text, version integer, canonical text, actor text, reason text, require_version boolean DEFAULT true)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest text;
    v_held text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    IF version IS NULL OR version < 1 THEN
        RAISE EXCEPTION 'a contract''s version is a whole number from 1'
            USING ERRCODE = 'OB002', COLUMN = 'version';
    END IF;
    IF canonical IS NULL OR octet_length(canonical) > 65536
       OR jsonb_typeof(canonical::jsonb) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'a contract''s schema is a JSON object of at most 65536 bytes'
            USING ERRCODE = 'OB002', COLUMN = 'canonical';
    END IF;
    v_digest := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = publish_contract.operation_type) THEN
        -- Never read under this name again: the same content is 'unchanged', as before.
        SELECT c.digest INTO v_held FROM outbox.contracts c
        WHERE c.operation_type = publish_contract.operation_type
          AND c.version = publish_contract.version;
        IF v_held = v_digest THEN
            RETURN 'unchanged';
        END IF;
        RAISE EXCEPTION '% is an alias of %: publish under that name',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    INSERT INTO outbox.contracts AS c (operation_type, version, canonical, digest, published_by)
    VALUES (publish_contract.operation_type, publish_contract.version, publish_contract.canonical,
            v_digest, actor)
    ON CONFLICT ON CONSTRAINT contracts_pkey DO NOTHING;
    IF FOUND THEN
        INSERT INTO outbox.contract_types AS t (operation_type, versions_required, changed_by)
        VALUES (publish_contract.operation_type, coalesce(require_version, true), actor)
        ON CONFLICT ON CONSTRAINT contract_types_pkey DO NOTHING;
        INSERT INTO outbox.audit (actor, action, reason, to_status, details)
        VALUES (actor, 'contract_publish', reason, 'active',
                jsonb_build_object('operation_type', operation_type, 'version', version,
                                   'digest', v_digest));
        RETURN 'published';
    END IF;
    SELECT c.digest INTO v_held FROM outbox.contracts c
    WHERE c.operation_type = publish_contract.operation_type
      AND c.version = publish_contract.version;
    IF v_held = v_digest THEN
        RETURN 'unchanged';
    END IF;
    RAISE EXCEPTION '%/v% is published with other content: publish the change as a new version',
        operation_type, version
        USING ERRCODE = 'OB008', COLUMN = 'canonical',
              DETAIL = format('published %s, pushed %s', v_held, v_digest);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.record_attempts(text,jsonb)
-- history: created by 0040_the_dispatcher_writes_through_functions; changed by
--     0050_a_success_writes_one_row

CREATE OR REPLACE FUNCTION outbox.record_attempts(p_worker text, p_batch jsonb)
 RETURNS TABLE(operation_id bigint, attempt integer)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_bad text;
BEGIN
    PERFORM outbox.check_worker(p_worker);
    IF jsonb_typeof(p_batch) IS DISTINCT FROM 'array' OR jsonb_array_length(p_batch) > 10000 THEN
        RAISE EXCEPTION 'a batch of records is a JSON array of at most 10000'
            USING ERRCODE = '22023';
    END IF;
    SELECT c.bad INTO v_bad
    FROM (SELECT CASE
                     WHEN i.status IS NULL
                          OR i.status NOT IN ('pending', 'succeeded', 'quarantined', 'reconciling')
                         THEN 'a record gives the status pending, succeeded, quarantined or '
                              'reconciling'
                     WHEN i.outcome IS NULL OR (i.outcome = 'succeeded') <> (i.status = 'succeeded')
                         THEN 'a record''s outcome is succeeded exactly when its status is'
                     WHEN i.retry_in_s IS NULL OR NOT i.retry_in_s BETWEEN 0 AND 366 * 86400
                         THEN 'a retry is due in 0 to 366 days'
                     WHEN length(i.provider_ref) > 1024
                         THEN 'a provider reference is at most 1024 characters'
                 END AS bad
          FROM jsonb_to_recordset(p_batch)
               AS i(status text, outcome text, retry_in_s double precision,
                    provider_ref text)) c
    WHERE c.bad IS NOT NULL
    LIMIT 1;
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'refused: %', v_bad USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    WITH input AS (
        -- One JSON document for the whole batch: encoded in C by json.dumps, where a dozen
        -- arrays would be encoded element by element.
        SELECT i.id, i.lease_token, i.attempt, i.status, i.reason, i.retry_in_s, i.sent,
               i.provider_ref, i.result, left(i.error, 8192) AS error, i.failure, i.outcome,
               left(i.error_class, 200) AS error_class, i.http_status,
               left(i.request_id, 1024) AS request_id, i.unspent, left(i.api_version, 200) AS api_version,
               left(i.scope, 1024) AS scope,
               -- Kept on the operation, not as a row of attempt_log (the header says why).
               coalesce(i.outcome = 'succeeded' AND i.attempt = 1 AND i.sent, false) AS inline
        FROM jsonb_to_recordset(p_batch)
             AS i(id bigint, lease_token uuid, attempt integer, status text, reason text,
                  retry_in_s double precision, sent boolean, provider_ref text, result jsonb,
                  error text, failure text, outcome text, error_class text, http_status integer,
                  request_id text, unspent boolean, api_version text, scope text)
    ),
    recorded AS (
        UPDATE outbox.operations AS o
        SET status = i.status,
            status_reason = i.reason,
            available_at = CASE WHEN i.status = 'pending'
                                THEN now() + make_interval(secs => i.retry_in_s)
                                ELSE o.available_at END,
            -- A retry after a delay waits out of the claim index until STAGE finds it due.
            scheduled = i.status = 'pending' AND i.retry_in_s > 0,
            lease_owner = NULL,
            lease_token = NULL,
            lease_expires_at = NULL,
            first_sent_at = CASE WHEN i.sent THEN coalesce(o.first_sent_at, o.last_attempt_at)
                                 ELSE o.first_sent_at END,
            -- An attempt the provider did not act on is not counted toward max_attempts.
            attempt_base = o.attempt_base + CASE WHEN i.unspent THEN 1 ELSE 0 END,
            -- The API version of the first attempt that may have reached the provider (sql/0023).
            api_version = coalesce(o.api_version, CASE WHEN i.sent THEN i.api_version END),
            sent_scope = coalesce(o.sent_scope, CASE WHEN i.sent THEN i.scope END),
            provider_ref = coalesce(i.provider_ref, o.provider_ref),
            -- At most 64 KiB of the provider's answer is kept (its reference always is): a row is
            -- read back by operators and get_operation, and the answer's size is the provider's.
            result = CASE WHEN pg_column_size(i.result) > 65536
                          THEN jsonb_build_object('outbox_omitted', format(
                                   'the answer was %s bytes; outbox keeps at most 65536',
                                   pg_column_size(i.result)))
                          ELSE coalesce(i.result, o.result) END,
            last_error = i.error,
            last_error_class = i.failure,
            -- The view outbox.attempts shows these as the row attempt_log would have held.
            success_worker = CASE WHEN i.inline THEN p_worker END,
            success_http_status = CASE WHEN i.inline THEN i.http_status END,
            success_request_id = CASE WHEN i.inline THEN i.request_id END,
            updated_at = now(),
            status_changed_at = now(),
            finished_at = CASE WHEN i.status IN ('succeeded', 'cancelled') THEN now() END
        FROM input AS i
        WHERE o.id = i.id
          AND o.lease_token = i.lease_token
          AND o.attempts = i.attempt
          AND o.status = 'in_flight'
        RETURNING o.id, o.idempotency_key, o.last_attempt_at, i.attempt, i.outcome, i.sent,
                  i.error_class, i.error, i.http_status, i.request_id, i.inline
    ),
    logged AS (
        INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, started_at,
                                        outcome, sent, error_class, error_message, http_status,
                                        provider_request_id)
        SELECT id, attempt, idempotency_key, p_worker, last_attempt_at, outcome, sent, error_class,
               error, http_status, request_id
        FROM recorded
        WHERE NOT inline
    )
    SELECT id, attempt FROM recorded;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.record_check(bigint,text,text,jsonb)
-- history: created by 0005_operator; changed by 0006_check_audit, 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.record_check(operation_id bigint, found_ref text, actor text, details jsonb DEFAULT '{}'::jsonb)
 RETURNS text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF found_ref IS NOT NULL THEN
        UPDATE outbox.operations o
        SET status = 'succeeded', provider_ref = found_ref, status_reason = NULL,
            checked_at = now(), check_finding = 'found', updated_at = now(),
            status_changed_at = now(), finished_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'check', 'found at the provider', 'succeeded',
                                   details || jsonb_build_object('provider_ref', found_ref));
        RETURN 'succeeded';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'not_found', updated_at = now()
    WHERE o.id = op.id;
    IF op.check_finding IS DISTINCT FROM 'not_found' THEN
        PERFORM outbox.write_audit(op, actor, 'check',
                                   'not found at the provider as of ' || now()::text,
                                   'reconciling', details);
    END IF;
    RETURN 'reconciling';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.record_check(bigint,text,text,jsonb,integer,integer)
-- history: created by 0009_stricter_retry_checks_and_audit; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.record_check(operation_id bigint, found_ref text, actor text, details jsonb, expected_generation integer, expected_attempts integer)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF op.key_generation <> expected_generation OR op.attempts <> expected_attempts THEN
        RETURN 'stale';
    END IF;
    IF found_ref IS NOT NULL AND btrim(found_ref) = '' THEN
        RAISE EXCEPTION 'a check that found the effect must give its reference' USING ERRCODE = 'OB004';
    END IF;
    RETURN outbox.record_check(operation_id, found_ref, actor, coalesce(details, '{}'::jsonb));
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.record_finding(bigint,text,text,text,text,jsonb,integer,integer)
-- history: created by 0021_findings_carry_the_state; changed by 0023_lookups_say_what_they_searched

CREATE OR REPLACE FUNCTION outbox.record_finding(operation_id bigint, finding text, found_ref text, state text, actor text, details jsonb, expected_generation integer, expected_attempts integer)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
    v_details jsonb := coalesce(details, '{}'::jsonb);
    v_state text := left(state, 64);
BEGIN
    IF finding IS NULL OR finding NOT IN ('found', 'not_found', 'refused', 'undecided') THEN
        RAISE EXCEPTION 'a finding is found, not_found, refused or undecided, not %',
            coalesce(finding, 'NULL') USING ERRCODE = 'OB004';
    END IF;
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF op.key_generation <> expected_generation OR op.attempts <> expected_attempts THEN
        RETURN 'stale';
    END IF;
    IF finding IN ('found', 'refused') AND (found_ref IS NULL OR btrim(found_ref) = '') THEN
        RAISE EXCEPTION 'a check that found an object must give its reference'
            USING ERRCODE = 'OB004';
    END IF;
    IF finding IN ('found', 'not_found') THEN
        PERFORM outbox.record_check(operation_id, CASE WHEN finding = 'found' THEN found_ref END,
                                    actor, v_details);
        UPDATE outbox.operations o SET check_state = v_state, check_details = v_details
        WHERE o.id = op.id;
        RETURN CASE WHEN finding = 'found' THEN 'succeeded' ELSE 'reconciling' END;
    END IF;
    IF finding = 'refused' THEN
        UPDATE outbox.operations o
        SET status = 'quarantined', status_reason = 'provider_declined', provider_ref = found_ref,
            checked_at = now(), check_finding = 'refused', check_state = v_state,
            check_details = v_details,
            -- As a permanent failure of the send path would say it: the class, and the
            -- provider's own words with its codes (card_declined: generic_decline: ...).
            last_error = left(concat_ws(': ', v_details->>'code', v_details->>'decline_code',
                                        coalesce(v_details->>'message', 'refused by the provider'
                                        )), 1000),
            last_error_class = 'permanent',
            updated_at = now(), status_changed_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'check',
                                   'found at the provider, refused: ' || coalesce(v_state, '?'),
                                   'quarantined',
                                   v_details || jsonb_build_object('provider_ref', found_ref,
                                                                   'state', v_state));
        RETURN 'quarantined';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'undecided', check_state = v_state,
        check_details = v_details, updated_at = now()
    WHERE o.id = op.id;
    IF op.check_finding IS DISTINCT FROM 'undecided' OR op.check_state IS DISTINCT FROM v_state THEN
        PERFORM outbox.write_audit(op, actor, 'check',
                                   CASE WHEN found_ref IS NULL
                                        THEN 'search incomplete, undecided: '
                                             || coalesce(v_details->>'reason', '?')
                                        ELSE 'found at the provider, undecided: '
                                             || coalesce(v_state, '?') END,
                                   'reconciling',
                                   v_details || jsonb_build_object('provider_ref', found_ref,
                                                                   'state', v_state));
    END IF;
    RETURN 'reconciling';
END;
$function$;
COMMENT ON FUNCTION outbox.record_finding(bigint,text,text,text,text,jsonb,integer,integer) IS 'A reconciliation finding with the state of the object found: found (succeeded), refused (quarantined, provider_declined), undecided or not_found (still reconciling).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.record_no_effect(bigint,text,text)
-- history: created by 0032_operator_finds_no_effect; changed by
--     0034_no_effect_after_the_last_attempt

CREATE OR REPLACE FUNCTION outbox.record_no_effect(operation_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'no_effect', ARRAY['reconciling']);
    IF op.last_attempt_at > now() - interval '30 seconds' THEN
        RAISE EXCEPTION 'operation %: its last attempt was less than 30 s ago, and what the '
                        'provider shows may not have its effect yet: look again in a moment',
                        op.id
            USING ERRCODE = 'OB004';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'not_found', check_state = NULL,
        check_details = jsonb_build_object('by', 'operator', 'actor', actor),
        updated_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'no_effect', reason, 'reconciling',
                               jsonb_build_object('finding', 'not_found',
                                                  'previous_finding', op.check_finding,
                                                  'previous_state', op.check_state));
    RETURN 'reconciling';
END;
$function$;
COMMENT ON FUNCTION outbox.record_no_effect(bigint,text,text) IS 'An operator found no effect at the provider: a not_found finding by a person, audited, after which reconcile retry needs no force.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.rejoin_line()
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks
-- fired by trigger operations_rejoin_line ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.rejoin_line()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM outbox.lock_ordering_key(NEW.tenant_id, NEW.ordering_key);
    NEW.ordering_blocked := outbox.ordering_has_head(NEW.tenant_id, NEW.ordering_key, NEW.id);
    RETURN NEW;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.renew_leases(bigint[],uuid[],interval)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.renew_leases(p_ids bigint[], p_tokens uuid[], p_lease interval)
 RETURNS SETOF bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM outbox.check_between('lease', p_lease, interval '1 millisecond', interval '1 day');
    RETURN QUERY
    UPDATE outbox.operations AS o
    SET lease_expires_at = now() + p_lease
    FROM unnest(p_ids, p_tokens) AS held(id, token)
    WHERE o.id = held.id AND o.lease_token = held.token AND o.status = 'in_flight'
    RETURNING o.id;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.repair_ordering_key(text,text)
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks

CREATE OR REPLACE FUNCTION outbox.repair_ordering_key(tenant_id text, ordering_key text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
BEGIN
    IF NOT outbox.try_lock_ordering_key(tenant_id, ordering_key) THEN
        -- No row yet (the key's first operations came before 0019): make one, then try again.
        INSERT INTO outbox.ordering_keys AS k (tenant_id, ordering_key)
        VALUES (tenant_id, ordering_key) ON CONFLICT DO NOTHING;
        IF NOT FOUND AND NOT outbox.try_lock_ordering_key(tenant_id, ordering_key) THEN
            UPDATE outbox.ordering_repairs r SET noted_at = now()
            WHERE r.tenant_id = tenant_id AND r.ordering_key = ordering_key;
            RETURN NULL;
        END IF;
    END IF;
    DELETE FROM outbox.ordering_repairs r
    WHERE r.tenant_id = tenant_id AND r.ordering_key = ordering_key;
    RETURN outbox.promote_next(tenant_id, ordering_key);
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.replay_operation(bigint,text,text)
-- history: created by 0005_operator; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.replay_operation(operation_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'replay', ARRAY['quarantined']);
    UPDATE outbox.operations o
    SET status = 'pending', status_reason = NULL, attempt_base = o.attempts,
        available_at = now(), updated_at = now(), status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'replay', reason, 'pending', '{}'::jsonb);
    RETURN 'pending';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.request_cancel(bigint,text,text)
-- history: created by 0019_limits_schedule_and_key_locks

CREATE OR REPLACE FUNCTION outbox.request_cancel(operation_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'cancel',
                                 ARRAY['pending', 'in_flight', 'reconciling', 'quarantined']);
    IF op.status = 'in_flight' THEN
        IF op.cancel_requested_at IS NULL THEN
            UPDATE outbox.operations o SET cancel_requested_at = now(), updated_at = now()
            WHERE o.id = op.id;
        END IF;
        PERFORM outbox.write_audit(op, actor, 'cancel_requested', reason, 'in_flight',
                                   jsonb_build_object('attempt', op.attempts));
        RETURN 'in_flight';
    END IF;
    IF op.status = 'pending' AND op.first_sent_at IS NOT NULL THEN
        UPDATE outbox.operations o
        SET status = 'reconciling', status_reason = 'cancel_requested', scheduled = false,
            ordering_blocked = false, checked_at = NULL, check_finding = NULL,
            updated_at = now(), status_changed_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'cancel_requested', reason, 'reconciling',
            jsonb_build_object('first_sent_at', op.first_sent_at));
        RETURN 'reconciling';
    END IF;
    UPDATE outbox.operations o
    SET status = 'cancelled', status_reason = 'cancelled by operator', scheduled = false,
        ordering_blocked = false, updated_at = now(), status_changed_at = now(),
        finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'cancel', reason, 'cancelled', '{}'::jsonb);
    RETURN 'cancelled';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.request_provider_action(text,text,text,text)
-- history: created by 0031_provider_health

CREATE OR REPLACE FUNCTION outbox.request_provider_action(p_provider text, p_action text, p_actor text, p_reason text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_id bigint;
BEGIN
    IF p_action IS NULL OR p_action NOT IN ('reset', 'probe') THEN
        RAISE EXCEPTION 'unknown provider action %', p_action USING ERRCODE = 'OB002';
    END IF;
    IF p_provider IS NULL OR p_provider !~ '^[a-z0-9][a-z0-9_-]{0,63}$' THEN
        RAISE EXCEPTION 'not a provider name: %', p_provider USING ERRCODE = 'OB002';
    END IF;
    PERFORM outbox.require_reason(p_actor, p_reason);
    DELETE FROM outbox.provider_actions WHERE at < now() - interval '1 day';
    INSERT INTO outbox.provider_actions (provider, action) VALUES (p_provider, p_action)
    RETURNING id INTO v_id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, p_actor, 'provider_' || p_action, p_reason,
            jsonb_build_object('provider', p_provider, 'request', v_id));
    RETURN v_id;
END;
$function$;
COMMENT ON FUNCTION outbox.request_provider_action(text,text,text,text) IS 'Reset a provider''s breakers or ask for a probe now, on every dispatcher; audited.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.request_reconciliation(bigint,text,text)
-- history: created by 0007_request_reconciliation; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.request_reconciliation(operation_id bigint, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'reconcile', ARRAY['quarantined']);
    UPDATE outbox.operations o
    SET status = 'reconciling', status_reason = 'operator_request', checked_at = NULL,
        check_finding = NULL, updated_at = now(), status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'reconcile', reason, 'reconciling', '{}'::jsonb);
    RETURN 'reconciling';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.require_allowance(text,text,text)
-- history: created by 0026_enqueue_allow_lists; changed by 0035_allowances_match_the_tenant_exactly

CREATE OR REPLACE FUNCTION outbox.require_allowance(tenant_id text, provider text, action text)
 RETURNS void
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
BEGIN
    IF EXISTS (SELECT FROM outbox.enqueue_allowances a
               WHERE tenant_id LIKE outbox.tenant_glob_to_like(a.tenant_pattern)
                 AND a.provider = provider
                 AND (a.action = '*' OR a.action = action)) THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT FROM outbox.enqueue_allowances a
                   WHERE tenant_id LIKE outbox.tenant_glob_to_like(a.tenant_pattern)
                     AND a.provider = provider) THEN
        RAISE EXCEPTION 'tenant % may not enqueue to provider %', tenant_id, provider
            USING ERRCODE = 'OB002', COLUMN = 'provider',
                  HINT = 'the allow-list (outbox.enqueue_allowances) has no rule for it';
    END IF;
    RAISE EXCEPTION 'tenant % may not enqueue % to provider %', tenant_id, action, provider
        USING ERRCODE = 'OB002', COLUMN = 'action',
              HINT = 'the allow-list (outbox.enqueue_allowances) has no rule for it';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.require_reason(text,text)
-- history: created by 0005_operator; changed by 0011_security_definer,
--     0025_an_audit_that_tells_the_truth

CREATE OR REPLACE FUNCTION outbox.require_reason(actor text, reason text)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF actor IS NULL OR btrim(actor) = '' THEN
        RAISE EXCEPTION 'an operator action needs an actor' USING ERRCODE = 'OB004';
    END IF;
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'an operator action needs a reason' USING ERRCODE = 'OB004';
    END IF;
    IF char_length(actor) > 255 THEN
        RAISE EXCEPTION 'the actor is % characters long; at most 255 are allowed',
            char_length(actor) USING ERRCODE = 'OB004';
    END IF;
    IF char_length(reason) > 2000 THEN
        RAISE EXCEPTION 'the reason is % characters long; at most 2000 are allowed',
            char_length(reason) USING ERRCODE = 'OB004';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.require_tenant(text)
-- history: created by 0011_security_definer; changed by 0038_bindings_end_with_their_transaction

CREATE OR REPLACE FUNCTION outbox.require_tenant(tenant_id text)
 RETURNS void
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    bound text := outbox.bound_tenant();
BEGIN
    IF tenant_id IS NULL OR btrim(tenant_id) = ''
       OR NOT (SELECT c.relrowsecurity FROM pg_catalog.pg_class c
               WHERE c.oid = 'outbox.operations'::regclass) THEN
        RETURN;  -- a missing or blank tenant_id is enqueue's OB002
    END IF;
    IF bound IS NULL AND nullif(current_setting('outbox.tenant_id', true), '') IS NOT NULL THEN
        RAISE EXCEPTION 'tenant isolation is on: this transaction is not bound to a tenant '
                        '(outbox.tenant_id is set, but not by outbox.bind_tenant in this '
                        'transaction)'
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'SELECT outbox.bind_tenant(<tenant>) in the same transaction, or '
                         'outbox.bind_tenant(conn, tenant) in Python; a SET of the session, or '
                         'set_config alone, would outlive the transaction and is not taken';
    END IF;
    IF bound IS NULL THEN
        RAISE EXCEPTION 'tenant isolation is on: bind this transaction to its tenant first'
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'SELECT outbox.bind_tenant(<tenant>) in the same transaction, or '
                         'outbox.bind_tenant(conn, tenant) in Python';
    END IF;
    IF bound <> tenant_id THEN
        RAISE EXCEPTION 'this transaction is bound to tenant %: it may not act for tenant %',
            bound, tenant_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.rescue_leases(integer,integer)
-- history: created by 0040_the_dispatcher_writes_through_functions; changed by
--     0050_a_success_writes_one_row

CREATE OR REPLACE FUNCTION outbox.rescue_leases(p_limit integer, p_max_attempts integer)
 RETURNS TABLE(id bigint, status text, status_reason text, provider text, tenant_id text, operation_type text, operation_key text, action text, attempts integer, correlation_id text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM outbox.check_count('limit', p_limit, 0, 100000);
    -- enqueue's own bound on an operation's max_attempts (0004).
    PERFORM outbox.check_count('max_attempts', p_max_attempts, 1, 1000);
    RETURN QUERY
    WITH expired AS MATERIALIZED (
        -- Served by the partial index operations_lease; SKIP LOCKED so that rescuers in several
        -- processes split the work and never wait on a row a dispatcher is recording right now.
        SELECT id, lease_owner, last_attempt_at, idempotency_key, attempts
        FROM outbox.operations
        WHERE status = 'in_flight' AND lease_expires_at < now()
        ORDER BY lease_expires_at
        LIMIT p_limit::integer
        FOR UPDATE SKIP LOCKED
    ),
    rescued AS (
        UPDATE outbox.operations AS o
        SET status = CASE WHEN o.attempts - o.attempt_base
                               >= coalesce(o.max_attempts, p_max_attempts::integer)
                          THEN 'reconciling' ELSE 'pending' END,
            status_reason = CASE WHEN o.attempts - o.attempt_base
                                      >= coalesce(o.max_attempts, p_max_attempts::integer)
                                 THEN 'indeterminate_provider_error' END,
            available_at = now(),
            lease_owner = NULL,
            lease_token = NULL,
            lease_expires_at = NULL,
            first_sent_at = coalesce(o.first_sent_at, o.last_attempt_at),
            last_error = 'lease expired: the dispatcher stopped renewing it during the attempt',
            last_error_class = 'unknown',
            updated_at = now(),
            status_changed_at = now()
        FROM expired AS e
        -- Re-checked under the row lock: a row recorded since the scan is left alone.
        WHERE o.id = e.id AND o.status = 'in_flight' AND o.lease_expires_at < now()
        RETURNING o.id, o.status, o.status_reason, o.provider, o.tenant_id, o.operation_type,
                  o.operation_key, o.action, o.attempts, o.correlation_id
    ),
    history AS (
        INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker,
                                        started_at, outcome, sent, error_class,
                                        error_message)
        SELECT e.id, e.attempts, e.idempotency_key, coalesce(e.lease_owner, 'unknown'),
               e.last_attempt_at, 'unknown', true,
               'lease_expired',
               'lease expired: the dispatcher stopped renewing it during the attempt'
        FROM rescued AS r JOIN expired AS e ON e.id = r.id
    )
    SELECT id, status, status_reason, provider, tenant_id, operation_type, operation_key, action,
           attempts, correlation_id
    FROM rescued;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.resolve_operation(bigint,text,text,text)
-- history: created by 0005_operator; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.resolve_operation(operation_id bigint, provider_ref text, reason text, actor text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF provider_ref IS NULL OR btrim(provider_ref) = '' THEN
        RAISE EXCEPTION 'resolve needs the provider''s reference of the effect' USING ERRCODE = 'OB004';
    END IF;
    op := outbox.lock_for_action(operation_id, 'resolve', ARRAY['reconciling', 'quarantined']);
    UPDATE outbox.operations o
    SET status = 'succeeded', provider_ref = resolve_operation.provider_ref, status_reason = NULL,
        updated_at = now(), status_changed_at = now(), finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'resolve', reason, 'succeeded',
                               jsonb_build_object('provider_ref', provider_ref));
    RETURN 'succeeded';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.retry_operation(bigint,text,text,boolean)
-- history: created by 0005_operator; changed by 0009_stricter_retry_checks_and_audit,
--     0011_security_definer

CREATE OR REPLACE FUNCTION outbox.retry_operation(operation_id bigint, reason text, actor text, force boolean DEFAULT false)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    op outbox.operations;
    forced boolean := coalesce(force, false);
    first_key text;
    new_key text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'retry', ARRAY['reconciling']);
    IF NOT forced AND op.check_finding IS DISTINCT FROM 'not_found' THEN
        RAISE EXCEPTION 'operation % was not checked against the provider, or its effect was found; '
                        'run `outbox reconcile check %` first, or retry with --force', op.id, op.id
            USING ERRCODE = 'OB004';
    END IF;
    IF NOT forced AND op.checked_at < op.last_attempt_at + interval '30 seconds' THEN
        RAISE EXCEPTION 'operation %: the last check came too soon after the last attempt to prove '
                        'anything; run `outbox reconcile check %` again, or retry with --force',
                        op.id, op.id
            USING ERRCODE = 'OB004';
    END IF;
    first_key := CASE WHEN op.key_generation = 1 THEN op.idempotency_key
                      ELSE left(op.idempotency_key,
                                length(op.idempotency_key) - length(':r' || op.key_generation)) END;
    new_key := outbox.key_for_generation(first_key, op.key_generation + 1);
    UPDATE outbox.operations o
    SET status = 'pending', status_reason = NULL, idempotency_key = new_key,
        key_generation = o.key_generation + 1, first_sent_at = NULL, attempt_base = o.attempts,
        available_at = now(), checked_at = NULL, check_finding = NULL, updated_at = now(),
        status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'retry', reason, 'pending', jsonb_build_object(
        'previous_key', op.idempotency_key, 'new_key', new_key, 'forced', forced,
        'key_generation', op.key_generation + 1));
    RETURN 'pending';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.schema_version()
-- history: created by 0027_schema_version

CREATE OR REPLACE FUNCTION outbox.schema_version()
 RETURNS integer
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT max(version) FROM outbox.schema_migrations
$function$;
COMMENT ON FUNCTION outbox.schema_version() IS 'The newest migration applied: outbox run refuses to start on an older schema than its own.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.server_identity()
-- history: created by 0030_server_identity

CREATE OR REPLACE FUNCTION outbox.server_identity(OUT in_recovery boolean, OUT system_identifier text, OUT timeline integer, OUT server_now timestamp with time zone)
 RETURNS record
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    in_recovery := pg_is_in_recovery();
    server_now := now();
    BEGIN
        SELECT s.system_identifier::text INTO system_identifier FROM pg_control_system() AS s;
        IF NOT in_recovery THEN
            -- The timeline of the WAL being written: a promoted standby's new one at once (the
            -- checkpoint's, in pg_control_checkpoint(), changes only at the next checkpoint).
            timeline := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int;
        END IF;
    EXCEPTION WHEN insufficient_privilege THEN
        system_identifier := NULL;
        timeline := NULL;
    END;
END;
$function$;
COMMENT ON FUNCTION outbox.server_identity() IS 'Whether this server is in recovery, its system identifier and WAL timeline (NULL where they cannot be read), and its clock: what the readiness probe of outbox run asks every second.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.set_contract_alias(text,text,text,text)
-- history: created by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.set_contract_alias(alias text, operation_type text, actor text, reason text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_held text;
    v_differs text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    PERFORM outbox.check_text('alias', alias, 128);
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    -- One alias at a time, so that two cannot form a chain or a cycle between their checks.
    LOCK TABLE outbox.contract_aliases IN SHARE ROW EXCLUSIVE MODE;
    SELECT a.operation_type INTO v_held FROM outbox.contract_aliases a
    WHERE a.alias = set_contract_alias.alias;
    IF v_held = operation_type THEN
        RETURN 'unchanged';
    END IF;
    IF v_held IS NOT NULL THEN
        RAISE EXCEPTION '% is already an alias of %', alias, v_held
            USING ERRCODE = 'OB005', COLUMN = 'alias';
    END IF;
    IF alias = operation_type THEN
        RAISE EXCEPTION 'a type is no alias of itself' USING ERRCODE = 'OB002', COLUMN = 'alias';
    END IF;
    IF NOT EXISTS (SELECT FROM outbox.contracts c
                   WHERE c.operation_type = set_contract_alias.operation_type) THEN
        RAISE EXCEPTION 'operation type % has no published contract', operation_type
            USING ERRCODE = 'P0002', COLUMN = 'operation_type',
                  HINT = 'publish its versions first: outbox contracts push DIR';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_alias.operation_type
                  OR a.operation_type = set_contract_alias.alias) THEN
        RAISE EXCEPTION 'no chains of aliases: % or % is one end of another', alias,
            operation_type USING ERRCODE = 'OB002', COLUMN = 'alias';
    END IF;
    SELECT string_agg(format('v%s', o.version), ', ' ORDER BY o.version) INTO v_differs
    FROM outbox.contracts o
    LEFT JOIN outbox.contracts n
           ON n.operation_type = set_contract_alias.operation_type AND n.version = o.version
    WHERE o.operation_type = set_contract_alias.alias AND n.digest IS DISTINCT FROM o.digest;
    IF v_differs IS NOT NULL THEN
        RAISE EXCEPTION '% has versions % has not, or with other content: %', alias,
            operation_type, v_differs
            USING ERRCODE = 'OB008', COLUMN = 'alias',
                  HINT = 'publish each of them under the new name with the same content first';
    END IF;
    INSERT INTO outbox.contract_aliases (alias, operation_type, created_by)
    VALUES (alias, operation_type, actor);
    -- The requirement, mirrored under the alias (set_contract_requirement keeps it so): an
    -- enqueue that names no version reads one row of contract_types, as before aliases.
    INSERT INTO outbox.contract_types AS t (operation_type, versions_required, changed_by)
    SELECT set_contract_alias.alias, n.versions_required, actor
    FROM outbox.contract_types n WHERE n.operation_type = set_contract_alias.operation_type
    ON CONFLICT ON CONSTRAINT contract_types_pkey
    DO UPDATE SET versions_required = excluded.versions_required, changed_at = now(),
                  changed_by = excluded.changed_by;
    INSERT INTO outbox.audit (actor, action, reason, details)
    VALUES (actor, 'contract_alias', reason,
            jsonb_build_object('alias', alias, 'operation_type', operation_type));
    RETURN 'aliased';
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.set_contract_requirement(text,boolean,text,text)
-- history: created by 0053_contracts_at_enqueue; changed by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.set_contract_requirement(operation_type text, required boolean, actor text, reason text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_was boolean;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF required IS NULL THEN
        RAISE EXCEPTION 'required is true or false' USING ERRCODE = 'OB002', COLUMN = 'required';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_requirement.operation_type) THEN
        RAISE EXCEPTION '% is an alias of %: that type''s requirement holds for both',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    SELECT t.versions_required INTO v_was FROM outbox.contract_types t
    WHERE t.operation_type = set_contract_requirement.operation_type FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'operation type % has no published contract', operation_type
            USING ERRCODE = 'P0002';
    END IF;
    IF v_was = required THEN
        RETURN 'unchanged';
    END IF;
    -- The type's aliases keep rows of their own that say the same (set_contract_alias): enqueue
    -- then reads one row for an operation that names no version, whatever its type's name.
    UPDATE outbox.contract_types t
    SET versions_required = required, changed_at = now(), changed_by = actor
    WHERE t.operation_type = set_contract_requirement.operation_type
       OR t.operation_type IN (SELECT a.alias FROM outbox.contract_aliases a
                               WHERE a.operation_type = set_contract_requirement.operation_type);
    INSERT INTO outbox.audit (actor, action, reason, details)
    VALUES (actor, CASE WHEN required THEN 'contract_require' ELSE 'contract_allow_unversioned' END,
            reason, jsonb_build_object('operation_type', operation_type));
    RETURN CASE WHEN required THEN 'required' ELSE 'not required' END;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.set_contract_state(text,integer,text,text,text)
-- history: created by 0052_operation_contracts; changed by 0055_contract_aliases

CREATE OR REPLACE FUNCTION outbox.set_contract_state(operation_type text, version integer, state text, actor text, reason text)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_was text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF state IS NULL OR state NOT IN ('active', 'deprecated', 'retired') THEN
        RAISE EXCEPTION 'a contract''s state is active, deprecated or retired'
            USING ERRCODE = 'OB002', COLUMN = 'state';
    END IF;
    SELECT c.state INTO v_was FROM outbox.contracts c
    WHERE c.operation_type = set_contract_state.operation_type
      AND c.version = set_contract_state.version
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no contract %/v% is published', operation_type, version
            USING ERRCODE = 'P0002';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_state.operation_type) THEN
        RAISE EXCEPTION '% is an alias of %: its versions'' states are that type''s',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    IF v_was = state THEN
        RETURN 'unchanged';
    END IF;
    UPDATE outbox.contracts c SET state = set_contract_state.state, state_changed_at = now()
    WHERE c.operation_type = set_contract_state.operation_type
      AND c.version = set_contract_state.version;
    INSERT INTO outbox.audit (actor, action, reason, from_status, to_status, details)
    VALUES (actor, 'contract_' || state, reason, v_was, state,
            jsonb_build_object('operation_type', operation_type, 'version', version));
    RETURN state;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.set_ordering_mode(text,text,text)
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks,
--     0025_an_audit_that_tells_the_truth

CREATE OR REPLACE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text, actor text)
 RETURNS integer
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.set_ordering_mode(operation_type, on_failure, actor, NULL::text)
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.set_ordering_mode(text,text,text,text)
-- history: created by 0025_an_audit_that_tells_the_truth

CREATE OR REPLACE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text, actor text, reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
DECLARE
    v_key record;
    v_promoted integer := 0;
    v_before text;
BEGIN
    IF on_failure IS NULL OR on_failure NOT IN ('block', 'skip') THEN
        RAISE EXCEPTION 'on_failure must be block or skip, not %', coalesce(on_failure, 'NULL')
            USING ERRCODE = 'OB002', COLUMN = 'on_failure';
    END IF;
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    PERFORM outbox.check_text('actor', actor, 255);
    PERFORM outbox.check_text('reason', reason, 2000, false);
    SELECT m.on_failure INTO v_before FROM outbox.ordering_modes m
    WHERE m.operation_type = operation_type;
    INSERT INTO outbox.ordering_modes AS m (operation_type, on_failure, updated_by)
    VALUES (operation_type, on_failure, actor)
    ON CONFLICT ON CONSTRAINT ordering_modes_pkey
    DO UPDATE SET on_failure = EXCLUDED.on_failure, updated_at = now(),
                  updated_by = EXCLUDED.updated_by;
    IF on_failure = 'skip' THEN
        FOR v_key IN
            SELECT DISTINCT o.tenant_id, o.ordering_key
            FROM outbox.operations o
            WHERE o.operation_type = operation_type AND o.ordering_key IS NOT NULL
              AND NOT o.ordering_blocked AND o.status IN ('quarantined', 'reconciling')
            ORDER BY o.tenant_id, o.ordering_key
        LOOP
            PERFORM outbox.lock_ordering_key(v_key.tenant_id, v_key.ordering_key);
            IF outbox.promote_next(v_key.tenant_id, v_key.ordering_key) IS NOT NULL THEN
                v_promoted := v_promoted + 1;
            END IF;
        END LOOP;
    END IF;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details, db_user)
    VALUES (NULL, actor, 'ordering_mode',
            coalesce(nullif(btrim(reason), ''), 'ordering set-mode, no reason given'),
            jsonb_build_object('operation_type', operation_type, 'on_failure', on_failure,
                               'before', coalesce(v_before, 'block'), 'keys_released', v_promoted,
                               'db_user', session_user),
            session_user);
    RETURN v_promoted;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.stage_due(integer)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.stage_due(p_limit integer)
 RETURNS TABLE(staged bigint, next_in double precision)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM outbox.check_count('limit', p_limit, 0, 100000);
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT o.id FROM outbox.operations o
        WHERE o.scheduled AND o.available_at <= now()
        ORDER BY o.available_at, o.id
        LIMIT p_limit::integer
        FOR UPDATE SKIP LOCKED
    ),
    staged AS (
        UPDATE outbox.operations AS o SET scheduled = false
        WHERE o.id = ANY (ARRAY(SELECT id FROM due)) AND o.scheduled
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM staged) AS staged,
           (SELECT extract(epoch FROM min(o.available_at) - now())::float8
            FROM outbox.operations o WHERE o.scheduled AND o.available_at > now()) AS next_in;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.take_tokens(text,double precision,double precision,integer,integer)
-- history: created by 0016_provider_buckets; changed by
--     0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.take_tokens(provider text, rate double precision, burst double precision, wanted integer, returned integer)
 RETURNS TABLE(granted integer, tokens double precision)
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.check_number('rate', take_tokens.rate, 1e-6, 1e6),
           outbox.check_number('burst', take_tokens.burst, 1, 1e6),
           outbox.check_count('wanted', take_tokens.wanted, 0, 100000),
           outbox.check_count('returned', take_tokens.returned, 0, 100000);
    INSERT INTO outbox.provider_buckets AS b (provider, rate, burst, tokens, refilled_at, taken)
    VALUES (take_tokens.provider, take_tokens.rate, take_tokens.burst, 0, now(), 0)
    ON CONFLICT ON CONSTRAINT provider_buckets_pkey DO UPDATE
    -- Every right-hand side reads the row as it was: `taken` and `tokens` agree on the level.
    -- greatest(..., 0): a transaction that began before the last refill must not refill
    -- backwards.
    SET taken = greatest(0, least(take_tokens.wanted, floor(least(take_tokens.burst,
                    b.tokens + take_tokens.returned + take_tokens.rate
                    * greatest(extract(epoch FROM now() - b.refilled_at)::float8, 0)))))::integer,
        tokens = least(take_tokens.burst,
                    b.tokens + take_tokens.returned + take_tokens.rate
                    * greatest(extract(epoch FROM now() - b.refilled_at)::float8, 0))
                 - greatest(0, least(take_tokens.wanted, floor(least(take_tokens.burst,
                    b.tokens + take_tokens.returned + take_tokens.rate
                    * greatest(extract(epoch FROM now() - b.refilled_at)::float8, 0))))),
        refilled_at = greatest(b.refilled_at, now()),
        rate = take_tokens.rate,
        burst = take_tokens.burst
    RETURNING b.taken, b.tokens
$function$;
COMMENT ON FUNCTION outbox.take_tokens(text,double precision,double precision,integer,integer) IS 'Give back `returned` tokens and take up to `wanted` from a provider''s bucket, refilled by now().';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.take_turn()
-- history: created by 0015_ordering_keys; changed by 0019_limits_schedule_and_key_locks
-- fired by trigger operations_take_turn ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.take_turn()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_xid xid8 := pg_current_xact_id();
    -- This row's key still noted: this is the first firing for the transaction's notes.
    v_first boolean := EXISTS (SELECT 1 FROM outbox.ordering_turns t
                               WHERE t.xid = v_xid AND t.tenant_id = NEW.tenant_id
                                 AND t.ordering_key = NEW.ordering_key);
    v_key record;
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        IF v_first THEN
            INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
            SELECT t.tenant_id, t.ordering_key FROM outbox.ordering_turns t WHERE t.xid = v_xid;
            DELETE FROM outbox.ordering_turns t WHERE t.xid = v_xid;
        ELSE
            INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
            VALUES (NEW.tenant_id, NEW.ordering_key);
        END IF;
        RETURN NULL;
    END IF;
    IF v_first THEN
        FOR v_key IN
            SELECT t.tenant_id, t.ordering_key FROM outbox.ordering_turns t
            WHERE t.xid = v_xid
            ORDER BY t.tenant_id, t.ordering_key
        LOOP
            PERFORM outbox.lock_ordering_key(v_key.tenant_id, v_key.ordering_key);
            PERFORM outbox.promote_next(v_key.tenant_id, v_key.ordering_key);
        END LOOP;
        DELETE FROM outbox.ordering_turns t WHERE t.xid = v_xid;
        RETURN NULL;
    END IF;
    PERFORM outbox.lock_ordering_key(NEW.tenant_id, NEW.ordering_key);
    PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.tenant_glob_to_like(text)
-- history: created by 0035_allowances_match_the_tenant_exactly

CREATE OR REPLACE FUNCTION outbox.tenant_glob_to_like(pattern text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE STRICT
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    -- LIKE's escape character is \ by default: escape it first, then LIKE's wildcards.
    SELECT replace(replace(replace(replace(pattern, '\', '\\'), '%', '\%'), '_', '\_'), '*', '%')
$function$;
COMMENT ON FUNCTION outbox.tenant_glob_to_like(text) IS 'An allow-list tenant_pattern as the LIKE pattern that matches the same tenants: * any run of characters, every other character itself (sql/0035).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.throttle_bucket(text,double precision,double precision,interval)
-- history: created by 0016_provider_buckets; changed by
--     0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.throttle_bucket(provider text, rate double precision, burst double precision, pause interval)
 RETURNS double precision
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT outbox.check_number('rate', throttle_bucket.rate, 1e-6, 1e6),
           outbox.check_number('burst', throttle_bucket.burst, 1, 1e6),
           outbox.check_between('pause', throttle_bucket.pause, interval '0', interval '1 day');
    INSERT INTO outbox.provider_buckets AS b (provider, rate, burst, tokens, refilled_at)
    VALUES (throttle_bucket.provider, throttle_bucket.rate, throttle_bucket.burst,
            -throttle_bucket.rate * extract(epoch FROM throttle_bucket.pause)::float8, now())
    ON CONFLICT ON CONSTRAINT provider_buckets_pkey DO UPDATE
    SET tokens = least(least(throttle_bucket.burst, b.tokens + throttle_bucket.rate
                             * greatest(extract(epoch FROM now() - b.refilled_at)::float8, 0)),
                       -throttle_bucket.rate * extract(epoch FROM throttle_bucket.pause)::float8),
        refilled_at = greatest(b.refilled_at, now()),
        taken = 0,
        rate = throttle_bucket.rate,
        burst = throttle_bucket.burst
    RETURNING b.tokens
$function$;
COMMENT ON FUNCTION outbox.throttle_bucket(text,double precision,double precision,interval) IS 'After a 429: empty a provider''s bucket and push it into debt for the provider''s Retry-After.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.touch_check(bigint)
-- history: created by 0009_stricter_retry_checks_and_audit; changed by 0011_security_definer

CREATE OR REPLACE FUNCTION outbox.touch_check(operation_id bigint)
 RETURNS void
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    UPDATE outbox.operations o SET checked_at = now()
    WHERE o.id = touch_check.operation_id AND o.status = 'reconciling';
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.try_lock_ordering_key(text,text)
-- history: created by 0019_limits_schedule_and_key_locks

CREATE OR REPLACE FUNCTION outbox.try_lock_ordering_key(tenant_id text, ordering_key text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_variable
BEGIN
    PERFORM 1 FROM outbox.ordering_keys k
    WHERE k.tenant_id = tenant_id AND k.ordering_key = ordering_key FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.try_wake_gate()
-- history: created by 0039_a_wake_gate_only_outbox_can_hold

CREATE OR REPLACE FUNCTION outbox.try_wake_gate()
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    LOCK TABLE outbox.wake_gate IN SHARE MODE NOWAIT;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END;
$function$;
COMMENT ON FUNCTION outbox.try_wake_gate() IS 'A dispatcher marking itself waiting: true (and the wake-up gate held until the end of its transaction) when no commit is becoming visible unseen; false at once otherwise (sql/0039).';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.unclaim(bigint,uuid,text,text,interval)
-- history: created by 0040_the_dispatcher_writes_through_functions

CREATE OR REPLACE FUNCTION outbox.unclaim(p_id bigint, p_lease_token uuid, p_status text, p_reason text, p_delay interval)
 RETURNS SETOF bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF p_status IS NULL OR p_status NOT IN ('pending', 'reconciling') THEN
        RAISE EXCEPTION 'a row handed back goes to pending or reconciling, not %',
            coalesce(p_status, 'NULL') USING ERRCODE = '22023';
    END IF;
    IF p_delay IS NOT NULL THEN
        PERFORM outbox.check_between('delay', p_delay, interval '0', interval '366 days');
    END IF;
    RETURN QUERY
    UPDATE outbox.operations AS o
    SET status = p_status,
        status_reason = p_reason,
        attempts = o.attempts - 1,
        -- Shutdown keeps the row's place in line; a row handed back for later waits its delay.
        available_at = coalesce(now() + p_delay, o.available_at),
        scheduled = coalesce(p_status = 'pending' AND p_delay > interval '0', false),
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        updated_at = now(),
        status_changed_at = now()
    WHERE o.id = p_id AND o.lease_token = p_lease_token AND o.status = 'in_flight'
    RETURNING o.id;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.unnamed_origin()
-- history: created by 0048_the_origin_is_part_of_the_identity

CREATE OR REPLACE FUNCTION outbox.unnamed_origin()
 RETURNS uuid
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT '00000000-0000-0000-0000-000000000000'::uuid $function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.wake_dispatchers()
-- history: created by 0012_wake_only_idle_dispatchers; changed by 0029_one_wakeup_per_idle_period,
--     0039_a_wake_gate_only_outbox_can_hold
-- fired by trigger operations_wake_dispatchers ON outbox.operations

CREATE OR REPLACE FUNCTION outbox.wake_dispatchers()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    BEGIN
        -- Held from here until this transaction's rows are visible (locks outlast the commit's
        -- visibility), or not at all: never waited for.
        LOCK TABLE outbox.wake_gate IN ROW EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        -- A dispatcher is marking itself this instant (or the owner holds the gate): notify, as
        -- every commit did before 0029; one notification per transaction, however many rows.
        PERFORM pg_notify('outbox_enqueue', '');
        RETURN NULL;
    END;
    IF current_setting('synchronous_standby_names') = '' THEN
        -- No synchronous standby: a NOTIFY costs a commit little, so marks stay, and a
        -- dispatcher need not mark itself again after every wake-up (a statement each time).
        -- Nothing counted: a dispatcher whose mark stays claims once more after any fresh mark.
        IF EXISTS (SELECT 1 FROM outbox.waiting_dispatchers
                   WHERE seen_at > now() - interval '10 minutes') THEN
            PERFORM pg_notify('outbox_enqueue', '');
        END IF;
        RETURN NULL;
    END IF;
    DELETE FROM outbox.waiting_dispatchers w
    WHERE w.worker IN (SELECT m.worker FROM outbox.waiting_dispatchers m
                       WHERE m.seen_at > now() - interval '10 minutes'
                       FOR UPDATE SKIP LOCKED);
    IF FOUND THEN
        -- 'taken': the woken dispatchers are marked no more, and mark themselves again.
        PERFORM pg_notify('outbox_enqueue', 'taken');
    ELSE
        PERFORM nextval('outbox.unnotified_commits');
    END IF;
    RETURN NULL;
END;
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.wake_lock_space()
-- history: created by 0029_one_wakeup_per_idle_period; changed by
--     0039_a_wake_gate_only_outbox_can_hold

CREATE OR REPLACE FUNCTION outbox.wake_lock_space()
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF outbox.try_wake_gate() THEN
        RETURN 1869968504;  -- 'outx' as a big-endian integer, 0029's
    END IF;
    RETURN NULL;
END;
$function$;
COMMENT ON FUNCTION outbox.wake_lock_space() IS 'For dispatchers of versions before sql/0039 only: tries the wake-up gate (try_wake_gate) and gives the key of 0029''s advisory lock only when it holds it, NULL otherwise.';
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.with_intent(outbox.claimed_row[])
-- history: created by 0045_deliveries_carry_their_origin_and_fingerprint

CREATE OR REPLACE FUNCTION outbox.with_intent(p_rows outbox.claimed_row[])
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid)
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT r.id, r.tenant_id, r.operation_type, r.operation_key, r.provider, r.action, r.payload,
           r.payload_bytes, r.payload_limit, r.idempotency_key, r.correlation_id, r.traceparent,
           r.attempts, r.attempt_base, r.max_attempts, r.lease_token, r.first_sent_at,
           r.created_at, r.claimed_at, r.api_version,
           o.ordering_key, o.fingerprint, (SELECT i.origin FROM outbox.installation i)
    FROM unnest(p_rows) WITH ORDINALITY AS r
    JOIN outbox.operations o ON o.id = r.id
    ORDER BY r.ordinality
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.with_intent_v3(outbox.claimed_row[])
-- history: created by 0054_the_dispatcher_checks_contracts

CREATE OR REPLACE FUNCTION outbox.with_intent_v3(p_rows outbox.claimed_row[])
 RETURNS TABLE(id bigint, tenant_id text, operation_type text, operation_key text, provider text, action text, payload text, payload_bytes integer, payload_limit integer, idempotency_key text, correlation_id text, traceparent text, attempts integer, attempt_base integer, max_attempts integer, lease_token uuid, first_sent_at timestamp with time zone, created_at timestamp with time zone, claimed_at timestamp with time zone, api_version text, ordering_key text, fingerprint bytea, origin uuid, contract_version integer)
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT r.id, r.tenant_id, r.operation_type, r.operation_key, r.provider, r.action, r.payload,
           r.payload_bytes, r.payload_limit, r.idempotency_key, r.correlation_id, r.traceparent,
           r.attempts, r.attempt_base, r.max_attempts, r.lease_token, r.first_sent_at,
           r.created_at, r.claimed_at, r.api_version,
           o.ordering_key, o.fingerprint, (SELECT i.origin FROM outbox.installation i),
           o.contract_version
    FROM unnest(p_rows) WITH ORDINALITY AS r
    JOIN outbox.operations o ON o.id = r.id
    ORDER BY r.ordinality
$function$;
-- privileges: the owner's only

-- =================================================================================================
-- function outbox.write_audit(outbox.operations,text,text,text,text,jsonb)
-- history: created by 0005_operator; changed by 0011_security_definer,
--     0025_an_audit_that_tells_the_truth

CREATE OR REPLACE FUNCTION outbox.write_audit(op outbox.operations, actor text, action text, reason text, to_status text, details jsonb)
 RETURNS void
 LANGUAGE sql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    INSERT INTO outbox.audit (operation_id, actor, action, reason, from_status, to_status, details,
                              db_user)
    VALUES (op.id, actor, action, reason, op.status, to_status,
            details || jsonb_build_object('db_user', session_user), session_user);
$function$;
-- privileges: the owner's only
