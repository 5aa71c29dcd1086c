"""The Graph-R1 policy: cold-start SFT on gold-path demonstrations, then GRPO in the KG environment.

`graph_r1_sft` registers its policy as `medgraph-graph-r1-sft`, `champion`
moving only when it beats the champion or, with none, the base model on the
same validation questions (evaluation falls back to the SFT champion when no
GRPO policy is champion); its data version is the logged model's URI, which
`graph_r1_policy` reads back from the SFT materialization and trains from.
The policy asset registers each trained version as `medgraph-graph-r1-policy`
and moves `champion` only when it beats the champion or, with none, its SFT
start as validated at step 0 (same profile and seed: the same validation
questions). Both gates: validation reward strictly higher and accuracy not
lower (the registry in medgraph/tracking.py). The policy's data version is the champion's
version, so a run that loses the gate triggers nothing downstream.
"""

import shutil

import dagster as dg
import mlflow

from medgraph.llm.hf import TransformersChatModel
from medgraph.methods.graph_r1 import GraphR1Env
from medgraph.qa.item import QaItem
from medgraph.qa.table import load_qa_items
from medgraph.retrieval import Retriever
from medgraph.rl.grpo import GrpoConfig, train_grpo
from medgraph.rl.model import save_policy
from medgraph.rl.policy import (
    VALIDATION_KEY_TAG,
    base_model_baseline,
    download_checkpoint,
    log_grpo_result,
    log_policy,
    recorded_validation,
    sft_start_baseline,
    validate,
)
from medgraph.rl.rollout import validation_key
from medgraph.rl.sft import SftConfig, expert_demonstrations, train_sft
from medgraph.storage import Warehouse
from medgraph.tracking import GRAPH_R1_POLICY_MODEL, GRAPH_R1_SFT_MODEL, Tracking, checkpoint_dir
from platform_assets.automation import gpu_model_asset
from resources import EncoderResource, LlmResource, MlflowResource, WarehouseResource
from resources.training import TrainingResource

SFT_KEY = dg.AssetKey(["models", "graph_r1_sft"])
# What the environment reads: the graph, node texts, and the BM25 index and node vectors of concept search.
ENV_INPUTS = [dg.AssetKey(["qa", "qa_items"]), dg.AssetKey(["kg", "kg_edges"]), dg.AssetKey(["kg", "kg_node_text"]),
              dg.AssetKey(["text", "corpus_chunks"]), dg.AssetKey(["embeddings", "node_embeddings"])]
POLICY_INPUTS = [SFT_KEY, *ENV_INPUTS]


class _TrainingConfig(dg.Config):
    profile: str | None = None
    """tiny | demo | full (default: the `training` resource's, MEDGRAPH_PROFILE): steps, sizes, LoRA, environment; any field set below wins."""
    steps: int | None = None
    valid_items: int | None = None
    lr: float | None = None
    datasets: list[str] | None = None
    """The datasets the train and validation questions come from (default: every dataset); the demo names the one
    it evaluates."""
    seed: int = 0
    device: str = "auto"

    def _profile_settings(self, default_profile: str, config_class, *fields: str):
        """`config_class.profile(...)` with every field of `fields` (and steps, valid_items, lr, datasets) set."""
        overrides = {name: getattr(self, name) for name in ("steps", "valid_items", "lr", *fields)
                     if getattr(self, name) is not None}
        if self.datasets is not None:
            overrides["datasets"] = tuple(self.datasets)
        return config_class.profile(self.profile or default_profile, seed=self.seed, device=self.device,
                                    **overrides)


class GraphR1SftConfig(_TrainingConfig):
    train_items: int | None = None
    """Training questions the expert tries to demonstrate (some are dropped)."""
    evaluate_base: bool = True
    """Score the base model on the validation questions too (the 'before' of the report); always done
    while no SFT policy is champion, since the gate then compares with it."""

    def sft_config(self, default_profile: str) -> SftConfig:
        return self._profile_settings(default_profile, SftConfig, "train_items")


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{k}": float(v) for k, v in metrics.items()}


def _validation_items(store: Warehouse, config: SftConfig | GrpoConfig) -> list[QaItem]:
    """The validation questions of the profile; none is an error, since the champion gate needs them."""
    valid = load_qa_items(store, "validation", config.valid_items, config.seed, config.datasets)
    if not valid:
        raise dg.Failure("no validation questions: the champion gate needs them (qa/qa_items split 'validation')")
    return valid


