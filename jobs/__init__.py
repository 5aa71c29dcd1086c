"""Asset jobs and schedules."""

import dagster as dg

umls_ingest_job = dg.define_asset_job(
    "umls_ingest",
    selection=dg.AssetSelection.groups("umls"),
    description="Ingest the UMLS release into the lake and the warehouse (umls.* tables).",
)

# The method evaluations (one run per dataset partition); the report follows by automation.
EVALUATIONS = dg.AssetSelection.groups("evaluation") - dg.AssetSelection.assets(
    dg.AssetKey(["eval", "qa_benchmark"]), dg.AssetKey(["eval", "evaluation_report"]))
evaluate_job = dg.define_asset_job(
    "evaluate_methods",
    selection=EVALUATIONS,
    description="Re-evaluate A2RAG, Graph-R1, SEMA-RAG and the baselines on one benchmark dataset.",
)

retrain_job = dg.define_asset_job(
    "retrain_models",
    selection=dg.AssetSelection.groups("models"),
    description="Retrain the GAT, the HIIM projector and the Graph-R1 policy; champions move only if better.",
)

weekly_retraining = dg.ScheduleDefinition(
    name="weekly_retraining",
    job=retrain_job,
    cron_schedule="0 3 * * 0",  # Sundays 03:00, when nobody waits on the GPU
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Weekly retraining of gat_model, hiim_projector and graph_r1_policy.",
)

defs = dg.Definitions(jobs=[umls_ingest_job, evaluate_job, retrain_job], schedules=[weekly_retraining])
