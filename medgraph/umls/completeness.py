"""Is a release file complete? Split parts contiguous, gzip intact, text UTF-8, rows and bytes as MRFILES says.

One streaming pass over the physical files of an RRF source, before DuckDB parses anything: a truncated
`.gz` (DuckDB reads it silently as fewer rows), a missing split part or a file cut short fails here in
seconds, naming the file and both numbers, instead of being ingested as a smaller release.
`MRFILES.RRF` (FIL|DES|FMT|CLS|RWS|BTS|) declares each file's rows and uncompressed bytes, and has "one row
for each physical segment of each logical file": when it lists a file's split parts, their number is checked
too, so a missing last part is refused. A release without it is read as it is, and the ingestion metadata says
its completeness could not be verified; split parts are then only known to have no gap between them (`.aa`,
`.ab`, ... in a row): a missing *last* part cannot be detected at all, and the metadata says so.
"""

from __future__ import annotations

import codecs
import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from medgraph.umls.release import RrfSource

MRFILES_NAME = "MRFILES.RRF"
_CHUNK = 8 << 20


class ReleaseIncompleteError(ValueError):
    """A release file that is truncated, corrupt, missing a part or not what MRFILES.RRF declares."""


@dataclass(frozen=True)
class Declared:
    rows: int
    bytes: int


@dataclass(frozen=True)
class Completeness:
    """What the pass found for one RRF file, and whether MRFILES.RRF vouched for it."""

    filename: str
    rows: int
    bytes: int
    declared: Declared | None
    parts: tuple[str, ...] = ()  # the split parts read, in order; () for one plain or .gz file

    @property
    def verified(self) -> bool:
        return self.declared is not None

    def describe(self) -> str:
        parts = f"{len(self.parts)} split parts ({self.parts[0]} to {self.parts[-1]})" if self.parts else ""
        if self.declared is None:
            read = f"{self.rows} rows, {self.bytes} bytes read"
            if parts:
                read += (f" from {parts} with no gap between them; a missing last part cannot be detected without "
                         f"{MRFILES_NAME}")
            return f"not verified: no {MRFILES_NAME} entry for {self.filename} was compared ({read})"
        return f"verified against {MRFILES_NAME}: " + (f"{parts}, " if parts else "") + f"{self.rows} rows, {self.bytes} bytes"


def read_mrfiles(release_dir: str | Path) -> dict[str, Declared] | None:
    """`{FIL: Declared(RWS, BTS)}` from the release's MRFILES.RRF, or None when it has none."""
    path = Path(release_dir) / MRFILES_NAME
    if not path.is_file():
        return None
    declared: dict[str, Declared] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.rstrip("\n").split("|")
            if not line.strip():
                continue
            if len(fields) < 6 or not fields[4].isdigit() or not fields[5].isdigit():
                raise ReleaseIncompleteError(f"{path}:{number}: expected FIL|DES|FMT|CLS|RWS|BTS| with integer "
                                             f"RWS and BTS, found {line.rstrip()!r}")
            declared[fields[0]] = Declared(int(fields[4]), int(fields[5]))
    return declared


