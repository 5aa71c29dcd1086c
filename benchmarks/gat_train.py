"""GAT pretraining on the CPU: training throughput (edges/s) and peak memory vs graph size.

- throughput: `train_gat`'s data path on a MEDGRAPH_HOME with the KG marts and
  `embeddings.node_description_embeddings` (`--warehouse`), with the `demo` profile for a fixed
  number of steps; without `--warehouse`, a synthetic graph of the demo release's
  size (50k nodes, 680k edges) with random 384-d features;
- memory: synthetic UMLS-like graphs of increasing size (nodes = edges / 7, every
  relation listed in both directions, skewed degrees, 384-d random features), each
  in a fresh process: the bytes of the graph arrays, the resident memory after
  setup, and the peak after N and after 2N training steps. The peak should follow
  the graph and stay flat in the number of steps.

edges/s counts positive training edges (each step also scores `negatives` corrupted
triples per positive).

    .venv/bin/python benchmarks/gat_train.py --warehouse $MEDGRAPH_HOME --steps 30
    .venv/bin/python benchmarks/gat_train.py --sizes 100000,1000000,5000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from medgraph.gnn.train import GatConfig, fit_gat, node_features, prepare_graph
from medgraph.kg.csr import GraphIndex, build_graph_index
from medgraph.storage import Lake, Warehouse

DEMO_NODES, DEMO_EDGES = 50_000, 680_000


def synthetic_graph_index(num_edges: int, num_nodes: int, num_relations: int = 16, seed: int = 0) -> GraphIndex:
    """A GraphIndex shaped like UMLS: each relation in both directions (a, r, b) + (b, r', a), hubs at low ids."""
    rng = np.random.default_rng(seed)
    half, forward = num_edges // 2, num_relations // 2
    src = (num_nodes * rng.random(half) ** 2).astype(np.int64)  # skewed out-degree
    dst = rng.integers(0, num_nodes, half)
    rel = rng.integers(0, forward, half)
    src, dst, rel = np.concatenate([src, dst]), np.concatenate([dst, src]), np.concatenate([rel, rel + forward])
    keep = src != dst
    # One int64 key per edge, sorted like build_graph_index (src, relation, dst) and deduplicated.
    key = np.unique((src[keep] * num_relations + rel[keep]) * num_nodes + dst[keep])
    dst, rel, src = key % num_nodes, (key // num_nodes) % num_relations, key // num_nodes // num_relations
    indptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=num_nodes))]).astype(np.int64)
    width = max(7, len(str(num_nodes - 1)))
    digits = (np.arange(num_nodes)[:, None] // 10 ** np.arange(width - 1, -1, -1)) % 10 + ord("0")
    cuis = np.concatenate([np.full((num_nodes, 1), ord("C")), digits], axis=1).astype(np.uint8)
    relations = tuple(("RO", f"rel_{i}", f"rel_{i}") for i in range(num_relations))
    return GraphIndex(cuis.view(f"S{width + 1}").reshape(-1), indptr, dst.astype(np.int32), rel.astype(np.int16),
                      relations, pa.nulls(num_nodes, pa.string()), f"synthetic-{num_edges}-{num_nodes}-{seed}")


def random_features(num_nodes: int, dim: int = 384, seed: int = 0) -> torch.Tensor:
    features = torch.randn(num_nodes, dim, generator=torch.Generator().manual_seed(seed))
    return features / features.norm(dim=1, keepdim=True)  # unit vectors, like MiniLM's


def mb(value: float) -> float:
    return value / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: a child started by fork + exec
    inherits its parent's ru_maxrss, which would hide a child's smaller peak."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB; macOS: bytes


def reset_peak_rss() -> bool:
    """Start a new peak (Linux >= 4.0): training's peak is then not the graph generator's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def throughput(args: argparse.Namespace) -> None:
    config = GatConfig.profile("demo", epochs=1, steps_per_epoch=args.steps, eval_edges=200, rank_negatives=10,
                               progress=False)
    started = time.perf_counter()
    if args.warehouse:
        home = Path(args.warehouse)
        warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
        index = build_graph_index(warehouse)
        features = node_features(warehouse.lake, index)
        source = f"{home} (node_description_embeddings)"
    else:
        index = synthetic_graph_index(DEMO_EDGES, DEMO_NODES)
        features = random_features(index.num_nodes)
        source = "synthetic, demo size"
    data = prepare_graph(index, config)
    setup = time.perf_counter() - started
    result = fit_gat(data, features, config)
    print(f"\nthroughput on {source}: {index.num_nodes:,} nodes, {index.num_edges:,} edges "
          f"({data.message_passing.num_edges:,} message-passing), {torch.get_num_threads()} torch threads")
    print(f"demo profile: batch {config.batch_size}, fanouts {config.fanouts}, hidden {config.hidden}, "
          f"heads {config.heads}, {config.negatives} negative/positive, {args.steps} steps")
    print(f"{'setup s':>10}{'train s':>10}{'s/step':>10}{'edges/s':>12}")
    print(f"{setup:>10.1f}{result.timings['train_seconds']:>10.1f}"
          f"{result.timings['train_seconds'] / args.steps:>10.2f}{result.timings['edges_per_second']:>12,.0f}")


def memory_child(edges: int, steps: int) -> dict[str, float]:
    """One size, in this (fresh) process: graph bytes, RSS and peak of the setup, then the peak RSS
    of training alone after N and 2N steps."""
    process = psutil.Process()
    baseline = mb(process.memory_info().rss)
    index = synthetic_graph_index(edges, max(edges // 7, 10))
    features = random_features(index.num_nodes)
    config = GatConfig.profile("demo", batch_size=512, epochs=1, steps_per_epoch=2 * steps, log_every=steps,
                               eval_edges=100, rank_negatives=5, progress=False)
    data = prepare_graph(index, config)
    del index  # training holds the prepared arrays only
    graph_bytes = sum(t.numel() * t.element_size() for t in (
        data.message_passing.indptr, data.message_passing.dst, data.message_passing.relation,
        data.train, data.valid, data.test, data.known.keys))
    after_setup, setup_peak = mb(process.memory_info().rss), peak_rss_mb()
    if not reset_peak_rss():
        print("cannot reset the peak RSS: training peaks include the setup's", file=sys.stderr)
    peaks: dict[int, float] = {}
    result = fit_gat(data, features, config, log_fn=lambda step, metrics: peaks.setdefault(step, peak_rss_mb()))
    return {"edges": data.known.keys.numel(), "nodes": data.num_nodes, "graph_mb": mb(graph_bytes),
            "features_mb": mb(features.numel() * features.element_size()), "baseline_mb": baseline,
            "setup_mb": after_setup, "setup_peak_mb": setup_peak, "peak_n_mb": peaks[steps], "peak_2n_mb": peaks[2 * steps],
            "edges_per_second": result.timings["edges_per_second"]}


def memory_scaling(args: argparse.Namespace) -> None:
    rows = []
    for edges in [int(s) for s in args.sizes.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--child", str(edges), "--steps", str(args.steps),
                              "--threads", str(torch.get_num_threads())],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {edges:,} edges done", flush=True)
    n = args.steps
    print("\npeak memory vs graph size (CPU, batch 512, fanouts (10, 10), 384-d features; MB).\n"
          "graph = CSR + split triples + known-triple keys; RSS after setup; peak while building the graph;\n"
          f"peak RSS of training alone after {n} and {2 * n} steps")
    print(f"{'edges':>11}{'nodes':>10}{'graph':>7}{'features':>9}{'RSS setup':>10}{'peak setup':>11}"
          f"{f'peak@{n}':>9}{f'peak@{2 * n}':>9}{'edges/s':>9}")
    for r in rows:
        print(f"{r['edges']:>11,}{r['nodes']:>10,}{r['graph_mb']:>7.0f}{r['features_mb']:>9.0f}"
              f"{r['setup_mb']:>10.0f}{r['setup_peak_mb']:>11.0f}{r['peak_n_mb']:>9.0f}{r['peak_2n_mb']:>9.0f}"
              f"{r['edges_per_second']:>9,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warehouse", help="a MEDGRAPH_HOME with kg marts and node embeddings (default: synthetic)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (memory: N and 2N)")
    parser.add_argument("--sizes", default="100000,1000000,5000000", help="synthetic graph sizes in edges")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--skip", choices=["throughput", "memory"], help="run only the other part")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(memory_child(args.child, args.steps)))
        return
    if args.skip != "throughput":
        throughput(args)
    if args.skip != "memory":
        memory_scaling(args)


if __name__ == "__main__":
    main()
