-- 0014: claims served per (provider, tenant) group, and the columns ordering keys need (0015).
--
-- The claim took the oldest due rows of the whole table. A tenant with a million pending
-- operations then filled every batch while another tenant's single one waited behind them all,
-- and a provider left unclaimed (its breaker open) still cost every claim a walk over its
-- backlog. The claim now visits the groups with a loose index scan (one probe per group) and
-- takes a share from each; this index serves both the visit and the share.
--
-- ordering_blocked marks a pending operation that waits for an earlier one with its ordering
-- key: it stays out of the claim index until it is the first of its key (sql/0015).

ALTER TABLE outbox.operations
    ADD COLUMN ordering_key text,
    ADD COLUMN ordering_blocked boolean NOT NULL DEFAULT false;

-- Only a pending operation can wait for its turn; a later status clears the mark.
ALTER TABLE outbox.operations
    ADD CONSTRAINT operations_blocked_only_pending CHECK (NOT ordering_blocked OR status = 'pending');

CREATE INDEX operations_claim_group ON outbox.operations (provider, tenant_id, available_at, id)
    WHERE status = 'pending' AND NOT ordering_blocked;

-- Replaced by operations_claim_group: one index fewer for every enqueue to maintain.
DROP INDEX outbox.operations_claim;

-- The operations waiting for their turn, per ordering key in enqueue order: the next to go is
-- found here (sql/0015), and the gauges count them.
CREATE INDEX operations_ordering_blocked ON outbox.operations (tenant_id, ordering_key, id)
    WHERE ordering_blocked;
