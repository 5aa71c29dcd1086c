"""One-hop lookup latency on a UMLS-scale synthetic graph: the platform vs a naive full scan.

- platform: `KnowledgeGraph.one_hop`, which slices an in-memory CSR of
  `kg.kg_edges` (integer arrays, ~10 bytes per edge) and reads names from Arrow;
- SQL on sorted storage: the same lookup as one DuckDB query over `kg.kg_edges`
  sorted by `src_cui` (as the dbt model writes it), names joined from `kg.kg_nodes`;
- naive full scan: that query over the edges in arrival order, so every row
  group has to be read.

    .venv/bin/python benchmarks/one_hop.py --edges 50000000 --nodes 7000000
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from medgraph.kg.csr import build_graph_index
from medgraph.kg.graph import KnowledgeGraph
from medgraph.storage import Lake, Warehouse

SQL_ONE_HOP = """
    SELECT e.edge_id, e.src_cui, s.preferred_name, e.relation, e.dst_cui, d.preferred_name
    FROM {edges} e JOIN kg.kg_nodes s ON s.cui = e.src_cui JOIN kg.kg_nodes d ON d.cui = e.dst_cui
    WHERE e.src_cui IN (SELECT unnest($c))
"""


def build(path: Path, edges: int, nodes: int) -> None:
    """kg_nodes and kg_edges like the dbt marts (sorted by source) plus an unsorted copy of the edges."""
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE SCHEMA kg")
        con.execute(f"""CREATE TABLE kg.kg_nodes AS
            SELECT 'C' || lpad(CAST(i AS VARCHAR), 7, '0') AS cui, 'concept ' || i AS preferred_name
            FROM range({nodes}) t(i)""")
        # Skewed out-degree: hubs exist, like phenotypes annotated to thousands of diseases.
        con.execute(f"""CREATE TABLE kg.kg_edges_unsorted AS
            SELECT md5(CAST(i AS VARCHAR)) AS edge_id,
                   'C' || lpad(CAST(CAST(floor({nodes} * pow(random(), 1.5)) AS BIGINT) AS VARCHAR), 7, '0') AS src_cui,
                   'RO' AS rel, NULL::VARCHAR AS rela,
                   ['isa', 'inverse_isa', 'may_treat', 'has_manifestation', 'associated_with'][1 + i % 5] AS relation,
                   'C' || lpad(CAST(hash(i) % {nodes} AS VARCHAR), 7, '0') AS dst_cui
            FROM range({edges}) t(i)""")
        con.execute("CREATE TABLE kg.kg_edges AS SELECT * FROM kg.kg_edges_unsorted ORDER BY src_cui, relation, dst_cui")


def timed(calls, fn) -> list[float]:
    fn(calls[0])  # warm caches and connections
    timings = []
    for cuis in calls:
        started = time.perf_counter()
        fn(cuis)
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", type=int, default=50_000_000)
    parser.add_argument("--nodes", type=int, default=7_000_000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="CUIs per one_hop call (one agent step of a batch)")
    parser.add_argument("--work-dir", type=Path, default=Path(__file__).parent / "_work" / "one_hop")
    args = parser.parse_args()

    home = args.work_dir / f"{args.edges}_{args.nodes}"
    home.mkdir(parents=True, exist_ok=True)
    warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
    if not warehouse.path.exists():
        started = time.perf_counter()
        print(f"building a graph with {args.edges:,} edges over {args.nodes:,} nodes ...", flush=True)
        build(warehouse.path, args.edges, args.nodes)
        print(f"  {time.perf_counter() - started:.1f}s", flush=True)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    index = build_graph_index(warehouse, cache=False)
    build_seconds = time.perf_counter() - started
    index_mb = (index.cuis.nbytes + index.indptr.nbytes + index.dst.nbytes + index.relation.nbytes
                + index.names.nbytes) / 2**20
    print(f"CSR index: {build_seconds:.1f}s to build, {index_mb:.0f} MB of arrays "
          f"(peak RSS {rss_before:.0f} -> {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")

    rng = random.Random(0)
    calls = [[f"C{rng.randrange(args.nodes):07d}" for _ in range(args.batch)] for _ in range(args.calls)]
    graph = KnowledgeGraph(warehouse)
    graph._index = index
    con = duckdb.connect(str(warehouse.path), read_only=True)
    results = {
        "platform (CSR)": timed(calls, graph.one_hop),
        "SQL, sorted by src_cui": timed(calls, lambda c: con.execute(SQL_ONE_HOP.format(edges="kg.kg_edges"),
                                                                     {"c": c}).fetchall()),
        "naive full scan (SQL)": timed(calls[: max(10, args.calls // 5)], lambda c: con.execute(
            SQL_ONE_HOP.format(edges="kg.kg_edges_unsorted"), {"c": c}).fetchall()),
    }
    print(f"\none_hop over {args.edges:,} edges: {args.calls} calls of {args.batch} CUIs")
    print(f"{'method':<26}{'p50 ms':>10}{'p95 ms':>10}{'speed-up (p50)':>16}")
    naive = pct(results["naive full scan (SQL)"], 50)
    for name, t in results.items():
        print(f"{name:<26}{pct(t, 50):>10.2f}{pct(t, 95):>10.2f}{naive / pct(t, 50):>15.1f}x")


if __name__ == "__main__":
    main()
