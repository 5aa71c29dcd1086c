"""RRF -> zstd Parquet in the lake -> views in the warehouse, with validation and filters.

Each file is read twice by DuckDB's parallel CSV reader with an explicit column
layout (no sniffing, `|` delimiter, no quoting): a first pass that validates
every row and counts what each filter keeps, and a second that streams the
kept rows into Parquet. Both passes are cheap next to the Parquet encoding and
memory stays bounded by DuckDB's streaming execution, whatever the file size.
"""

from __future__ import annotations

import gzip
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from medgraph.s3 import S3Lake
from medgraph.storage import Lake, Warehouse, quote_ident, sql_literal
from medgraph.umls import checks
from medgraph.umls.completeness import verify_source
from medgraph.umls.filters import IngestFilters
from medgraph.umls.lake_files import remove_superseded_files
from medgraph.umls.release import RrfSource, release_fingerprint, rrf_source
from medgraph.umls.schema import INTEGER_COLUMNS, MRSAB, SCHEMA, RrfLayout
from medgraph.umls.schema import layout as layout_named

log = logging.getLogger(__name__)

# zstd level 1 and no dictionary pages: the Parquet writer is ~85% of ingestion time, and on
# RRF text these cut ~18% of it for files of the same size (zstd still sees the repeats).
_PARQUET_OPTIONS = "COMPRESSION zstd, COMPRESSION_LEVEL 1, DICTIONARY_SIZE_LIMIT 0, ROW_GROUP_SIZE 122880"
_TRAILING = "_trailing"  # the empty field after the last `|`; non-empty means a malformed row


class StagedCheckError(ValueError):
    """The staged rows of a file fail a blocking check; nothing was published."""


class RrfFormatError(ValueError):
    """A row of an RRF file does not match its layout."""

    def __init__(self, path: Path, line: int, message: str, rejected: int = 1):
        self.path, self.line, self.rejected = path, line, rejected
        more = f" ({rejected - 1} more malformed rows)" if rejected > 1 else ""
        super().__init__(f"{path}:{line}: {message}{more}")


@dataclass(frozen=True)
class RejectedRow:
    path: str
    line: int
    error: str
    raw: str


@dataclass
class IngestStats:
    """What one file's ingestion did; becomes Dagster metadata."""

    table: str
    files: list[str]
    rows_in: int
    kept_after: dict[str, int]
    rows_out: int
    rejected: int
    bytes_in: int
    parquet_bytes: int
    seconds: float
    parquet_path: str
    filters: dict[str, str] = field(default_factory=dict)
    completeness: str = "not checked"  # against MRFILES.RRF: "verified ..." or "not verified: ..."

    def as_metadata(self) -> dict[str, object]:
        metadata: dict[str, object] = {
            "table": f"{SCHEMA}.{self.table}",
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "rows_rejected": self.rejected,
            "bytes_in": self.bytes_in,
            "parquet_bytes": self.parquet_bytes,
            "seconds": round(self.seconds, 3),
            "rows_per_second": round(self.rows_in / self.seconds) if self.seconds > 0 else 0,
            "parquet_path": self.parquet_path,
            "source_files": ", ".join(self.files),
            "release_completeness": self.completeness,
        }
        metadata.update({f"rows_kept_after_{name}": kept for name, kept in self.kept_after.items()})
        metadata.update({f"filter_{name}": value for name, value in self.filters.items()})
        return metadata


def _read_csv_sql(source: RrfSource, rejects: bool) -> str:
    integer_columns = INTEGER_COLUMNS.get(source.layout.name, frozenset())
    columns = ", ".join(
        f"{sql_literal(c)}: '{'INTEGER' if c in integer_columns else 'VARCHAR'}'" for c in source.layout.columns
    )
    files = "[" + ", ".join(sql_literal(str(p)) for p in source.paths) + "]"
    # auto_detect=false: the layout is known, and sniffing could misread a file
    # whose first rows are unusual. quote/escape '': RRF has no quoting and
    # strings do contain `"`.
    options = (
        f"columns={{{columns}, '{_TRAILING}': 'VARCHAR'}}, delim='|', quote='', escape='', header=false, "
        "auto_detect=false, new_line='\\n', encoding='utf-8'"
    )
    if rejects:
        options += ", store_rejects=true, rejects_table='rrf_reject_errors', rejects_scan='rrf_reject_scans'"
    return f"read_csv({files}, {options})"


def _field_count_error(row: str, expected: int) -> str:
    """'expected N fields, found M': fields are `|`-terminated; an unterminated last value counts too."""
    if row.endswith("|"):
        return f"expected {expected} fields, found {row.count('|')}"
    return f"expected {expected} fields, found {row.count('|') + 1} (the row does not end with '|')"


