"""The lake files of the `umls.*` tables: deleting the ones no view reads any more.

Shared by ingestion of one file (`medgraph.umls.ingest`) and the all-or-nothing publish of a release
(`medgraph.umls.publish`), so neither imports the other for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from medgraph.s3 import S3Lake
from medgraph.storage import Lake
from medgraph.umls.schema import INGESTED, SCHEMA

log = logging.getLogger(__name__)


def remove_superseded_files(lake: Lake | S3Lake, current: dict[str, Path | str]) -> list[str]:
    """Delete every file of each table (`<table>.parquet`, `<table>.<version>.parquet`) but `current[table]`,
    which its view now reads; the removed paths. A file that cannot be deleted is logged, not fatal."""
    removed = []
    for table, keep in current.items():
        for path in lake.glob(SCHEMA, f"{table}.*parquet"):
            if _name(path) != _name(keep) and remove_quietly(lake, path):
                removed.append(str(path))
    return removed


def remove_unreferenced_versions(lake: Lake | S3Lake, view_files: dict[str, list[str]]) -> list[str]:
    """Delete versioned files `umls/<table>.<version>.parquet` that no view reads: those a killed publish
    moved into place but never committed, or old versions it had no time to delete. Called at the start of
    a publish (the `warehouse` pool runs one at a time)."""
    # By file name: the names under umls/ are unique, and a view's path may spell the root differently.
    referenced = {_name(path) for paths in view_files.values() for path in paths}
    removed = []
    for layout in INGESTED:
        for table in (layout.table, f"{layout.table}_rejects"):
            for path in lake.glob(SCHEMA, f"{table}.*.parquet"):
                if _name(path) not in referenced and remove_quietly(lake, path):
                    removed.append(str(path))
    if removed:
        log.warning("removed %d lake file(s) no view reads, left by an interrupted publish: %s", len(removed),
                    ", ".join(Path(str(p)).name for p in removed))
    return removed


def _name(path: Path | str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def remove_quietly(lake: Lake | S3Lake, path: Path | str) -> bool:
    try:
        lake.remove(path)
        return True
    except Exception as error:  # noqa: BLE001 - a leftover file must not fail a publish that committed
        log.warning("could not delete the superseded lake file %s: %s", path, error)
        return False
