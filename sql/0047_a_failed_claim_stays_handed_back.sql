-- 0047: a renewal cannot take back a claim that was handed back (issue 40, external mode).
--
-- inbox_fail hands a claim back at once (lease_expires_at NULL, the token unchanged), so that the
-- next delivery takes it without waiting for a lease to run out. inbox_renew checked the token
-- and the state but not the lease, so a renewal that arrived after the failure (a heartbeat the
-- worker did not stop, or any caller of the function) set a lease again, and the next delivery
-- heard "in progress" until it ran out. Now only a claim that still has a lease is renewed.

CREATE OR REPLACE FUNCTION outbox.inbox_renew(inbox_id bigint, token uuid, lease interval)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    UPDATE outbox.inbox i SET lease_expires_at = now() + lease
    WHERE i.id = inbox_renew.inbox_id AND i.token = inbox_renew.token
      AND i.state = 'in_progress' AND i.mode = 'external'
      AND i.lease_expires_at IS NOT NULL;  -- handed back by inbox_fail: not this caller's now
    RETURN FOUND;
END;
$$;
