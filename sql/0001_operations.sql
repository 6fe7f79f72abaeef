-- 0001: the operations table. One row is one business intent to call a provider once.
-- The migration runner creates the outbox schema and wraps each file in a transaction.

CREATE TABLE outbox.operations (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Identity, chosen by the application: the same identity is the same intent.
    tenant_id         text        NOT NULL,
    operation_type    text        NOT NULL,
    operation_key     text        NOT NULL,
    -- sha256 of provider, action and payload: the same identity with another fingerprint is a conflict.
    fingerprint       bytea       NOT NULL,
    provider          text        NOT NULL,
    action            text        NOT NULL,
    payload           jsonb       NOT NULL,
    -- Sent on every attempt; only an operator's reconcile retry moves to a new generation.
    idempotency_key   text        NOT NULL,
    key_generation    integer     NOT NULL DEFAULT 1,
    correlation_id    text,
    traceparent       text,
    status            text        NOT NULL DEFAULT 'pending',
    -- Why the row is quarantined or reconciling (or cancelled): shown to the operator.
    status_reason     text,
    attempts          integer     NOT NULL DEFAULT 0,
    -- NULL means the dispatcher's configured max_attempts.
    max_attempts      integer,
    available_at      timestamptz NOT NULL DEFAULT now(),
    lease_owner       text,
    lease_token       uuid,
    lease_expires_at  timestamptz,
    -- The first attempt that may have reached the provider: the key window counts from here.
    first_sent_at     timestamptz,
    last_attempt_at   timestamptz,
    provider_ref      text,
    result            jsonb,
    last_error        text,
    last_error_class  text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    status_changed_at timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,

    CONSTRAINT operations_identity UNIQUE (tenant_id, operation_type, operation_key),
    -- Mirrors outbox.model.Status; a test keeps the two equal.
    CONSTRAINT operations_status_valid CHECK (
        status IN ('pending', 'in_flight', 'succeeded', 'quarantined', 'reconciling', 'cancelled')
    ),
    CONSTRAINT operations_error_class_valid CHECK (
        last_error_class IN ('transient', 'permanent', 'unknown')
    ),
    -- A lease exists exactly while the row is in flight, so no finished row can look leased.
    CONSTRAINT operations_lease_only_in_flight CHECK (
        (status = 'in_flight') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)
    ),
    -- Our promise: nothing is succeeded without the provider's reference.
    CONSTRAINT operations_succeeded_has_ref CHECK (status <> 'succeeded' OR provider_ref IS NOT NULL),
    CONSTRAINT operations_attempts_valid CHECK (attempts >= 0),
    CONSTRAINT operations_max_attempts_valid CHECK (max_attempts IS NULL OR max_attempts > 0),
    CONSTRAINT operations_key_generation_valid CHECK (key_generation >= 1)
);

COMMENT ON TABLE outbox.operations IS
    'Operations recorded by producers through outbox.enqueue and delivered by outbox run.';

-- The claim reads only due pending rows; a partial index keeps millions of finished rows out of
-- its way, and (available_at, id) is the claim's ORDER BY.
CREATE INDEX operations_claim ON outbox.operations (available_at, id) WHERE status = 'pending';

-- The rescuer looks for expired leases among in-flight rows only.
CREATE INDEX operations_lease ON outbox.operations (lease_expires_at) WHERE status = 'in_flight';

-- What needs a person: operators list these, and the gauges read the oldest of each.
CREATE INDEX operations_attention ON outbox.operations (status, status_changed_at)
    WHERE status IN ('reconciling', 'quarantined');
