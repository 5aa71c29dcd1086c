"""Do the methods' prompts work with a given LLM? Parse failures, truncations and extra answer calls per method.

Runs each method on the same kgqa validation questions with one LLM spec (any `MEDGRAPH_LLM` form: a built-in model,
a local checkpoint, or `openai:<model>@<url>` for an OpenAI-compatible server) and prints, per method, with n:
accuracy, the share of replies that could not be parsed, the share cut at their token budget (counted apart:
a truncated reply is the budget's fault, not the model's), and how often the one extra "just the answer" call
was made. `--serve` starts medgraph's own OpenAI-compatible server (medgraph/llm/serve.py) on loopback in
front of the spec and runs the methods through the HTTP backend, so the OpenAI code path is exercised too.

    .venv/bin/python benchmarks/prompt_check.py --home .medgraph --llm qwen2.5-coder-0.5b-instruct --questions 12
    .venv/bin/python benchmarks/prompt_check.py --home .medgraph --llm smollm2-135m-instruct --serve
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

METHODS = ("cot", "rag", "irag", "a2rag-no-hiim", "graph-r1", "sema-rag")


@contextlib.contextmanager
def served(llm, name: str):
    """`llm` behind medgraph's OpenAI-compatible server on a free loopback port; yields the HTTP client model."""
    from medgraph.llm.serve import LlmServer

    with LlmServer(llm, host="127.0.0.1", port=0) as server:
        server.start()
        yield load_llm(f"openai:{name}@{server.url}")


def stat_means(results: list) -> str:
    """The mean of every numeric or yes/no per-question stat the method records (SEMA-RAG's rounds and cut
    reports, Graph-R1's steps, ...)."""
    values: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.stats.items():
            if isinstance(value, (bool, int, float)):
                values.setdefault(key, []).append(float(value))
    return ", ".join(f"{key} {sum(v) / len(v):.2f}" for key, v in sorted(values.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"))
    # Prompt, dtype and configuration choices are judged on validation questions, never on test.
    parser.add_argument("--split", choices=("validation", "train"), default="validation")
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--datasets", default="kgqa_mc")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--serve", action="store_true", help="run through medgraph's OpenAI-compatible server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.FIELD=JSON",
                        help="a configuration override, e.g. sema-rag.report_max_new_tokens=400 (repeatable)")
    parser.add_argument("--dtype", default=None, help="the LLM's weights: float32 (the CPU default), bfloat16, auto")
    args = parser.parse_args()
    overrides: dict[str, dict[str, object]] = {}
    for assignment in args.set:
        target, value = assignment.split("=", 1)
        method, field = target.rsplit(".", 1)
        overrides.setdefault(method, {})[field] = json.loads(value)
    torch.set_num_threads(args.threads)

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    items = []
    for dataset in args.datasets.split(","):
        items += load_mirage(args.home / "qa" / f"qa_items.{args.split}.json", [dataset])[: args.questions]
    llm = load_llm(args.llm, home=args.home, dtype=args.dtype)
    rows = []
    with Retriever(warehouse, load_encoder("minilm")) as retriever, \
            (served(llm, llm.name) if args.serve else contextlib.nullcontext(llm)) as model:
        tools = KnowledgeTools(retriever)
        print(f"{len(items)} questions ({args.datasets}), {model!r}", flush=True)
        for method in args.methods.split(","):
            started = time.perf_counter()
            results = run_method(method, items, tools, model, make_config(method, overrides.get(method)),
                                 batch_size=len(items))
            n = len(results)
            rows.append((method, n, sum(r.correct for r in results) / n, sum(r.parse_failed for r in results) / n,
                         sum(r.truncated for r in results) / n, sum(r.extra_answer_call for r in results) / n,
                         time.perf_counter() - started))
            print(f"  {method}: {rows[-1][-1]:.0f} s; {stat_means(results)}", flush=True)
    print(f"\n{'method':<15} {'n':>4} {'accuracy':>8} {'parse fail':>10} {'truncated':>9} {'extra call':>10} {'s':>6}")
    for method, n, accuracy, parse_failed, truncated, extra, seconds in rows:
        print(f"{method:<15} {n:>4} {accuracy:>8.2f} {parse_failed:>10.2f} {truncated:>9.2f} {extra:>10.2f} "
              f"{seconds:>6.0f}")


if __name__ == "__main__":
    main()
