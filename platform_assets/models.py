"""Trained models: the GAT pretrained on UMLS triples (and, built on it, the HIIM projector), and the reader
adapted to read evidence.

Each model asset trains, logs to MLflow (`medgraph/<asset>`), registers a new
version and moves the `champion` alias only if that version beats the
current champion on the validation metric or, with none yet, the baseline it
starts from, measured on the same validation items (`Tracking.register_and_gate`):
the untrained GAT, A2RAG's text-only answer, the base reader. Evaluation loads models by
alias, so a worse retraining run is recorded but changes nothing downstream.
"""

import shutil
from pathlib import Path

import dagster as dg
import mlflow

from medgraph.eval.gsrm import tuned_a2rag_config
from medgraph.gnn.graph_tokens import NodeFeatures
from medgraph.gnn.train import FEATURE_TABLE, GatConfig, pick_device, train_gat
from medgraph.gnn.training_log import history_markdown, log_gat_result, result_metadata, untrained_baseline
from medgraph.llm.hf import TransformersChatModel
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.table import first_as_evaluated, load_qa_items
from medgraph.retrieval import Retriever
from medgraph.rl.hiim import (
    ProjectorConfig,
    log_projector_result,
    projector_examples,
    text_only_baseline,
    train_projector,
)
from medgraph.rl.model import save_policy
from medgraph.rl.policy import log_policy
from medgraph.rl.reader import (
    ReaderConfig,
    base_reader_baseline,
    gate_metrics,
    held_out_pairs,
    reader_examples,
    reading_accuracy,
    train_reader_adapter,
)
from medgraph.settings import redact_uri
from medgraph.tracking import GAT_MODEL, HIIM_PROJECTOR_MODEL, READER_ADAPTER_MODEL, checkpoint_dir
from platform_assets.automation import gpu_model_asset
from resources import EncoderResource, LlmResource, MlflowResource, WarehouseResource
from resources.training import TrainingResource

GAT_INPUTS = [dg.AssetKey(["kg", "kg_edges"]), dg.AssetKey(["embeddings", FEATURE_TABLE]),
              dg.AssetKey("umls_release")]


class GatTrainingConfig(dg.Config):
    profile: str | None = None
    """tiny | demo | full (default: the `training` resource's, MEDGRAPH_PROFILE): model size, batch size, steps (GatConfig.profile)."""
    epochs: int | None = None
    steps_per_epoch: int | None = None
    seed: int | None = None
    device: str = "auto"
    """auto: CUDA when present (with AMP), else the CPU."""
    resume: bool = True
    """Continue from the checkpoint an interrupted run with the same inputs and settings left behind."""

    def gat_config(self, default_profile: str) -> GatConfig:
        overrides = {name: value for name, value in
                     {"epochs": self.epochs, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed}.items()
                     if value is not None}
        return GatConfig.profile(self.profile or default_profile, device=self.device, progress=True,
                                 **overrides)


@gpu_model_asset("gat_model", GAT_INPUTS, code_version="1")
def gat_model(context: dg.AssetExecutionContext, config: GatTrainingConfig, warehouse: WarehouseResource,
              mlflow_tracking: MlflowResource, training: TrainingResource) -> dg.MaterializeResult:
    """A 2-layer GAT pretrained by triple classification on `kg.kg_edges` (relation-free node
    descriptions as features), registered as MLflow model `medgraph-gat`; `champion` moves only on a
    better validation ROC-AUC than the champion's or, with none, than the same GAT untrained."""
    gat_config = config.gat_config(training.profile)
    store = warehouse.get_warehouse()
    tracking = mlflow_tracking.tracking()
    with mlflow_tracking.start_asset_run(context, GAT_INPUTS) as run:
        checkpoints = checkpoint_dir(warehouse.layout.checkpoints("gat_model"), run, gat_config.as_dict())
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
    """tiny | demo | full (default: the `training` resource's, MEDGRAPH_PROFILE): steps, batch size, training and validation questions."""
    steps: int | None = None
    batch_size: int | None = None
    train_items: int | None = None
    valid_items: int | None = None
    graph_triples: str = "gsrm"
    """gsrm: the triples A2RAG's GSRM retrieves (what HIIM sees in evaluation); gold_path: gold path plus
    distractors (an experiment: its gate then does not measure HIIM inside A2RAG)."""
    seed: int = 0

    def projector_config(self, default_profile: str) -> ProjectorConfig:
        overrides = {name: value for name, value in {"steps": self.steps, "batch_size": self.batch_size,
                                                     "train_items": self.train_items,
                                                     "valid_items": self.valid_items}.items() if value is not None}
        return ProjectorConfig.profile(self.profile or default_profile, seed=self.seed, progress=True,
                                       graph_triples=self.graph_triples, **overrides)


