"""Evaluation: the benchmark as data, one asset per method family (partitioned by dataset), the report.

Every method runs on the same KG, corpus, encoder, LLM and scorer; models come
from the MLflow registry by alias (HIIM projector and Graph-R1 policy
`@champion`, when registered). Results and per-step traces are tables
(`eval.<asset>_results`, `eval.<asset>_traces`, `eval.<asset>_summary`), the
metrics go to MLflow and to the asset's metadata.
"""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import dagster as dg
import mlflow

from medgraph.eval.evaluate import MethodSummary, markdown_table, summarize, write_run
from medgraph.eval.families import (
    FAMILIES,
    EvalFamily,
    EvalRequestError,
    UnknownReaderError,
    checked_eval_request,
    plan_family,
    run_family,
)
from medgraph.eval.gsrm import read_gsrm_params
from medgraph.eval.monitoring import (
    Alarm,
    EvalTableMissing,
    TokenPrice,
    cost_alarm,
    latency_p95_alarm,
    step_budget_alarm,
)
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.benchmarks import load_benchmark
from medgraph.qa.item import QaItem
from medgraph.qa.mirage import load_mirage, write_mirage
from medgraph.retrieval import Retriever
from medgraph.settings import redact_uri
from medgraph.tracking import GRAPH_R1_POLICY_MODEL, MODELS, metric_name
from medgraph.umls.schema import MRCONSO
from platform_assets.automation import on_data_version_change, on_data_version_change_once_settled
from platform_assets.partitions import BENCHMARK, DATASETS
from resources import EncoderResource, LlmResource, MlflowResource, WarehouseResource
from resources.mlflow import latest_data_version


class BenchmarkConfig(dg.Config):
    spec: str = BENCHMARK
    """Benchmark sources (MEDGRAPH_BENCHMARK): kg, mirage:PATH[#a+b], pubmedqa:PATH, jsonl:PATH[#name]."""
    limit: int | None = None
    """Questions per dataset (the first N in file order); None: all."""


@dg.asset(
    key=["eval", "qa_benchmark"],
    deps=[dg.AssetKey(["qa", "qa_items"])],
    partitions_def=DATASETS,
    group_name="evaluation",
    kinds={"json"},
    code_version="1",
    automation_condition=on_data_version_change(),
)
def qa_benchmark(context: dg.AssetExecutionContext, config: BenchmarkConfig,
                 warehouse: WarehouseResource) -> dg.MaterializeResult:
    """One dataset of the benchmark, frozen as a MIRAGE-format file `$MEDGRAPH_HOME/eval/benchmark/<dataset>.json`
    (the embedded KG-derived test split by default, or MIRAGE / PubMedQA / JSONL files)."""
    dataset = context.partition_key
    benchmark = load_benchmark(config.spec, Path(warehouse.home), config.limit)
    if dataset not in benchmark:
        raise dg.Failure(f"benchmark {config.spec!r} has no dataset {dataset!r} (it has {sorted(benchmark)})")
    items = benchmark[dataset]
    path = write_mirage(warehouse.layout.benchmark(dataset), items)
    return dg.MaterializeResult(metadata={"questions": len(items), "path": dg.MetadataValue.path(str(path)),
                                          "spec": config.spec,
                                          "multiple_choice": sum(i.is_multiple_choice for i in items)})


class EvalConfig(dg.Config):
    methods: list[str] | None = None
    """Methods or named ablations to run (default: the asset's methods)."""
    limit: int | None = None
    """Questions of the dataset to evaluate (the first N); None: all."""
    batch_size: int = 24
    """Questions advancing in lockstep (one LLM call per agent step). On a CPU a decode step costs little more
    for 24 rows than for 8 (benchmarks/llm_decode.py): 24 questions at once took 0.50-0.85x the time of three
    batches of 8, with the same answers, even before the KV cache was written in place
    (benchmarks/methods_throughput.py --small-batch 8)."""
    method_config: str = "{}"
    """JSON object: method or ablation name -> configuration overrides, e.g. {"a2rag": {"tau": 0.4}}."""
    readers: list[str] = ["base"]
    """Who answers each method's answering call: base (the LLM) and/or adapted (the `medgraph-reader-adapter`
    champion; results labelled `<method>@adapted`). Graph-R1 and A2RAG's HIIM row keep the base reader."""
    adapted_probe_items: int = 12
    """Validation questions of the dataset each `@adapted` row answers first: the row runs on the benchmark only
    where at most 0.10 of them were asked again (`medgraph.eval.families.MAX_ADAPTED_ASKED_AGAIN`). 0: no probe."""


