"""Locating the files of a UMLS release directory and fingerprinting it.

A release is a `META` directory. Each file may be plain (`MRREL.RRF`), gzip
compressed (`MRREL.RRF.gz`) or split into parts the way NLM ships large files
(`MRREL.RRF.aa`, `MRREL.RRF.ab`, ...). Parts are read in name order.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from medgraph.umls.schema import INGESTED, RrfLayout

_PART_SUFFIX = re.compile(r"^\.[a-z]{2}(\.gz)?$")
# Files up to this size are hashed whole (a few hundred ms). Bigger ones (MRREL
# is ~9.5 GB) are hashed by size plus evenly spaced blocks: NLM never edits a
# release in place, a new release has new sizes and contents everywhere.
_FULL_HASH_LIMIT = 256 << 20
_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK_BYTES = 1 << 16


class MissingRrfFileError(FileNotFoundError):
    """A file the ingestion needs is not in the release directory."""


@dataclass(frozen=True)
class RrfSource:
    """Where the rows of one RRF file live: one or more physical files."""

    layout: RrfLayout
    paths: tuple[Path, ...]

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def find_rrf_files(release_dir: str | Path, layout: RrfLayout) -> tuple[Path, ...]:
    """The physical files holding `layout` in `release_dir`, in read order.

    Precedence: the plain file, else its `.gz`, else its split parts. Mixing
    them would double count rows, so only one form is used.
    """
    root = Path(release_dir)
    plain = root / layout.filename
    if plain.is_file():
        return (plain,)
    gz = root / f"{layout.filename}.gz"
    if gz.is_file():
        return (gz,)
    parts = sorted(
        p for p in root.glob(f"{layout.filename}.*")
        if p.is_file() and _PART_SUFFIX.match(p.name[len(layout.filename):])
    )
    return tuple(parts)


def rrf_source(release_dir: str | Path, layout: RrfLayout) -> RrfSource:
    """The source of one required file, or a clear error naming what is missing."""
    root = Path(release_dir)
    if not root.is_dir():
        raise MissingRrfFileError(f"UMLS release directory not found: {root}")
    paths = find_rrf_files(root, layout)
    if not paths:
        raise MissingRrfFileError(
            f"{root / layout.filename} is missing: a UMLS release META directory must contain "
            f"{layout.filename} (or {layout.filename}.gz, or split parts {layout.filename}.aa, .ab, ...)"
        )
    return RrfSource(layout, paths)


def release_fingerprint(release_dir: str | Path, layouts: tuple[RrfLayout, ...] = INGESTED) -> str:
    """A cheap content fingerprint of a release: names, sizes and contents
    (whole for files up to 256 MiB, sampled blocks beyond).

    Used as the data version of the `umls_release` observable source, so that an
    unchanged release (even if touched or copied) triggers nothing downstream.
    """
    digest = hashlib.sha256()
    for layout in layouts:
        for path in find_rrf_files(release_dir, layout):
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            with path.open("rb") as handle:
                if size <= _FULL_HASH_LIMIT:
                    digest.update(hashlib.file_digest(handle, "sha256").digest())
                    continue
                step = (size - _SAMPLE_BLOCK_BYTES) // (_SAMPLE_BLOCKS - 1)
                for block in range(_SAMPLE_BLOCKS):
                    handle.seek(block * step)
                    digest.update(handle.read(_SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()[:16]


def ensure_sample_release(directory: str | Path, profile: str) -> Path:
    """The generated sample release in `directory`, built on first use.

    MRFILES.RRF is written last by the builder (the whole directory appears by
    rename), so its presence means a complete release.
    """
    root = Path(directory)
    if not (root / "MRFILES.RRF").is_file():
        from medgraph.umls.sample_release import build_sample_release

        build_sample_release(root, profile=profile)
    return root


def resolve_release_dir(umls_dir: str | None, sample_dir: str | Path, profile: str) -> Path:
    """`MEDGRAPH_UMLS_DIR` when set, else the sample release for `profile`."""
    if umls_dir:
        root = Path(umls_dir).expanduser()
        if not root.is_dir():
            raise MissingRrfFileError(f"MEDGRAPH_UMLS_DIR={umls_dir} is not a directory (expected a UMLS META folder)")
        return root
    if profile == "full":
        raise MissingRrfFileError(
            "MEDGRAPH_PROFILE=full needs a real release: set MEDGRAPH_UMLS_DIR to a UMLS META directory"
        )
    return ensure_sample_release(sample_dir, profile)