@gpu_model_asset("hiim_projector", PROJECTOR_INPUTS, code_version="2")
def hiim_projector(context: dg.AssetExecutionContext, config: ProjectorTrainingConfig, warehouse: WarehouseResource,
                   encoder: EncoderResource, mlflow_tracking: MlflowResource, llm: LlmResource,
                   training: TrainingResource) -> dg.MaterializeResult:
    """HIIM's W_proj: champion-GAT triple vectors -> the LLM's input-embedding space, trained (LLM frozen) on
    the answer likelihood of `qa_items` (train split) under A2RAG's answer prompt with GSRM's triples;
    registered as `medgraph-hiim-projector`, `champion` moving only on a lower validation answer NLL than
    the champion's or, with none, than A2RAG's text-only answer on the same triples."""
    projector_config = config.projector_config(training.profile)
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


READER_INPUTS = [dg.AssetKey(["qa", "qa_items"]), dg.AssetKey(["kg", "kg_edges"]), dg.AssetKey(["kg", "kg_node_text"])]


class ReaderAdapterConfig(dg.Config):
    profile: str | None = None
    """tiny | demo | full (default: the `training` resource's, MEDGRAPH_PROFILE): steps, batch size, LoRA, validation questions."""
    steps: int | None = None
    lr: float | None = None
    valid_items: int | None = None
    """Validation questions of the gate (the first N of `valid_dataset` in the split's MIRAGE file, as evaluated)."""
    gold_share: float | None = None
    """Share of the multiple-choice examples that show their gold facts (RAFT's P); the rest withhold them."""
    layouts: dict[str, float] | None = None
    """Answering-call layouts of the examples and their weights, e.g. {kg_facts: 0.3, a2rag: 0.2, documents: 0.2,
    rag_kg: 0.3} (the default); names as `medgraph.rl.reader.LAYOUTS`."""
    no_evidence_share: float | None = None
    """Share of the multiple-choice examples shown no evidence at all (target: nothing found); 0.1 by default."""
    one_hop_copies: int | None = None
    """Copies of each one-hop multiple-choice train question among the examples (1 by default; 2 was no reliable gain on
    validation)."""
    baited_copies: int | None = None
    """Copies (times `one_hop_copies`) of each one-hop question whose answer links to a wrong option, whose evidence
    baits a second hop (`medgraph.rl.reader.baits_a_second_hop`); 1 by default (3 were no gain over three seeds on
    validation)."""
    answer_form: str | None = None
    """How targets name the answer: "text" (the option's text in the answer tag; the profiles' default) or "letter"
    (the text, then its letter); `medgraph.rl.reader.name_the_option`."""
    seed: int = 0
    device: str = "auto"

    def reader_config(self, default_profile: str) -> ReaderConfig:
        config = ReaderConfig.profile(self.profile or default_profile, seed=self.seed,
                                      **{k: v for k, v in (("valid_items", self.valid_items),
                                                           ("gold_share", self.gold_share),
                                                           ("no_evidence_share", self.no_evidence_share),
                                                           ("answer_form", self.answer_form),
                                                           ("one_hop_copies", self.one_hop_copies),
                                                           ("baited_copies", self.baited_copies),
                                                           ("layouts", self.layouts and tuple(self.layouts.items())))
                                         if v is not None})
        return config.but(seed=self.seed, device=self.device,
                          **{k: v for k, v in (("steps", self.steps), ("lr", self.lr)) if v is not None})