def validation_items(split_file: Path, dataset: str, limit: int) -> list[QaItem]:
    """The first `limit` validation questions of `dataset` as the evaluation would draw them (none when the
    dataset has no validation split here: MIRAGE and PubMedQA come as test sets)."""
    if limit <= 0 or not split_file.exists() or dataset not in json.loads(split_file.read_text()):
        return []
    return load_mirage(split_file, [dataset])[:limit]


def _eval_asset(family: EvalFamily):
    inputs = [dg.AssetKey(["eval", "qa_benchmark"]), dg.AssetKey(["embeddings", "node_embeddings"]),
              dg.AssetKey(["embeddings", "edge_embeddings"]), dg.AssetKey(["embeddings", "chunk_embeddings"]),
              *(dg.AssetKey(["models", model]) for model in family.models)]

    @dg.asset(
        key=["eval", family.name],
        deps=inputs,
        partitions_def=DATASETS,
        group_name="evaluation",
        kinds={"duckdb", "parquet", "mlflow"},
        pool="gpu",
        code_version="1",
        description=family.description,
        automation_condition=on_data_version_change(),
    )
    def _evaluate(context: dg.AssetExecutionContext, config: EvalConfig, warehouse: WarehouseResource,
                  encoder: EncoderResource, llm: LlmResource, mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
        dataset = context.partition_key
        try:
            request = checked_eval_request(family, config.methods, config.limit, config.method_config)
        except EvalRequestError as error:
            raise dg.Failure(f"{error} (run config of eval/{family.name})") from None
        items = load_mirage(warehouse.layout.benchmark(dataset))[: request.limit]
        store = warehouse.get_warehouse()
        try:
            plan = plan_family(family, llm.load(), store, mlflow_tracking.tracking(), warehouse.layout.root,
                               encoder_id=encoder.load().encoder_id, methods=request.methods, readers=config.readers,
                               overrides=request.overrides)
        except UnknownReaderError as error:
            raise dg.Failure(f"{error} (run config `readers`)") from None
        with Retriever(store, encoder.load()) as retriever, \
                mlflow_tracking.start_asset_run(context, inputs, run_name=f"{family.name}-{dataset}") as run:
            mlflow.set_tags({"dataset": dataset, **{f"lineage/{k}": v for k, v in plan.lineage.items()}})
            probe_items = (validation_items(warehouse.layout.qa_split("validation"), dataset,
                                            config.adapted_probe_items) if "adapted" in config.readers else [])
            results = run_family(plan, items, KnowledgeTools.with_home_cache(retriever, warehouse.home),
                                 batch_size=config.batch_size, log=context.log.info, warn=context.log.warning,
                                 dataset=dataset, probe_items=probe_items)
            summaries = summarize(results)
            _log_run(summaries, plan.lineage, dataset)
            run_id = run.info.run_id
        paths = write_run(store, family.name, dataset, results, summaries)
        metadata: dict[str, object] = {
            "summary": dg.MetadataValue.md(markdown_table(summaries)),
            "mlflow_run_id": run_id, "questions": len(items), **plan.lineage,
            "results_table": f"eval.{family.name}_results", "traces_table": f"eval.{family.name}_traces",
            "results_path": dg.MetadataValue.path(str(paths["results"])),
        }
        for s in summaries:
            metadata[f"{s.method}/accuracy"] = s.accuracy
            metadata[f"{s.method}/parse_failure_rate"] = s.parse_failure_rate
            metadata[f"{s.method}/answer_retry_rate"] = s.answer_retry_rate
        return dg.MaterializeResult(metadata=metadata)

    return _evaluate


def _log_run(summaries: Sequence[MethodSummary], lineage: Mapping[str, object], dataset: str) -> None:
    """Each row's metrics, the summaries and the lineage into the active MLflow run (the validation probe's
    outcome too: it is known only after the rows ran)."""
    if "adapted_probe" in lineage:
        mlflow.set_tag("lineage/adapted_probe", lineage["adapted_probe"])
    for s in summaries:
        mlflow.log_metrics({metric_name(f"{s.method}/{k}"): v for k, v in s.as_row().items()
                            if isinstance(v, float | int) and not isinstance(v, bool)})
        mlflow.log_metrics({metric_name(f"{s.method}/{k}"): v for k, v in s.extra.items()})
    mlflow.log_dict({"summaries": [s.as_row() for s in summaries], "lineage": dict(lineage)}, f"summary_{dataset}.json")


eval_assets = [_eval_asset(family) for family in FAMILIES]

class LatencyBudget(dg.Config):
    max_p95_s: float = 60.0
    """Alarm when any method's p95 latency per question exceeds this (seconds)."""


class CostBudget(dg.Config):
    prompt_usd_per_1k_tokens: float = 0.0
    """Price of 1,000 prompt tokens (0: a self-hosted model; set the provider's price for an API)."""
    completion_usd_per_1k_tokens: float = 0.0
    max_usd_per_question: float = 0.05
    """Alarm when a method's estimated cost per question (mean tokens x price) exceeds this."""


class StepBudget(dg.Config):
    max_agent_steps: int = 10
    """The agent step budget (Graph-R1 stops at 10 steps by design; more means the loop guard failed)."""
    max_gsrm_iterations: int = 2
    """GSRM's K: more iterations than configured means the refinement loop ran away."""


def _warn(alarm: Alarm) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=alarm.passed, severity=dg.AssetCheckSeverity.WARN,
                               description=alarm.description, metadata=alarm.metadata)