def _base_model(llm: LlmResource) -> TransformersChatModel:
    chat = llm.load()
    if not isinstance(chat, TransformersChatModel):
        raise dg.Failure(f"Graph-R1 training needs an in-process transformers model (MEDGRAPH_LLM = a built-in name "
                         f"or a local checkpoint); {llm.spec!r} is served by {type(chat).__name__}")
    return chat


@gpu_model_asset("graph_r1_sft", ENV_INPUTS, code_version="1")
def graph_r1_sft(context: dg.AssetExecutionContext, config: GraphR1SftConfig, warehouse: WarehouseResource,
                 encoder: EncoderResource, llm: LlmResource, mlflow_tracking: MlflowResource,
                 training: TrainingResource) -> dg.MaterializeResult:
    """Cold start: the base LLM fine-tuned on expert episodes that walk each training question's gold
    path through the real environment (observations masked out of the loss); validation reward and
    accuracy of the base model and of the SFT policy; registered as `medgraph-graph-r1-sft`, gated
    against the champion or, with none, the base model."""
    sft_config = config.sft_config(training.profile)
    store, base, tracking = warehouse.get_warehouse(), _base_model(llm), mlflow_tracking.tracking()
    evaluate_base = config.evaluate_base or tracking.champion_version(GRAPH_R1_SFT_MODEL.name) is None
    out = warehouse.layout.checkpoints("graph_r1_sft") / context.run.run_id
    with Retriever(store, encoder.load()) as retriever, mlflow_tracking.start_asset_run(context, ENV_INPUTS):
        env, valid = GraphR1Env(retriever, sft_config.graph_r1), _validation_items(store, sft_config)
        demos = expert_demonstrations(env, load_qa_items(store, "train", sft_config.train_items, sft_config.seed,
                                                         sft_config.datasets))
        context.log.info(f"SFT: {demos.as_metadata()}; {len(valid)} validation questions")
        mlflow.log_params({**{k: str(v) for k, v in sft_config.as_dict().items()}, "base_model": base.name})
        mlflow.set_tag(VALIDATION_KEY_TAG, validation_key(valid, sft_config.graph_r1))  # evaluate()'s defaults
        mlflow.log_metrics(demos.as_metadata())
        before = validate(base, env, valid, sft_config.bf16) if evaluate_base else {}
        result = train_sft(base.model_dir, demos.states, sft_config, name=f"graph-r1-sft-{base.name}",
                           log_fn=lambda step, metrics: mlflow.log_metrics(metrics, step=step))
        # Validated as registered: merged (save_policy merges the LoRA adapter), the network GRPO starts from
        # and evaluation loads, so GRPO's step 0 can take this measurement (merged + a zero adapter is the same).
        save_policy(result.policy, out)
        after = validate(result.policy, env, valid, sft_config.bf16)
        metrics = {**_prefixed(before, "valid_base_"), **_prefixed(after, "valid_"), **result.metrics}
        mlflow.log_metrics(metrics)
        model_uri = log_policy(out, result.policy.name, metadata={"base_model": base.name,
                                                                  "graph_r1_config": sft_config.as_dict()})
        registration = tracking.register_and_gate(model_uri, GRAPH_R1_SFT_MODEL,
                                                  base_model_baseline(before, base.name),
                                                  tags={"dagster/run_id": context.run.run_id})
    shutil.rmtree(out, ignore_errors=True)  # the checkpoint is in MLflow now
    context.log.info(f"SFT validation reward {after.get('reward', float('nan')):.3f} (base "
                     f"{before.get('reward', float('nan')):.3f}) on {len(valid)} questions; "
                     f"{registration.promotion.reason}")
    return dg.MaterializeResult(  # model_uri: the logged model, graph_r1_policy's start while no SFT champion
        metadata={**registration.as_metadata(), "model_uri": model_uri, "base_model": base.name,
                  "validation_questions": len(valid), "seed": sft_config.seed, **demos.as_metadata(), **metrics},
        data_version=dg.DataVersion(model_uri),
    )


