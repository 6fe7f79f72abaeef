-- 0003: what operators did to operations (reconcile resolve/retry/cancel, quarantine replay/cancel):
-- who, when and why. Rows are never changed once written.

CREATE TABLE outbox.audit (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- No foreign key: the record of a decision outlives the pruning of its operation.
    operation_id bigint      NOT NULL,
    at           timestamptz NOT NULL DEFAULT now(),
    actor        text        NOT NULL,
    action       text        NOT NULL,
    reason       text        NOT NULL,
    from_status  text,
    to_status    text,
    details      jsonb       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX audit_operation ON outbox.audit (operation_id, at);

COMMENT ON TABLE outbox.audit IS 'Operator actions on operations; append-only.';

CREATE FUNCTION outbox.audit_is_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox.audit is append-only: rows are never updated'
        USING ERRCODE = 'OB003', TABLE = 'audit', SCHEMA = 'outbox';
END;
$$;

CREATE TRIGGER audit_append_only BEFORE UPDATE ON outbox.audit
    FOR EACH ROW EXECUTE FUNCTION outbox.audit_is_append_only();
