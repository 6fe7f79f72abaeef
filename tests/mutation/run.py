"""Apply each curated mutant (tests/mutation/catalogue.py) alone to a scratch copy of the tree and
run the tests that claim to cover it; fail when a mutant survives.

    python -m tests.mutation.run            # every mutant, two at a time
    python -m tests.mutation.run --list     # the catalogue
    python -m tests.mutation.run record-fence send-key-window --jobs 1

First the tests of every mutant run once on the unmutated copy: a test that fails there would
"kill" every mutant and prove nothing. Right after the whole suite passed on the same commit (as
in CI), `--baseline sample` runs one test of each file instead: enough to show the copy runs its
tests as the checkout does, in a fraction of the time. Exit status 0: every mutant killed; 1: a
mutant survived or its tests could not run; 2: the catalogue no longer matches the code, or the
baseline failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.mutation.catalogue import MUTANTS, Edit, Mutant

ROOT = Path(__file__).resolve().parents[2]
# A mutant that makes its tests hang is killed too (a hang is a failure), but said so.
TIMEOUT = 600.0
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Verdict:
    mutant: Mutant
    outcome: str  # killed | survived | timeout | error
    seconds: float
    detail: str  # the test that killed it, or what went wrong


def tree_files() -> list[str]:
    """What a fresh clone would hold, with this checkout's uncommitted changes."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


def check_catalogue(mutants: Sequence[Mutant]) -> list[str]:
    """Every edit's text must occur exactly once in its file; returns the problems."""
    problems = []
    for mutant in mutants:
        for edit in mutant.edits:
            count = (ROOT / edit.path).read_text().count(edit.find)
            if count != 1:
                problems.append(f"{mutant.name}: {edit.path} has its text {count} times, not once")
            elif (later := superseded_by(edit)) is not None:
                problems.append(
                    f"{mutant.name}: {edit.path} edits a function that {later} "
                    "defines again: the mutant would change nothing that runs"
                )
        for test in mutant.tests:
            path, _, node = test.partition("::")
            if not (ROOT / path).is_file():
                problems.append(f"{mutant.name}: no test file {test}")
            elif node and not defines(node.split("::")[-1].split("[")[0], ROOT / path):
                problems.append(f"{mutant.name}: {path} defines no {node}")
    return problems


def defines(function: str, path: Path) -> bool:
    """Whether the test file at ``path`` defines the test function ``function``."""
    return (
        re.search(rf"^\s*(?:async )?def {re.escape(function)}\(", path.read_text(), re.M)
        is not None
    )


_MIGRATION = re.compile(r"sql/(\d{4})_[^/]+\.sql")
_FUNCTION = re.compile(r"CREATE (?:OR REPLACE )?FUNCTION (outbox\.\w+)\(")


