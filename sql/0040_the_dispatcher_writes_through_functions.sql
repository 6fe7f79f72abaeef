-- 0040: the dispatcher changes operations and attempts only through functions (issue 38, item 1).
--
-- Until now outbox_dispatcher held UPDATE on the state, lease and result columns of
-- outbox.operations and INSERT on outbox.attempts, so its credential alone could rewrite
-- history with no trace: a quarantined operation set back to pending with first_sent_at NULL
-- (sent again outside its key window, on no operator's word), an operation marked succeeded
-- with a forged reference, attempts that never happened, a reconciliation check deferred by a
-- thousand years, a provider's bucket throttled for as long.
--
-- Now every write the dispatcher makes to those two tables is one of the functions below,
-- SECURITY DEFINER with search_path pinned, and roles.sql grants only them (no INSERT, UPDATE
-- or DELETE on either table). Each enforces the part of the lifecycle that is the dispatcher's
-- (docs/design.md, "Status lifecycle"): a claim leases only due pending rows that it picks itself;
-- a record or an unclaim changes only a row in flight under the caller's lease token and
-- attempt, into the statuses a dispatcher may give it, and writes exactly one attempt row per
-- record; a heartbeat renews only the caller's leases; the rescuer takes back only expired
-- leases; the stager moves only scheduled rows that are due. Arguments are bounded: a lease of
-- at most a day, a retry delay of at most 366 days, a throttle of at most a day, a check
-- deferred by at most 31 days. What stays the dispatcher's to say is the outcome of a call it
-- made under a lease it holds: that is what a dispatcher is for.
--
-- The statements are those of outbox/db/statements.py before this migration, moved here as
-- they were; statements.py now calls these functions. PL/pgSQL, not SQL functions: a SECURITY
-- DEFINER function is never inlined, and PL/pgSQL keeps each statement's plan for the session
-- (as psycopg's prepared statements did), where a SQL function plans its body at every call.
--
-- Upgrading: migrate, then deploy dispatchers of this version, then run roles.sql again (it
-- revokes the table privileges that dispatchers of earlier versions still use).

-- Argument checks shared by the functions below: SQLSTATE 22023 (invalid_parameter_value),
-- which a dispatcher of this version never provokes.
CREATE FUNCTION outbox.check_between(name text, value interval, low interval, high interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$$;

CREATE FUNCTION outbox.check_count(name text, value bigint, low bigint, high bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$$;

CREATE FUNCTION outbox.check_number(name text, value double precision, low double precision,
                                    high double precision)
RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- NaN sorts above every number, infinity above every finite one: both are refused.
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION '% must be % to %, not %', name, low, high, coalesce(value::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
END;
$$;

-- A dispatcher's name (outbox.dispatcher's worker id: host, pid and a random part).
CREATE FUNCTION outbox.check_worker(worker text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF worker IS NULL OR length(worker) NOT BETWEEN 1 AND 400 THEN
        RAISE EXCEPTION 'a worker name is 1 to 400 characters' USING ERRCODE = '22023';
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox.check_between(text, interval, interval, interval),
    outbox.check_count(text, bigint, bigint, bigint),
    outbox.check_number(text, double precision, double precision, double precision),
    outbox.check_worker(text) FROM PUBLIC;

-- The claims' last step: lease the rows a claim locked (FOR UPDATE SKIP LOCKED, so they are
-- this transaction's until it commits). Granted to no one: only the claim functions below,
-- which run as the owner, call it.
CREATE FUNCTION outbox.lease_claimed(p_ids bigint[], p_worker text, p_lease interval)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
REVOKE ALL ON FUNCTION outbox.lease_claimed(bigint[], text, interval) FROM PUBLIC;

-- CLAIM (outbox/db/statements.py): a fair share of due rows from each (provider, tenant)
-- group, the groups visited from just after (p_after_provider, p_after_tenant) and around.
CREATE FUNCTION outbox.claim_fair(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[], p_after_provider text, p_after_tenant text,
    p_max_groups integer)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- CLAIM_ONE_GROUP: while a single (provider, tenant) group has claimable rows, its oldest
-- due rows, without the fair claim's steps; nothing while several groups have rows.
CREATE FUNCTION outbox.claim_one_group(p_worker text, p_lease interval, p_limit integer,
    p_cap_providers text[], p_caps integer[])
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- CLAIM_PROBE: one due row of a provider whose breaker is half open, as its probe.
CREATE FUNCTION outbox.claim_probe(p_worker text, p_provider text, p_lease interval, p_after_tenant text)
RETURNS TABLE (
        id bigint, tenant_id text, operation_type text, operation_key text, provider text,
        action text, payload text, payload_bytes integer, payload_limit integer,
        idempotency_key text, correlation_id text, traceparent text, attempts integer,
        attempt_base integer, max_attempts integer, lease_token uuid,
        first_sent_at timestamptz, created_at timestamptz, claimed_at timestamptz,
        api_version text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- RECORD_MANY: the outcomes of attempts, one or many (the dispatcher's group commit), each
-- recorded only under the lease token and attempt of the claim it answers, as one attempt row
-- and the operation's next status. Refused whole (22023) if any entry is not one a dispatcher
-- makes: a status other than the four a record may give, an outcome that disagrees with it, a
-- retry delay outside 0 to 366 days, a reference longer than 1,024 characters. The provider's
-- texts (error, request id, ...) are cut to their bounds instead: they are the provider's words,
-- and an outcome must not be lost for their length.
CREATE FUNCTION outbox.record_attempts(p_worker text, p_batch jsonb)
RETURNS TABLE (operation_id bigint, attempt integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
               left(i.scope, 1024) AS scope
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
            updated_at = now(),
            status_changed_at = now(),
            finished_at = CASE WHEN i.status IN ('succeeded', 'cancelled') THEN now() END
        FROM input AS i
        WHERE o.id = i.id
          AND o.lease_token = i.lease_token
          AND o.attempts = i.attempt
          AND o.status = 'in_flight'
        RETURNING o.id, o.idempotency_key, o.last_attempt_at, i.attempt, i.outcome, i.sent,
                  i.error_class, i.error, i.http_status, i.request_id
    )
    INSERT INTO outbox.attempts (operation_id, attempt, idempotency_key, worker, started_at, outcome,
                                 sent, error_class, error_message, http_status, provider_request_id)
    SELECT id, attempt, idempotency_key, p_worker, last_attempt_at, outcome, sent, error_class,
           error, http_status, request_id
    FROM recorded
    RETURNING operation_id, attempt;
END;
$$;

-- UNCLAIM: a row handed back without an attempt, under its lease: to pending (due again after
-- p_delay, or keeping its place) or, its key window closed, to reconciliation.
CREATE FUNCTION outbox.unclaim(p_id bigint, p_lease_token uuid, p_status text, p_reason text,
                               p_delay interval)
RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- HEARTBEAT: renew the leases of calls still in flight, each under its token; returns the ids
-- still held.
CREATE FUNCTION outbox.renew_leases(p_ids bigint[], p_tokens uuid[], p_lease interval)
RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_between('lease', p_lease, interval '1 millisecond', interval '1 day');
    RETURN QUERY
    UPDATE outbox.operations AS o
    SET lease_expires_at = now() + p_lease
    FROM unnest(p_ids, p_tokens) AS held(id, token)
    WHERE o.id = held.id AND o.lease_token = held.token AND o.status = 'in_flight'
    RETURNING o.id;
END;
$$;

-- RESCUE: take back rows whose dispatcher stopped renewing its lease, each recorded as an
-- attempt of unknown outcome.
CREATE FUNCTION outbox.rescue_leases(p_limit integer, p_max_attempts integer)
RETURNS TABLE (id bigint, status text, status_reason text, provider text, tenant_id text,
               operation_type text, operation_key text, action text, attempts integer,
               correlation_id text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
        INSERT INTO outbox.attempts (operation_id, attempt, idempotency_key, worker, started_at,
                                     outcome, sent, error_class, error_message)
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
$$;

-- STAGE: scheduled operations that are due join the claim index; returns how many, and the
-- seconds until the next scheduled one is due (NULL: none is).
CREATE FUNCTION outbox.stage_due(p_limit integer)
RETURNS TABLE (staged bigint, next_in double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- EXPIRE_STRAY_LEASES: after a failover, this worker's leases that none of its calls holds,
-- taken before p_since, made expired so that the rescuer takes them back. Only ever expires a
-- lease, which is what a dispatcher's crash does too.
CREATE FUNCTION outbox.expire_stray_leases(p_worker text, p_held uuid[], p_since timestamptz)
RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- The bounds of the functions the dispatcher already called (0013, 0016, 0020): a check
-- deferred by at most 31 days (or a thousand years, never to be seen again), a provider
-- throttled for at most a day (a Retry-After is capped at an hour, http_wire.MAX_RETRY_AFTER).

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

REVOKE ALL ON FUNCTION
    outbox.claim_fair(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group(text, interval, integer, text[], integer[]),
    outbox.claim_probe(text, text, interval, text),
    outbox.record_attempts(text, jsonb),
    outbox.unclaim(bigint, uuid, text, text, interval),
    outbox.renew_leases(bigint[], uuid[], interval),
    outbox.rescue_leases(integer, integer),
    outbox.stage_due(integer),
    outbox.expire_stray_leases(text, uuid[], timestamptz)
FROM PUBLIC;

-- A dispatcher of this version calls these functions as soon as the schema has them; roles.sql
-- grants exactly them (and takes the table privileges away) when it runs next.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.claim_fair(text, interval, integer, text[], integer[], text, text, integer),
            outbox.claim_one_group(text, interval, integer, text[], integer[]),
            outbox.claim_probe(text, text, interval, text),
            outbox.record_attempts(text, jsonb),
            outbox.unclaim(bigint, uuid, text, text, interval),
            outbox.renew_leases(bigint[], uuid[], interval),
            outbox.rescue_leases(integer, integer),
            outbox.stage_due(integer),
            outbox.expire_stray_leases(text, uuid[], timestamptz)
        TO outbox_dispatcher;
    END IF;
END;
$$;
