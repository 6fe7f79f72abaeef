-- 0050: a success at its first attempt writes one row, not two (issue 41, "a success that
-- writes what it must, once").
--
-- Until now every recorded attempt was a row of outbox.attempts, a success at the first attempt
-- included: the most common outcome by far cost a second row, its primary-key entry and, for the
-- foreign key, a KEY SHARE lock on the operation's new version (one more WAL record). In bare
-- workers without it the drain ran 1.12x (issue 41; with the unique keys apart as well, 1.6 to
-- 2.3x: bench/README.md, "Lifecycles in bare workers").
--
-- Now such a success is kept on the operation: record_attempts sets success_worker,
-- success_http_status and success_request_id (the attempt's facts the row lacks: its key, start
-- and end are the row's idempotency_key, last_attempt_at and finished_at, which nothing changes
-- after a success) and writes no attempt row. The table of attempts is renamed attempt_log, and
-- outbox.attempts becomes a view of it plus one row per such success, column for column as the
-- row would have been, so every reader (show, the "was my record committed?" question, the last
-- error of a list, reconciliation's "every key any sent attempt carried") reads what it read.
--
-- Why only the first attempt, and only a success that was sent: the row then stands for the
-- operation's whole history, so the view's attempt number is 1 and no attempt_log row can share
-- it (a rescued attempt keeps its number, the next claim takes the next one); an operation that
-- failed first keeps every attempt in the log, its success included. A succeeded operation is
-- final: no function changes its key, its last_attempt_at or its finished_at afterwards.
--
-- The view runs with its reader's privileges (security_invoker): a role reads it when it reads
-- both operations and attempt_log, as outbox_dispatcher and outbox_operator do (sql/roles.sql,
-- which grants attempt_log too); the grants of the table are copied to the view here, so running
-- roles.sql again is not needed for a rolling upgrade. Nothing writes the view: the functions
-- write attempt_log. Dispatchers of earlier versions keep working: record_attempts and
-- rescue_leases keep their signatures, and what they read of outbox.attempts is still there.

ALTER TABLE outbox.attempts RENAME TO attempt_log;
COMMENT ON TABLE outbox.attempt_log IS 'Every attempt but a success at the first, which stays on its operation; outbox.attempts shows both (sql/0050).';

-- Nullable and without a default: added without rewriting the table.
ALTER TABLE outbox.operations
    ADD COLUMN success_worker text,
    ADD COLUMN success_http_status integer,
    ADD COLUMN success_request_id text;
COMMENT ON COLUMN outbox.operations.success_worker IS 'The worker of a success at the first attempt, kept here instead of a row of attempt_log; set exactly for such a success (sql/0050).';

CREATE VIEW outbox.attempts WITH (security_invoker = true) AS
SELECT l.operation_id, l.attempt, l.idempotency_key, l.worker, l.started_at, l.finished_at,
       l.outcome, l.sent, l.error_class, l.error_message, l.http_status, l.provider_request_id
FROM outbox.attempt_log l
UNION ALL
SELECT o.id, 1, o.idempotency_key, o.success_worker, o.last_attempt_at, o.finished_at,
       'succeeded', true, NULL, NULL, o.success_http_status, o.success_request_id
FROM outbox.operations o
WHERE o.success_worker IS NOT NULL;
COMMENT ON VIEW outbox.attempts IS 'The delivery history of every operation, one row per attempt: attempt_log, and the success at the first attempt kept on its operation (sql/0050).';

-- Whoever read the table reads the view.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
        FROM pg_class c, aclexplode(c.relacl) a
        LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.oid = 'outbox.attempt_log'::regclass AND a.privilege_type = 'SELECT'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT SELECT ON outbox.attempts TO %s', g.grantee);
    END LOOP;
END;
$grants$;

CREATE OR REPLACE FUNCTION outbox.record_attempts(p_worker text, p_batch jsonb)
RETURNS TABLE (operation_id bigint, attempt integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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
