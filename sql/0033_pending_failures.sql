-- 0033: the pending operations whose last attempt failed, by provider (issue 37).
--
-- On call, "50 pending with http_500" was nowhere to be seen: `outbox status` counted pending
-- operations per provider, not why they wait, and a list of them read every pending row of a
-- table of millions. This partial index holds only pending operations with a last error (those
-- retrying after a failure, waiting out a backoff or their provider's breaker): `outbox status`
-- counts them per provider from it (one probe per provider, each count bounded), and `outbox
-- pending list` pages them oldest first, per provider or across all. A fresh operation, or one
-- that succeeded, is never in it; a failure's record adds one entry, its next claim none.

CREATE INDEX operations_pending_failed ON outbox.operations (provider, status_changed_at, id)
    WHERE status = 'pending' AND last_error_class IS NOT NULL;
