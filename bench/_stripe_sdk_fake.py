"""The fake Stripe (outbox/testing/stripe.py) in a process of its own, for
bench/stripe_sdk.py: the fake is a ThreadingHTTPServer, and in the benchmark's process it would
share the GIL with the client loop it is measured against.

The child prints ``URL <base>``, then answers each line ``count`` on stdin with the number of
objects created, and stops at end of input.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class FakeStripeProcess:
    """A FakeStripe with the default test key, in a subprocess."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(  # noqa: S603 (this file, fixed arguments)
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        line = self._readline()
        if not line.startswith("URL "):
            self.stop()
            raise RuntimeError(f"the fake Stripe did not start: {line!r}")
        self.url = line.split()[1]
        self.pid = self.proc.pid

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def object_count(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self._readline())

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> FakeStripeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve() -> None:
    sys.path.insert(0, str(REPO))
    from outbox.testing.stripe import FakeStripe  # noqa: PLC0415 (after the path)

    with FakeStripe() as fake:
        print(f"URL {fake.url}", flush=True)
        for line in sys.stdin:
            if line.strip() == "count":
                print(fake.object_count(), flush=True)


if __name__ == "__main__":
    _serve()
