"""Atomic local writes: a file or a directory appears complete or not at all.

Everything the platform writes outside DuckDB (reports, MIRAGE question files, checkpoints, converted
models, sample releases) goes through here: write beside the target, fsync, rename over it. A crash or
an exception leaves the previous version in place and no staging file behind. (Lake tables have their own
staging in `medgraph.storage.Lake`, and the warehouse uses DuckDB transactions: `storage.transaction`.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock


def staging_path(final: Path, suffix: str = ".tmp") -> Path:
    """A fresh hidden name beside `final` (same directory, so the closing rename is atomic)."""
    return final.parent / f".{final.name}.{uuid.uuid4().hex[:12]}{suffix}"


def write_atomically(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) in one rename; parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    try:
        with open(staging, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path


def write_json_atomically(path: str | Path, payload: object, indent: int | None = 1) -> Path:
    """`payload` as UTF-8 JSON (non-ASCII kept as is), written with `write_atomically`."""
    return write_atomically(path, json.dumps(payload, ensure_ascii=False, indent=indent))


def replace_directory(staging: Path, final: Path) -> Path:
    """Move the finished directory `staging` to `final`, replacing a previous `final` (renamed aside first,
    then removed: a reader sees the old or the new directory, and for one rename's time none)."""
    retired = None
    if final.exists():
        retired = staging_path(final, ".old")
        os.replace(final, retired)
    os.replace(staging, final)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    return final


@contextlib.contextmanager
def directory_written_atomically(final: Path) -> Iterator[Path]:
    """Yields a fresh directory beside `final` to fill; on success it replaces `final` (`replace_directory`),
    on an exception it is removed and `final` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(final)
    staging.mkdir()
    try:
        yield staging
        replace_directory(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def build_directory_once(final: Path) -> Iterator[Path | None]:
    """Build a shared cache directory so that `final` appears complete or not at all, once.

    Yields a fresh temporary directory beside `final` (or None when `final` already exists, e.g. another
    process finished first); on success it is renamed into place. A file lock keeps concurrent callers from
    doing the same expensive work twice; the rename tolerates losing a race with a process that does not
    take the lock. Unlike `directory_written_atomically`, an existing `final` is never replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if final.exists():
            yield None
            return
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by a team
        try:
            yield tmp
            try:
                os.replace(tmp, final)
            except OSError:
                if not final.exists():  # a real failure, not a lost race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
