"""How much SFT does the Graph-R1 policy need to answer in the dataset's format?

`make demo` trains the cold-start policy for 12 steps of 4 expert episodes (the `demo` SFT profile) on 60
training questions of every type. This script trains the same way with more steps and questions, on a home built
by `make demo`, and runs the trained policy greedily on VALIDATION kgqa_mc questions (never test) in the
environment it was trained in. It prints the share of unparseable answers (no option named), of episodes where
the environment refused an answer that named no option, of episodes that walked from the concept the question
names, and accuracy, with the training time.

    .venv/bin/python benchmarks/graph_r1_sft.py --home .medgraph --steps 36 --train-items 150 --questions 16

The policy is not registered; compare `--steps 12 --train-items 60` (the demo's) with longer runs.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="a `make demo` home")
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--train-items", type=int, default=150)
    parser.add_argument("--questions", type=int, default=16, help="validation kgqa_mc questions")
    parser.add_argument("--datasets", default=None,
                        help="comma list of the datasets SFT questions come from (default: every dataset)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["MEDGRAPH_HOME"] = str(args.home.resolve())
    torch.set_num_threads(args.threads)

    from medgraph.embed.encoder import load_encoder
    from medgraph.llm import load_llm
    from medgraph.methods.graph_r1 import GraphR1Env
    from medgraph.methods.registry import run_method
    from medgraph.methods.tools import KnowledgeTools
    from medgraph.qa.mirage import load_mirage
    from medgraph.qa.table import load_qa_items
    from medgraph.retrieval import Retriever
    from medgraph.rl.sft import SftConfig, expert_demonstrations, train_sft
    from medgraph.settings import load_settings
    from medgraph.storage import open_warehouse

    settings = load_settings()
    warehouse = open_warehouse(settings)
    config = SftConfig.profile("demo", steps=args.steps, train_items=args.train_items,
                               datasets=tuple(args.datasets.split(",")) if args.datasets else None)
    base = load_llm(settings.llm, home=args.home)
    items = load_mirage(args.home / "qa" / "qa_items.validation.json", ["kgqa_mc"])[: args.questions]
    # The encoder as `make demo` stores its vectors (deploy/local/demo_run_config.yaml: bf16).
    with Retriever(warehouse, load_encoder(settings.encoder, dtype="bfloat16")) as retriever:
        env = GraphR1Env(retriever, config.graph_r1)
        demos = expert_demonstrations(env, load_qa_items(warehouse, "train", config.train_items, config.seed,
                                                            config.datasets))
        types = Counter(s.item.extra["question_type"] for s in demos.states)
        print(f"{len(demos.states)} demonstrations by question type: {dict(types)}", flush=True)
        started = time.perf_counter()
        result = train_sft(base.model_dir, demos.states, config)
        train_s = time.perf_counter() - started
        started = time.perf_counter()  # evaluated in the environment it was trained in
        results = run_method("graph-r1", items, KnowledgeTools(retriever), result.policy, config.graph_r1,
                             batch_size=8)
        eval_s = time.perf_counter() - started
    n = len(results)

    def share(flags) -> float:
        return sum(bool(f) for f in flags) / n

    print(f"\nSFT {config.steps} steps x {config.batch_size} episodes ({len(demos.states)} demonstrations): "
          f"{train_s:.0f} s; train NLL {result.metrics['train_nll_first']:.2f} -> {result.metrics['train_nll_last']:.2f}")
    print(f"validation kgqa_mc, n = {n} ({eval_s:.0f} s): accuracy {share(r.correct for r in results):.3f}, "
          f"parse failures {share(r.parse_failed for r in results):.3f}, "
          f"answer refused at least once {share(r.stats['refused_answers'] for r in results):.3f}, "
          f"walked from the named concept {share(r.stats.get('visited_named_concept') for r in results):.3f}, "
          f"turns {sum(r.stats['turns'] for r in results) / n:.2f}")
    for r in results:
        print(f"  {r.qid} gold {r.answer} predicted {r.prediction} {' '.join(r.stats['actions'])}")


if __name__ == "__main__":
    main()
