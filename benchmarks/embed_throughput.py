"""Benchmark: the embedding pipeline (`embed_table`) against the raw model forward it wraps.

What is measured, side by side in one run, for two workloads (KG node texts,
~90 tokens, and triple texts "<head> <relation> <tail>", ~20 tokens):

- pipeline: `embed_table` end to end on a fresh target: snapshot of the source
  query, DuckDB reuse join, tokenization, forward, Parquet writes, publish;
- raw forward: only `model(**batch)` + pooling over the same length-sorted
  batches, tokenized beforehand — the floor no pipeline can beat (measured
  before and after the pipeline; the faster of the two counts).
  efficiency = raw forward time / pipeline time (target >= 0.8), on CPU time
  (this process, all threads) as well as wall time: on a shared machine the
  wall clock mostly measures the neighbours;
- incremental: 1% of the rows get a new text, then `embed_table` runs again.
  cost = incremental seconds / full-run seconds (target <= 0.05);
- padding: on a small sample, the same batches tokenized unsorted and padded
  to max_length (what a naive loop does) vs length-sorted dynamic padding;
- dtype: raw forward in float32 vs bfloat16 (`Encoder(dtype="bfloat16")`) on
  the same sample, and the lowest cosine between the two vectors of a text.

Texts come from a warehouse with the KG marts (`--warehouse`, a MEDGRAPH_HOME
or its warehouse.duckdb, only read: --n rows of each are copied into a scratch
warehouse under --work-dir) or, without one, are generated. The machine may be shared: compare ratios within a run.

    .venv/bin/python benchmarks/embed_throughput.py [--warehouse DIR] [--n 2000]
        [--threads 2] [--batch-size 64] [--work-dir benchmarks/_work/embed_throughput]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from medgraph.embed.encoder import Encoder, load_encoder
from medgraph.embed.tables import EMBEDDING_SOURCES, EmbedStats, embed_table
from medgraph.storage import Lake, Warehouse

TARGET_EFFICIENCY = 0.8
TARGET_INCREMENTAL = 0.05
PADDING_SAMPLE = 256
DEMO_ROWS = {"nodes": 49_991, "triples": 680_452}  # kg_node_text and kg_edges of the demo release

# Words for generated texts when no warehouse is given (lengths similar to the real marts).
_DISEASES = ["epilepsy", "migraine", "asthma", "diabetes mellitus", "hypertension", "psoriasis", "anemia",
             "hepatitis", "pneumonia", "arthritis", "glaucoma", "nephrotic syndrome", "cardiomyopathy"]
_FINDINGS = ["seizure", "headache", "fever", "cough", "fatigue", "jaundice", "proteinuria", "tachycardia",
             "abdominal pain", "visual loss", "rash", "dyspnea", "short stature", "hepatomegaly"]
_RELATIONS = ["has_manifestation", "isa", "inverse_isa", "may_treat", "gene_associated_with_phenotype",
              "associated_with", "has_finding_site"]


def generated_texts(kind: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        disease, finding = f"{rng.choice(_DISEASES)} type {i % 97}", rng.choice(_FINDINGS)
        if kind == "triples":
            text = f"{disease} {rng.choice(_RELATIONS).replace('_', ' ')} {finding}"
        else:
            synonyms = "; ".join(rng.sample(_DISEASES, 4))
            relations = "; ".join(f"has manifestation {f}" for f in rng.sample(_FINDINGS, 6))
            text = (f"{disease}. Also known as: {synonyms}. Semantic type: Disease or Syndrome. "
                    f"Definition: a disorder characterized by {finding} and {rng.choice(_FINDINGS)} "
                    f"with onset in {rng.choice(['childhood', 'adulthood', 'infancy'])}. Relations: {relations}.")
        rows.append((f"{kind[0]}{i}", text))
    return rows


def prepare_warehouse(args: argparse.Namespace, home: Path) -> Warehouse:
    """A private warehouse with `bench.nodes` and `bench.triples` (id, text) of --n rows each."""
    if args.warehouse:
        source = Path(args.warehouse)
        source = source if source.suffix == ".duckdb" else source / "warehouse.duckdb"
        with Warehouse(source, Lake(source.parent / "lake")).connect(read_only=True) as con:
            nodes = con.execute(f"SELECT cui, text FROM kg.kg_node_text ORDER BY hash(cui) LIMIT {args.n}").fetchall()
            edges = EMBEDDING_SOURCES["edge_embeddings"].sql
            triples = con.execute(f"SELECT * FROM ({edges}) ORDER BY hash(edge_id) LIMIT {args.n}").fetchall()
    else:
        nodes, triples = generated_texts("nodes", args.n), generated_texts("triples", args.n)
    shutil.rmtree(home, ignore_errors=True)
    warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
    with warehouse.connect() as con:
        con.execute("CREATE SCHEMA bench")
        for name, rows in (("nodes", nodes), ("triples", triples)):
            table = pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows]})
            con.register("rows", table)
            con.execute(f"CREATE TABLE bench.{name} AS SELECT * FROM rows")
            con.unregister("rows")
    return warehouse


@dataclass
class Timing:
    """Wall seconds and this process's CPU seconds (all threads). On a shared machine the wall clock
    depends on the neighbours; CPU time much less so, so efficiency is judged on CPU time."""

    wall: float = 0.0
    cpu: float = 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu


def best(a: Timing, b: Timing) -> Timing:
    return Timing(min(a.wall, b.wall), min(a.cpu, b.cpu))


@torch.inference_mode()
def raw_forward(encoder: Encoder, texts: list[str], padding: str = "longest", sort: bool = True) -> Timing:
    """Model forward + pooling only, over batches tokenized beforehand."""
    order = sorted(texts, key=len, reverse=True) if sort else texts
    size = encoder.batch_size
    batches = [encoder.tokenizer(order[i:i + size], padding=padding, truncation=True,
                                 max_length=encoder.max_length, return_tensors="pt")
               for i in range(0, len(order), size)]
    timing = Timing()
    for batch in batches:
        with timing.measure():
            hidden = encoder.model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    return timing


@dataclass
class Result:
    name: str
    n: int
    tokens: float
    raw: Timing
    full: Timing
    full_stats: EmbedStats
    again: Timing
    again_stats: EmbedStats
    padded: Timing
    dynamic: Timing
    dynamic_bf16: Timing
    cosine: float


def measure(warehouse: Warehouse, name: str, encoder: Encoder, bf16: Encoder) -> Result:
    with warehouse.connect(read_only=True) as con:
        texts = [row[0] for row in con.execute(f"SELECT text FROM bench.{name}").fetchall()]
    tokens = sum(map(len, encoder.tokenizer(texts, truncation=True, max_length=encoder.max_length)["input_ids"]))
    source = f"SELECT id, text FROM bench.{name}"

    # Raw forward before and after the pipeline, keeping the faster of each clock.
    raw_before, full = raw_forward(encoder, texts), Timing()
    with full.measure():
        full_stats = embed_table(warehouse, source, name, encoder, id_column="id", text_column="text")
    raw = best(raw_before, raw_forward(encoder, texts))

    changed = max(len(texts) // 100, 1)
    with warehouse.connect() as con:
        con.execute(f"UPDATE bench.{name} SET text = text || ' (revised)' "
                    f"WHERE id IN (SELECT id FROM bench.{name} ORDER BY hash(id) LIMIT {changed})")
    again = Timing()
    with again.measure():
        again_stats = embed_table(warehouse, source, name, encoder, id_column="id", text_column="text")

    sample = random.Random(1).sample(texts, min(PADDING_SAMPLE, len(texts)))
    padded = raw_forward(encoder, sample, padding="max_length", sort=False)
    dynamic, dynamic_bf16 = raw_forward(encoder, sample), raw_forward(bf16, sample)
    cosine = float((encoder.encode(sample) * bf16.encode(sample)).sum(axis=1).min())
    return Result(name, len(texts), tokens / len(texts), raw, full, full_stats, again, again_stats,
                  padded, dynamic, dynamic_bf16, cosine)


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report(results: list[Result]) -> None:
    print("| texts | n | tokens/text | raw forward texts/s | pipeline texts/s | efficiency, wall | "
          "efficiency, CPU time (target >= 0.8) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        cpu = r.raw.cpu / r.full.cpu
        print(f"| {r.name} | {r.n} | {r.tokens:.0f} | {r.n / r.raw.wall:.0f} | {r.n / r.full.wall:.0f} | "
              f"{r.raw.wall / r.full.wall:.2f} | {cpu:.2f} {verdict(cpu >= TARGET_EFFICIENCY)} |")

    print("\n| texts | full run s (CPU s) | 1% changed: embedded / reused | re-run s (CPU s) | "
          "cost ratio, wall | cost ratio, CPU time (target <= 0.05) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        cpu = r.again.cpu / r.full.cpu
        print(f"| {r.name} | {r.full.wall:.1f} ({r.full.cpu:.1f}) | {r.again_stats.embedded} / "
              f"{r.again_stats.reused} | {r.again.wall:.2f} ({r.again.cpu:.2f}) | {r.again.wall / r.full.wall:.3f} | "
              f"{cpu:.3f} {verdict(cpu <= TARGET_INCREMENTAL)} |")

    print(f"\n| texts | {PADDING_SAMPLE} texts unsorted, padded to max_length: CPU s | "
          "length-sorted, dynamic padding: CPU s | speed-up |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r.name} | {r.padded.cpu:.2f} | {r.dynamic.cpu:.2f} | {r.padded.cpu / r.dynamic.cpu:.1f}x |")

    print(f"\n| texts | {PADDING_SAMPLE} texts float32: CPU s | bfloat16: CPU s | speed-up | "
          "lowest cosine bf16 vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.name} | {r.dynamic.cpu:.2f} | {r.dynamic_bf16.cpu:.2f} | "
              f"{r.dynamic.cpu / r.dynamic_bf16.cpu:.1f}x | {r.cosine:.5f} |")

    print()
    for r in results:
        rate, rows = r.n / r.full.wall, DEMO_ROWS[r.name]
        print(f"# {r.name}: pipeline {rate:.0f} texts/s wall (float32): the demo release's {rows:,} "
              f"in {rows / rate / 60:.0f} min at this rate")


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    encoder = load_encoder(args.encoder, batch_size=args.batch_size, max_length=args.max_length)
    bf16 = load_encoder(args.encoder, batch_size=args.batch_size, max_length=args.max_length, dtype="bfloat16")
    warehouse = prepare_warehouse(args, Path(args.work_dir) / "home")
    print(f"# embed_throughput: {platform.machine()}, {os.cpu_count()} cpus, torch threads "
          f"{torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.1f}")
    print(f"# encoder {encoder.encoder_id} (batch {encoder.batch_size}, max_length {encoder.max_length}), "
          f"texts from {args.warehouse or 'the generator'}, n={args.n}")
    results = [measure(warehouse, name, encoder, bf16) for name in ("nodes", "triples")]
    print(f"# load average at end {os.getloadavg()[0]:.1f}\n")
    report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warehouse", help="MEDGRAPH_HOME (or warehouse.duckdb) with kg.kg_node_text and kg.kg_edges")
    parser.add_argument("--n", type=int, default=2000, help="texts per workload")
    parser.add_argument("--encoder", default=os.environ.get("MEDGRAPH_ENCODER", "minilm"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--work-dir", default="benchmarks/_work/embed_throughput")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
