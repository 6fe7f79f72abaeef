"""Google Cloud Tasks under test: `gcloud-tasks-emulator` (PyPI) in a subprocess on a free port,
and a loopback HTTP target that counts the tasks it is called with.

What the emulator (0.6) models of the real service: CreateTask with a caller's task name (not
checked against TASK_ID's characters), a queue that does not exist (FAILED_PRECONDITION, where
the real service says NOT_FOUND or FAILED_PRECONDITION), PauseQueue and ResumeQueue, ListTasks,
and the dispatch of each HTTP task to its URL with its method, headers and body, retried
(forever, by default) while the target answers 4xx or 5xx, one task at a time per queue. What it
does not: ALREADY_EXISTS (a repeated name is a second task, dispatched again), the names of
tasks that ran (it forgets a task once dispatched), GetTask and DeleteTask (UNIMPLEMENTED),
OIDC tokens, IAM, quotas (no RESOURCE_EXHAUSTED), the 100 KB task limit, retry configuration,
dispatch deadlines, and durability: its state is in memory, so a restart loses every queued
task and every queue but those of its command line.

``faithful=True`` runs the same emulator with the documented de-duplication added (this module
run as ``python -m tests.support.tasks_emulator``): ALREADY_EXISTS for the name of a task that
exists or ran or was deleted within ``TOMBSTONE_S``, GetTask (NOT_FOUND once a task ran or was
deleted, as the real service answers), DeleteTask, and NOT_FOUND from GetQueue for a queue that
does not exist. It is still in memory: a restart forgets the names too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

from tests.support.queues import service_answers, wait_for_port

ROOT: Final = Path(__file__).resolve().parents[2]
BINARY: Final = Path(sys.executable).parent / "gcloud-tasks-emulator"
PROJECT: Final = "outbox-test"
LOCATION: Final = "europe-west1"
# How long the faithful emulator refuses a name after its task ran or was deleted (the real
# service: about an hour for a queue created through the API).
TOMBSTONE_S: Final = 3600.0
_CREATED: Final = re.compile(r"\[TASKS\] Created task (\S+)")
_SUBMITTED: Final = re.compile(r"\[TASKS\] Submitting task (\S+)")
_REPEATED: Final = re.compile(r"\[TASKS\] Already exists (\S+)")


def queue_name(queue_id: str) -> str:
    return f"projects/{PROJECT}/locations/{LOCATION}/queues/{queue_id}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available() -> bool:
    return BINARY.exists()


class TasksEmulator:
    """One emulator process with ``queues`` (ids) created at start; ``log_path`` keeps every
    process's log (appended), from which ``created()`` and ``dispatched()`` count."""

    def __init__(
        self, queues: list[str], log_path: Path, *, faithful: bool = False, port: int | None = None
    ) -> None:
        self.queues = [queue_name(q) for q in queues]
        self.log_path = log_path
        self.faithful = faithful
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TasksEmulator:
        if self.faithful:
            command = [sys.executable, "-m", "tests.support.tasks_emulator"]
        else:
            command = [str(BINARY), "start"]
        command += ["--port", str(self.port)]
        for queue in self.queues:
            command += ["--default-queue", queue]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1}\n".encode())
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env
            )
        self.starts += 1
        wait_for_port(self.port, timeout=20, what="the Cloud Tasks emulator")
        time.sleep(0.2)  # its processor thread starts after the gRPC port opens
        return self

    def kill(self) -> None:
        """SIGKILL: everything it held in memory is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        self.kill()
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> TasksEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def runs(self) -> list[str]:
        """The log of each process started, in order."""
        return [part for part in re.split(r"^--- start \d+\n", self.log_text(), flags=re.M) if part]

    def created(self, run: int | None = None) -> collections.Counter[str]:
        """Tasks created, by name (a name twice: the emulator made two tasks of it)."""
        return collections.Counter(_CREATED.findall(self._text(run)))

    def dispatched(self, run: int | None = None) -> collections.Counter[str]:
        return collections.Counter(_SUBMITTED.findall(self._text(run)))

    def repeats(self, run: int | None = None) -> collections.Counter[str]:
        """Creations refused with ALREADY_EXISTS (faithful only), by name."""
        return collections.Counter(_REPEATED.findall(self._text(run)))

    def _text(self, run: int | None) -> str:
        return self.log_text() if run is None else self.runs()[run]


@dataclass
class Delivery:
    """One call of the target; ``headers`` by lower-case name."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)
    first: dict[str, Delivery] = field(default_factory=dict)
    total: int = 0


