"""Publishing a UMLS release all-or-nothing: the staged tables become the `umls.*` views in one step.

`stage_release` stages every table (medgraph.umls.ingest.stage_rrf_file: parse, filters, completeness and
the blocking checks on the staged Parquet); nothing a reader sees has changed yet. `publish_release` then
1. refuses a run that would mix two releases (tables it does not republish were published from other RRF
   content than the release now holds),
2. moves every staged file to a new versioned lake file `umls/<table>.<version>.parquet`: no file a view
   reads is touched, so a crash here leaves only files nothing references,
3. replaces all the views in ONE DuckDB transaction: readers see the whole previous release or the whole
   new one, never a mix,
4. after the commit, deletes the tables' older files (`<table>.parquet`, other versions).
A failure before the commit (a parse error, a failing check, a crash) leaves every view, and so the
whole previous release, as it was; versioned files a killed run left unreferenced are deleted by the next
publish. Versioned files live in `<root>/umls/` like every lake file, so a moved home re-points their views
as any other (medgraph.storage.lake_views_to_repoint).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from pathlib import Path

from medgraph.storage import Warehouse, sql_literal
from medgraph.umls.filters import IngestFilters
from medgraph.umls.ingest import (
    RRF_FINGERPRINT_KEY,
    IngestStats,
    StagedTable,
    published_stats,
    stage_rrf_file,
)
from medgraph.umls.lake_files import remove_quietly, remove_superseded_files, remove_unreferenced_versions
from medgraph.umls.release import release_fingerprint
from medgraph.umls.schema import INGESTED, SCHEMA, RrfLayout

log = logging.getLogger(__name__)


class ReleaseNotPublishedError(RuntimeError):
    """A table of the release failed to stage or to publish; every `umls.*` view is as it was."""


class MixedReleaseError(ReleaseNotPublishedError):
    """Publishing only some tables would leave the others from another release."""


def _unchanged(layouts: list[RrfLayout] | tuple[RrfLayout, ...]) -> str:
    return ", ".join(f"umls.{layout.table}" for layout in layouts)


def stage_release(release_dir: str | Path, layouts: list[RrfLayout] | tuple[RrfLayout, ...], warehouse: Warehouse,
                  filters: IngestFilters | None = None, quarantine: bool = False,
                  check_mrfiles: bool = True) -> list[StagedTable]:
    """Stage every table (nothing published). The first failure discards what was staged and raises
    ReleaseNotPublishedError, whose message starts with the failing file's own error."""
    staged: list[StagedTable] = []
    try:
        for layout in layouts:
            staged.append(stage_rrf_file(release_dir, layout, warehouse, filters, quarantine, check_mrfiles))
    except BaseException as error:
        for table in staged:
            table.discard(warehouse.lake)
        if not isinstance(error, Exception):
            raise
        raise ReleaseNotPublishedError(
            f"{error}\nThe release was not published: {_unchanged(layouts)} keep the previous release") from error
    return staged


def publish_release(warehouse: Warehouse, staged: list[StagedTable],
                    release_dir: str | Path | None = None) -> list[IngestStats]:
    """Make the staged tables the `umls.*` views in one transaction (see the module docstring); their stats,
    in order. With `release_dir`, refuse (MixedReleaseError) when an ingested table this call does not
    publish was published from other RRF content than `release_dir` holds. Any failure discards the staged
    files and leaves every view as it was."""
    lake = warehouse.lake
    layouts = [table.layout for table in staged]
    moved: dict[str, Path | str] = {}
    try:
        current = warehouse.view_files(SCHEMA)
        remove_unreferenced_versions(lake, current)
        if release_dir is not None:
            _refuse_mixed_release(warehouse, Path(release_dir), staged, current)
        version = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        for table in staged:
            name = table.layout.table
            moved[name] = lake.publish(table.staging, SCHEMA, name, version)
            if table.rejects_staging is not None:
                moved[f"{name}_rejects"] = lake.publish(table.rejects_staging, SCHEMA, f"{name}_rejects", version)
        warehouse.register_parquet_views(SCHEMA, moved)  # the one step readers see
    except BaseException as error:
        for table in staged:
            table.discard(lake)
        for path in moved.values():  # never referenced by a view
            remove_quietly(lake, path)
        if not isinstance(error, Exception) or isinstance(error, ReleaseNotPublishedError):
            raise
        raise ReleaseNotPublishedError(
            f"publishing {_unchanged(layouts)} failed, every umls view is unchanged: {error}") from error
    remove_superseded_files(lake, moved)
    log.info("published %s (version %s) in one transaction", _unchanged(layouts), version)
    return [published_stats(table, lake, moved[table.layout.table]) for table in staged]


def table_data_version(code_version: str, staged: StagedTable, filters: IngestFilters, quarantine: bool) -> str:
    """A published table's data version: its own RRF files, the filters and the ingestion code. Re-ingesting
    unchanged files (from the UI, without observing the release) changes nothing downstream, and a revised
    file changes only this table's descendants."""
    content = f"{code_version}|{staged.rrf_fingerprint}|{filters}|{quarantine}"
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def table_warnings(staged: StagedTable, stats: IngestStats) -> list[str]:
    """What an operator should see in the run log about one published table."""
    warnings = []
    if not stats.completeness.startswith("verified"):
        warnings.append(f"{staged.layout.filename}: completeness {stats.completeness}")
    if stats.rejected:
        warnings.append(f"{stats.rejected} malformed rows quarantined in {SCHEMA}.{stats.table}_rejects")
    return warnings


def published_fingerprint(warehouse: Warehouse, path: str) -> str | None:
    """The RRF fingerprint a published file was made from (its Parquet key-value metadata), or None when
    it does not say (a file from before the fingerprint was recorded) or cannot be read."""
    try:
        with warehouse.connect(read_only=True) as con:
            rows = con.execute(f"SELECT decode(value) FROM parquet_kv_metadata({sql_literal(path)}) "
                               f"WHERE decode(key) = {sql_literal(RRF_FINGERPRINT_KEY)}").fetchall()
    except Exception as error:  # noqa: BLE001 - unknown, reported by the caller
        log.warning("cannot read the key-value metadata of %s: %s", path, error)
        return None
    return rows[0][0] if rows else None


def _refuse_mixed_release(warehouse: Warehouse, release_dir: Path, staged: list[StagedTable],
                          view_files: dict[str, list[str]]) -> None:
    """A run that publishes only some tables (one table from the UI) keeps one release in the warehouse
    only if every other published table was made from the RRF content the release still holds."""
    publishing = {table.layout.table for table in staged}
    behind = []
    for layout in INGESTED:
        paths = view_files.get(layout.table)
        if layout.table in publishing or not paths:
            continue  # republished now, or never published
        published = published_fingerprint(warehouse, paths[0])
        if published is None:
            log.warning("umls.%s does not record which %s it was made from; publishing %s alone may mix "
                        "releases", layout.table, layout.filename, _unchanged([t.layout for t in staged]))
            continue
        if published != release_fingerprint(release_dir, (layout,)):
            behind.append(layout)
    if behind:
        raise MixedReleaseError(
            f"publishing only {_unchanged([t.layout for t in staged])} would mix two releases: "
            f"{', '.join(layout.filename for layout in behind)} changed in {release_dir} since "
            f"{_unchanged(behind)} {'was' if len(behind) == 1 else 'were'} published, and this run does not "
            f"republish {'it' if len(behind) == 1 else 'them'}. Nothing was published; "
            f"materialize all five umls tables together (the umls_ingest job, or `--select group:umls`)")