def superseded_by(edit: Edit) -> str | None:
    """The later migration that defines again the function a migration's edit falls in, if
    any: a mutant of a definition nothing runs any more survives every test."""
    numbered = _MIGRATION.fullmatch(edit.path)
    if numbered is None:
        return None
    text = (ROOT / edit.path).read_text()
    defined = _FUNCTION.findall(text[: text.index(edit.find)])
    if not defined:
        return None
    name = re.escape(defined[-1])
    for later in sorted((ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql")):
        if int(later.name[:4]) > int(numbered[1]) and re.search(
            rf"CREATE (?:OR REPLACE )?FUNCTION {name}\(", later.read_text()
        ):
            return f"sql/{later.name}"
    return None


def copy_tree(files: Sequence[str], into: Path) -> Path:
    tree = into / "tree"
    for name in files:
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return tree


def apply(mutant: Mutant, tree: Path) -> None:
    for edit in mutant.edits:
        path = tree / edit.path
        path.write_text(path.read_text().replace(edit.find, edit.replace, 1))


def run_tests(tree: Path, tests: Sequence[str], *, workers: int = 0) -> tuple[int | None, str]:
    """pytest in ``tree``, importing outbox from there; (exit status or None on timeout, output).
    Stops at the first failure: one is enough to kill a mutant."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-n",
        str(workers),
        *tests,
    ]
    with subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as pytest:
        try:
            output, _ = pytest.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            # SIGINT, not SIGKILL: pytest then runs the tests' finalizers and its atexit hooks,
            # which stop the `outbox run` processes (each in a session of its own) it started.
            pytest.send_signal(signal.SIGINT)
            try:
                output, _ = pytest.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.kill()
                output, _ = pytest.communicate()
            return None, output or ""
    return pytest.returncode, output or ""


def imports_from(tree: Path) -> bool:
    """Whether ``import outbox`` in ``tree`` finds the copy, not the installed checkout."""
    probe = "import outbox, sys; sys.stdout.write(outbox.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=False,
    ).stdout
    return Path(found).resolve().is_relative_to(tree.resolve())


def judge(mutant: Mutant, files: Sequence[str]) -> Verdict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"outbox-mutant-{mutant.name}-") as scratch:
        tree = copy_tree(files, Path(scratch))
        apply(mutant, tree)
        status, output = run_tests(tree, mutant.tests)
    seconds = time.monotonic() - started
    if status is None:
        return Verdict(mutant, "timeout", seconds, f"its tests ran past {TIMEOUT:.0f} s")
    if status == 0:
        return Verdict(mutant, "survived", seconds, "every test passed")
    failed = _FAILED.findall(output)
    if status == 1 and failed:
        return Verdict(mutant, "killed", seconds, failed[0])
    tail = " | ".join(output.strip().splitlines()[-3:])
    return Verdict(mutant, "error", seconds, f"pytest exited {status}: {tail}")


def baseline(
    mutants: Sequence[Mutant], files: Sequence[str], jobs: int, *, sample: bool = False
) -> str | None:
    """None if every mutant's tests pass on the unmutated tree; else what failed. ``sample``:
    one test of each test file, which shows that the scratch copy runs its tests as the
    checkout does, for a caller that has just run every one of them on this commit (CI)."""
    tests = sorted({test for mutant in mutants for test in mutant.tests})
    if sample:
        tests = sorted({test.split("::", 1)[0]: test for test in reversed(tests)}.values())
    with tempfile.TemporaryDirectory(prefix="outbox-mutant-baseline-") as scratch:
        tree = copy_tree(files, Path(scratch))
        if not imports_from(tree):
            return "the scratch copy imports outbox from elsewhere: the mutants would not run"
        status, output = run_tests(tree, tests, workers=jobs)
    if status == 0:
        return None
    return f"pytest exited {status} on the unmutated tree:\n{output[-3000:]}"


def report(verdicts: Sequence[Verdict]) -> None:
    width = max(len(v.mutant.name) for v in verdicts)
    for v in verdicts:
        print(f"{v.outcome:<8} {v.mutant.name:<{width}} {v.seconds:6.1f} s  {v.detail}")
        if v.outcome != "killed":
            print(f"{'':<8} {'':<{width}}           breaks: {v.mutant.breaks}")
    killed = sum(v.outcome in ("killed", "timeout") for v in verdicts)
    print(f"{killed} of {len(verdicts)} mutants killed")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutation.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants at once (default 2)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    parser.add_argument(
        "--baseline",
        choices=("all", "sample"),
        default="all",
        help="run every mutant's tests on the unmutated copy first (all, the default), or one "
        "test of each file (sample: only right after a run of the whole suite on this commit)",
    )
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}; --list shows them")
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.breaks}\n    {', '.join(m.tests)}")
        return 0
    problems = check_catalogue(chosen)
    if problems:
        print("the catalogue no longer matches the code:", *problems, sep="\n  ")
        return 2
    files = tree_files()
    failed = baseline(chosen, files, max(1, args.jobs), sample=args.baseline == "sample")
    if failed is not None:
        print(failed)
        return 2
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        verdicts = list(pool.map(lambda m: judge(m, files), chosen))
    report(verdicts)
    return 0 if all(v.outcome in ("killed", "timeout") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
