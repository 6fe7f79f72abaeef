"""Every SQL statement the inbox issues (sql/0042). Each runs inside the delivery's own
transaction, on the connection the handler writes with; none commits."""

from __future__ import annotations

from typing import Final

# The first statement of a delivery: decides new, replayed, conflict or in progress, binding
# the transaction to the delivery's tenant. Relies on: outbox.inbox_begin().
BEGIN: Final = (
    "SELECT decision, inbox_id, token, response_status, response_headers, response_body"
    " FROM outbox.inbox_begin(%(tenant_id)s, %(handler)s, %(key)s, %(body_json)s,"
    " %(body_raw)s, %(wait)s, %(retention)s)"
)

# The outcome, fenced by the record's token. Relies on: outbox.inbox_complete().
COMPLETE: Final = (
    "SELECT outbox.inbox_complete(%(inbox_id)s, %(token)s, %(status)s, %(headers)s, %(body)s)"
)

# At most `batch` completed records past their retention. Relies on: outbox.inbox_prune().
PRUNE: Final = "SELECT outbox.inbox_prune(%(batch)s)"
