"""Bulk actions of the console: the ids a filter selects are taken once and shown as a count
(the dry run), then the person's confirmation acts on exactly those, one by one, each through
the same SQL function and in its own transaction as a single action, as `outbox quarantine
cancel --all` does (outbox/cli/bulk.py). An operation that left the status meanwhile is refused
by that function's own check and counted as skipped, never acted on from a stale reading.

A job runs on a thread of its own and can be stopped between two operations; its progress is
read by the page that shows it. Selections and jobs live in this process: a console restarted
mid-job has done what its audit rows say, and the same selection again takes up the rest.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool

from outbox.core.model import Status
from outbox.oncall import operators

# A selection not confirmed within this long is forgotten: counted again, it may differ.
SELECTION_TTL: Final = 15 * 60.0
MAX_KEPT: Final = 100  # selections and finished jobs kept per process, the newest

Action = Callable[[psycopg.Connection[Any], int], Status]


@dataclass
class Selection:
    """The ids a dry run counted, and what they were selected by."""

    status: Status
    filters: operators.Filters
    ids: list[int]
    made_by: str
    made_at: float = field(default_factory=time.monotonic)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))

    def expired(self) -> bool:
        return time.monotonic() - self.made_at > SELECTION_TTL


@dataclass
class Job:
    """One bulk action under way or done: what it did so far."""

    action: str
    total: int
    started_by: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    done: int = 0
    skipped: int = 0
    failed: int = 0
    last_error: str | None = None
    finished: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()

    def state(self) -> str:
        if not self.finished:
            return "stopping" if self.stopped else "running"
        return "stopped" if self.stopped and self.handled < self.total else "finished"

    @property
    def handled(self) -> int:
        return self.done + self.skipped + self.failed


class Jobs:
    """This process's selections and jobs, by token."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._selections: dict[str, Selection] = {}
        self._jobs: dict[str, Job] = {}

    def keep(self, selection: Selection) -> Selection:
        with self._lock:
            self._selections[selection.token] = selection
            _trim(self._selections)
        return selection

    def selection(self, token: str, made_by: str) -> Selection | None:
        """The person's own selection, if it is still fresh; taken (a second confirm finds none)."""
        with self._lock:
            found = self._selections.get(token)
            if found is None or found.made_by != made_by or found.expired():
                return None
            del self._selections[token]
            return found

    def job(self, token: str) -> Job | None:
        with self._lock:
            return self._jobs.get(token)

    def start(self, name: str, ids: list[int], action: Action, started_by: str) -> Job:
        job = Job(action=name, total=len(ids), started_by=started_by)
        with self._lock:
            self._jobs[job.token] = job
            _trim(self._jobs, keep=lambda j: not j.finished)
        threading.Thread(
            target=self._run, args=(job, ids, action), name=f"outbox-web-job-{name}", daemon=True
        ).start()
        return job

    def _run(self, job: Job, ids: list[int], action: Action) -> None:
        try:
            for operation_id in ids:
                if job.stop.is_set():
                    break
                try:
                    with self._pool.connection() as conn:
                        action(conn, operation_id)
                    job.done += 1
                except operators.ActionRefused:
                    job.skipped += 1  # left the status meanwhile: its function said so
                except psycopg.Error as exc:
                    job.failed += 1
                    job.last_error = type(exc).__name__
                    job.stop.set()  # the database is gone or refuses: stop, say so
        finally:
            job.finished = True


def _trim(kept: dict[str, Any], keep: Callable[[Any], bool] = lambda _: False) -> None:
    """Forget the oldest beyond MAX_KEPT, sparing those ``keep`` says are live."""
    for token in list(kept)[: max(0, len(kept) - MAX_KEPT)]:
        if not keep(kept[token]):
            del kept[token]
