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

A home can move: views hold absolute paths (so a plain `duckdb warehouse.duckdb`
reads them too), and `Warehouse.open_connection` re-points views that read a local lake
other than the configured one (a moved or copied MEDGRAPH_HOME) at the same
files of the configured lake, in one transaction, before anything reads them.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from medgraph.home import HomeLayout
from medgraph.s3 import S3Lake, S3Options, is_s3_uri, s3_client_and_options

if TYPE_CHECKING:
    from medgraph.settings import Settings

log = logging.getLogger(__name__)

# DuckDB allows one writing process per database file; other processes (e.g.
# parallel Dagster steps) wait for the lock instead of failing outright.
_LOCK_WAIT_SECONDS = 120.0
# Private re-pointed copies of read-only warehouse files, by (path, size, mtime): see `_connect_repointed_copy`.
_repointed_copies: dict[tuple[str, int, int], Path] = {}


class WarehouseNotWritableError(RuntimeError):
    """The warehouse file must be changed (its views re-pointed) but cannot be written."""


class DamagedLakeFileError(RuntimeError):
    """A lake file that is not readable Parquet (truncated, overwritten): named, with the way to rebuild it."""


@contextmanager
def reading_lake_file(path: Path | str) -> Iterator[None]:
    """pyarrow reads inside the block raise DamagedLakeFileError naming `path` (the lake's name for the file,
    not a local copy's): pyarrow's own message names neither ("Parquet magic bytes not found in footer")."""
    try:
        yield
    except (pa.ArrowException, duckdb.InvalidInputException, duckdb.IOException) as error:
        raise DamagedLakeFileError(
            f"{path}: not a readable Parquet file ({error}). It is damaged or incomplete: materialize the asset "
            f"that writes it again (`medgraph status` names it)") from None

# A string literal in the SQL text DuckDB keeps for a view ('' is an escaped quote).
_SQL_STRING = re.compile(r"'((?:[^']|'')*)'")


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """BEGIN ... COMMIT on `con`, ROLLBACK on any exception (KeyboardInterrupt too): readers see all of the
    block's writes or none of them."""
    con.execute("BEGIN")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def table_exists(con: duckdb.DuckDBPyConnection, schema: str, table: str) -> bool:
    """Whether the connection's catalog holds `schema.table` (a table or a view)."""
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = ? "
                            "AND table_name = ?", [schema, table]).fetchone()[0])


def list_tables(con: duckdb.DuckDBPyConnection, schema: str | None = None, like: str = "%") -> list[tuple[str, str]]:
    """(schema, name) of the catalog's tables and views matching `like`, in `schema` or in every schema of
    ours (not DuckDB's own, nor the BM25 index's internal `fts_*`), sorted."""
    if schema:
        where, params = "table_schema = ?", [schema]
    else:
        where, params = "table_schema NOT IN ('information_schema', 'pg_catalog') AND table_schema NOT LIKE 'fts_%'", []
    return [tuple(row) for row in con.execute(
        f"SELECT table_schema, table_name FROM information_schema.tables WHERE {where} AND table_name LIKE ? "
        "ORDER BY 1, 2", [*params, like]).fetchall()]