def _guarded(compute) -> dg.AssetCheckResult:
    try:
        return _warn(compute())
    except EvalTableMissing as missing:
        return _warn(Alarm(False, str(missing)))


def _monitoring_checks(asset: dg.AssetsDefinition) -> list[dg.AssetChecksDefinition]:
    """Operational alarms (WARN: they inform, they do not block) over the asset's summary/results tables."""
    name = asset.key.path[-1]

    @dg.asset_check(asset=asset, name="latency_p95_within_budget",
                    description="p95 latency per question of each method vs LatencyBudget.max_p95_s.")
    def latency_p95_within_budget(config: LatencyBudget, warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _guarded(lambda: latency_p95_alarm(warehouse.get_warehouse(), name, config.max_p95_s))

    @dg.asset_check(asset=asset, name="cost_per_question_within_budget",
                    description="Estimated cost per question (tokens x configured price) vs CostBudget.")
    def cost_per_question_within_budget(config: CostBudget, warehouse: WarehouseResource) -> dg.AssetCheckResult:
        price = TokenPrice(config.prompt_usd_per_1k_tokens, config.completion_usd_per_1k_tokens)
        return _guarded(lambda: cost_alarm(warehouse.get_warehouse(), name, price, config.max_usd_per_question))

    @dg.asset_check(asset=asset, name="step_budgets_respected",
                    description="No question exceeded the agent step budget or GSRM's iteration count.")
    def step_budgets_respected(config: StepBudget, warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _guarded(lambda: step_budget_alarm(warehouse.get_warehouse(), name, config.max_agent_steps,
                                                  config.max_gsrm_iterations))

    return [latency_p95_within_budget, cost_per_question_within_budget, step_budgets_respected]


eval_checks = [check for asset in eval_assets for check in _monitoring_checks(asset)]


def _reward_curves(tracking, name: str) -> dict[str, list[tuple[int, float]]]:
    """Reward-like metric histories of the champion's training run (empty when none is registered)."""
    version = tracking.champion_version(name)
    if version is None:
        return {}
    run = tracking.client.get_run(tracking.client.get_model_version(name, version).run_id)
    curves = {}
    for key in sorted(run.data.metrics):
        if any(word in key for word in ("reward", "format_rate", "kl", "valid_accuracy")):
            history = tracking.client.get_metric_history(run.info.run_id, key)
            curves[key] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    return curves


def _ingested_release_fingerprint(instance: dg.DagsterInstance) -> str:
    """The fingerprint of the release the `umls.*` tables were ingested from (recorded by ingestion), else
    the last observed one; a run that materializes without observing the source still has the former."""
    ingested = instance.get_latest_materialization_event(dg.AssetKey(["umls", MRCONSO.table]))
    recorded = ingested.asset_materialization.metadata.get("release_fingerprint") if ingested else None
    if recorded is not None:
        return str(recorded.value)
    return latest_data_version(instance, dg.AssetKey("umls_release"))


class ReportConfig(dg.Config):
    reference: str = "rag"
    """The method every other method is compared with, question by question (paired bootstrap CI, McNemar)."""


def _latest_metadata(instance: dg.DagsterInstance, key: dg.AssetKey, name: str) -> str | None:
    event = instance.get_latest_materialization_event(key)
    value = event.asset_materialization.metadata.get(name) if event else None
    return None if value is None else str(value.value)


@dg.asset(
    key=["eval", "evaluation_report"],
    deps=[*(a.key for a in eval_assets), dg.AssetKey(["eval", "gsrm_recall"])],
    group_name="evaluation",
    kinds={"html", "markdown", "mlflow"},
    code_version="2",
    automation_condition=on_data_version_change_once_settled(),
)
def evaluation_report(context: dg.AssetExecutionContext, config: ReportConfig, warehouse: WarehouseResource,
                      encoder: EncoderResource, llm: LlmResource, mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
    """`$MEDGRAPH_HOME/reports/report.md` and `report.html`: whether n can separate the methods, accuracy, evidence
    recall, paired differences with CIs (forest plots), ablations, GSRM Recall@10 per iteration, the seed-claims
    table, routing, rounds, GRPO curves, cost, and the lineage of every number. Writes `eval.paired_comparisons`."""
    from medgraph.eval.report import assemble, build_report

    store = warehouse.get_warehouse()
    tracking = mlflow_tracking.tracking()
    lineage = {"release fingerprint": _ingested_release_fingerprint(context.instance),
               "encoder": encoder.spec, "LLM": redact_uri(llm.spec), "benchmark": redact_uri(BENCHMARK)}
    for name in (model.name for model in MODELS.values()):
        lineage[f"{name}@champion"] = f"v{tracking.champion_version(name)}" if tracking.champion_version(name) \
            else "none registered"
    for key, field in (("graph-r1 policy", "graph_r1_policy"), ("graph-r1 environment", "graph_r1_environment"),
                       ("GSRM tau", "gsrm_tau"), ("GSRM iterations K", "gsrm_iterations"), ("GSRM top N", "gsrm_top_n"),
                       ("GSRM per dataset", "gsrm_by_dataset"), ("GSRM parameters from", "gsrm_params_source")):
        asset = "eval_graph_r1" if field.startswith("graph_r1") else "eval_a2rag"
        value = _latest_metadata(context.instance, dg.AssetKey(["eval", asset]), field)
        if value is not None:
            lineage[key] = value
    for asset in ("eval_baselines", "eval_a2rag"):  # which @adapted rows ran, from their validation probe
        value = _latest_metadata(context.instance, dg.AssetKey(["eval", asset]), "adapted_probe")
        if value is not None:
            lineage[f"adapted rows ({asset.removeprefix('eval_')})"] = value
    data = assemble(store, lineage, _reward_curves(tracking, GRAPH_R1_POLICY_MODEL.name), config.reference,
                    read_gsrm_params(Path(warehouse.home)))
    if not data.summaries:
        raise dg.Failure("no evaluation results yet: materialize the eval/* assets first")
    paths = build_report(data, warehouse.layout.reports)
    with mlflow_tracking.start_asset_run(context, [a.key for a in eval_assets]):
        mlflow.log_artifact(str(paths["markdown"]))
        mlflow.log_artifact(str(paths["html"]))
        for c in data.comparisons:
            prefix = metric_name(f"paired/{c.method}-vs-{c.reference}/{c.dataset}/{c.metric}")
            mlflow.log_metrics({f"{prefix}/difference": c.difference, f"{prefix}/ci_low": c.ci_low,
                                f"{prefix}/ci_high": c.ci_high, f"{prefix}/p_value": c.p_value, f"{prefix}/n": c.n})
        mlflow.log_dict({"comparisons": [c.as_row() for c in data.comparisons],
                         "claims": [dict(zip(("claim", "seed", "measured", "ci", "n", "verdict"), c.as_row()))
                                    for c in data.claims]}, "paired_and_claims.json")
        # MLflow tag keys allow letters, digits, "_-. :/" only.
        mlflow.set_tags({"lineage/" + "".join(c if c.isalnum() or c in "_-. :/" else ":" for c in k): v
                         for k, v in lineage.items()})
    context.log.info(f"report: {paths['html']}")
    separable = sum(1 for c in data.comparisons if c.metric == "correct" and not c.too_small)
    return dg.MaterializeResult(metadata={
        "report_html": dg.MetadataValue.path(str(paths["html"])),
        "report_markdown": dg.MetadataValue.path(str(paths["markdown"])),
        "methods": len({s["method"] for s in data.summaries}), "rows": len(data.summaries),
        "paired_comparisons": len(data.comparisons), "accuracy_comparisons_with_ci_width_le_0.2": separable,
        "claims_holding": sum(c.verdict.startswith("holds") for c in data.claims),
        "preview": dg.MetadataValue.md(paths["markdown"].read_text(encoding="utf-8").split("## Latency")[0]),
    })


defs = dg.Definitions(assets=[qa_benchmark, *eval_assets, evaluation_report], asset_checks=eval_checks)
