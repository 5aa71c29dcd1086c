"""Trained models: the GAT pretrained on UMLS triples (and, built on it, the HIIM projector).

Each model asset trains, logs to MLflow (`medgraph/<asset>`), registers a new
version and moves the `champion` alias only if that version beats the
current champion on the validation metric or, with none yet, the baseline it
starts from, measured on the same validation items (`Tracking.register_and_gate`):
the untrained GAT, A2RAG's text-only answer. Evaluation loads models by
alias, so a worse retraining run is recorded but changes nothing downstream.
"""

import shutil
from pathlib import Path

import dagster as dg
import mlflow

from medgraph.eval.gsrm import tuned_a2rag_config
from medgraph.gnn.graph_tokens import (
    NodeFeatures,
    ProjectorConfig,
    log_projector_result,
    projector_examples,
    text_only_baseline,
    train_projector,
)
from medgraph.gnn.train import FEATURE_TABLE, GatConfig, pick_device, train_gat
from medgraph.gnn.training_log import history_markdown, log_gat_result, result_metadata, untrained_baseline
from medgraph.methods.tools import KnowledgeTools
from medgraph.retrieval import Retriever
from medgraph.settings import load_settings, redact_uri
from medgraph.tracking import GAT_MODEL, HIIM_PROJECTOR_MODEL, checkpoint_dir
from platform_assets.automation import gpu_model_asset
from resources import EncoderResource, LlmResource, MlflowResource, WarehouseResource

GAT_INPUTS = [dg.AssetKey(["kg", "kg_edges"]), dg.AssetKey(["embeddings", FEATURE_TABLE]),
              dg.AssetKey("umls_release")]


class GatTrainingConfig(dg.Config):
    profile: str | None = None
    """tiny | demo | full (default: MEDGRAPH_PROFILE): model size, batch size, steps (GatConfig.profile)."""
    epochs: int | None = None
    steps_per_epoch: int | None = None
    seed: int | None = None
    device: str = "auto"
    """auto: CUDA when present (with AMP), else the CPU."""
    resume: bool = True
    """Continue from the checkpoint an interrupted run with the same inputs and settings left behind."""

    def gat_config(self) -> GatConfig:
        overrides = {name: value for name, value in
                     {"epochs": self.epochs, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed}.items()
                     if value is not None}
        return GatConfig.profile(self.profile or load_settings().profile, device=self.device, progress=True,
                                 **overrides)