def _malformed_trailing_rows(source: RrfSource, limit: int) -> list[RejectedRow]:
    """Rows with too many fields or no final `|`, which DuckDB accepts into the
    trailing column; found by a plain scan, run only when such rows exist."""
    expected = len(source.layout.columns)
    found: list[RejectedRow] = []
    for path in source.paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", newline="\n") as handle:
            for line_number, line in enumerate(handle, start=1):
                row = line.rstrip("\n").rstrip("\r")
                fields = row.count("|")
                if (fields, row.endswith("|")) not in ((expected + 1, True), (expected, False)):
                    continue
                found.append(RejectedRow(str(path), line_number, _field_count_error(row, expected), row))
                if len(found) >= limit:
                    return found
    return found


def _reader_rejects(con: duckdb.DuckDBPyConnection, expected: int) -> list[RejectedRow]:
    # DuckDB creates the rejects tables only once a scan has rejected something.
    if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'rrf_reject_errors'").fetchone()[0]:
        return []
    rows = con.execute(
        """
        SELECT s.file_path, e.line, e.error_type, e.column_name, e.error_message, e.csv_line
        FROM rrf_reject_errors e JOIN rrf_reject_scans s USING (scan_id, file_id)
        ORDER BY s.file_id, e.line
        """
    ).fetchall()
    rejected: dict[tuple[str, int], RejectedRow] = {}
    for path, line, error_type, column, message, raw in rows:
        if (path, line) in rejected:  # DuckDB reports each surplus field of a row separately
            continue
        if error_type in ("MISSING COLUMNS", "TOO MANY COLUMNS"):
            error = _field_count_error(raw, expected)
        else:
            error = f"column {column}: {message}" if column else str(message)
        rejected[(path, line)] = RejectedRow(path, int(line), error, raw)
    return list(rejected.values())


def restricted_sabs(release_dir: str | Path, max_srl: int) -> tuple[str, ...]:
    """SABs whose source restriction level in MRSAB exceeds `max_srl`."""
    source = rrf_source(release_dir, MRSAB)
    with duckdb.connect() as con:
        rows = con.execute(
            f"SELECT DISTINCT RSAB FROM {_read_csv_sql(source, rejects=False)} WHERE SRL > ? ORDER BY 1", [max_srl]
        ).fetchall()
    return tuple(r[0] for r in rows)


@dataclass
class StagedTable:
    """One RRF file parsed, filtered and written as Parquet at a staging path, its blocking checks passed;
    not yet a table: `publish_table` or `medgraph.umls.publish.publish_release` makes it one (or `discard`)."""

    layout: RrfLayout
    staging: Path | str
    rejects_staging: Path | str | None  # the quarantined rows (with `quarantine`), else None: rejects untouched
    stats: IngestStats  # parquet_path / parquet_bytes are filled in when published
    rrf_fingerprint: str  # release_fingerprint of this file alone, also stored in the Parquet's key-value metadata
    checks: dict[str, checks.CheckOutcome]  # the blocking checks on the staged rows (all passed)

    def discard(self, lake: Lake | S3Lake) -> None:
        lake.discard(self.staging)
        if self.rejects_staging is not None:
            lake.discard(self.rejects_staging)


# Parquet key-value metadata of every staged file: which RRF content it was made from (publish_release
# compares it with the release when a run publishes only some tables).
RRF_FINGERPRINT_KEY = "medgraph_rrf_fingerprint"


def ingest_rrf_file(
    release_dir: str | Path,
    rrf: RrfLayout | str,
    warehouse: Warehouse,
    filters: IngestFilters = IngestFilters(),
    quarantine: bool = False,
    check_mrfiles: bool = True,
) -> IngestStats:
    """Ingest one META file into `lake/umls/<table>.parquet` and the view `umls.<table>`: `stage_rrf_file`
    then `publish_table`. Publishing one table on its own; the Dagster assets publish a release's tables
    together with `medgraph.umls.publish.publish_release`."""
    staged = stage_rrf_file(release_dir, rrf, warehouse, filters, quarantine, check_mrfiles)
    return publish_table(warehouse, staged)


