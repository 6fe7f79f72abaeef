-- 0045: every delivery names the database it came from and the fingerprint of its intent
-- (issue 40: the receiving half shares the sender's fingerprint).
--
-- An inbox knows a delivery from outbox by its operation id. Operation ids are per database: two
-- services with outbox databases of their own that feed one worker handler send operation 1234
-- each, and the second would be taken for a repeat of the first (replayed, its effect lost) or
-- for a conflict (never run). So each database gets a public id, outbox.installation.origin, that
-- a delivery carries (Outbox-Origin) and the inbox keys by. Unlike key_secret it is no secret: it
-- names the database, like a server's system identifier, but survives pg_dump and restore (a
-- restored database is the same sender; its redeliveries must find their records).
--
-- The claim functions return three more columns per row (ordering_key, fingerprint, origin), so
-- that a provider can send enqueue's fingerprint and the receiver can check the body it got
-- against it. A function's result type cannot change in place, and dispatchers of the previous
-- version read the claims' rows by position (SELECT *): the new shape gets new functions (_v2)
-- beside the old ones, which the dispatchers of a rolling upgrade go on calling until they are
-- replaced. Each _v2 keeps its predecessor's rows and then, in a second statement, reads the
-- three columns of each by its id. Not one statement with a join: its snapshot would be taken
-- before the claim ran, and a row enqueued in between, claimed but not yet visible to it, would
-- be leased and never returned. One primary-key probe per claimed row.

ALTER TABLE outbox.installation ADD COLUMN origin uuid NOT NULL DEFAULT gen_random_uuid();
COMMENT ON TABLE outbox.installation IS 'This database''s secret, mixed into derived idempotency keys (sql/0041), and its public id, origin, which every delivery carries (sql/0045). The schema owner''s alone; never granted.';

-- A claimed row as the claim functions of 0040 return it, kept between the two statements below.
CREATE TYPE outbox.claimed_row AS (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text);

-- The origin of this database's deliveries, for operators and tests (the dispatcher gets it
-- with each claimed row).
CREATE FUNCTION outbox.origin() RETURNS uuid
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$ SELECT i.origin FROM outbox.installation i $$;
COMMENT ON FUNCTION outbox.origin() IS 'The public id of this database, which every delivery of its operations carries as Outbox-Origin (sql/0045).';

-- The claimed rows with their operation's ordering key and fingerprint, and this database's
-- origin, in the claim's order. Granted to no one: only the _v2 claims, run as the owner, call it.
CREATE FUNCTION outbox.with_intent(p_rows outbox.claimed_row[])
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.id, r.tenant_id, r.operation_type, r.operation_key, r.provider, r.action, r.payload,
           r.payload_bytes, r.payload_limit, r.idempotency_key, r.correlation_id, r.traceparent,
           r.attempts, r.attempt_base, r.max_attempts, r.lease_token, r.first_sent_at,
           r.created_at, r.claimed_at, r.api_version,
           o.ordering_key, o.fingerprint, (SELECT i.origin FROM outbox.installation i)
    FROM unnest(p_rows) WITH ORDINALITY AS r
    JOIN outbox.operations o ON o.id = r.id
    ORDER BY r.ordinality
$$;

-- CLAIM: claim_fair's rows with their intent.
CREATE FUNCTION outbox.claim_fair_v2(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text,
    p_max_groups integer)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- CLAIM_ONE_GROUP: claim_one_group's rows with their intent.
CREATE FUNCTION outbox.claim_one_group_v2(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[])
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- CLAIM_PROBE: claim_probe's rows with their intent.
CREATE FUNCTION outbox.claim_probe_v2(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

REVOKE ALL ON FUNCTION
    outbox.origin(),
    outbox.with_intent(outbox.claimed_row[]),
    outbox.claim_fair_v2(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group_v2(text, interval, integer, text[], integer[]),
    outbox.claim_probe_v2(text, text, interval, text)
FROM PUBLIC;

-- A dispatcher of this version calls these as soon as the schema has them (roles.sql grants
-- the same when it runs next).
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.claim_fair_v2(text, interval, integer, text[], integer[], text, text, integer),
            outbox.claim_one_group_v2(text, interval, integer, text[], integer[]),
            outbox.claim_probe_v2(text, text, interval, text)
        TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.origin() TO outbox_operator;
    END IF;
END;
$$;
