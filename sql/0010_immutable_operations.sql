-- 0010: what a row asks of its provider never changes after enqueue: the identity, the provider,
-- the action, the payload, its fingerprint and the idempotency key. The one legitimate change is
-- an operator's reconcile retry, which moves a reconciling operation to the next key generation
-- (key, key:r2, key:r3, ...).
--
-- SQLSTATE OB005 operation_immutable: an UPDATE changed one of these columns; the COLUMN field
-- names it.

-- The key of the generation after ``generation`` for an operation that carries ``current_key``
-- now: the same expression outbox.retry_operation (0009) assigns; tests/integration/test_roles.py
-- retries through several generations, long keys included, so the two cannot drift apart unseen.
CREATE FUNCTION outbox.next_generation_key(current_key text, generation integer) RETURNS text
LANGUAGE sql IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.key_for_generation(
        CASE WHEN generation = 1 THEN current_key
             ELSE left(current_key, length(current_key) - length(':r' || generation)) END,
        generation + 1)
$$;

-- Why the rule looks at the change itself rather than at who makes it:
-- * exempting the table owner would exempt every SECURITY DEFINER function (they all run as the
--   owner), i.e. exactly the code that can touch these columns, and every migration;
-- * a transaction-local "rotation allowed" flag proves nothing: any session may set_config any
--   custom setting, and a SET clause on a function does not make the flag unforgeable.
-- The shape of a key rotation is checkable, though: reconciling -> pending, key_generation + 1,
-- and the key the next generation derives. Nothing else may change these columns, whoever asks.
-- Other roles never get this far: the dispatcher has no UPDATE privilege on them at all (the
-- roles script grants state, lease and result columns only), so this guard binds the owner's
-- functions and anyone granted too much.
CREATE FUNCTION outbox.operations_keep_immutable() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- UPDATE OF: the dispatcher's statements never name these columns, so the claim, record,
-- heartbeat and rescue do not pay for the trigger at all.
CREATE TRIGGER operations_immutable
    BEFORE UPDATE OF tenant_id, operation_type, operation_key, provider, action, payload,
                     fingerprint, idempotency_key, key_generation
    ON outbox.operations
    FOR EACH ROW EXECUTE FUNCTION outbox.operations_keep_immutable();
