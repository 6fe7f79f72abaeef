-- 0052: operation contracts (issue 42, first part): a JSON Schema per operation type and
-- version, published from the application's files by `outbox contracts push`, never changed
-- once published, and read back by the producer, the dispatcher and the inbox through
-- outbox.get_contract. Enqueue does not consult them yet.
--
-- The schema is stored as its canonical JSON text (sorted keys, no spaces, as
-- outbox/contracts/files.py writes it) with the SHA-256 of that text, which the table checks:
-- "the same content" is the same digest, whatever the layout of the file it came from. The
-- jsonb beside it is derived, for reading in SQL. What a schema may be (Draft 2020-12, local
-- references only, bounded size, depth and fan-out) is checked by the Python side before it
-- publishes; the function refuses only what it can see itself (the size, an object).

CREATE TABLE outbox.contracts (
    operation_type   text        NOT NULL,
    version          integer     NOT NULL,
    canonical        text        NOT NULL,
    digest           text        NOT NULL,
    document         jsonb       GENERATED ALWAYS AS (canonical::jsonb) STORED,
    state            text        NOT NULL DEFAULT 'active',
    published_at     timestamptz NOT NULL DEFAULT now(),
    published_by     text        NOT NULL,
    state_changed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT contracts_pkey PRIMARY KEY (operation_type, version),
    CONSTRAINT contracts_version_valid CHECK (version >= 1),
    CONSTRAINT contracts_state_valid CHECK (state IN ('active', 'deprecated', 'retired')),
    CONSTRAINT contracts_digest_valid
        CHECK (digest = encode(sha256(convert_to(canonical, 'UTF8')), 'hex'))
);
COMMENT ON TABLE outbox.contracts IS
    'Published operation contracts (issue 42): one JSON Schema per operation type and version, never changed once published; state active, deprecated or retired.';
REVOKE ALL ON outbox.contracts FROM PUBLIC;

-- A published version is kept as it is for good: operations name it, receivers check against
-- it. Only its state moves, through outbox.set_contract_state.
CREATE FUNCTION outbox.contracts_keep_published()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
CREATE TRIGGER contracts_keep_published BEFORE UPDATE OR DELETE ON outbox.contracts
    FOR EACH ROW EXECUTE FUNCTION outbox.contracts_keep_published();
CREATE TRIGGER contracts_no_truncate BEFORE TRUNCATE ON outbox.contracts
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.contracts_keep_published();

-- Publish one version: 'published', or 'unchanged' when the same content is there already. The
-- same version with other content is refused (OB008) naming both digests; the caller shows the
-- difference (it can read the published text with get_contract).
CREATE FUNCTION outbox.publish_contract(operation_type text, version integer, canonical text,
                                        actor text, reason text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
    INSERT INTO outbox.contracts AS c (operation_type, version, canonical, digest, published_by)
    VALUES (publish_contract.operation_type, publish_contract.version, publish_contract.canonical,
            v_digest, actor)
    ON CONFLICT ON CONSTRAINT contracts_pkey DO NOTHING;
    IF FOUND THEN
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
$$;

-- Deprecate, retire or reactivate a version, audited. Retired: refused at enqueue.
CREATE FUNCTION outbox.set_contract_state(operation_type text, version integer, state text,
                                          actor text, reason text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- One version as producers, dispatchers and receivers read it (none of them reads the table).
CREATE FUNCTION outbox.get_contract(operation_type text, version integer)
RETURNS TABLE (canonical text, digest text, state text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.canonical, c.digest, c.state FROM outbox.contracts c
    WHERE c.operation_type = get_contract.operation_type AND c.version = get_contract.version
$$;

REVOKE ALL ON FUNCTION outbox.contracts_keep_published(),
    outbox.publish_contract(text, integer, text, text, text),
    outbox.set_contract_state(text, integer, text, text, text),
    outbox.get_contract(text, integer)
FROM PUBLIC;

-- The roles of sql/roles.sql, where they exist already (roles.sql run again grants the same).
DO $grants$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT SELECT ON outbox.contracts TO outbox_operator;
        GRANT EXECUTE ON FUNCTION outbox.publish_contract(text, integer, text, text, text),
            outbox.set_contract_state(text, integer, text, text, text),
            outbox.get_contract(text, integer) TO outbox_operator;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_producer') THEN
        GRANT EXECUTE ON FUNCTION outbox.get_contract(text, integer) TO outbox_producer;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.get_contract(text, integer) TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_consumer') THEN
        GRANT EXECUTE ON FUNCTION outbox.get_contract(text, integer) TO outbox_consumer;
    END IF;
END
$grants$;
