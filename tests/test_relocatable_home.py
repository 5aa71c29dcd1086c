"""Issue 17, fault 7: a MEDGRAPH_HOME can be moved or copied; its views read the lake of the home
they are in."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO_ROOT, copy_warehouse

from medgraph.eval.evaluate import write_partition
from medgraph.kg.graph import KnowledgeGraph
from medgraph.storage import Lake, Warehouse
from medgraph.umls.schema import INGESTED

UMLS_TABLES = [layout.table for layout in INGESTED]


def home_built_in_place(kg_warehouse: Warehouse, home: Path) -> Warehouse:
    """A home as `make demo` leaves it: umls views and an eval view over its own lake, dbt marts built."""
    warehouse = copy_warehouse(kg_warehouse, home)
    for table in UMLS_TABLES:  # over this home's lake files, as ingestion in place writes them
        warehouse.register_parquet_view("umls", table, warehouse.lake.table_path("umls", table))
    write_partition(warehouse, "demo_results", "medqa",
                    [{"qid": "q1", "correct": True}, {"qid": "q2", "correct": False}])
    return warehouse


def view_paths(warehouse_file: Path) -> list[str]:
    """The SQL of every view, read with plain DuckDB (no re-pointing)."""
    with duckdb.connect(str(warehouse_file), read_only=True) as con:
        return [row[0] for row in con.execute("SELECT sql FROM duckdb_views() WHERE NOT internal").fetchall()]


def status(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "MEDGRAPH_PROFILE": "tiny"}
    env.pop("MEDGRAPH_LAKE", None)
    return subprocess.run([sys.executable, "-m", "medgraph.cli", "status"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def rewrite_parquet(path: Path, keep_rows: int) -> None:
    """Keep the first rows of a lake file, replaced atomically."""
    table = pq.read_table(path).slice(0, keep_rows)
    staging = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, staging)
    staging.replace(path)


def test_moved_home_answers_status_and_kg_queries(kg_warehouse: Warehouse, tmp_path: Path):
    """Before the fix: `medgraph status` failed with `IO Error: No files found that match the pattern
    "<old home>/lake/eval/demo_results/*.parquet"` (the views held the old absolute paths)."""
    original = home_built_in_place(kg_warehouse, tmp_path / "before")
    rows = {table: original.count(f"umls.{table}") for table in UMLS_TABLES}
    moved_home = tmp_path / "after"
    shutil.move(original.path.parent, moved_home)

    shown = status(moved_home)
    assert shown.returncode == 0, shown.stderr
    for table in UMLS_TABLES:
        line = next(line for line in shown.stdout.splitlines() if f" umls.{table} " in line)
        assert line.endswith(f" {rows[table]:,} rows")
    assert "eval.demo_results" in shown.stdout
    assert "re-pointed 6 warehouse views" in shown.stderr
    assert not [sql for sql in view_paths(moved_home / "warehouse.duckdb") if str(tmp_path / "before") in sql]

    moved = Warehouse(moved_home / "warehouse.duckdb", Lake(moved_home / "lake"))
    with KnowledgeGraph(moved) as kg:
        cui = kg.con.execute("SELECT cui FROM kg.kg_nodes ORDER BY cui LIMIT 1").fetchone()[0]
        name = kg.nodes([cui])[cui].name
        assert cui in kg.lookup([name])[0]
        assert len(kg.neighbors(cui)) == kg.con.execute(
            "SELECT count(*) FROM kg.kg_edges WHERE src_cui = ?", [cui]).fetchone()[0]
    with moved.connect(read_only=True) as con:  # dbt's staging views read the umls views
        assert con.execute("SELECT count(*) FROM staging.stg_umls__atoms").fetchone()[0] > 0
    assert moved.repoint_lake_views() == []  # done once, at the first open


def test_copied_home_reads_its_own_lake(kg_warehouse: Warehouse, tmp_path: Path):
    """Before the fix the copy silently read the original's files: 6 sources, 2 eval rows, not 2 and 1."""
    original = home_built_in_place(kg_warehouse, tmp_path / "original")
    copy_home = Path(shutil.copytree(original.path.parent, tmp_path / "copy"))
    rewrite_parquet(copy_home / "lake" / "umls" / "mrsab.parquet", keep_rows=2)
    rewrite_parquet(copy_home / "lake" / "eval" / "demo_results" / "medqa.parquet", keep_rows=1)

    copy = Warehouse(copy_home / "warehouse.duckdb", Lake(copy_home / "lake"))
    assert copy.count("umls.mrsab") == 2
    assert copy.count("eval.demo_results") == 1
    assert original.count("umls.mrsab") == 6 and original.count("eval.demo_results") == 2
    copied_views = view_paths(copy.path)
    assert not [sql for sql in copied_views if str(original.lake.root) in sql]
    assert any(f"'{copy_home}/lake/umls/mrsab.parquet'" in sql for sql in copied_views)