class GraphR1PolicyConfig(_TrainingConfig):
    questions_per_step: int | None = None
    group_size: int | None = None
    beta: float | None = None
    eval_every: int | None = None
    reward_variant: str | None = None
    """paper (r_acc + 0.1 r_fmt) or authors (-1 + r_fmt + r_acc if well formed)."""
    rollout_server: str | None = None
    """openai:<model>@<url> of a vLLM server with runtime LoRA loading (medgraph/rl/scale.py)."""
    resume: bool = True
    """Continue from the checkpoint an interrupted run with the same inputs and settings left behind."""

    def grpo_config(self, default_profile: str) -> GrpoConfig:
        return self._profile_settings(default_profile, GrpoConfig, "questions_per_step", "group_size", "beta", "eval_every",
                                      "reward_variant", "rollout_server")


def _sft_start_uri(context: dg.AssetExecutionContext, tracking: Tracking) -> str:
    """Where GRPO starts: the SFT champion (the policy that passed its gate), else the latest SFT run's model."""
    champion = tracking.champion_version(GRAPH_R1_SFT_MODEL.name)
    if champion is not None:
        return f"models:/{GRAPH_R1_SFT_MODEL.name}/{champion}"
    event = context.instance.get_latest_materialization_event(SFT_KEY)
    uri = event.asset_materialization.metadata.get("model_uri") if event and event.asset_materialization else None
    if uri is None:
        raise dg.Failure("no cold-start policy: materialize models/graph_r1_sft first")
    return str(uri.value)


@gpu_model_asset("graph_r1_policy", POLICY_INPUTS, code_version="1")
def graph_r1_policy(context: dg.AssetExecutionContext, config: GraphR1PolicyConfig, warehouse: WarehouseResource,
                    encoder: EncoderResource, mlflow_tracking: MlflowResource,
                    training: TrainingResource) -> dg.MaterializeResult:
    """GRPO from the cold-start policy on the train split (G episodes per question, observation tokens
    masked, KL to the SFT policy), validated every N steps; registered as `medgraph-graph-r1-policy`,
    `champion` moving only when it beats the champion or, with none, its SFT start (GRAPH_R1_POLICY_MODEL.gate)."""
    grpo_config = config.grpo_config(training.profile)
    store, tracking = warehouse.get_warehouse(), mlflow_tracking.tracking()
    sft_uri = _sft_start_uri(context, tracking)
    with Retriever(store, encoder.load()) as retriever, mlflow_tracking.start_asset_run(context, POLICY_INPUTS) as run:
        work = checkpoint_dir(warehouse.layout.checkpoints("graph_r1_policy"), run, grpo_config.as_dict(),
                              sft=sft_uri)
        start = download_checkpoint(sft_uri, work / "start")
        env, valid = GraphR1Env(retriever, grpo_config.graph_r1), _validation_items(store, grpo_config)
        mlflow.log_params({**{k: str(v) for k, v in grpo_config.as_dict().items()}, "sft_model_uri": sft_uri})
        mlflow.set_tag("checkpoint_dir", str(work))
        key = validation_key(valid[: grpo_config.valid_items], grpo_config.graph_r1, grpo_config.eval_batch_size,
                             grpo_config.reward_variant, grpo_config.format_weight)
        start_validation = recorded_validation(tracking, sft_uri, key)
        if start_validation is not None:
            context.log.info(f"step 0: {sft_uri}'s validation as its SFT run recorded it (same key {key})")
        train = load_qa_items(store, "train", datasets=grpo_config.datasets)
        result = train_grpo(start, env, train, valid, grpo_config,
                            checkpoint_dir=work / "checkpoints", resume=config.resume, name="graph-r1-policy",
                            log_fn=lambda step, metrics: mlflow.log_metrics(metrics, step=step),
                            start_validation=start_validation)
        registration = tracking.register_and_gate(log_grpo_result(result, grpo_config, work / "final", sft_uri),
                                                  GRAPH_R1_POLICY_MODEL, sft_start_baseline(result.metrics, sft_uri),
                                                  tags={"dagster/run_id": context.run.run_id})
    shutil.rmtree(work, ignore_errors=True)  # the model is in MLflow; checkpoints only serve a retry
    context.log.info(registration.promotion.reason)
    return dg.MaterializeResult(
        metadata={**registration.as_metadata(), "sft_model_uri": sft_uri, "validation_questions": len(valid),
                  "seed": grpo_config.seed, **result.metrics},
        data_version=dg.DataVersion(registration.data_version),
    )


defs = dg.Definitions(assets=[graph_r1_sft, graph_r1_policy])
