-- 0016: a token bucket per rate-limited provider, shared by every replica.
--
-- `rate_limit = "100/s"` in a provider's settings must hold for all `outbox run` replicas
-- together, so the bucket lives here. A dispatcher takes tokens before it claims, and claims at
-- most as many of the provider's rows as it holds tokens; tokens it did not use it gives back at
-- once. Only the database clock refills a bucket (now()), so replicas whose clocks disagree
-- still share one rate.
--
-- Invariant: the tokens handed out over any span of T seconds are at most
-- burst + rate * T, because a bucket never holds more than `burst` tokens and only the passage
-- of time adds any (tokens given back were taken from it before, and the level stays capped).
-- A provider's 429 pushes its bucket into debt: nobody takes a token until it has refilled
-- for the provider's Retry-After.
--
-- The dispatcher changes buckets only through the two functions below (SECURITY DEFINER, with
-- the pinned search_path of 0011); sql/roles.sql grants it EXECUTE on them and nothing on the
-- table.

CREATE TABLE outbox.provider_buckets (
    provider    text             PRIMARY KEY,
    -- What the dispatcher that last touched the bucket was configured with: a rolling deploy
    -- that changes the limit converges on the new one.
    rate        double precision NOT NULL CHECK (rate > 0),
    burst       double precision NOT NULL CHECK (burst >= 1),
    -- The level at refilled_at; negative while in debt after a 429.
    tokens      double precision NOT NULL,
    refilled_at timestamptz      NOT NULL,
    -- How many tokens the last take handed out: the UPDATE computes it from the old level and
    -- RETURNING reads it back, so the take is a single atomic statement.
    taken       integer          NOT NULL DEFAULT 0
);
COMMENT ON TABLE outbox.provider_buckets IS
    'One token bucket per rate-limited provider, shared by every dispatcher (0016).';

-- Take up to `wanted` tokens after giving back `returned`; returns how many were granted and the
-- level left (a dispatcher that got none knows from it when the next token is due).
-- A new bucket starts empty, not full: nothing says what was sent just before it existed.
CREATE FUNCTION outbox.take_tokens(provider text, rate double precision, burst double precision,
                                   wanted integer, returned integer)
RETURNS TABLE (granted integer, tokens double precision)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
REVOKE ALL ON FUNCTION outbox.take_tokens(text, double precision, double precision, integer,
                                          integer) FROM PUBLIC;
COMMENT ON FUNCTION outbox.take_tokens IS
    'Give back `returned` tokens and take up to `wanted` from a provider''s bucket, refilled by now().';

-- The provider answered 429: empty its bucket and push it into debt, so that no replica gets a
-- token for `pause` (the provider's Retry-After). Setting the debt, not adding to it: a burst of
-- 429s from calls already in flight asks for one pause, not one per call.
CREATE FUNCTION outbox.throttle_bucket(provider text, rate double precision,
                                       burst double precision, pause interval)
RETURNS double precision
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
REVOKE ALL ON FUNCTION outbox.throttle_bucket(text, double precision, double precision, interval)
    FROM PUBLIC;
COMMENT ON FUNCTION outbox.throttle_bucket IS
    'After a 429: empty a provider''s bucket and push it into debt for the provider''s Retry-After.';
