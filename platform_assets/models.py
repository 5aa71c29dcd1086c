"""Trained models: the GAT pretrained on UMLS triples (and, built on it, the HIIM projector).

Each model asset trains, logs to MLflow (`medgraph/<asset>`), registers a new
version and moves the `champion` alias only if that version beats the
current champion on the validation metric or, with none yet, the baseline it
starts from, measured on the same validation items (`Tracking.register_and_gate`):
the untrained GAT, A2RAG's text-only answer. Evaluation loads models by
alias, so a worse retraining run is recorded but changes nothing downstream.
"""

import hashlib
import json
import shutil
from pathlib import Path

import dagster as dg
import mlflow

from medgraph.eval.gsrm import tuned_a2rag_config
from medgraph.gnn.graph_tokens import (
    PROJECTOR_GATE,
    PROJECTOR_MODEL_NAME,
    TEXT_ONLY_BASELINE,
    NodeFeatures,
    ProjectorConfig,
    projector_examples,
    train_projector,
)
from medgraph.gnn.train import FEATURE_TABLE, GatConfig, GatResult, pick_device, train_gat
from medgraph.methods.tools import KnowledgeTools
from medgraph.retrieval import Retriever
from medgraph.settings import load_settings, redact_uri
from medgraph.tracking import MODEL_NAMES, Baseline, Gate
from resources import EncoderResource, LlmResource, MlflowResource, WarehouseResource

GAT_MODEL_NAME = MODEL_NAMES["gat"]
GAT_GATE = Gate("valid_roc_auc")
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


def _checkpoint_dir(home: Path, config: GatConfig, data_versions: dict[str, str]) -> Path:
    """One folder per (settings, inputs): a retry resumes its own interrupted run, never another's."""
    key = json.dumps({"config": {k: v for k, v in config.as_dict().items() if k not in ("progress", "device")},
                      "inputs": data_versions}, sort_keys=True, default=str)
    return home / "checkpoints" / "gat_model" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _history_markdown(result: GatResult) -> str:
    lines = ["| epoch | step | train loss | valid ROC-AUC | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {int(r['epoch'])} | {int(r['step'])} | {r['train_loss']:.4f} | {r['valid_roc_auc']:.4f} "
              f"| {r['seconds']:.1f} |" for r in result.history]
    return "\n".join(lines)


