-- 0035: an allow-list rule matches its tenant exactly, or by a glob whose only wildcard is *
-- (issue 38).
--
-- 0026 matched enqueue_allowances.tenant_pattern with LIKE, so every _ in a tenant id was a
-- wildcard: a rule for acme_eu also admitted acme-eu and acmeXeu, tenants the operator never
-- named, to a provider such as a shared Stripe key. Tenant ids hold _ and % often enough
-- (check_text allows both), and nobody writing a rule thinks of escaping them.
--
-- Now a pattern is the tenant id as it is, where * alone stands for any run of characters
-- (none included): 'acme_eu' is that tenant only, 'eu-*' every tenant starting with eu-, '*'
-- every tenant. _, %, \ and every other character stand for themselves: they are escaped
-- before the LIKE that does the matching. A tenant id holding a * is matched by a pattern
-- that spells it, and also by that pattern read as a glob (a*b admits axb too); no such
-- tenant needs a rule of its own kind.
--
-- Rules already written for LIKE are rewritten, keeping what their author evidently meant: %
-- becomes *, a LIKE escape (\_ \% \\) the character it escaped; _ stays, and now matches only
-- itself, which is the point of this migration. A * in an old pattern (a literal star to LIKE)
-- becomes a wildcard, and is named in a WARNING; so is every rule whose text changes. Two old
-- rules that become one are kept once.

CREATE FUNCTION outbox.tenant_glob_to_like(pattern text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
    -- LIKE's escape character is \ by default: escape it first, then LIKE's wildcards.
    SELECT replace(replace(replace(replace(pattern, '\', '\\'), '%', '\%'), '_', '\_'), '*', '%')
$$;
REVOKE ALL ON FUNCTION outbox.tenant_glob_to_like(text) FROM PUBLIC;
COMMENT ON FUNCTION outbox.tenant_glob_to_like(text) IS
    'An allow-list tenant_pattern as the LIKE pattern that matches the same tenants: * any run '
    'of characters, every other character itself (sql/0035).';

DO $$
DECLARE
    r record;
    converted text;
BEGIN
    CREATE TEMPORARY TABLE allowances_0035 ON COMMIT DROP AS
        SELECT * FROM outbox.enqueue_allowances;
    FOR r IN SELECT * FROM allowances_0035 ORDER BY tenant_pattern, provider, action LOOP
        -- Read the LIKE pattern one token at a time: an escape pair, or one character.
        SELECT string_agg(CASE WHEN m[1] = '%' THEN '*'
                               WHEN m[1] LIKE '\\_' THEN substr(m[1], 2)
                               ELSE m[1] END, '' ORDER BY n)
        INTO converted
        FROM regexp_matches(r.tenant_pattern, '(\\.|.)', 'g') WITH ORDINALITY AS t (m, n);
        IF converted IS DISTINCT FROM r.tenant_pattern OR strpos(r.tenant_pattern, '_') > 0 THEN
            RAISE WARNING 'enqueue_allowances: the tenant pattern % (LIKE) is now % (exact, * any '
                          'run of characters), for provider % action %',
                quote_literal(r.tenant_pattern), quote_literal(converted), r.provider, r.action;
        END IF;
        IF strpos(r.tenant_pattern, '*') > 0 THEN
            RAISE WARNING 'enqueue_allowances: the * in tenant pattern % matched itself under LIKE '
                          'and now matches any run of characters',
                quote_literal(r.tenant_pattern);
        END IF;
        UPDATE allowances_0035 a SET tenant_pattern = converted
        WHERE a.tenant_pattern = r.tenant_pattern AND a.provider = r.provider
          AND a.action = r.action;
    END LOOP;
    DELETE FROM outbox.enqueue_allowances;
    INSERT INTO outbox.enqueue_allowances SELECT * FROM allowances_0035 ON CONFLICT DO NOTHING;
END;
$$;

COMMENT ON TABLE outbox.enqueue_allowances IS
    'What each tenant may enqueue: tenant_pattern the tenant id exactly, * any run of characters '
    '(sql/0035); provider; action exactly or *. Empty: everything.';

-- 0026's, with the tenant matched by the glob instead of LIKE.
CREATE OR REPLACE FUNCTION outbox.require_allowance(tenant_id text, provider text, action text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
