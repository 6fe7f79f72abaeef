"""External programs some tests drive (promtool, faketime, pgbouncer, valgrind): found, or the
test skips.

Under CI (``OUTBOX_TEST_REQUIRE_TOOLS=1``, set by ``.ci/run``, which installs them) a missing
program fails the test instead, so a fault test never passes by not running.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Debian installs some daemons outside a normal user's PATH.
_EXTRA_DIRS = ("/usr/sbin", "/usr/local/sbin")


def find_tool(name: str) -> str | None:
    """The program's path, or None."""
    found = shutil.which(name)
    if found:
        return found
    for directory in _EXTRA_DIRS:
        candidate = Path(directory) / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def require_tool(name: str, package: str | None = None) -> str:
    """The program's path; skips the test (fails it under CI) when it is not installed."""
    path = find_tool(name)
    if path is not None:
        return path
    message = f"{name} is not installed (Debian package {package or name})"
    if os.environ.get("OUTBOX_TEST_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)
