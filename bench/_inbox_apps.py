"""The two apps bench/inbox.py compares: examples/invoice-worker as it is (``with_inbox``), and the
same handler writing the same invoice in a transaction of its own, with no inbox
(``without_inbox``): what a worker costs before it converges repeats."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from invoice_worker.app import INSERT_INVOICE
from invoice_worker.app import app as with_inbox
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
    os.environ.get("OUTBOX_DATABASE_URL", ""), open=False, min_size=2, max_size=10
)


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    await pool.open(wait=True)
    try:
        yield
    finally:
        await pool.close()


async def _create_invoice(request: Request) -> JSONResponse:
    body = await request.json()
    tenant = request.headers["outbox-tenant-id"]
    async with pool.connection() as conn:
        cur = await conn.execute(
            INSERT_INVOICE, (tenant, body["account_id"], body["amount"], body["currency"])
        )
        row = await cur.fetchone()
    return JSONResponse({"invoice_id": row[0] if row else None}, status_code=201)


without_inbox = Starlette(
    routes=[Route("/invoices", _create_invoice, methods=["POST"])], lifespan=_lifespan
)

__all__ = ["with_inbox", "without_inbox"]
