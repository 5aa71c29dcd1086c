"""The LLM's weight dtype on the CPU: speed and answer equivalence of float32, bfloat16 and int8, side by side.

Each dtype loads the same model and, in the same process:
- prefills one fixed prompt of `--prefill-tokens` tokens (tokens/s, best of 3);
- answers the same `--questions` kgqa_mc validation questions with each method in `--methods`
  (one lockstep batch per method), recording every model output and the parsed answer.
Against float32 it prints the share of questions whose model outputs are all identical
(greedy decoding), the share whose parsed answer is identical, and accuracy, with n. The
backend's `auto` dtype follows this measurement (bf16 on CPUs with native bf16).

    .venv/bin/python benchmarks/llm_dtype.py --home .medgraph --questions 50
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from medgraph.embed.encoder import load_encoder
from medgraph.llm import load_llm
from medgraph.llm.hf import cpu_has_bf16
from medgraph.methods.registry import make_config, run_method
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.mirage import load_mirage
from medgraph.retrieval import Retriever
from medgraph.storage import Lake, Warehouse

DTYPES = ("float32", "bfloat16", "int8")


def prefill_tokens_per_s(llm, n_tokens: int, repeats: int = 3) -> float:
    """Prompt tokens per second of one forward pass over an `n_tokens` prompt (best of `repeats`)."""
    ids = torch.randint(100, 10_000, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            llm.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            best = min(best, time.perf_counter() - started)
    return n_tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"))
    # Prompt, dtype and configuration choices are judged on validation questions, never on test.
    parser.add_argument("--split", choices=("validation", "train"), default="validation")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--methods", default="cot,rag")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    items = load_mirage(args.home / "qa" / f"qa_items.{args.split}.json", ["kgqa_mc"])[: args.questions]
    methods = args.methods.split(",")
    dtypes = args.dtypes.split(",")
    print(f"{len(items)} kgqa_mc validation questions, {args.llm}, {args.threads} torch threads, "
          f"native CPU bf16: {cpu_has_bf16()}", flush=True)
    speed: dict[str, float] = {}
    seconds: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], list[tuple[tuple[str, ...], str | None, bool]]] = {}
    with Retriever(warehouse, load_encoder("minilm")) as retriever:
        tools = KnowledgeTools(retriever)
        for dtype in dtypes:
            llm = load_llm(args.llm, home=args.home, device="cpu", dtype=dtype)
            speed[dtype] = prefill_tokens_per_s(llm, args.prefill_tokens)
            for method in methods:
                run_method(method, items[:1], tools, llm, make_config(method), batch_size=1)  # warm caches
                started = time.perf_counter()
                results = run_method(method, items, tools, llm, make_config(method), batch_size=args.batch_size)
                seconds[dtype, method] = time.perf_counter() - started
                outputs[dtype, method] = [(tuple(s.output for s in r.steps), r.prediction, r.correct)
                                          for r in results]
            print(f"  {dtype}: prefill {speed[dtype]:.0f} tokens/s; "
                  + ", ".join(f"{m} {seconds[dtype, m]:.1f} s" for m in methods), flush=True)
            del llm

    reference = dtypes[0]
    print(f"\n{'dtype':<9} {'prefill tok/s':>13} {'x':>6} | " + " | ".join(
        f"{m}: {'s':>6} {'x':>5} {'same text':>9} {'same ans':>8} {'acc':>5}" for m in methods))
    for dtype in dtypes:
        cells = []
        for m in methods:
            ref, got = outputs[reference, m], outputs[dtype, m]
            same_text = sum(a[0] == b[0] for a, b in zip(ref, got)) / len(got)
            same_answer = sum(a[1] == b[1] for a, b in zip(ref, got)) / len(got)
            accuracy = sum(b[2] for b in got) / len(got)
            cells.append(f"{m}: {seconds[dtype, m]:>6.1f} {seconds[reference, m] / seconds[dtype, m]:>4.2f}x "
                         f"{same_text:>9.2f} {same_answer:>8.2f} {accuracy:>5.2f}")
        print(f"{dtype:<9} {speed[dtype]:>13.0f} {speed[dtype] / speed[reference]:>5.2f}x | " + " | ".join(cells))
    print(f"(n = {len(items)} questions per method; 'same' compares with {reference})")


if __name__ == "__main__":
    main()