def _curve_figure(result: GatResult):  # -> matplotlib Figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [int(r["epoch"]) for r in result.history]
    fig, loss_axis = plt.subplots(figsize=(6, 3.5))
    loss_axis.plot(epochs, [r["train_loss"] for r in result.history], "o-", color="tab:blue", label="train loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("train loss", color="tab:blue")
    auc_axis = loss_axis.twinx()
    auc_axis.plot(epochs, [r["valid_roc_auc"] for r in result.history], "s-", color="tab:orange")
    auc_axis.set_ylabel("validation ROC-AUC", color="tab:orange")
    fig.suptitle("GAT triple classification")
    fig.tight_layout()
    return fig


@dg.asset(
    key=["models", "gat_model"],
    deps=GAT_INPUTS,
    group_name="models",
    kinds={"pytorch", "mlflow"},
    pool="gpu",
    code_version="1",
    tags={"medgraph/accelerator": "gpu"},
    automation_condition=None,  # retrained by the weekly_retraining schedule: see platform_assets/automation.py
)
def gat_model(context: dg.AssetExecutionContext, config: GatTrainingConfig, warehouse: WarehouseResource,
              mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
    """A 2-layer GAT pretrained by triple classification on `kg.kg_edges` (relation-free node
    descriptions as features), registered as MLflow model `medgraph-gat`; `champion` moves only on a
    better validation ROC-AUC than the champion's or, with none, than the same GAT untrained."""
    gat_config = config.gat_config()
    store = warehouse.open()
    tracking = mlflow_tracking.tracking()
    with mlflow_tracking.start_asset_run(context, GAT_INPUTS) as run:
        data_versions = {k.removeprefix("data_version/"): v for k, v in run.data.tags.items()
                         if k.startswith("data_version/")}
        checkpoints = _checkpoint_dir(Path(warehouse.home), gat_config, data_versions)
        mlflow.log_params({k: str(v) for k, v in gat_config.as_dict().items()})
        mlflow.set_tag("checkpoint_dir", str(checkpoints))

        def log_metrics(step: int, metrics: dict[str, float]) -> None:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
            context.log.info(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

        result = train_gat(store, gat_config, checkpoint_dir=checkpoints, resume=config.resume,
                           log_fn=log_metrics)
        mlflow.log_metrics({**result.metrics, **{f"time_{k}": v for k, v in result.timings.items()}})
        mlflow.log_params({f"graph_{k}": v for k, v in result.graph.items()})
        mlflow.log_dict({"history": result.history, "relations": list(result.relations)}, "training.json")
        mlflow.log_figure(_curve_figure(result), "training_curve.png")
        logged_uri = tracking.log_torch_model(result.model, metadata={
            "relations": len(result.relations), "feature_table": result.model.feature_table,
            "feature_encoder_id": result.model.feature_encoder_id})
        untrained = Baseline("untrained GAT (same architecture and seed)",
                             {"valid_roc_auc": result.metrics["valid_roc_auc_untrained"]})
        version, promotion = tracking.register_and_gate(logged_uri, GAT_MODEL_NAME, GAT_GATE, untrained,
                                                        tags={"dagster/run_id": context.run.run_id})
        run_id = run.info.run_id
    shutil.rmtree(checkpoints, ignore_errors=True)  # the model is in MLflow; checkpoints only serve a retry
    context.log.info(promotion.reason)

    metadata: dict[str, object] = {
        "mlflow_run_id": run_id,
        "model_uri": f"models:/{GAT_MODEL_NAME}/{version}",
        "registered_model": GAT_MODEL_NAME,
        "model_version": version,
        "champion_uri": tracking.model_uri(GAT_MODEL_NAME),
        **promotion.as_metadata(),
        **{k: float(v) for k, v in result.metrics.items()},
        "edges_per_second": result.timings["edges_per_second"],
        "train_seconds": result.timings["train_seconds"],
        "device": str(pick_device(gat_config.device)),
        "history": dg.MetadataValue.md(_history_markdown(result)),
    }
    # Downstream assets use the champion, so its version is this asset's data version: a run that
    # does not beat the champion changes nothing below it (and triggers nothing).
    champion = tracking.champion_version(GAT_MODEL_NAME)
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(f"{GAT_MODEL_NAME}@champion=v{champion}"))


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


@dg.asset(
    key=["models", "hiim_projector"],
    deps=PROJECTOR_INPUTS,
    group_name="models",
    kinds={"pytorch", "mlflow"},
    pool="gpu",
    code_version="2",
    tags={"medgraph/accelerator": "gpu"},
    automation_condition=None,  # retrained by the weekly_retraining schedule: see platform_assets/automation.py
)
def hiim_projector(context: dg.AssetExecutionContext, config: ProjectorTrainingConfig, warehouse: WarehouseResource,
                   encoder: EncoderResource, mlflow_tracking: MlflowResource, llm: LlmResource) -> dg.MaterializeResult:
    """HIIM's W_proj: champion-GAT triple vectors -> the LLM's input-embedding space, trained (LLM frozen) on
    the answer likelihood of `qa_items` (train split) under A2RAG's answer prompt with GSRM's triples;
    registered as `medgraph-hiim-projector`, `champion` moving only on a lower validation answer NLL than
    the champion's or, with none, than A2RAG's text-only answer on the same triples."""
    projector_config = config.projector_config()
    store, tracking = warehouse.open(), mlflow_tracking.tracking()
    gat_version = tracking.champion_version(GAT_MODEL_NAME)
    if gat_version is None:
        raise dg.Failure(f"no {GAT_MODEL_NAME}@champion in {redact_uri(tracking.tracking_uri)}: "
                         "materialize models/gat_model first")
    gat_uri = f"models:/{GAT_MODEL_NAME}/{gat_version}"  # pinned: the projector only fits this GAT
    chat = llm.load()
    with Retriever(store, encoder.load()) as retriever, mlflow_tracking.start_asset_run(context, PROJECTOR_INPUTS) as run:
        mlflow.log_params({**projector_config.as_dict(), "gat_model_uri": gat_uri, "llm": chat.name})
        gat = mlflow.pytorch.load_model(gat_uri, map_location="cpu")
        train, valid = projector_examples(store, KnowledgeTools(retriever), projector_config,
                                          tuned_a2rag_config(Path(warehouse.home)))
        context.log.info(f"projector: {len(train)} train / {len(valid)} validation questions "
                         f"({projector_config.graph_triples} triples), GAT {gat_uri}, LLM {chat.name}")
        result = train_projector(chat, gat, NodeFeatures(store.lake, gat.feature_table), train, valid,
                                 projector_config, log_fn=lambda step, metrics: mlflow.log_metrics(metrics, step=step))
        result.projector.gat_model_uri = gat_uri
        mlflow.log_metrics(result.metrics)
        mlflow.log_dict({"history": result.history, "examples": result.examples}, "training.json")
        logged_uri = tracking.log_torch_model(result.projector, metadata={"llm": chat.name, "gat_model_uri": gat_uri})
        text_only = Baseline(TEXT_ONLY_BASELINE, {"valid_answer_nll": result.metrics["valid_answer_nll_text_only"]})
        version, promotion = tracking.register_and_gate(logged_uri, PROJECTOR_MODEL_NAME, PROJECTOR_GATE, text_only,
                                                        tags={"dagster/run_id": context.run.run_id, "llm": chat.name})
        run_id = run.info.run_id
    context.log.info(promotion.reason)
    return dg.MaterializeResult(
        metadata={"mlflow_run_id": run_id, "model_uri": f"models:/{PROJECTOR_MODEL_NAME}/{version}",
                  "model_version": version, "gat_model_uri": gat_uri, "llm": chat.name,
                  "graph_triples": projector_config.graph_triples, **promotion.as_metadata(), **result.metrics,
                  **{f"{k}_questions": v for k, v in result.examples.items()}},
        data_version=dg.DataVersion(f"{PROJECTOR_MODEL_NAME}@champion=v{tracking.champion_version(PROJECTOR_MODEL_NAME)}"),
    )


defs = dg.Definitions(assets=[gat_model, hiim_projector])