class TaskReceiver:
    """The tasks' HTTP target on loopback: answers 200 (or ``status``) and counts each call by
    its Outbox-Operation-Id header."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self._tally = _Tally()
        tally = self._tally
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}  # urllib recases them
                delivery = Delivery(self.command, self.path, headers, body)
                op = self.headers.get("Outbox-Operation-Id", "")
                with tally.lock:
                    tally.total += 1
                    tally.by_operation[op] += 1
                    tally.first.setdefault(op, delivery)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self._any()

            def do_PUT(self) -> None:
                self._any()

            def do_PATCH(self) -> None:
                self._any()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/task"

    def __enter__(self) -> TaskReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def total(self) -> int:
        with self._tally.lock:
            return self._tally.total

    def counts(self) -> dict[str, int]:
        with self._tally.lock:
            return dict(self._tally.by_operation)

    def first(self, operation_id: int) -> Delivery:
        with self._tally.lock:
            return self._tally.first[str(operation_id)]


# --- the faithful emulator: run as `python -m tests.support.tasks_emulator` ----------------------


def _faithful_main() -> None:
    """gcloud-tasks-emulator with the de-duplication Cloud Tasks documents (module docstring).
    Replaces the emulator's state and servicer classes in this process only."""
    # Imported here, in the emulator's process only: the test process never loads it.
    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    warnings.simplefilter("ignore")
    from gcloud_tasks_emulator import server  # noqa: PLC0415
    from google.api_core.exceptions import AlreadyExists, NotFound  # noqa: PLC0415
    from google.protobuf import empty_pb2  # type: ignore[import-untyped]  # noqa: PLC0415

    names_lock = threading.Lock()

    class FaithfulState(server.QueueState):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.gone: dict[str, float] = {}  # task name -> when it ran or was deleted

        def _holds(self, name: str) -> bool:
            queue = name.rsplit("/tasks/", 1)[0]
            live = any(t.name == name for t in list(self._queue_tasks.get(queue, ())))
            return live or time.monotonic() - self.gone.get(name, -TOMBSTONE_S) < TOMBSTONE_S

        def create_task(self, queue: str, task: Any) -> Any:
            with names_lock:
                if task.name and self._holds(task.name):
                    server.logger.info("[TASKS] Already exists %s", task.name)
                    raise AlreadyExists(f"Requested entity already exists: {task.name}")  # type: ignore[no-untyped-call]
                return super().create_task(queue, task)

        def submit_task(self, task_name: str, force_run: bool = False) -> Any:
            # The name is held from before the task leaves the list (the emulator pops it, then
            # calls the target) until an hour after its last run: no gap for a repeat.
            with names_lock:
                self.gone[task_name] = time.monotonic()
            task = super().submit_task(task_name, force_run)
            with names_lock:
                self.gone[task_name] = time.monotonic()
            return task

        def get_task(self, name: str) -> Any:
            queue = name.rsplit("/tasks/", 1)[0]
            for task in list(self._queue_tasks.get(queue, ())):
                if task.name == name:
                    return task
            raise NotFound(f"Requested entity was not found: {name}")  # type: ignore[no-untyped-call]

        def delete_task(self, name: str) -> None:
            queue = name.rsplit("/tasks/", 1)[0]
            with names_lock:
                tasks = self._queue_tasks.get(queue, [])
                for i, task in enumerate(tasks):
                    if task.name == name:
                        del tasks[i]
                        self.gone[name] = time.monotonic()
                        return
            raise NotFound(f"Requested entity was not found: {name}")  # type: ignore[no-untyped-call]

        def queue(self, name: str) -> Any:
            if name not in self._queues:
                raise NotFound(f"Requested entity was not found: {name}")  # type: ignore[no-untyped-call]
            return self._queues[name]

    class FaithfulGreeter(server.Greeter):  # type: ignore[misc]
        def _call(self, context: Any, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except server.GoogleAPICallError as err:
                context.abort(err.grpc_status_code, err.message)

        def GetTask(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
            return self._call(context, self._state.get_task, request.name)

        def DeleteTask(self, request: Any, context: Any) -> Any:  # noqa: N802
            self._call(context, self._state.delete_task, request.name)
            return empty_pb2.Empty()

    server.QueueState = FaithfulState
    server.Greeter = FaithfulGreeter
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--default-queue", action="append", default=[])
    args = parser.parse_args()
    logging.getLogger().addHandler(logging.StreamHandler())
    logging.getLogger().setLevel(logging.INFO)
    server.create_server("localhost", args.port, "localhost", 80, set(args.default_queue)).run()


@contextlib.contextmanager
def emulator(
    tmp_path: Path, queues: list[str], *, faithful: bool = False, name: str = "emulator"
) -> Iterator[TasksEmulator]:
    with TasksEmulator(queues, tmp_path / f"{name}.log", faithful=faithful) as running:
        yield running


def summary(emulator: TasksEmulator) -> str:
    """A line for assertion messages."""
    return json.dumps(
        {
            "created": sum(emulator.created().values()),
            "dispatched": sum(emulator.dispatched().values()),
            "repeats": sum(emulator.repeats().values()),
            "answers": service_answers(emulator.port),
        }
    )


if __name__ == "__main__":
    _faithful_main()