def check_split_parts(source: RrfSource) -> None:
    """Split parts must run `.aa`, `.ab`, `.ac`, ... without a gap (a missing middle part loses rows)."""
    filename = source.layout.filename
    suffixes = [p.name[len(filename):] for p in source.paths]
    if suffixes in ([""], [".gz"]):
        return  # the plain file or its .gz, not parts
    letters = [suffix[1:3] for suffix in suffixes]
    for index, found in enumerate(letters):
        expected = chr(ord("a") + index // 26) + chr(ord("a") + index % 26)
        if found != expected:
            raise ReleaseIncompleteError(
                f"{filename}: split part {filename}.{expected} is missing (found "
                f"{', '.join(p.name for p in source.paths)}): the parts must run .aa, .ab, ... without a gap")


def scan_source(source: RrfSource) -> tuple[int, int]:
    """(rows, uncompressed bytes) of a source's files read end to end, decompressing `.gz` parts.

    Fails on a truncated or corrupt gzip archive, and on bytes that are not UTF-8 (with file:line).
    """
    rows = total = 0
    for path in source.paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        line = 1
        last = b"\n"
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    try:
                        if not chunk.isascii() or decoder.getstate()[0]:  # ASCII needs no decoding
                            decoder.decode(chunk)
                    except UnicodeDecodeError as error:
                        at = line + chunk.count(b"\n", 0, max(error.start, 0))
                        bad = chunk[max(error.start, 0): max(error.start, 0) + 4]
                        raise ReleaseIncompleteError(f"{path}:{at}: not UTF-8 (bytes {bad.hex(' ')}); RRF files "
                                                     f"are UTF-8: re-extract the release or convert the file") from None
                    if b"\r" in chunk or last == b"\r":
                        _refuse_bare_carriage_return(path, chunk, line, last)
                    newlines = chunk.count(b"\n")
                    line += newlines
                    rows += newlines
                    total += len(chunk)
                    last = chunk[-1:]
                decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ReleaseIncompleteError(f"{path}:{line}: not UTF-8 (the file ends inside a character)") from None
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise ReleaseIncompleteError(f"{path}: corrupt or truncated gzip archive ({error}); "
                                         f"`gzip -t {path.name}` confirms it") from None
        if last == b"\r":
            _refuse_bare_carriage_return(path, b"", line, last)
        if last != b"\n":
            rows += 1  # a last row without its newline still counts
    return rows, total


_BARE_CR = re.compile(rb"\r(?!\n)")


def _refuse_bare_carriage_return(path: Path, chunk: bytes, line: int, previous_last: bytes) -> None:
    """A CR not followed by a line feed: RRF has no quoting, so DuckDB's reader stops on it with its parser
    state and no line. `line` is the chunk's first line; `previous_last` the previous chunk's last byte (a
    CR there belongs to this line)."""
    if previous_last == b"\r" and not chunk.startswith(b"\n"):
        at = line
    else:
        match = _BARE_CR.search(chunk[:-1] if chunk.endswith(b"\r") else chunk)
        if match is None:
            return
        at = line + chunk.count(b"\n", 0, match.start())
    raise ReleaseIncompleteError(f"{path}:{at}: a carriage return (\\r) inside the row; RRF rows end with a line "
                                 f"feed and no field holds a line break: remove it from the file")


def split_part_names(source: RrfSource) -> tuple[str, ...]:
    """The names of a source's split parts without `.gz` (`MRREL.RRF.aa`, ...); () for one plain or .gz file."""
    filename = source.layout.filename
    names = tuple(p.name.removesuffix(".gz") for p in source.paths)
    return () if names == (filename,) else names


def declared_parts(declared_all: dict[str, Declared], filename: str) -> dict[str, Declared]:
    """MRFILES.RRF's rows for the split parts of `filename` (`MRREL.RRF.aa`, ...), by name, in order."""
    prefix = f"{filename}."
    return {name.removesuffix(".gz"): declared for name, declared in sorted(declared_all.items())
            if name.startswith(prefix) and len(name.removesuffix(".gz")) == len(prefix) + 2}


def verify_source(release_dir: str | Path, source: RrfSource, check_mrfiles: bool = True) -> Completeness:
    """Check one RRF file's parts and archive, and compare its rows and bytes with MRFILES.RRF when present
    (and `check_mrfiles`): with its row for the file, or with its rows for the file's split parts, whose
    names must then be the parts the release has."""
    filename = source.layout.filename
    check_split_parts(source)
    parts = split_part_names(source)
    declared_all = read_mrfiles(release_dir) if check_mrfiles else None
    declared = None if declared_all is None else declared_all.get(filename)
    listed = {} if declared_all is None or declared is not None else declared_parts(declared_all, filename)
    if listed:
        names = list(listed)
        if parts and list(parts) != names:  # (the whole file instead of its parts is compared by its sums below)
            missing = [name for name in names if name not in parts]
            extra = [name for name in parts if name not in listed]
            problems = [f"{', '.join(group)} {'is' if len(group) == 1 else 'are'} {what}"
                        for group, what in ((missing, "missing"), (extra, "not listed")) if group]
            raise ReleaseIncompleteError(
                f"{filename}: {MRFILES_NAME} declares {len(names)} split parts ({names[0]} to {names[-1]}), the "
                f"release has {len(parts)}: {'; '.join(problems)}")
        declared = Declared(sum(d.rows for d in listed.values()), sum(d.bytes for d in listed.values()))
    rows, size = scan_source(source)
    if declared is not None and (declared.rows, declared.bytes) != (rows, size):
        files = ", ".join(p.name for p in source.paths)
        raise ReleaseIncompleteError(
            f"{filename} is incomplete: {MRFILES_NAME} declares {declared.rows} rows and "
            f"{declared.bytes} bytes, the release has {rows} rows and {size} bytes (read from {files})")
    return Completeness(filename, rows, size, declared, parts)