def _validate_rows(con: duckdb.DuckDBPyConnection, source: RrfSource, predicates: Sequence[tuple[str, str]],
                   quarantine: bool) -> tuple[int, list[RejectedRow], dict[str, int], int]:
    """Pass 1 over a source's files: every row validated (typed columns included, so a bad integer is caught
    here) and what each filter keeps counted. (rows in, malformed rows, rows kept after each filter, rows to
    write); a malformed row raises RrfFormatError naming the first, unless `quarantine`."""
    layout = source.layout
    kept_so_far = "TRUE"
    counts = ["count(*)", f"count(*) FILTER (WHERE {_TRAILING} IS NOT NULL)"]
    for _, condition in predicates:
        kept_so_far = f"{kept_so_far} AND ({condition})"
        counts.append(f"count(*) FILTER (WHERE {_TRAILING} IS NULL AND {kept_so_far})")
    typed = [c for c in layout.columns if c in INTEGER_COLUMNS.get(layout.name, ())]
    counts += [f"count({quote_ident(c)})" for c in typed]
    # fetchall, not fetchone: DuckDB writes the rejects tables when the result is exhausted.
    totals = con.execute(f"SELECT {', '.join(counts)} FROM {_read_csv_sql(source, rejects=True)}").fetchall()[0]
    parsed, trailing_bad = totals[0], totals[1]
    rejected = _reader_rejects(con, len(layout.columns))
    if trailing_bad:
        rejected += _malformed_trailing_rows(source, limit=trailing_bad)
    if rejected and not quarantine:
        first = min(rejected, key=lambda r: (source.paths.index(Path(r.path)), r.line))
        raise RrfFormatError(Path(first.path), first.line, first.error, rejected=len(rejected))
    kept_after = {name: totals[2 + i] for i, (name, _) in enumerate(predicates)}
    expected_out = kept_after[predicates[-1][0]] if predicates else parsed - trailing_bad
    return parsed + len(rejected) - trailing_bad, rejected, kept_after, expected_out


def _write_kept_rows(con: duckdb.DuckDBPyConnection, source: RrfSource, predicates: Sequence[tuple[str, str]],
                     staging: Path | str, fingerprint: str) -> int:
    """Pass 2: stream the well-formed rows every filter keeps into the Parquet file `staging`; how many."""
    select_columns = ", ".join(quote_ident(c) for c in source.layout.columns)
    where = " AND ".join([f"{_TRAILING} IS NULL"] + [f"({c})" for _, c in predicates])
    return con.execute(
        f"COPY (SELECT {select_columns} FROM {_read_csv_sql(source, rejects=True)} WHERE {where}) "
        f"TO {sql_literal(str(staging))} (FORMAT parquet, {_PARQUET_OPTIONS}, "
        f"KV_METADATA {{{RRF_FINGERPRINT_KEY}: {sql_literal(fingerprint)}}})"
    ).fetchall()[0][0]


def stage_rrf_file(release_dir: str | Path, rrf: RrfLayout | str, warehouse: Warehouse,
                   filters: IngestFilters | None = None, quarantine: bool = False,
                   check_mrfiles: bool = True) -> StagedTable:
    """Parse, validate and filter one META file into a staging Parquet file and run the blocking checks on
    it; nothing is published (the view and the table's files are untouched).

    A malformed row fails the whole file with its path, line and field counts,
    unless `quarantine` is set: then malformed rows are staged for `umls.<table>_rejects`
    and counted. Staged rows failing a blocking check raise StagedCheckError. On any error the staging
    files are removed.

    First the files are read once (medgraph.umls.completeness): a truncated `.gz`, a gap in split
    parts or non-UTF-8 bytes fail, and so do rows or bytes other than MRFILES.RRF declares, unless
    `check_mrfiles` is off (an excerpt of a release that kept the original MRFILES.RRF).
    """
    started = time.perf_counter()
    filters = filters if filters is not None else IngestFilters()
    layout = rrf if isinstance(rrf, RrfLayout) else layout_named(rrf)
    remove_stale_staging(warehouse.lake, layout.table)
    source = rrf_source(release_dir, layout)
    # Before parsing: a truncated .gz, a missing split part, non-UTF-8 bytes or a file that is not
    # what MRFILES.RRF declares fails here, in one read, rather than being ingested as fewer rows.
    completeness = verify_source(release_dir, source, check_mrfiles)
    fingerprint = release_fingerprint(release_dir, (layout,))
    if filters.max_srl is not None and "SRL" not in layout.columns and not filters.restricted_sabs:
        filters = IngestFilters(**{**filters.__dict__, "restricted_sabs": restricted_sabs(release_dir, filters.max_srl)})
    predicates = filters.predicates(layout)
    lake: Lake | S3Lake = warehouse.lake

    with warehouse.scratch() as con:
        rows_in, rejected, kept_after, expected_out = _validate_rows(con, source, predicates, quarantine)

        staging = lake.staging_path(SCHEMA, layout.table)
        rejects_staging = None
        try:
            written = _write_kept_rows(con, source, predicates, staging, fingerprint)
            if written != expected_out:
                raise RuntimeError(f"{layout.filename}: wrote {written} rows, validation pass kept {expected_out}")
            # The blocking checks run on the staged file, before it replaces anything (an empty MRREL or
            # malformed CUIs never become the table; the previous one stays).
            outcomes = _refuse_failing_stage(con, layout, staging)
            if quarantine:
                rejects_staging = _stage_rejects(con, lake, layout, rejected)
        except BaseException:
            lake.discard(staging)
            if rejects_staging is not None:
                lake.discard(rejects_staging)
            raise
    stats = IngestStats(table=layout.table, files=[p.name for p in source.paths], rows_in=rows_in,
                        kept_after=kept_after, rows_out=written, rejected=len(rejected), bytes_in=source.bytes,
                        parquet_bytes=0, seconds=time.perf_counter() - started, parquet_path="",
                        filters=filters.as_metadata(), completeness=completeness.describe())
    log.info("%s: %d rows in, %d kept, %d rejected in %.1fs (staged)", layout.filename, rows_in, written,
             len(rejected), stats.seconds)
    return StagedTable(layout, staging, rejects_staging, stats, fingerprint, outcomes)