@gpu_model_asset("reader_adapter", READER_INPUTS, code_version="9")
def reader_adapter(context: dg.AssetExecutionContext, config: ReaderAdapterConfig, warehouse: WarehouseResource,
                   encoder: EncoderResource, llm: LlmResource, mlflow_tracking: MlflowResource,
                   training: TrainingResource) -> dg.MaterializeResult:
    """A LoRA adapter of the base LLM that reads KG evidence (RAFT-style, `medgraph.rl.reader`): trained on the
    train split's questions with their gold facts among distractors (withheld in a share), in the answering-call
    layouts of oracle-evidence / rag-kg, A2RAG and MedRAG (facts as concept texts), never a fact joining
    a validation or test question's concepts; registered merged as `medgraph-reader-adapter`, `champion` moving
    only when its validation accuracy with the gold facts shown (`oracle-evidence`) beats the champion's or, with
    none, the base reader's, while its accuracy without evidence (`cot`) stays within 0.10 of the base reader's.
    Evaluation runs `reader: adapted` rows with the champion."""
    reader_config = config.reader_config(training.profile)
    store, base, tracking = warehouse.get_warehouse(), llm.load(), mlflow_tracking.tracking()
    if not isinstance(base, TransformersChatModel):
        raise dg.Failure(f"the reader adapter trains an in-process transformers model (MEDGRAPH_LLM = a built-in "
                         f"name or a local checkpoint); {llm.spec!r} is served by {type(base).__name__}")
    train, validation = load_qa_items(store, "train"), load_qa_items(store, "validation")
    held_out = held_out_pairs([*validation, *load_qa_items(store, "test")])
    # Drawn as the evaluation draws its split (the first N in file order), so the gate sees the test's mix of shapes.
    valid = first_as_evaluated(validation, warehouse.layout.qa_split("validation"), [reader_config.valid_dataset],
                               reader_config.valid_items)
    if not valid:
        raise dg.Failure(f"no validation questions of {reader_config.valid_dataset!r} in qa/qa_items: the champion "
                         "gate needs them")
    out = warehouse.layout.checkpoints("reader_adapter") / context.run.run_id
    with Retriever(store, encoder.load()) as retriever, mlflow_tracking.start_asset_run(context, READER_INPUTS):
        tools = KnowledgeTools(retriever)
        examples, counts = reader_examples(retriever.graph, train, reader_config, held_out,
                                           count_tokens=base.count_tokens, tools=tools)
        context.log.info(f"reader adapter: {len(examples)} examples from {len(train)} train questions "
                         f"({dict(counts)}); gate on {len(valid)} validation questions of {reader_config.valid_dataset}")
        mlflow.log_params({**reader_config.as_dict(), "base_model": base.name})
        mlflow.log_metrics({f"examples_{k}": float(v) for k, v in counts.items()})
        base_reading = reading_accuracy(base, tools, valid)
        base.clear_prefix_cache()  # up to 1 GB of the base reader's keys and values, unused during the fit
        result = train_reader_adapter(base.model_dir, examples, reader_config, held_out, name=f"{base.name}+reader",
                                      log_fn=lambda step, metrics: mlflow.log_metrics(metrics, step=step))
        save_policy(result.policy, out)  # merged: evaluation loads one plain checkpoint, as it does a policy
        metrics = {**result.metrics, **gate_metrics(base_reading, reading_accuracy(base, tools, valid,
                                                                                   reader=result.policy))}
        mlflow.log_metrics(metrics)
        model_uri = log_policy(out, result.policy.name, metadata={"base_model": base.name,
                                                                  "reader_config": reader_config.as_dict()},
                               artifact_path="reader")
        registration = tracking.register_and_gate(model_uri, READER_ADAPTER_MODEL,
                                                  base_reader_baseline(base_reading, base.name),
                                                  tags={"dagster/run_id": context.run.run_id, "llm": base.name})
    shutil.rmtree(out, ignore_errors=True)  # the checkpoint is in MLflow now
    context.log.info(f"reader adapter: oracle-evidence {metrics['valid_oracle_accuracy']:.3f} (base "
                     f"{metrics['valid_base_oracle_accuracy']:.3f}), no evidence {metrics['valid_no_evidence_accuracy']:.3f} "
                     f"(base {metrics['valid_base_no_evidence_accuracy']:.3f}) on {len(valid)} validation questions; "
                     f"{registration.promotion.reason}")
    return dg.MaterializeResult(
        metadata={**registration.as_metadata(), "base_model": base.name, "validation_questions": len(valid),
                  **{f"examples_{k}": v for k, v in counts.items()}, **metrics},
        data_version=dg.DataVersion(registration.data_version),
    )


defs = dg.Definitions(assets=[gat_model, hiim_projector, reader_adapter])
