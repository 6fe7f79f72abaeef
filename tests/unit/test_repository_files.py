"""No binaries and no large files in the repository (issue 38, item 7).

A 2.9 MB py-spy wheel sat at the root for weeks: nothing refused it. This test, in the README's
test command and so in CI, reads what git tracks (the index: in a clone, the commit under test;
in a working tree, what the next commit would hold) and refuses a file over ``MAX_BYTES``, a file
with a NUL byte (git's own sign of a binary), and an archive or compiled file by its name, unless
``ALLOWED`` names it with the reason. CI runs in a clone, so git and a checkout are required.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[2]
# The largest tracked file is bench/README.md, at about 150 KB; the whole schema dump is 95 KB.
MAX_BYTES: Final = 1024 * 1024
# Names that are binaries whatever their bytes: packages, archives, compiled code, databases.
BINARY_SUFFIXES: Final = (
    ".whl", ".egg", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".jar",
    ".so", ".dylib", ".dll", ".exe", ".o", ".a", ".pyc", ".pyo", ".pyd", ".sqlite", ".db",
)  # fmt: skip
# Path -> why it may be binary or large. Empty: no tracked file needs it today.
ALLOWED: Final[dict[str, str]] = {}


def refused_files(
    repo: Path, *, max_bytes: int = MAX_BYTES, allowed: dict[str, str] | None = None
) -> list[str]:
    """Each file git tracks in ``repo`` that breaks the rules, with why: one line each."""
    allowed = ALLOWED if allowed is None else allowed
    staged = _git(repo, "ls-files", "--stage", "-z").split(b"\0")
    blobs: dict[str, str] = {}
    for entry in filter(None, staged):
        meta, _, path = entry.decode().partition("\t")
        mode, blob, _ = meta.split()
        if mode != "160000":  # a submodule is a commit, not a file
            blobs[path] = blob
    problems = []
    for path, content in zip(blobs, _contents(repo, list(blobs.values())), strict=True):
        if path in allowed:
            continue
        if len(content) > max_bytes:
            problems.append(f"{path}: {len(content)} bytes, over the limit of {max_bytes}")
        elif b"\0" in content:
            problems.append(f"{path}: binary (it holds a NUL byte)")
        elif path.lower().endswith(BINARY_SUFFIXES):
            problems.append(f"{path}: a binary by its name")
    return problems


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), *args], input=stdin, capture_output=True, check=True
    ).stdout


def _contents(repo: Path, blobs: list[str]) -> list[bytes]:
    """The blobs' contents as git stores them (not the working files), in one git call."""
    out = _git(repo, "cat-file", "--batch", stdin="".join(f"{b}\n" for b in blobs).encode())
    contents = []
    at = 0
    for _ in blobs:
        header_end = out.index(b"\n", at)
        size = int(out[at:header_end].split()[2])
        contents.append(out[header_end + 1 : header_end + 1 + size])
        at = header_end + 1 + size + 1  # the content is followed by a newline
    return contents


def test_the_repository_holds_no_binary_and_no_large_file() -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail(f"{REPO} is not a git checkout with git installed: CI runs in a clone")
    problems = refused_files(REPO)
    assert problems == [], (
        "committed binaries or large files (remove them, or name them in ALLOWED with the "
        "reason):\n" + "\n".join(problems)
    )


def test_the_allowed_files_still_exist() -> None:
    """An allow-list entry for a file that is gone would let its path back in unseen."""
    tracked = set(_git(REPO, "ls-files", "-z").decode().split("\0"))
    assert [path for path in ALLOWED if path not in tracked] == []


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "README.md").write_text("# a project\n")
    _git(tmp_path, "add", "README.md")
    return tmp_path


def test_a_staged_wheel_is_refused_by_its_bytes_and_by_its_name(repo: Path) -> None:
    assert refused_files(repo) == []
    # What a wheel begins with: a zip's local file header, NULs and all.
    (repo / "py_spy-0.4.0-py2.py3-none-manylinux.whl").write_bytes(
        b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(range(256))
    )
    (repo / "notes.zip").write_text("not really a zip\n")
    _git(repo, "add", "--force", ".")
    assert refused_files(repo) == [
        "notes.zip: a binary by its name",
        "py_spy-0.4.0-py2.py3-none-manylinux.whl: binary (it holds a NUL byte)",
    ]


def test_a_large_text_file_is_refused_and_an_allowed_one_passes(repo: Path) -> None:
    (repo / "data").mkdir()
    (repo / "data" / "big.csv").write_text("a,b\n" * 300)
    _git(repo, "add", "data/big.csv")
    assert refused_files(repo, max_bytes=1000) == [
        "data/big.csv: 1200 bytes, over the limit of 1000"
    ]
    assert refused_files(repo, max_bytes=1000, allowed={"data/big.csv": "a fixture"}) == []


def test_what_git_stores_counts_not_the_working_file(repo: Path) -> None:
    """A binary staged and then overwritten in the working tree is still what would be
    committed."""
    (repo / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    _git(repo, "add", "image.txt")
    (repo / "image.txt").write_text("text now\n")
    assert refused_files(repo) == ["image.txt: binary (it holds a NUL byte)"]
