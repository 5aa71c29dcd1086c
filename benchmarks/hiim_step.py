"""HIIM's projector step: the whole batch in one padded pass with the LLM's layers recomputed, vs micro-batches.

On a home's real A2RAG answer prompts (train questions, GSRM's triples with the tuned settings, T_Text's
passages), one optimizer step's forward and backward of `accumulate_batch_gradient` on SmolLM2-135M (frozen,
bf16 autocast) with a fresh projector over random triple vectors (the GAT's cost is not in the step: its vectors
are computed once per question). Variants alternate; medians of `--repeats`; the loss and gradient norm show the
variants compute the same step.

    .venv/bin/python benchmarks/hiim_step.py --home .medgraph --questions 4
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch

from medgraph.embed.encoder import load_encoder
from medgraph.eval.gsrm import tuned_a2rag_config
from medgraph.gnn.graph_tokens import HiimProjector
from medgraph.llm import load_llm
from medgraph.methods.tools import KnowledgeTools
from medgraph.retrieval import Retriever
from medgraph.rl.hiim import ProjectorConfig, accumulate_batch_gradient, load_examples, token_embedding_norm
from medgraph.storage import warehouse_at

VARIANTS = {"batch, recomputed": {"micro_batch_size": 0, "recompute_layers": True},  # 0: the whole batch
            "micro-batches of 1": {"micro_batch_size": 1, "recompute_layers": False},
            "micro-batches of 2": {"micro_batch_size": 2, "recompute_layers": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="a `make demo` home")
    parser.add_argument("--questions", type=int, default=4, help="the batch (the demo profile's batch_size)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = load_llm("smollm2-135m-instruct", home=args.home, device="cpu")
    llm.model.requires_grad_(False)
    warehouse = warehouse_at(args.home)
    with Retriever(warehouse, load_encoder("minilm", dtype="bfloat16")) as retriever:
        examples = load_examples(warehouse, "train", ProjectorConfig(), KnowledgeTools(retriever),
                                 limit=args.questions, a2rag=tuned_a2rag_config(args.home))
    print("prompt tokens:", [llm.count_tokens(llm.render(e.conversation(True))) for e in examples])
    torch.manual_seed(0)
    projector = HiimProjector(64, llm.hidden_size, token_embedding_norm(llm))
    vectors = {e.qid: torch.randn(len(e.triples), 64) for e in examples}
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, fields in VARIANTS.items():
            config = ProjectorConfig(**{**fields, "micro_batch_size": fields["micro_batch_size"] or len(examples)})
            projector.zero_grad(set_to_none=True)
            started = time.perf_counter()
            loss = accumulate_batch_gradient(llm, projector, vectors, examples, config)
            seconds[name].append(time.perf_counter() - started)
            print(f"  {name}: {seconds[name][-1]:.2f} s, loss {loss:.4f}, "
                  f"grad norm {float(projector.proj.weight.grad.norm()):.4f}", flush=True)
    before = statistics.median(seconds["batch, recomputed"])
    for name, values in seconds.items():
        print(f"{name:20s} {statistics.median(values):6.2f} s  {statistics.median(values) / before:.2f}x")
    print(f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
