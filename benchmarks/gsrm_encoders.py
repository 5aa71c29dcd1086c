"""Does GSRM's refinement help with a stronger triple scorer? Recall@10 by iteration, MiniLM vs another encoder.

GSRM expands the entities of triples whose cosine with the question is >= tau. Whether expansion brings a
2-hop gold fact into the top 10 depends on the scorer. On the VALIDATION split of a `make demo` state, for
each question type apart, this script links E_q once (MiniLM, as A2RAG does) and then, for each encoder
given, grows and ranks GSRM's subgraphs for each tau at k = 0..K: Recall@10 per k, and the paired bootstrap
CI of (best k > 0) - (k = 0) per type. The encoders are local Hugging Face sentence-encoder directories (or a
built-in name); nothing is downloaded.

    .venv/bin/python benchmarks/gsrm_encoders.py --home .medgraph --encoder minilm \\
        --encoder /path/to/all-mpnet-base-v2 --limit 200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from medgraph.embed.encoder import load_encoder
from medgraph.eval.gsrm import gsrm_recall_curves, link_entities, measurable_items
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.mirage import load_mirage
from medgraph.retrieval import Retriever
from medgraph.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, paired_difference
from medgraph.storage import warehouse_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"))
    parser.add_argument("--encoder", action="append", default=[], help="built-in name or local model directory")
    parser.add_argument("--split", choices=("validation", "train"), default="validation")
    parser.add_argument("--taus", default="0.4,0.5,0.6,0.7")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="items per question type (None: all)")
    parser.add_argument("--types", default=None, help="comma-separated question types (default: every one)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    encoders = args.encoder or ["minilm"]
    taus = [float(t) for t in args.taus.split(",")]

    warehouse = warehouse_at(args.home)
    items = measurable_items(load_mirage(args.home / "qa" / f"qa_items.{args.split}.json"))
    by_type: dict[str, list] = {}
    for item in items:
        by_type.setdefault(str(item.extra.get("question_type") or "other"), []).append(item)
    wanted = set(args.types.split(",")) if args.types else set(by_type)
    by_type = {kind: group[: args.limit] for kind, group in sorted(by_type.items()) if kind in wanted}
    with Retriever(warehouse, load_encoder("minilm")) as linker:
        entities = {kind: link_entities(KnowledgeTools(linker), group) for kind, group in by_type.items()}
    print(f"{sum(map(len, by_type.values()))} {args.split} items: "
          + ", ".join(f"{kind} {len(group)}" for kind, group in by_type.items()), flush=True)

    print(f"\n{'encoder':<28} {'type':<11} {'tau':>4} {'n':>4}  Recall@10 k=0..K          best k: gain [95% CI]")
    for spec in encoders:
        encoder = load_encoder(spec)
        with Retriever(warehouse, encoder) as retriever:
            tools = KnowledgeTools(retriever)  # triple vectors of this encoder, encoded on the fly and kept
            started = time.perf_counter()
            for kind, group in by_type.items():
                for tau in taus:
                    curves = gsrm_recall_curves(tools, group, tau, args.iterations, [10], entity_sets=entities[kind])
                    at10 = [[c.recall[10][k] for c in curves] for k in range(args.iterations + 1)]
                    means = [sum(v) / len(v) for v in at10]
                    best = max(range(1, args.iterations + 1), key=lambda k: means[k])
                    gain = paired_difference(at10[best], at10[0], BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
                    curve = " ".join(f"{m:.3f}" for m in means)
                    print(f"{encoder.encoder_id[:28]:<28} {kind:<11} {tau:>4.2f} {len(curves):>4}  {curve:<24}  "
                          f"k={best}: {gain.difference:+.3f} [{gain.ci_low:+.3f}, {gain.ci_high:+.3f}]", flush=True)
            print(f"# {spec}: {time.perf_counter() - started:.0f} s, {tools.triples_encoded} triples encoded",
                  flush=True)


if __name__ == "__main__":
    main()
