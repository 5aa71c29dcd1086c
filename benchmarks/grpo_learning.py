"""Does GRPO learn on the demo KG? The trained policy vs its SFT start, paired over validation questions.

`make demo`'s GRPO runs 2 steps, enough to show the loop works, not that it learns. This script trains the
Graph-R1 policy longer from the home's SFT champion (the same `train_grpo` the asset runs, on the train split),
then runs both policies greedily on the same VALIDATION questions (never test) and prints the paired
difference of reward and accuracy with its bootstrap 95% CI and sign test. Every step's training metrics
(reward, kl, clip_fraction, ...) are logged to an MLflow run in the home's tracking store (experiment
`benchmarks/grpo_learning`), and the numbers are written to `benchmarks/_work/grpo_learning.json`.

    .venv/bin/python benchmarks/grpo_learning.py --home .medgraph --steps 30 --valid 48

Defaults are the `demo` GRPO profile (LoRA r 16 on the top 10 blocks, lr 1e-4, 2 mini-batches per rollout
batch, the small CPU environment) with 4 questions x G = 4 per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="a `make demo` home (SFT champion)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--valid", type=int, default=48, help="validation questions (paired, >= 48 for the README)")
    parser.add_argument("--questions-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=None, help="default: the demo profile's")
    parser.add_argument("--minibatches", type=int, default=None, help="default: the profile's (2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "_work" / "grpo_learning")
    args = parser.parse_args()
    os.environ["MEDGRAPH_HOME"] = str(args.home.resolve())
    torch.set_num_threads(args.threads)

    import mlflow

    from medgraph.embed.encoder import load_encoder
    from medgraph.llm.hf import autocast
    from medgraph.methods.graph_r1 import GraphR1Env
    from medgraph.qa.table import load_qa_items
    from medgraph.retrieval import Retriever
    from medgraph.rl.grpo import GrpoConfig, train_grpo, training_curves_figure
    from medgraph.rl.model import load_trainable
    from medgraph.rl.policy import download_checkpoint
    from medgraph.rl.rollout import greedy_episodes
    from medgraph.settings import load_settings
    from medgraph.stats import paired_difference
    from medgraph.storage import open_warehouse
    from medgraph.tracking import GRAPH_R1_SFT_MODEL, Tracking

    overrides = {k: v for k, v in {"lr": args.lr, "minibatches": args.minibatches}.items() if v is not None}
    config = GrpoConfig.profile("demo", steps=args.steps, questions_per_step=args.questions_per_step,
                                group_size=args.group_size, seed=args.seed, valid_items=0, checkpoint_every=10**9,
                                **overrides)
    settings = load_settings()
    tracking = Tracking.from_settings(settings)
    champion = tracking.champion_version(GRAPH_R1_SFT_MODEL.name)
    if champion is None:
        raise SystemExit(f"{args.home}: no {GRAPH_R1_SFT_MODEL.name} champion; run `make demo` first")
    sft_uri = f"models:/{GRAPH_R1_SFT_MODEL.name}/{champion}"
    mlflow.set_tracking_uri(tracking.tracking_uri)
    start_dir = download_checkpoint(sft_uri, args.out / "start")
    warehouse = open_warehouse(settings)
    train = load_qa_items(warehouse, "train")
    valid = load_qa_items(warehouse, "validation", args.valid, args.seed)
    print(f"{sft_uri}: {len(train)} train questions, {len(valid)} validation questions; "
          f"{config.steps} steps x {config.questions_per_step} questions x G={config.group_size}, lr {config.lr}, "
          f"{config.minibatches} mini-batches", flush=True)

    def per_question(policy, env) -> list:
        """Greedy episodes on the validation questions, one trajectory per question (as rollout.evaluate runs them)."""
        with autocast(policy.device, config.bf16, generation=True):
            return greedy_episodes(policy, env, valid, config.eval_batch_size).trajectories

    with Retriever(warehouse, load_encoder(settings.encoder)) as retriever, \
            tracking.start_run("benchmarks/grpo_learning", tags={"sft_model_uri": sft_uri}):
        env = GraphR1Env(retriever, config.graph_r1)
        mlflow.log_params({**{k: str(v) for k, v in config.as_dict().items()}, "valid_questions": len(valid)})
        started = time.perf_counter()
        before = per_question(load_trainable(start_dir, device="cpu", name="sft-start"), env)
        print(f"SFT start validated in {time.perf_counter() - started:.0f} s", flush=True)

        def log_step(step: int, metrics: dict[str, float]) -> None:
            mlflow.log_metrics(metrics, step=step)
            print(json.dumps({"step": step, **{k: round(v, 4) for k, v in metrics.items()
                                                if k in ("reward", "accuracy", "format_rate", "kl", "clip_fraction",
                                                         "flat_groups", "step_seconds")}}), flush=True)

        trained = train_grpo(start_dir, env, train, [], config, log_fn=log_step, name="graph-r1-policy")
        after = per_question(trained.policy, env)
        rows = {}
        for metric, value in (("reward", lambda t: t.reward.total), ("accuracy", lambda t: float(t.reward.correct)),
                              ("format", lambda t: t.reward.format)):
            diff = paired_difference([value(t) for t in after], [value(t) for t in before])
            rows[metric] = asdict(diff)
            mlflow.log_metrics({f"valid_{metric}": diff.mean_a, f"valid_{metric}_start": diff.mean_b,
                                f"valid_{metric}_diff_ci_low": diff.ci_low, f"valid_{metric}_diff_ci_high": diff.ci_high})
        history = trained.history
        clipped = [h["clip_fraction"] for h in history if h.get("step", 0) > 0]
        summary = {"sft_model_uri": sft_uri, "config": config.as_dict(), "valid_questions": len(valid),
                   "paired": rows, "steps_with_clipping": sum(c > 0 for c in clipped),
                   "clip_fraction_mean": sum(clipped) / max(len(clipped), 1),
                   "kl_last": history[-1].get("kl") if history else None,
                   "seconds": time.perf_counter() - started}
        mlflow.log_figure(training_curves_figure(history), "training_curves.png")
        mlflow.log_dict({"history": history, **summary}, "grpo_learning.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    (args.out.parent / "grpo_learning.json").write_text(json.dumps({"history": history, **summary}, indent=1, default=str))

    print(f"\n{'validation':<10} {'n':>3} {'SFT start':>9} {'GRPO':>7} {'diff':>7}  95% CI            better/worse  p")
    for metric, row in rows.items():
        print(f"{metric:<10} {row['n']:>3} {row['mean_b']:>9.3f} {row['mean_a']:>7.3f} {row['difference']:>+7.3f}  "
              f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]  {row['a_better']:>3}/{row['b_better']:<3}   "
              f"{row['p_value']:.3f}")
    print(f"steps with clip_fraction > 0: {summary['steps_with_clipping']} of {len(clipped)} "
          f"(mean {summary['clip_fraction_mean']:.4f}); {summary['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
