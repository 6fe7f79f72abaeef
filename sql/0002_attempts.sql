-- 0002: one row per attempt to deliver an operation, written when its outcome is known
-- (by the dispatcher that made it, or by the rescuer when that dispatcher died).

CREATE TABLE outbox.attempts (
    operation_id        bigint      NOT NULL REFERENCES outbox.operations (id) ON DELETE CASCADE,
    attempt             integer     NOT NULL,
    -- The key this attempt carried: it changes only with an operator's reconcile retry.
    idempotency_key     text        NOT NULL,
    worker              text        NOT NULL,
    started_at          timestamptz NOT NULL,
    finished_at         timestamptz NOT NULL DEFAULT now(),
    outcome             text        NOT NULL,
    -- Whether the request may have reached the provider; the key window counts from the first such.
    sent                boolean     NOT NULL,
    error_class         text,
    error_message       text,
    http_status         integer,
    provider_request_id text,

    PRIMARY KEY (operation_id, attempt),
    CONSTRAINT attempts_outcome_valid CHECK (
        outcome IN ('succeeded', 'transient', 'permanent', 'unknown')
    ),
    CONSTRAINT attempts_number_valid CHECK (attempt >= 1)
);

COMMENT ON TABLE outbox.attempts IS 'The delivery history of every operation, one row per attempt.';