def read_rows(warehouse: Warehouse, schema: str, table: str, order_by: str = "") -> list[dict[str, object]]:
    """The rows of `schema.table` as dicts (in `order_by`, an SQL ORDER BY list); [] while it does not exist."""
    with warehouse.connect(read_only=True) as con:
        if not table_exists(con, schema, table):
            return []
        cursor = con.execute(f"SELECT * FROM {quote_ident(schema)}.{quote_ident(table)}"
                             + (f" ORDER BY {order_by}" if order_by else ""))
        columns = [c[0] for c in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sql_literal(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


@dataclass(frozen=True)
class Lake:
    """Parquet files under a root directory: `<root>/<schema>/<table>.parquet`.

    Besides tables, a lake holds side files (a FAISS index, a CSR cache) as
    `<root>/<schema>/<name>`. Every method here has an `S3Lake` counterpart, so
    steps call these instead of touching the directory: on a local lake they
    are plain file operations (renames, hard links), on S3 uploads and copies.
    """

    root: Path

    is_local = True

    @property
    def uri(self) -> str:
        return str(self.root)

    def table_path(self, schema: str, table: str) -> Path:
        return self.file_path(schema, f"{table}.parquet")

    def file_path(self, schema: str, name: str) -> Path:
        """Where a side file of the lake lives (the FAISS index beside its embedding table, ...)."""
        return self.root / schema / name

    def staging_path(self, schema: str, table: str) -> Path:
        """A fresh temporary path beside the table, on the same filesystem (for an atomic rename)."""
        return self.scratch_path(schema, table)

    def scratch_path(self, schema: str, name: str, suffix: str = ".parquet") -> Path:
        """A fresh temporary local file for Python writers (pyarrow, FAISS, numpy) and intermediate results.

        Here it is the staging path beside the table, so `install` is a rename; on S3 it is on local disk."""
        path = self.root / schema / f".{name}.{uuid.uuid4().hex[:12]}.tmp{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, staging: Path, schema: str, table: str, version: str | None = None) -> Path:
        """Atomically replace the table's file with `staging`; with a `version`, move it to the new file
        `<table>.<version>.parquet` instead (a release publishes several tables, then moves their views at once)."""
        return self.install(staging, self.version_path(schema, table, version))

    def version_path(self, schema: str, table: str, version: str | None) -> Path:
        return self.file_path(schema, f"{table}.{version}.parquet") if version else self.table_path(schema, table)

    def install(self, local: Path, path: Path) -> Path:
        """Atomically replace the lake file `path` with the local file `local` (from `scratch_path`)."""
        os.replace(local, path)
        return path

    def discard(self, staging: Path) -> None:
        staging.unlink(missing_ok=True)

    def remove(self, path: Path) -> None:
        """Delete a lake file (an index version that is no longer current); no error when absent."""
        Path(path).unlink(missing_ok=True)

    def glob(self, schema: str, pattern: str) -> list[Path]:
        """Lake files of `schema` whose names match the shell pattern (hidden staging files never match)."""
        return sorted(p for p in (self.root / schema).glob(pattern) if not p.name.startswith("."))

    def size(self, path: Path) -> int:
        return Path(path).stat().st_size

    def exists(self, path: Path) -> bool:
        return Path(path).exists()

    def fetch(self, path: Path) -> Path:
        """A local file with the lake file's content, for readers that need a path (FAISS, numpy): itself here."""
        return Path(path)

    @contextmanager
    def local_copy(self, path: Path, stable: bool = False) -> Iterator[Path]:
        """The lake file as a local path for the duration of the block (pyarrow readers).

        `stable`: the content must not change under the reader, even if the file is
        republished meanwhile: a hard link (a publish renames over the path, not this file)."""
        if not stable:
            yield Path(path)
            return
        path = Path(path)
        snapshot = path.parent / f".{path.stem}.snapshot.{uuid.uuid4().hex[:12]}.tmp{path.suffix}"
        try:
            os.link(path, snapshot)
        except OSError:  # a filesystem without hard links
            try:
                shutil.copyfile(path, snapshot)
            except OSError:  # a lake that cannot be written cannot be republished either: read the file itself
                yield path
                return
        try:
            yield snapshot
        finally:
            snapshot.unlink(missing_ok=True)

    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """An in-memory DuckDB that can read the lake's files (no warehouse, no lock)."""
        con = duckdb.connect()
        try:
            yield con
        finally:
            con.close()

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


def warehouse_at(home: Path, lake: str | None = None, *, s3_endpoint_url: str | None = None,
                 s3_secret_id: str | None = None, memory_limit: str = "2GB", threads: int | None = None) -> Warehouse:
    """The warehouse `<home>/warehouse.duckdb` over the lake `lake` (a directory or `s3://bucket/prefix`;
    None: `<home>/lake`). An S3 lake is reached at `s3_endpoint_url` (None: AWS) with keys from the AWS chain
    or the Secrets Manager secret `s3_secret_id`. The one place a warehouse is laid out: the Dagster
    resource, the CLI and the launchers all call it, so each sees what the others wrote."""
    layout = HomeLayout(home)
    location = lake or str(layout.lake)
    client, options = s3_client_and_options(s3_endpoint_url, s3_secret_id) if is_s3_uri(location) \
        else (None, None)
    return Warehouse(layout.warehouse, open_lake(location, layout.lake_local, client, options),
                     memory_limit, threads)


def duckdb_default_memory_limit() -> str:
    """DuckDB's own default memory_limit, 80% of physical memory (for a process, such as dbt, whose
    configuration needs an explicit value)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{int(total * 0.8) // 2**20}MiB"


def open_warehouse(settings: Settings, memory_limit: str = "2GB", threads: int | None = None) -> Warehouse:
    """The configured warehouse and lake (MEDGRAPH_HOME, MEDGRAPH_LAKE, MEDGRAPH_S3_ENDPOINT_URL,
    MEDGRAPH_AWS_SECRET_ID) outside Dagster: `warehouse_at` with the settings' values."""
    return warehouse_at(settings.home, settings.lake or None, s3_endpoint_url=settings.s3_endpoint_url,
                        s3_secret_id=settings.aws_secret_id, memory_limit=memory_limit, threads=threads)


@dataclass(frozen=True)
class Warehouse:
    """The DuckDB database file under MEDGRAPH_HOME, with the lake beside it."""

    path: Path
    lake: Lake | S3Lake
    memory_limit: str = "2GB"
    threads: int | None = None

    def open_connection(self, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """A connection the caller closes (long-lived readers). Every connection of this
        process uses the same configuration, as DuckDB requires for one database file.

        Views still reading another local lake (the home was moved or copied) are re-pointed at the
        configured lake first; a read-only caller gets a short write connection for that, or, when the
        warehouse file cannot be written (a read-only home), a connection to a private re-pointed copy of it."""
        con = self._connect(read_only)
        try:
            if self.lake.is_local and lake_views_to_repoint(con, self._lake_root):
                if read_only:
                    con.close()
                    try:
                        self.repoint_lake_views()
                        con = self._connect(read_only)
                    except WarehouseNotWritableError:
                        con = self._connect_repointed_copy()
                else:
                    _repoint_in_transaction(con, self._lake_root)
            self.lake.configure(con)  # an S3 lake: httpfs and credentials, so the views over s3:// resolve
        except BaseException:
            con.close()
            raise
        return con

    def _connect(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + _LOCK_WAIT_SECONDS
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only, config=self._config())
            except duckdb.IOException as error:
                if "lock" not in str(error).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def repoint_lake_views(self) -> list[str]:
        """Point every view that reads files of another local lake at the same files of this lake, in one
        transaction; returns the views changed. `open_connection` does this by itself; dbt, which opens the
        warehouse file on its own, needs it called first."""
        if not self.lake.is_local:
            return []  # views over an S3 lake do not depend on where MEDGRAPH_HOME is
        try:
            con = self._connect(read_only=False)
        except (duckdb.Error, OSError) as error:
            raise WarehouseNotWritableError(
                f"{self.path}: views read files of another lake than {self._lake_root} (the home was moved "
                f"or copied); re-pointing them needs write access to the warehouse: {error}") from error
        try:
            return _repoint_in_transaction(con, self._lake_root)
        finally:
            con.close()

    def _connect_repointed_copy(self) -> duckdb.DuckDBPyConnection:
        """A read-only connection to a private copy of the warehouse file whose views read this home's lake:
        for a moved or copied home that cannot be written. The copy is made once per process and file version
        (in the temporary directory, removed at exit); nothing is written under MEDGRAPH_HOME."""
        stat = self.path.stat()
        key = (str(self.path), stat.st_size, stat.st_mtime_ns)
        copy = _repointed_copies.get(key)
        if copy is None:
            import atexit
            import tempfile

            scratch = Path(tempfile.mkdtemp(prefix="medgraph-warehouse-"))
            atexit.register(shutil.rmtree, scratch, True)
            copy = scratch / self.path.name
            for suffix in ("", ".wal"):
                if Path(f"{self.path}{suffix}").exists():
                    shutil.copy2(f"{self.path}{suffix}", f"{copy}{suffix}")
            con = duckdb.connect(str(copy), config=self._config())
            try:
                moved = _repoint_in_transaction(con, self._lake_root)
            finally:
                con.close()
            log.warning("%s cannot be written and its views read another lake (the home was moved or copied): "
                        "reading a private copy with %d views re-pointed at %s (%.0f MB, in %s). Open the home once "
                        "with write access to re-point it for good", self.path, len(moved), self._lake_root,
                        stat.st_size / 1e6, scratch)
            _repointed_copies[key] = copy
        return duckdb.connect(str(copy), read_only=True, config=self._config())

    @property
    def _lake_root(self) -> str:
        return os.path.abspath(self.lake.uri)

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        con = self.open_connection(read_only)
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

    def publish_arrow(self, schema: str, table: str, rows: pa.Table) -> Path | str:
        """Write an Arrow table as the lake file of `schema.table` (local scratch, then installed over the
        table's file: a rename, or on S3 a staging upload and server-side copy) and point the view at it."""
        import pyarrow.parquet as pq

        lake = self.lake
        staging = lake.scratch_path(schema, table)
        try:
            pq.write_table(rows, staging, compression="zstd")
            final = lake.install(staging, lake.table_path(schema, table))
        except BaseException:
            lake.discard(staging)
            raise
        self.register_parquet_view(schema, table, final)
        return final

    def register_parquet_view(self, schema: str, table: str, parquet: Path | str) -> None:
        """Point `schema.table` at a Parquet file, in one transaction."""
        self.register_parquet_views(schema, {table: parquet})

    def register_parquet_views(self, schema: str, parquet_by_table: dict[str, Path | str]) -> None:
        """Point every `schema.<table>` at its Parquet file in ONE transaction: readers see all the old
        files or all the new ones (a UMLS release moves its five tables together)."""
        with self.connect() as con, transaction(con):
            con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
            for table, parquet in parquet_by_table.items():
                con.execute(
                    f"CREATE OR REPLACE VIEW {quote_ident(schema)}.{quote_ident(table)} AS "
                    f"SELECT * FROM read_parquet({sql_literal(str(parquet))})"
                )

    def view_files(self, schema: str) -> dict[str, list[str]]:
        """The files each view of `schema` reads (the string literals of its SQL), by view name."""
        if not self.path.exists():
            return {}
        with self.connect(read_only=True) as con:
            rows = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND NOT temporary "
                               "AND database_name = current_database() AND schema_name = ?", [schema]).fetchall()
        return {view: [m.group(1).replace("''", "'") for m in _SQL_STRING.finditer(sql)] for view, sql in rows}

    def count(self, relation: str) -> int:
        with self.connect(read_only=True) as con:
            return con.execute(f"SELECT count(*) FROM {relation}").fetchone()[0]

    def exists(self, schema: str, table: str) -> bool:
        if not self.path.exists():
            return False
        with self.connect(read_only=True) as con:
            return table_exists(con, schema, table)


@dataclass(frozen=True)
class LakeViewMove:
    """A view that reads a file of another local lake, and the same file in the configured lake."""

    view: str
    old_path: str
    new_path: str
    create_sql: str  # CREATE OR REPLACE VIEW ... over the configured lake's files


def lake_views_to_repoint(con: duckdb.DuckDBPyConnection, lake_root: str) -> list[LakeViewMove]:
    """Views of the warehouse reading local lake files outside `lake_root` whose counterparts under
    `lake_root` exist (a moved home, or a copy still reading the original's lake).

    Every lake file is `<root>/<schema>/<name>` and a view of schema S reads files under `<root>/S/`
    (no `<name>` contains `/S/` again), so the root a view was written against is what precedes the
    last `/S/` of its path. Paths that are not absolute (s3://...) are left as they are. A view whose
    file the configured lake lacks keeps its path, with a warning: the next materialization replaces it.
    """
    rows = con.execute(
        "SELECT schema_name, view_name, sql FROM duckdb_views() "
        "WHERE NOT internal AND NOT temporary AND database_name = current_database()").fetchall()
    moves = []
    for schema, view, sql in rows:
        name = f"{schema}.{view}"
        new_sql, paths = _sql_over_lake(sql, schema, lake_root)
        if not paths:
            continue
        missing = [new for _, new in paths if not _lake_path_exists(new)]
        if missing or not new_sql.startswith("CREATE VIEW "):
            reason = f"{missing[0]} does not exist" if missing else "its SQL is not a plain CREATE VIEW"
            _warn_once(f"{name} {paths[0][0]}",
                       f"view {name} reads {paths[0][0]}, outside the lake {lake_root}, and is left as "
                       f"it is: {reason} (materialize its asset again to rebuild it)")
            continue
        create_sql = "CREATE OR REPLACE VIEW " + new_sql[len("CREATE VIEW "):]
        unreadable = _unreadable(con, create_sql)
        if unreadable:  # DuckDB reads a Parquet footer to create the view: one bad file would fail them all
            _warn_once(f"{name} {paths[0][1]}",
                       f"view {name} reads {paths[0][0]}, outside the lake {lake_root}, and is left as it is: "
                       f"{paths[0][1]} cannot be read ({unreadable}; materialize its asset again to rebuild it)")
            continue
        moves.append(LakeViewMove(name, paths[0][0], paths[0][1], create_sql))
    return moves


def _unreadable(con: duckdb.DuckDBPyConnection, create_sql: str) -> str | None:
    """Why the query of a CREATE VIEW statement cannot be bound (its files unreadable), or None. Probed on a
    cursor of its own: a failed statement aborts the transaction it runs in."""
    query = re.split(r"\s+AS\s+", create_sql, maxsplit=1)[1].strip().rstrip(";")
    try:
        with con.cursor() as probe:
            probe.execute(f"SELECT * FROM ({query}) LIMIT 0")
    except duckdb.Error as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def _sql_over_lake(sql: str, schema: str, lake_root: str) -> tuple[str, list[tuple[str, str]]]:
    """`sql` with every absolute path `<other root>/<schema>/...` replaced by `<lake_root>/<schema>/...`,
    and the (old, new) paths replaced."""
    paths: list[tuple[str, str]] = []

    def replace(literal: re.Match) -> str:
        path = literal.group(1).replace("''", "'")
        cut = path.rfind(f"/{schema}/")
        if not path.startswith("/") or cut <= 0 or path[:cut] == lake_root:
            return literal.group(0)
        paths.append((path, lake_root + path[cut:]))
        return sql_literal(paths[-1][1])

    return _SQL_STRING.sub(replace, sql), paths


def _repoint_in_transaction(con: duckdb.DuckDBPyConnection, lake_root: str) -> list[str]:
    """Re-point the stale views in one transaction (looked up again inside it: another process may have
    done it meanwhile)."""
    with transaction(con):
        moves = lake_views_to_repoint(con, lake_root)
        for move in moves:
            con.execute(move.create_sql)
    if moves:
        log.warning("re-pointed %d warehouse views at the lake %s (they read another lake, e.g. %s: the home "
                    "was moved or copied)", len(moves), lake_root, moves[0].old_path)
    return [move.view for move in moves]


def _lake_path_exists(path: str) -> bool:
    if glob.has_magic(path):
        return bool(glob.glob(path, recursive=True))
    return os.path.exists(path)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
