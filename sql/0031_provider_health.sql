-- 0031: each provider's health, seen by on-call and kept across restarts (issue 37).
--
-- Every `outbox run` writes its breakers here (one row per provider and worker): on each
-- transition and every few seconds. `outbox providers` shows them; a dispatcher starting up
-- takes the newest open breaker of its providers from here, so that a restart (a crash loop, a
-- deploy) does not forget that a provider is down and send it a burst. Operators reset a breaker
-- or ask for a probe through outbox.request_provider_action, which writes the audit; every
-- dispatcher reads outbox.provider_actions and acts on what is new to it.

CREATE TABLE outbox.provider_health (
    provider      text        NOT NULL,
    worker        text        NOT NULL,
    state         text        NOT NULL,
    reason        text,
    -- The share of failures among the calls the breaker weighs now, and how many those are.
    failure_rate  real        NOT NULL DEFAULT 0,
    calls         integer     NOT NULL DEFAULT 0,
    -- Operations found failing alone: their failures do not weigh on the breaker.
    failing_alone integer     NOT NULL DEFAULT 0,
    opened_at     timestamptz,
    next_probe_at timestamptz,
    open_for      interval,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_health_pkey PRIMARY KEY (provider, worker),
    CONSTRAINT provider_health_state_valid CHECK (state IN ('closed', 'open', 'half_open'))
);
COMMENT ON TABLE outbox.provider_health IS
    'Each dispatcher''s circuit breaker of each provider, as it last wrote it (issue 37).';

CREATE TABLE outbox.provider_actions (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider  text        NOT NULL,
    action    text        NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_actions_action_valid CHECK (action IN ('reset', 'probe'))
);
CREATE INDEX provider_actions_at ON outbox.provider_actions (at);
COMMENT ON TABLE outbox.provider_actions IS
    'Operators'' requests to reset a provider''s breakers or probe it now; every dispatcher acts '
    'on those newer than its start.';

-- An operator's reset or probe: the request every dispatcher reads, and its audit row. Requests
-- older than a day are dropped here: a dispatcher acts only on those newer than its start.
CREATE FUNCTION outbox.request_provider_action(
    p_provider text, p_action text, p_actor text, p_reason text
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id bigint;
BEGIN
    IF p_action IS NULL OR p_action NOT IN ('reset', 'probe') THEN
        RAISE EXCEPTION 'unknown provider action %', p_action USING ERRCODE = 'OB002';
    END IF;
    IF p_provider IS NULL OR p_provider !~ '^[a-z0-9][a-z0-9_-]{0,63}$' THEN
        RAISE EXCEPTION 'not a provider name: %', p_provider USING ERRCODE = 'OB002';
    END IF;
    PERFORM outbox.require_reason(p_actor, p_reason);
    DELETE FROM outbox.provider_actions WHERE at < now() - interval '1 day';
    INSERT INTO outbox.provider_actions (provider, action) VALUES (p_provider, p_action)
    RETURNING id INTO v_id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, p_actor, 'provider_' || p_action, p_reason,
            jsonb_build_object('provider', p_provider, 'request', v_id));
    RETURN v_id;
END;
$$;
REVOKE ALL ON FUNCTION outbox.request_provider_action(text, text, text, text) FROM PUBLIC;
COMMENT ON FUNCTION outbox.request_provider_action(text, text, text, text) IS
    'Reset a provider''s breakers or ask for a probe now, on every dispatcher; audited.';

-- Where the roles exist, what roles.sql grants them (run it again after upgrading, as always).
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.provider_health TO outbox_dispatcher;
        GRANT SELECT ON outbox.provider_actions TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT SELECT ON outbox.provider_health, outbox.provider_actions TO outbox_operator;
        GRANT EXECUTE ON FUNCTION outbox.request_provider_action(text, text, text, text)
            TO outbox_operator;
    END IF;
END;
$$;
