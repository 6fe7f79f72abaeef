-- A sketch for issue 40 (docs/drafts/inbox.md), tried on PostgreSQL 15.20 in throwaway
-- databases: not a migration, and nothing runs it. The migration will be sql/0042 or later.

-- Verified sketch behind /tmp/inbox_design.md (PostgreSQL 15.20, scratch database, since dropped).
-- Not a migration: no RLS, roles, bounds checks, audit or conflict body; needs pgcrypto for
-- gen_random_bytes in the installation row only.
CREATE SCHEMA outbox;
CREATE TABLE outbox.installation (singleton boolean PRIMARY KEY DEFAULT true, key_secret bytea NOT NULL);
INSERT INTO outbox.installation VALUES (true, gen_random_bytes(32));

CREATE FUNCTION outbox.fingerprint(provider text, action text, payload jsonb, ordering_key text)
RETURNS bytea LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
  SELECT sha256(convert_to(provider || E'\n' || action || E'\n' || payload::text
                           || coalesce(E'\n' || ordering_key, ''), 'UTF8'))
$$;

CREATE TABLE outbox.inbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id text NOT NULL, handler text NOT NULL, key text NOT NULL,
    mode text NOT NULL, state text NOT NULL,
    fingerprint bytea, body_digest bytea NOT NULL, token uuid NOT NULL,
    lease_expires_at timestamptz, claims integer NOT NULL DEFAULT 1,
    response_status smallint, response_headers jsonb, response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz,
    expires_at timestamptz, abandoned_at timestamptz,
    CONSTRAINT inbox_identity UNIQUE (tenant_id, handler, key),
    CONSTRAINT inbox_state_valid CHECK (state IN ('in_progress', 'completed', 'abandoned')),
    CONSTRAINT inbox_never_5xx CHECK (response_status IS NULL OR response_status BETWEEN 200 AND 499)
) WITH (fillfactor = 80);
CREATE INDEX inbox_expiry ON outbox.inbox (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX inbox_leases ON outbox.inbox (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
CREATE INDEX inbox_abandoned ON outbox.inbox (abandoned_at) WHERE abandoned_at IS NOT NULL;

CREATE TABLE outbox.inbox_conflicts (
    inbox_id bigint NOT NULL REFERENCES outbox.inbox ON DELETE CASCADE,
    body_digest bytea NOT NULL, fingerprint bytea, seen integer NOT NULL DEFAULT 1,
    first_seen_at timestamptz NOT NULL DEFAULT now(), last_seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (inbox_id, body_digest));

CREATE FUNCTION outbox.inbox_outcome_before_commit() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF EXISTS (SELECT FROM outbox.inbox i WHERE i.id = NEW.id AND i.state = 'in_progress') THEN
    RAISE EXCEPTION 'inbox record % of a transaction-mode handler has no outcome at commit', NEW.id
      USING ERRCODE = 'OB006';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER inbox_outcome_before_commit AFTER INSERT ON outbox.inbox
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.mode = 'transaction')
  EXECUTE FUNCTION outbox.inbox_outcome_before_commit();

-- Transaction mode: the first statement of the handler's own transaction.
CREATE FUNCTION outbox.inbox_begin(p_tenant text, p_handler text, p_key text, p_provider text,
    p_action text, p_body text, p_ordering_key text, p_wait interval, p_retention interval,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status smallint,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  v_payload jsonb := p_body::jsonb;
  v_fp bytea := CASE WHEN p_provider IS NOT NULL
                     THEN outbox.fingerprint(p_provider, p_action, v_payload, p_ordering_key) END;
  v_digest bytea := sha256(convert_to(v_payload::text, 'UTF8'));
  v_old text := current_setting('lock_timeout');
  r outbox.inbox;
BEGIN
  LOOP
    PERFORM set_config('lock_timeout', (extract(epoch FROM p_wait) * 1000)::bigint::text, true);
    INSERT INTO outbox.inbox AS i (tenant_id, handler, key, mode, state, fingerprint, body_digest,
                                   token, expires_at)
    VALUES (p_tenant, p_handler, p_key, 'transaction', 'in_progress', v_fp, v_digest,
            gen_random_uuid(), now() + p_retention)
    ON CONFLICT (tenant_id, handler, key) DO NOTHING
    RETURNING i.id, i.token INTO inbox_id, token;
    PERFORM set_config('lock_timeout', v_old, true);
    IF inbox_id IS NOT NULL THEN decision := 'new'; RETURN; END IF;
    SELECT * INTO r FROM outbox.inbox i
    WHERE i.tenant_id = p_tenant AND i.handler = p_handler AND i.key = p_key;
    CONTINUE WHEN NOT FOUND;
    inbox_id := r.id;
    IF (r.fingerprint IS NOT NULL AND v_fp IS NOT NULL AND r.fingerprint <> v_fp)
       OR ((r.fingerprint IS NULL OR v_fp IS NULL) AND r.body_digest <> v_digest) THEN
      INSERT INTO outbox.inbox_conflicts AS c (inbox_id, body_digest, fingerprint)
      VALUES (r.id, v_digest, v_fp)
      ON CONFLICT ON CONSTRAINT inbox_conflicts_pkey
      DO UPDATE SET seen = c.seen + 1, last_seen_at = now();
      decision := 'conflict'; RETURN;
    END IF;
    IF r.state = 'completed' THEN
      decision := 'replayed'; response_status := r.response_status;
      response_headers := r.response_headers; response_body := r.response_body; RETURN;
    END IF;
    decision := r.state;
    RETURN;
  END LOOP;
END $$;

CREATE FUNCTION outbox.inbox_complete(p_id bigint, p_token uuid, p_status smallint,
    p_headers jsonb, p_body bytea) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  UPDATE outbox.inbox SET state = 'completed', completed_at = now(), response_status = p_status,
         response_headers = p_headers, response_body = p_body, lease_expires_at = NULL
  WHERE id = p_id AND token = p_token AND state = 'in_progress';
  RETURN FOUND;
END $$;

-- External mode: an autocommit claim with a lease on the database clock.
CREATE FUNCTION outbox.inbox_claim(p_tenant text, p_handler text, p_key text, p_body text,
    p_lease interval, p_max_claims integer,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT claims integer,
    OUT downstream_key text, OUT retry_after interval)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  v_digest bytea := sha256(convert_to(p_body::jsonb::text, 'UTF8'));
  r outbox.inbox;
BEGIN
  SELECT 'ib1_' || encode(sha256(s.key_secret || sha256(s.key_secret || convert_to(
           jsonb_build_array(p_tenant, p_handler, p_key)::text, 'UTF8'))), 'hex')
    INTO downstream_key FROM outbox.installation s;
  LOOP
    INSERT INTO outbox.inbox AS i (tenant_id, handler, key, mode, state, body_digest, token,
                                   lease_expires_at)
    VALUES (p_tenant, p_handler, p_key, 'external', 'in_progress', v_digest, gen_random_uuid(),
            now() + p_lease)
    ON CONFLICT (tenant_id, handler, key) DO NOTHING
    RETURNING i.id, i.token, i.claims INTO inbox_id, token, claims;
    IF inbox_id IS NOT NULL THEN decision := 'new'; RETURN; END IF;
    SELECT * INTO r FROM outbox.inbox i
    WHERE i.tenant_id = p_tenant AND i.handler = p_handler AND i.key = p_key FOR UPDATE;
    CONTINUE WHEN NOT FOUND;
    inbox_id := r.id; claims := r.claims;
    IF r.body_digest <> v_digest THEN decision := 'conflict'; RETURN; END IF;
    IF r.state <> 'in_progress' THEN
      decision := CASE r.state WHEN 'completed' THEN 'replayed' ELSE r.state END; RETURN;
    END IF;
    IF r.lease_expires_at > now() THEN
      decision := 'in_progress'; retry_after := r.lease_expires_at - now(); RETURN;
    END IF;
    IF r.claims >= p_max_claims THEN
      UPDATE outbox.inbox SET state = 'abandoned', abandoned_at = now(), lease_expires_at = NULL
      WHERE id = r.id;
      decision := 'abandoned'; RETURN;
    END IF;
    UPDATE outbox.inbox SET claims = r.claims + 1, token = gen_random_uuid(),
           lease_expires_at = now() + p_lease
    WHERE id = r.id RETURNING inbox.token, inbox.claims INTO token, claims;
    decision := 'reclaimed'; RETURN;
  END LOOP;
END $$;

CREATE FUNCTION outbox.inbox_renew(p_id bigint, p_token uuid, p_lease interval) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  UPDATE outbox.inbox SET lease_expires_at = now() + p_lease
  WHERE id = p_id AND token = p_token AND state = 'in_progress';
  RETURN FOUND;
END $$;
