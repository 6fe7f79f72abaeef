"""Every SQL statement the inbox issues (sql/0042). Each runs inside the delivery's own
transaction, on the connection the handler writes with; none commits."""

from __future__ import annotations

from typing import Final

# The first statement of a delivery: decides new, replayed, conflict or in progress, binding
# the transaction to the delivery's tenant; checks the body against the sender's fingerprint
# and finds the record of the sender's database (sql/0046, 0048); another contract than the
# record's is a conflict (sql/0056). Relies on: outbox.inbox_begin().
BEGIN: Final = (
    "SELECT decision, inbox_id, token, response_status, response_headers, response_body"
    " FROM outbox.inbox_begin(%(tenant_id)s, %(handler)s, %(key)s, %(body_json)s,"
    " %(body_raw)s, %(wait)s, %(retention)s, %(origin)s, %(fingerprint)s, %(provider)s,"
    " %(action)s, %(ordering_key)s, %(contract)s)"
)

# One published contract (sql/0052), which a delivery's body is checked against before the
# decision (outbox.inbox.contracts); outside the delivery's transaction, once per version.
GET_CONTRACT: Final = "SELECT canonical, digest FROM outbox.get_contract(%s, %s)"

# The outcome, fenced by the record's token. Relies on: outbox.inbox_complete().
COMPLETE: Final = (
    "SELECT outbox.inbox_complete(%(inbox_id)s, %(token)s, %(status)s, %(headers)s, %(body)s)"
)

# A delivery in transaction mode costs the sender's latency two round trips fewer than BEGIN,
# BEGIN's statement, the handler's, COMPLETE and COMMIT one by one: the transaction's start goes
# with the decision and the outcome with the COMMIT, each pair one simple query that psycopg's
# client-side binding sends (docs/design.md, "The inbox", "Round trips"). Safe to pair: an error
# in the first statement stops the second, and a COMMIT of a record still in progress is refused
# by the deferred trigger inbox_outcome_before_commit (OB006).
COMPLETE_AND_COMMIT: Final = COMPLETE + "; COMMIT"


def begin_and_decide(isolation: str | None, read_only: bool | None, deferrable: bool | None) -> str:
    """BEGIN, with the characteristics the connection asks of its transactions (as psycopg's
    own BEGIN would), then BEGIN's statement: one query."""
    parts = ["BEGIN"]
    if isolation is not None:
        parts.append(f"ISOLATION LEVEL {isolation}")
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts) + "; " + BEGIN


# At most `batch` completed records past their retention. Relies on: outbox.inbox_prune().
PRUNE: Final = "SELECT outbox.inbox_prune(%(batch)s)"

# --- operators (`outbox inbox`): read through outbox_operator's SELECT, act through functions ----

# Records newest first, a page after an id; each filter applies when given. Relies on: the
# inbox_identity index for a tenant and handler, the primary key for paging.
LIST: Final = """
SELECT i.id, i.tenant_id, i.handler, i.key, i.state, i.response_status, i.created_at,
       i.completed_at, i.expires_at,
       coalesce((SELECT sum(c.seen) FROM outbox.inbox_conflicts c WHERE c.inbox_id = i.id), 0)
           AS conflicts
FROM outbox.inbox i
WHERE (%(handler)s::text IS NULL OR i.handler = %(handler)s)
  AND (%(tenant)s::text IS NULL OR i.tenant_id = %(tenant)s)
  AND (%(status)s::integer IS NULL OR i.response_status = %(status)s)
  AND (%(since)s::timestamptz IS NULL OR i.created_at >= %(since)s)
  AND (NOT %(conflicts)s OR EXISTS (SELECT FROM outbox.inbox_conflicts c WHERE c.inbox_id = i.id))
  AND (%(after)s::bigint IS NULL OR i.id < %(after)s)
ORDER BY i.id DESC
LIMIT %(limit)s
"""

# One record, with its stored response.
SHOW: Final = """
SELECT i.id, i.tenant_id, i.handler, i.key,
       nullif(i.origin, '00000000-0000-0000-0000-000000000000')::text AS origin, i.mode, i.state,
       encode(i.body_digest, 'hex') AS body_digest, encode(i.fingerprint, 'hex') AS fingerprint,
       i.response_status, i.response_headers,
       i.response_body, i.claims, i.last_error, i.lease_expires_at, i.abandoned_at, i.created_at,
       i.completed_at, i.expires_at
FROM outbox.inbox i WHERE i.id = %(id)s
"""

# What else came under a record's identity.
CONFLICTS: Final = """
SELECT encode(c.body_digest, 'hex') AS body_digest, c.seen, c.first_seen_at, c.last_seen_at
FROM outbox.inbox_conflicts c WHERE c.inbox_id = %(id)s ORDER BY c.first_seen_at
"""

# `since` as a time: a duration back from the database's clock.
SINCE: Final = "SELECT now() - %(back)s::interval"

# Relies on: outbox.inbox_forget() (audited).
FORGET: Final = "SELECT outbox.inbox_forget(%(id)s, %(reason)s, %(actor)s, %(force)s)"

# What a prune would delete now.
PRUNABLE: Final = (
    "SELECT count(*) FROM outbox.inbox WHERE expires_at < now() AND state = 'completed'"
)

# --- external mode: a claim committed on its own, with a lease (sql/0042) ------------------------

# Relies on: outbox.inbox_claim() (autocommit: the claim must outlive the handler's calls).
CLAIM: Final = (
    "SELECT decision, inbox_id, token, claims, downstream_key, retry_after, response_status,"
    " response_headers, response_body FROM outbox.inbox_claim(%(tenant_id)s, %(handler)s,"
    " %(key)s, %(body_json)s, %(body_raw)s, %(lease)s, %(max_claims)s, %(retention)s,"
    " %(origin)s, %(fingerprint)s, %(provider)s, %(action)s, %(ordering_key)s,"
    " %(contract)s)"
)
# Relies on: outbox.inbox_renew(), outbox.inbox_fail(), outbox.bind_tenant().
RENEW: Final = "SELECT outbox.inbox_renew(%(inbox_id)s, %(token)s, %(lease)s)"
FAIL: Final = "SELECT outbox.inbox_fail(%(inbox_id)s, %(token)s, %(error)s)"
BIND_TENANT: Final = "SELECT outbox.bind_tenant(%(tenant_id)s)"
# Relies on: outbox.inbox_release() (audited).
RELEASE: Final = "SELECT outbox.inbox_release(%(id)s, %(reason)s, %(actor)s)"

# Per handler: external claims in progress, the oldest's age, abandoned records.
# Relies on: outbox.inbox_gauges().
GAUGES: Final = (
    "SELECT handler, in_progress, extract(epoch FROM oldest_in_progress), abandoned"
    " FROM outbox.inbox_gauges()"
)
