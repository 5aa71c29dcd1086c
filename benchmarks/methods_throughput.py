"""Questions per minute of every method, batched vs one question at a time, and latency relative to RAG.

On a MEDGRAPH_HOME built by `make demo` (KG, corpus, embeddings, qa items) with
SmolLM2 on the CPU: each method answers the same N questions of the embedded
test split twice, once in lockstep batches of N and once one at a time, in
the same process, side by side. Prints questions/minute, the batched/serial
ratio (target >= 4x), and each method's batched latency per question relative
to single-round RAG (A2RAG is expected at 2-4x).

    .venv/bin/python benchmarks/methods_throughput.py --home .medgraph --questions 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from medgraph.embed.encoder import load_encoder
from medgraph.kg.qa import load_mirage
from medgraph.llm import load_llm
from medgraph.methods.registry import make_config, run_method
from medgraph.methods.tools import KnowledgeTools
from medgraph.retrieval import Retriever
from medgraph.storage import Lake, Warehouse

METHODS = ("cot", "rag", "irag", "a2rag", "graph-r1", "sema-rag")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"))
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    items = load_mirage(args.home / "qa" / "qa_items.test.json", ["kgqa_mc"])[: args.questions]
    llm = load_llm(args.llm, home=args.home)
    encoder = load_encoder("minilm")
    print(f"{len(items)} questions (kgqa_mc test split), {llm.name}, {args.threads} torch threads")
    print(f"{'method':<10} {'batched q/min':>14} {'serial q/min':>13} {'ratio':>7} {'latency/q vs rag':>17}")
    per_question: dict[str, float] = {}
    rows = []
    with Retriever(warehouse, encoder) as retriever:
        tools = KnowledgeTools(retriever)
        for method in args.methods.split(","):
            config = make_config(method)
            run_method(method, items[:1], tools, llm, config, batch_size=1)  # warm caches (entity linker, indexes)
            started = time.perf_counter()
            run_method(method, items, tools, llm, config, batch_size=len(items))
            batched = time.perf_counter() - started
            started = time.perf_counter()
            run_method(method, items, tools, llm, config, batch_size=1)
            serial = time.perf_counter() - started
            per_question[method] = batched / len(items)
            rows.append((method, 60 * len(items) / batched, 60 * len(items) / serial, serial / batched))
            print(f"  {method}: batched {batched:.1f} s, serial {serial:.1f} s", flush=True)  # partial results survive
    for method, batched_qpm, serial_qpm, ratio in rows:
        relative = per_question[method] / per_question["rag"] if "rag" in per_question else float("nan")
        print(f"{method:<10} {batched_qpm:>14.1f} {serial_qpm:>13.1f} {ratio:>6.2f}x {relative:>16.2f}x")


if __name__ == "__main__":
    main()
