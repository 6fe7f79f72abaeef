"""examples/invoice-worker under a real uvicorn, as a subprocess the tests can kill.

The worker runs from the example's own directory (on PYTHONPATH, so an uninstalled checkout
works too) against the test's database, on a free loopback port. ``kill`` is SIGKILL to the
whole process group: the supervisor and every worker process die mid-request, as in a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

import httpx
import psycopg

from tests.support.moto_server import free_port

EXAMPLE: Final = Path(__file__).resolve().parents[2] / "examples" / "invoice-worker"
JSON: Final = {"Content-Type": "application/json"}


class InvoiceWorker:
    """One ``uvicorn invoice_worker.app:app`` with ``workers`` processes."""

    def __init__(
        self,
        db_url: str,
        log_path: Path,
        *,
        workers: int = 1,
        delay_ms: int = 0,
        port: int | None = None,
        transport: str = "http",
        env: dict[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.env = env or {}
        self.db_url = db_url
        self.log_path = log_path
        self.workers = workers
        self.delay_ms = delay_ms
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> InvoiceWorker:
        env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": self.db_url,
            "INVOICE_WORKER_DELAY_MS": str(self.delay_ms),
            "INVOICE_WORKER_TRANSPORT": self.transport,
            **self.env,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])
            ),
        }
        args = [
            sys.executable,
            "-m",
            "uvicorn",
            "invoice_worker.app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            "--no-access-log",
        ]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the worker exited: {self.log_path.read_text()[-2000:]}")
            try:
                # An undeclared route reaches Starlette: 404 once every process serves.
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 404:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the worker did not start: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, to every process of the worker, and wait for them."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """SIGTERM: uvicorn lets the requests under way finish, then exits."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)
        self._proc = None


def invoice(account: str = "acct-1", amount: int = 1250, currency: str = "EUR") -> dict[str, Any]:
    return {"account_id": account, "amount": amount, "currency": currency}


def headers(key: str, tenant: str = "acme") -> dict[str, str]:
    return {**JSON, "Idempotency-Key": f'"{key}"', "Outbox-Tenant-Id": tenant}


def count(db_url: str, query: str, params: Any = None) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(query, params).fetchone()
        return int(row[0]) if row else 0


def open_transactions(db_url: str) -> int:
    """Sessions of the worker's database holding a transaction open, other than this one."""
    return count(
        db_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()",
    )


def wait_for(check: Any, timeout: float = 10, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
