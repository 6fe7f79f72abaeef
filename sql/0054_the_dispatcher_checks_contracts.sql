-- 0054: the dispatcher checks an operation's payload against its contract before the first send
-- (issue 42). Enqueue's own check is the Python API's (sql/0053): a row written by the SQL
-- function, or by hand past it, reaches the dispatcher unchecked, and must not reach the
-- provider if it breaks the contract it names. So each claimed row carries its contract_version.
--
-- As in 0045: a function's result type cannot change in place and dispatchers of the previous
-- version read the claims' rows by position, so the new shape gets new functions (_v3) beside
-- the old ones, which the dispatchers of a rolling upgrade go on calling (and which check
-- nothing) until they are replaced. Each _v3 keeps its claim's rows and then, in a second
-- statement, reads what the delivery carries by the row's id (the snapshot reason of 0045).

-- The claimed rows with their intent (0045) and their contract's version, in the claim's order.
-- Granted to no one: only the _v3 claims, run as the owner, call it.
CREATE FUNCTION outbox.with_intent_v3(p_rows outbox.claimed_row[])
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid,
        contract_version integer)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.id, r.tenant_id, r.operation_type, r.operation_key, r.provider, r.action, r.payload,
           r.payload_bytes, r.payload_limit, r.idempotency_key, r.correlation_id, r.traceparent,
           r.attempts, r.attempt_base, r.max_attempts, r.lease_token, r.first_sent_at,
           r.created_at, r.claimed_at, r.api_version,
           o.ordering_key, o.fingerprint, (SELECT i.origin FROM outbox.installation i),
           o.contract_version
    FROM unnest(p_rows) WITH ORDINALITY AS r
    JOIN outbox.operations o ON o.id = r.id
    ORDER BY r.ordinality
$$;

-- CLAIM: claim_fair's rows with their intent and contract version.
CREATE FUNCTION outbox.claim_fair_v3(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text,
    p_max_groups integer)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid,
        contract_version integer)
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
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$$;

-- CLAIM_ONE_GROUP: claim_one_group's rows with their intent and contract version.
CREATE FUNCTION outbox.claim_one_group_v3(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[])
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid,
        contract_version integer)
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
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$$;

-- CLAIM_PROBE: claim_probe's rows with their intent and contract version.
CREATE FUNCTION outbox.claim_probe_v3(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text, ordering_key text, fingerprint bytea, origin uuid,
        contract_version integer)
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
    RETURN QUERY SELECT * FROM outbox.with_intent_v3(v_rows);
END;
$$;

REVOKE ALL ON FUNCTION
    outbox.with_intent_v3(outbox.claimed_row[]),
    outbox.claim_fair_v3(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group_v3(text, interval, integer, text[], integer[]),
    outbox.claim_probe_v3(text, text, interval, text)
FROM PUBLIC;

-- A dispatcher of this version calls these as soon as the schema has them (roles.sql grants
-- the same when it runs next).
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.claim_fair_v3(text, interval, integer, text[], integer[], text, text, integer),
            outbox.claim_one_group_v3(text, interval, integer, text[], integer[]),
            outbox.claim_probe_v3(text, text, interval, text)
        TO outbox_dispatcher;
    END IF;
END;
$$;
