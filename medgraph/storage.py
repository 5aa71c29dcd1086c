"""The lake (Parquet files) and the warehouse (one DuckDB file with a catalog over them).

Tables are stored once, as zstd Parquet in the lake; the warehouse holds views
over those files, so dbt and ad-hoc SQL see `umls.mrrel` while a 100M-row
table is not copied a second time into DuckDB's own storage. Publishing a
table is atomic: the new file is written beside the old one and renamed over
it, so a failed write never leaves a half-written table behind.

The lake is a local directory (`Lake`, the default) or an S3 prefix
(`medgraph.s3.S3Lake`, same methods; DuckDB reaches it through httpfs); the
warehouse itself is always a local DuckDB file, whose views then point at
`s3://` paths. `open_lake` picks one from a location string.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from medgraph.s3 import S3Lake, S3Options, is_s3_uri

# DuckDB allows one writing process per database file; other processes (e.g.
# parallel Dagster steps) wait for the lock instead of failing outright.
_LOCK_WAIT_SECONDS = 120.0


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sql_literal(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


@dataclass(frozen=True)
class Lake:
    """Parquet files under a root directory: `<root>/<schema>/<table>.parquet`."""

    root: Path

    is_local = True

    @property
    def uri(self) -> str:
        return str(self.root)

    def table_path(self, schema: str, table: str) -> Path:
        return self.root / schema / f"{table}.parquet"

    def staging_path(self, schema: str, table: str) -> Path:
        """A fresh temporary path beside the table, on the same filesystem (for an atomic rename)."""
        path = self.root / schema / f".{table}.{uuid.uuid4().hex[:12]}.tmp.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, staging: Path, schema: str, table: str) -> Path:
        """Atomically replace the table's file with `staging`."""
        final = self.table_path(schema, table)
        os.replace(staging, final)
        return final

    def discard(self, staging: Path) -> None:
        staging.unlink(missing_ok=True)

    def size(self, path: Path) -> int:
        return Path(path).stat().st_size

    def exists(self, path: Path) -> bool:
        return Path(path).exists()

    @property
    def scratch_dir(self) -> Path:
        return self.root / ".duckdb_tmp"

    def duckdb_config(self) -> dict[str, str]:
        return {}

    def configure(self, con: duckdb.DuckDBPyConnection) -> None:
        """Nothing to set up: DuckDB reads local files as they are."""


def open_lake(location: str | Path, local_dir: Path, s3_client: Any = None,
              s3_options: S3Options | None = None) -> Lake | S3Lake:
    """A local lake at a path, or an S3 lake at `s3://bucket/prefix` (which needs a boto3 client and
    DuckDB's S3 options; `local_dir` then holds spill files and the httpfs extension)."""
    if not is_s3_uri(str(location)):
        return Lake(Path(location))
    if s3_client is None or s3_options is None:
        raise ValueError(f"the lake {location} is on S3: configure S3 access (endpoint, region, credentials)")
    return S3Lake(str(location).rstrip("/"), s3_client, s3_options, local_dir)


@dataclass(frozen=True)
class Warehouse:
    """The DuckDB database file under MEDGRAPH_HOME, with the lake beside it."""

    path: Path
    lake: Lake | S3Lake
    memory_limit: str = "2GB"
    threads: int | None = None

    def open(self, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """A connection the caller closes (long-lived readers). Every connection of this
        process uses the same configuration, as DuckDB requires for one database file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + _LOCK_WAIT_SECONDS
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=read_only, config=self._config())
                break
            except duckdb.IOException as error:
                if "lock" not in str(error).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        try:
            self.lake.configure(con)  # an S3 lake: httpfs and credentials, so the views over s3:// resolve
        except BaseException:
            con.close()
            raise
        return con

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        con = self.open(read_only)
        try:
            yield con
        finally:
            con.close()

    @contextmanager
    def scratch(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """An in-memory DuckDB for heavy lifting (parsing, joins, Parquet writing) that spills under
        the lake and never holds the warehouse's single-writer lock."""
        spill = self.lake.scratch_dir
        spill.mkdir(parents=True, exist_ok=True)
        con = duckdb.connect(":memory:", config={**self._config(), "temp_directory": str(spill)})
        try:
            self.lake.configure(con)
            yield con
        finally:
            con.close()

    def _config(self) -> dict[str, str]:
        config = {"memory_limit": self.memory_limit, "preserve_insertion_order": "false", **self.lake.duckdb_config()}
        if self.threads:
            config["threads"] = str(self.threads)
        return config

    def register_parquet_view(self, schema: str, table: str, parquet: Path | str) -> None:
        """Point `schema.table` at a Parquet file, in one transaction."""
        with self.connect() as con:
            con.execute("BEGIN")
            con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
            con.execute(
                f"CREATE OR REPLACE VIEW {quote_ident(schema)}.{quote_ident(table)} AS "
                f"SELECT * FROM read_parquet({sql_literal(str(parquet))})"
            )
            con.execute("COMMIT")

    def count(self, relation: str) -> int:
        with self.connect(read_only=True) as con:
            return con.execute(f"SELECT count(*) FROM {relation}").fetchone()[0]

    def exists(self, schema: str, table: str) -> bool:
        if not self.path.exists():
            return False
        with self.connect(read_only=True) as con:
            row = con.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?",
                [schema, table],
            ).fetchone()
            return bool(row[0])
