"""The README's first hour, run: every ``sh``, ``python`` and ``sql`` block, as written and in the
order a reader meets them, against one fresh, empty database.

A block marked ``<!-- not run: reason -->`` is skipped (tests/unit/test_readme.py counts them).
One substitution, the reader's own: a line ``export OUTBOX_DATABASE_URL=...`` points at the
test's database instead, and every block runs with ``OUTBOX_DATABASE_URL`` set to it, no other
``OUTBOX_*`` variable, and this virtual environment's ``outbox`` first on the PATH. Shell blocks
run under ``bash -e -o pipefail`` in a scratch directory; Python blocks in a fresh interpreter; SQL
blocks in one transaction, as "inside your transaction" says.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psycopg

from tests.support.readme import RUN, Block, blocks

_READERS_DATABASE = re.compile(r"^export OUTBOX_DATABASE_URL=\S+", re.MULTILINE)
# The identities the blocks enqueue, as the Python and SQL examples write them.
_KEYS = re.compile(r"""operation_key\s*(?:=|=>)\s*["']([^"']+)["']""")


def _environment(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATABASE_URL"] = url
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(block: Block, number: int, url: str, scratch: Path) -> str:
    """Run one block; returns what it printed. Fails the test with the block's place."""
    if block.lang == "sql":
        try:
            with psycopg.connect(url) as conn, conn.transaction():
                conn.execute(block.text.encode())
        except psycopg.Error as exc:
            raise AssertionError(f"{block.where()} failed: {exc}\n{block.text}") from None
        return ""
    if block.lang == "sh":
        own = f"export OUTBOX_DATABASE_URL={shlex.quote(url)}"
        script = _READERS_DATABASE.sub(lambda _: own, block.text)
        command = ["bash", "-e", "-o", "pipefail", "-c", script]
    else:
        path = scratch / f"readme_block_{number}.py"
        path.write_text(block.text)
        command = [sys.executable, str(path)]
    done = subprocess.run(
        command,
        cwd=scratch,
        env=_environment(url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (
        f"{block.where()} exited {done.returncode}\n--- block\n{block.text}"
        f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
    )
    return done.stdout


def test_every_block_of_the_readme_runs_as_written_in_order(
    empty_db_url: str, tmp_path: Path
) -> None:
    runnable = [b for b in blocks() if b.lang in RUN and b.not_run is None]
    assert len(runnable) >= 5
    printed = [_run(block, n, empty_db_url, tmp_path) for n, block in enumerate(runnable)]
    # They did what they say: `outbox status` answered on the migrated database, and each
    # operation the examples enqueue is there, committed.
    assert any("pending" in out for out in printed), printed
    keys = {k for b in runnable if b.lang in ("python", "sql") for k in _KEYS.findall(b.text)}
    assert keys, "the examples enqueue nothing"
    with psycopg.connect(empty_db_url) as conn:
        stored = {
            key
            for (key,) in conn.execute(
                "SELECT operation_key FROM outbox.operations WHERE operation_key = ANY(%s)",
                (sorted(keys),),
            )
        }
    assert stored == keys
    # "Contracts": the typo written from SQL was quarantined unsent by the dispatcher, and the
    # listing the README shows names the violation.
    with psycopg.connect(empty_db_url) as conn:
        forced = conn.execute(
            "SELECT status, status_reason, first_sent_at FROM outbox.operations"
            " WHERE operation_key = 'invoice-44-refund'"
        ).fetchall()
    assert forced == [("quarantined", "contract_violation", None)]
    assert any("breaks contract invoice.refund/v1" in out for out in printed), printed