def test_views_over_another_schema_and_a_missing_file(kg_warehouse: Warehouse, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture):
    """Every view over lake files moves (here one as embeddings and qa register them); a view whose file the
    new lake lacks is left as it was, with a warning, and does not stop the warehouse from opening."""
    original = home_built_in_place(kg_warehouse, tmp_path / "original")
    vectors = original.lake.table_path("embeddings", "node_embeddings")
    vectors.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["C1", "C2", "C3"]}), vectors)
    original.register_parquet_view("embeddings", "node_embeddings", vectors)

    copy_home = Path(shutil.copytree(original.path.parent, tmp_path / "copy"))
    rewrite_parquet(copy_home / "lake" / "embeddings" / "node_embeddings.parquet", keep_rows=1)
    (copy_home / "lake" / "umls" / "mrdef.parquet").unlink()
    copy = Warehouse(copy_home / "warehouse.duckdb", Lake(copy_home / "lake"))
    with caplog.at_level(logging.WARNING, logger="medgraph.storage"):
        assert copy.count("embeddings.node_embeddings") == 1
        assert copy.count("umls.mrsty") == original.count("umls.mrsty")
    assert "view umls.mrdef reads" in caplog.text and "mrdef.parquet does not exist" in caplog.text
    # Left as it was (reading the original) rather than broken: the next ingestion replaces it.
    assert any(f"'{original.lake.root}/umls/mrdef.parquet'" in sql for sql in view_paths(copy.path))


def test_a_copy_with_one_garbage_lake_file_repoints_every_other_view(kg_warehouse: Warehouse, tmp_path: Path):
    """Issue 30, fault 4 on a copied home. Before: DuckDB reads a Parquet footer to create a view, so the
    one re-pointing transaction failed on the garbage file and `medgraph status` died ("too small to be a
    Parquet file") instead of listing the tables."""
    original = home_built_in_place(kg_warehouse, tmp_path / "original")
    copy_home = Path(shutil.copytree(original.path.parent, tmp_path / "copy"))
    (copy_home / "lake" / "umls" / "mrdef.parquet").write_bytes(b"not parquet" * 500)
    rewrite_parquet(copy_home / "lake" / "umls" / "mrsab.parquet", keep_rows=2)

    shown = status(copy_home)
    assert shown.returncode == 0, shown.stderr
    assert "view umls.mrdef reads" in shown.stderr and "cannot be read" in shown.stderr
    assert next(line for line in shown.stdout.splitlines() if " umls.mrsab " in line).endswith(" 2 rows")
    copied_views = view_paths(copy_home / "warehouse.duckdb")
    # Left reading the original's (readable) file; every other view reads the copy's lake.
    assert [sql for sql in copied_views if str(original.lake.root) in sql] == [
        sql for sql in copied_views if "read_parquet" in sql and "mrdef" in sql]


def test_s3_and_relative_paths_are_left_alone(tmp_path: Path):
    """Only absolute local paths follow the home; views over s3:// keep theirs (checked by SQL text only)."""
    home = tmp_path / "home"
    warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
    with warehouse.connect() as con:
        con.execute("CREATE SCHEMA umls")
        con.execute("CREATE VIEW umls.remote AS SELECT 's3://bucket/lake/umls/mrrel.parquet' AS path")
        con.execute("CREATE VIEW umls.other AS SELECT '/elsewhere/lake/umls/x.parquet' AS path")
    # s3:// is not absolute; /elsewhere/... has no counterpart in this lake: both untouched.
    assert warehouse.repoint_lake_views() == []
    sql = " ".join(view_paths(warehouse.path))
    assert "'s3://bucket/lake/umls/mrrel.parquet'" in sql and "'/elsewhere/lake/umls/x.parquet'" in sql
