"""GRPO from the command line, for runs outside Dagster: many GPUs under torchrun, or a vLLM rollout server.

    torchrun --nproc-per-node 8 -m medgraph.rl.train --model-dir /ckpt/graph-r1-sft --out /runs/grpo \
        --profile full [--rollout-server openai:sft@http://vllm:8000/v1 --lora-r 64] [--register]

Reads the warehouse and encoder from the settings (MEDGRAPH_HOME, MEDGRAPH_ENCODER), trains on the
train split, resumes from `<out>/checkpoints` after an interruption, and on rank 0 writes the merged
policy to `<out>/policy` and, with --register, logs it to MLflow as `medgraph-graph-r1-policy`
behind the champion gate (the champion, or with none the SFT start validated at step 0). The
Dagster asset `models/graph_r1_policy` runs the same `train_grpo`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medgraph.rl.grpo import GrpoConfig, train_grpo, training_curves_figure
from medgraph.rl.model import save_policy
from medgraph.rl.scale import Distributed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="the starting (cold-start SFT) checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", default="full", help="tiny | demo | full")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lora-r", type=int)
    parser.add_argument("--datasets", help="comma list of the datasets to train and validate on (default: all)")
    parser.add_argument("--rollout-server", help="openai:<model>@<base_url> of a vLLM server (LoRA only)")
    parser.add_argument("--register", action="store_true", help="log and register the policy in MLflow")
    args = parser.parse_args(argv)

    from medgraph.embed.encoder import load_encoder
    from medgraph.methods.graph_r1 import GraphR1Env
    from medgraph.qa.table import load_qa_items
    from medgraph.retrieval import Retriever
    from medgraph.settings import load_settings
    from medgraph.storage import open_warehouse

    overrides = {k: v for k, v in {"steps": args.steps, "lora_r": args.lora_r,
                                   "rollout_server": args.rollout_server,
                                   "datasets": tuple(args.datasets.split(",")) if args.datasets else None}.items()
                 if v is not None}
    config = GrpoConfig.profile(args.profile, **overrides)
    settings = load_settings()
    warehouse = open_warehouse(settings)
    with Retriever(warehouse, load_encoder(settings.encoder)) as retriever:
        env = GraphR1Env(retriever, config.graph_r1)
        train = load_qa_items(warehouse, "train", datasets=config.datasets)
        valid = load_qa_items(warehouse, "validation", config.valid_items, config.seed, config.datasets)
        result = train_grpo(args.model_dir, env, train, valid, config, checkpoint_dir=args.out / "checkpoints",
                            name="graph-r1-policy",
                            log_fn=lambda step, metrics: print(json.dumps({"step": step, **metrics}), flush=True))
    if not Distributed.from_env().is_main:
        return 0
    policy_dir = save_policy(result.policy, args.out / "policy")
    print(json.dumps({"policy": str(policy_dir), **result.metrics}))
    if args.register:
        from medgraph.rl.policy import log_policy, sft_start_baseline
        from medgraph.tracking import GRAPH_R1_POLICY_MODEL, Tracking

        tracking = Tracking.from_settings(settings)
        with tracking.start_run("graph_r1_policy", tags={"launcher": "medgraph.rl.train"}):
            import mlflow

            mlflow.log_params({k: str(v) for k, v in config.as_dict().items()})
            mlflow.log_metrics(result.metrics)
            mlflow.log_figure(training_curves_figure(result.history), "training_curves.png")
            uri = log_policy(policy_dir, result.policy.name, metadata={"graph_r1_config": config.as_dict()})
            registration = tracking.register_and_gate(uri, GRAPH_R1_POLICY_MODEL,
                                                      sft_start_baseline(result.metrics, str(args.model_dir)))
            print(registration.promotion.reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