@gpu_model_asset("gat_model", GAT_INPUTS, code_version="1")
def gat_model(context: dg.AssetExecutionContext, config: GatTrainingConfig, warehouse: WarehouseResource,
              mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
    """A 2-layer GAT pretrained by triple classification on `kg.kg_edges` (relation-free node
    descriptions as features), registered as MLflow model `medgraph-gat`; `champion` moves only on a
    better validation ROC-AUC than the champion's or, with none, than the same GAT untrained."""
    gat_config = config.gat_config()
    store = warehouse.get_warehouse()
    tracking = mlflow_tracking.tracking()
    with mlflow_tracking.start_asset_run(context, GAT_INPUTS) as run:
        checkpoints = checkpoint_dir(Path(warehouse.home) / "checkpoints" / "gat_model", run, gat_config.as_dict())
        mlflow.log_params({k: str(v) for k, v in gat_config.as_dict().items()})
        mlflow.set_tag("checkpoint_dir", str(checkpoints))

        def log_metrics(step: int, metrics: dict[str, float]) -> None:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
            context.log.info(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

        result = train_gat(store, gat_config, checkpoint_dir=checkpoints, resume=config.resume,
                           log_fn=log_metrics)
        registration = tracking.register_and_gate(log_gat_result(tracking, result), GAT_MODEL,
                                                  untrained_baseline(result),
                                                  tags={"dagster/run_id": context.run.run_id})
    shutil.rmtree(checkpoints, ignore_errors=True)  # the model is in MLflow; checkpoints only serve a retry
    context.log.info(registration.promotion.reason)
    # Downstream assets use the champion, so its version is this asset's data version: a run that
    # does not beat the champion changes nothing below it (and triggers nothing).
    return dg.MaterializeResult(
        metadata={**registration.as_metadata(), **result_metadata(result),
                  "device": str(pick_device(gat_config.device)),
                  "history": dg.MetadataValue.md(history_markdown(result))},
        data_version=dg.DataVersion(registration.data_version))


PROJECTOR_INPUTS = [dg.AssetKey(["models", "gat_model"]), dg.AssetKey(["qa", "qa_items"]),
                    dg.AssetKey(["embeddings", FEATURE_TABLE]), dg.AssetKey(["embeddings", "node_embeddings"]),
                    dg.AssetKey(["embeddings", "edge_embeddings"]),  # these two: GSRM retrieval, as in A2RAG
                    dg.AssetKey(["models", "gsrm_params"])]  # ... with the tau, K, N evaluation uses


class ProjectorTrainingConfig(dg.Config):
    profile: str | None = None
    """tiny | demo | full (default: MEDGRAPH_PROFILE): steps, batch size, training and validation questions."""
    steps: int | None = None
    batch_size: int | None = None
    train_items: int | None = None
    valid_items: int | None = None
    graph_triples: str = "gsrm"
    """gsrm: the triples A2RAG's GSRM retrieves (what HIIM sees in evaluation); gold_path: gold path plus
    distractors (an experiment: its gate then does not measure HIIM inside A2RAG)."""
    seed: int = 0

    def projector_config(self) -> ProjectorConfig:
        overrides = {name: value for name, value in {"steps": self.steps, "batch_size": self.batch_size,
                                                     "train_items": self.train_items,
                                                     "valid_items": self.valid_items}.items() if value is not None}
        return ProjectorConfig.profile(self.profile or load_settings().profile, seed=self.seed, progress=True,
                                       graph_triples=self.graph_triples, **overrides)


@gpu_model_asset("hiim_projector", PROJECTOR_INPUTS, code_version="2")
def hiim_projector(context: dg.AssetExecutionContext, config: ProjectorTrainingConfig, warehouse: WarehouseResource,
                   encoder: EncoderResource, mlflow_tracking: MlflowResource, llm: LlmResource) -> dg.MaterializeResult:
    """HIIM's W_proj: champion-GAT triple vectors -> the LLM's input-embedding space, trained (LLM frozen) on
    the answer likelihood of `qa_items` (train split) under A2RAG's answer prompt with GSRM's triples;
    registered as `medgraph-hiim-projector`, `champion` moving only on a lower validation answer NLL than
    the champion's or, with none, than A2RAG's text-only answer on the same triples."""
    projector_config = config.projector_config()
    store, tracking = warehouse.get_warehouse(), mlflow_tracking.tracking()
    gat_version = tracking.champion_version(GAT_MODEL.name)
    if gat_version is None:
        raise dg.Failure(f"no {GAT_MODEL.name}@champion in {redact_uri(tracking.tracking_uri)}: "
                         "materialize models/gat_model first")
    gat_uri = f"models:/{GAT_MODEL.name}/{gat_version}"  # pinned: the projector only fits this GAT
    chat = llm.load()
    with Retriever(store, encoder.load()) as retriever, mlflow_tracking.start_asset_run(context, PROJECTOR_INPUTS):
        mlflow.log_params({**projector_config.as_dict(), "gat_model_uri": gat_uri, "llm": chat.name})
        gat = tracking.load_model(gat_uri, lambda path: mlflow.pytorch.load_model(path, map_location="cpu"))
        train, valid = projector_examples(store, KnowledgeTools.with_home_cache(retriever, warehouse.home),
                                          projector_config, tuned_a2rag_config(Path(warehouse.home)))
        context.log.info(f"projector: {len(train)} train / {len(valid)} validation questions "
                         f"({projector_config.graph_triples} triples), GAT {gat_uri}, LLM {chat.name}")
        result = train_projector(chat, gat, NodeFeatures(store.lake, gat.feature_table), train, valid,
                                 projector_config, log_fn=lambda step, metrics: mlflow.log_metrics(metrics, step=step))
        registration = tracking.register_and_gate(log_projector_result(tracking, result, chat.name, gat_uri),
                                                  HIIM_PROJECTOR_MODEL, text_only_baseline(result),
                                                  tags={"dagster/run_id": context.run.run_id, "llm": chat.name})
    context.log.info(registration.promotion.reason)
    return dg.MaterializeResult(
        metadata={**registration.as_metadata(), "gat_model_uri": gat_uri, "llm": chat.name,
                  "graph_triples": projector_config.graph_triples, **result.metrics,
                  **{f"{k}_questions": v for k, v in result.examples.items()}},
        data_version=dg.DataVersion(registration.data_version),
    )


defs = dg.Definitions(assets=[gat_model, hiim_projector])
