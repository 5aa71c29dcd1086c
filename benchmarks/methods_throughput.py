"""Questions per minute of every method, batched vs one question at a time, prefix cache on vs off.

On a MEDGRAPH_HOME built by `make demo` (KG, corpus, embeddings, qa items) with
SmolLM2 on the CPU: each method answers the same N questions of the embedded
validation split (--split) in lockstep batches of N and (unless --no-serial) one at a time,
for each LLM variant (prefix cache on/off x dtype), in the same process, side
by side. Prints questions/minute, the batched/serial ratio (target >= 4x),
prompt tokens sent and computed per question (the prefix cache computes only
what is new in each turn), each method's batched latency per question relative
to single-round RAG (A2RAG is expected at 2-4x), and the share of answers
identical to the first variant's.

    .venv/bin/python benchmarks/methods_throughput.py --home .medgraph --questions 8
    .venv/bin/python benchmarks/methods_throughput.py --home .medgraph --prefix-cache on,off \
        --methods a2rag,sema-rag,graph-r1 --no-serial
    .venv/bin/python benchmarks/methods_throughput.py --home .medgraph --questions 24 --small-batch 8

--small-batch B compares the lockstep batch of N with batches of B (the demo's eval batch_size) instead of
one question at a time; the LLM then takes up to max(N, 16) rows per forward call (--max-batch-size).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from medgraph.embed.encoder import load_encoder
from medgraph.llm import load_llm
from medgraph.methods.registry import make_config, run_method
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.mirage import load_mirage
from medgraph.retrieval import Retriever
from medgraph.storage import Lake, Warehouse

METHODS = ("cot", "rag", "irag", "a2rag", "graph-r1", "sema-rag")


def _run(method, items, tools, llm, config, batch_size):
    """Results and wall time of one run (`run_method` starts it with an empty prefix cache)."""
    started = time.perf_counter()
    results = run_method(method, items, tools, llm, config, batch_size=batch_size)
    return results, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"))
    # Prompt, dtype and configuration choices are judged on validation questions, never on test.
    parser.add_argument("--split", choices=("validation", "train"), default="validation")
    parser.add_argument("--llm-home", type=Path, default=None,
                        help="where the built-in LLM is converted (default: --home; use it for a read-only home)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-cache", default="on", help="on, off or on,off (side by side)")
    parser.add_argument("--dtypes", default="auto", help="comma list of LLM dtypes (auto, float32, bfloat16, int8)")
    parser.add_argument("--no-serial", action="store_true", help="skip the one-question-at-a-time runs")
    parser.add_argument("--small-batch", type=int, default=1,
                        help="the comparison runs in lockstep batches of this size (default 1: one at a time)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="rows per LLM forward call (default max(--questions, 16))")
    parser.add_argument("--no-warmup", action="store_true", help="skip the one-question warm-up run (token counts only)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    items = load_mirage(args.home / "qa" / f"qa_items.{args.split}.json", ["kgqa_mc"])[: args.questions]
    encoder = load_encoder("minilm")
    variants = [(dtype, cache) for dtype in args.dtypes.split(",") for cache in args.prefix_cache.split(",")]
    methods = args.methods.split(",")
    print(f"{len(items)} questions (kgqa_mc {args.split} split), {args.llm}, {args.threads} torch threads; "
          f"'serial' = lockstep batches of {args.small_batch}")
    rows = []
    first_predictions: dict[str, list] = {}
    # Every variant loaded up front and the variants interleaved per method: a machine whose load drifts
    # during the run affects them alike.
    llms = {}
    for dtype, cache in variants:
        llm = load_llm(args.llm, home=args.llm_home or args.home, dtype=dtype, prefix_cache=cache == "on",
                       max_batch_size=args.max_batch_size or max(len(items), 16))
        llms[f"{getattr(llm, 'dtype', dtype)}".removeprefix("torch.") + f" cache {cache}"] = llm
    with Retriever(warehouse, encoder) as retriever:
        tools = KnowledgeTools(retriever)
        for method in methods:
            config = make_config(method)
            for variant, llm in llms.items():
                if not args.no_warmup:
                    _run(method, items[:1], tools, llm, config, 1)  # warm caches (entity linker, indexes)
                results, batched = _run(method, items, tools, llm, config, len(items))
                serial, same_small = float("nan"), float("nan")
                if not args.no_serial:
                    small_results, serial = _run(method, items, tools, llm, config, args.small_batch)
                    same_small = sum(a.prediction == b.prediction for a, b in zip(results, small_results, strict=True))
                    same_small /= len(items)
                sent = sum(r.prompt_tokens for r in results) / len(items)
                computed = sum(r.prompt_tokens_computed for r in results) / len(items)
                predictions = [r.prediction for r in results]
                reference = first_predictions.setdefault(method, predictions)
                same = sum(a == b for a, b in zip(predictions, reference, strict=True)) / len(items)
                accuracy = sum(r.correct for r in results) / len(items)
                rows.append((variant, method, batched, serial, sent, computed, same, accuracy))
                print(f"  {variant} {method}: batched {batched:.1f} s, serial {serial:.1f} s, prompt tokens/q "
                      f"{sent:.0f} sent {computed:.0f} computed, same answers batched vs serial {same_small:.0%}",
                      flush=True)  # partial results survive
    rag = {v: b / len(items) for v, m, b, *_ in rows if m == "rag"}
    print(f"\n| variant | method | batched q/min | serial q/min | ratio | prompt tok/q sent | computed | "
          f"latency/q vs rag | same answers as {rows[0][0]} | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, method, batched, serial, sent, computed, same, accuracy in rows:
        relative = batched / len(items) / rag[variant] if variant in rag else float("nan")
        print(f"| {variant} | {method} | {60 * len(items) / batched:.1f} | {60 * len(items) / serial:.1f} "
              f"| {serial / batched:.2f}x | {sent:.0f} | {computed:.0f} | {relative:.2f}x | {same:.0%} "
              f"| {accuracy:.0%} |")


if __name__ == "__main__":
    main()