def publish_table(warehouse: Warehouse, staged: StagedTable) -> IngestStats:
    """Make one staged table `lake/umls/<table>.parquet` (a rename over the previous file) and the view
    `umls.<table>`; the table's versioned files of an earlier release publish are removed afterwards."""
    lake = warehouse.lake
    table = staged.layout.table
    try:
        rejects = lake.publish(staged.rejects_staging, SCHEMA, f"{table}_rejects") \
            if staged.rejects_staging is not None else None
        final = lake.publish(staged.staging, SCHEMA, table)
    except BaseException:
        staged.discard(lake)
        raise
    if rejects is not None:
        warehouse.register_parquet_view(SCHEMA, f"{table}_rejects", rejects)
    warehouse.register_parquet_view(SCHEMA, table, final)
    remove_superseded_files(lake, {table: final, **({f"{table}_rejects": rejects} if rejects else {})})
    return published_stats(staged, lake, final)


def published_stats(staged: StagedTable, lake: Lake | S3Lake, final: Path | str) -> IngestStats:
    stats = staged.stats
    stats.parquet_path, stats.parquet_bytes = str(final), lake.size(final)
    return stats


def remove_stale_staging(lake: Lake | S3Lake, table: str) -> list[Path]:
    """Delete staging files `lake/umls/.<table>.<12 hex>.tmp.parquet` (and of `<table>_rejects`) that a killed
    ingestion left behind; the removed paths. Safe at the start of an ingestion of that table: the
    `warehouse` pool runs one ingestion at a time, and readers' snapshots (`.<table>.snapshot.*`) never match.
    A local lake only: S3 staging objects are not listed here."""
    if not isinstance(lake, Lake):
        return []
    pattern = re.compile(rf"\.{re.escape(table)}(_rejects)?\.[0-9a-f]{{12}}\.tmp\.parquet")
    removed = []
    for path in sorted((lake.root / SCHEMA).glob(f".{table}*.tmp.parquet")):
        if pattern.fullmatch(path.name):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d stale staging file(s) of umls.%s left by an interrupted ingestion: %s",
                    len(removed), table, ", ".join(p.name for p in removed))
    return removed


def _refuse_failing_stage(con: duckdb.DuckDBPyConnection, layout: RrfLayout,
                          staging: Path | str) -> dict[str, checks.CheckOutcome]:
    outcomes = checks.staged_outcomes(con, layout, f"read_parquet({sql_literal(str(staging))})")
    failed = {name: outcome for name, outcome in outcomes.items() if not outcome.passed}
    if failed:
        details = "; ".join(
            f"{name}: {outcome.description}"
            + "".join(f", {key} {value!r}" for key, value in outcome.metadata.items() if key.startswith("example_"))
            for name, outcome in failed.items())
        raise StagedCheckError(f"{layout.filename}: not published, the staged rows fail blocking checks ({details}); "
                               f"umls.{layout.table} is unchanged")
    return outcomes


def _stage_rejects(con: duckdb.DuckDBPyConnection, lake: Lake | S3Lake, layout: RrfLayout,
                   rejected: list[RejectedRow]) -> Path | str:
    """Stage the quarantined rows (possibly none: publishing them replaces an older list) for
    `umls.<table>_rejects`."""
    con.execute("CREATE OR REPLACE TEMP TABLE rejects (path VARCHAR, line BIGINT, error VARCHAR, raw VARCHAR)")
    if rejected:
        con.executemany("INSERT INTO rejects VALUES (?, ?, ?, ?)", [(r.path, r.line, r.error, r.raw) for r in rejected])
    staging = lake.staging_path(SCHEMA, f"{layout.table}_rejects")
    try:
        con.execute(f"COPY rejects TO {sql_literal(str(staging))} (FORMAT parquet, COMPRESSION zstd)")
    except BaseException:
        lake.discard(staging)
        raise
    return staging
