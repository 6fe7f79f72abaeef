"""The console under a real uvicorn on loopback, in a thread of the test's process, and an httpx
client that talks to it over TCP: the requests a browser or curl would send, no ASGI shortcut."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from starlette.applications import Starlette


@contextmanager
def served(app: Starlette) -> Iterator[httpx.Client]:
    """``app`` served on a free loopback port until the block ends (its lifespan included)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="console-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the console did not start within 10 s")
        time.sleep(0.01)
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", follow_redirects=True, timeout=30
        ) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
