"""Asset jobs and schedules."""

import os
from pathlib import Path

import dagster as dg
import yaml


def gpu_run_tags(env: dict[str, str] | None = None) -> dict[str, str]:
    """Run tags of the jobs that need a GPU: `medgraph/accelerator=gpu` (the run queue admits one such run at a
    time, deploy/production/dagster.yaml), plus the launcher's tags from the YAML file MEDGRAPH_GPU_RUN_TAGS
    names (ECS: GPU task definition and capacity provider; Kubernetes: GPU limits and node selector)."""
    env = os.environ if env is None else env
    tags = {"medgraph/accelerator": "gpu"}
    path = env.get("MEDGRAPH_GPU_RUN_TAGS")
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"MEDGRAPH_GPU_RUN_TAGS={path} is not a file (expected a YAML mapping of run tags)")
        launcher_tags = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if not isinstance(launcher_tags, dict) or not all(isinstance(v, str) for v in launcher_tags.values()):
            raise ValueError(f"{path}: run tags must be a mapping of names to strings (JSON values as strings)")
        tags.update(launcher_tags)
    return tags


umls_ingest_job = dg.define_asset_job(
    "umls_ingest",
    selection=dg.AssetSelection.groups("umls"),
    description="Ingest the UMLS release into the lake and the warehouse (umls.* tables).",
)

# The method evaluations (one run per dataset partition); GSRM's test recall (unpartitioned, no LLM) and the
# report follow by automation.
EVALUATIONS = dg.AssetSelection.groups("evaluation") - dg.AssetSelection.assets(
    dg.AssetKey(["eval", "qa_benchmark"]), dg.AssetKey(["eval", "evaluation_report"]),
    dg.AssetKey(["eval", "gsrm_recall"]))
evaluate_job = dg.define_asset_job(
    "evaluate_methods",
    selection=EVALUATIONS,
    description="Re-evaluate A2RAG, Graph-R1, SEMA-RAG and the baselines on one benchmark dataset.",
    tags=gpu_run_tags(),
)

retrain_job = dg.define_asset_job(
    "retrain_models",
    selection=dg.AssetSelection.groups("models"),
    description="Retrain every models/* asset (GAT, HIIM projector, GSRM parameters, Graph-R1 SFT and policy); champions move only if better.",
    tags=gpu_run_tags(),
)

weekly_retraining = dg.ScheduleDefinition(
    name="weekly_retraining",
    job=retrain_job,
    cron_schedule="0 3 * * 0",  # Sundays 03:00, when nobody waits on the GPU
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Weekly retraining of every models/* asset (GAT, HIIM projector, GSRM parameters, Graph-R1 SFT and policy).",
)

defs = dg.Definitions(jobs=[umls_ingest_job, evaluate_job, retrain_job], schedules=[weekly_retraining])
