"""The MedGraph code location: every asset, check, job, schedule and sensor, with resources
configured from the environment (MEDGRAPH_HOME, MEDGRAPH_UMLS_DIR, MEDGRAPH_PROFILE, ...)."""

import dagster as dg

import jobs
import sensors
from jobs.executor import recovering_in_process_executor
from medgraph.settings import install_log_redaction
from platform_assets import embeddings, evaluation, gsrm, kg, models, policy, qa, text, text_extraction, umls
from resources import build_resources

# Every log record of the code location's processes (the UI's code server, run workers, `dg launch`), from any
# library's logger, shows URIs with their credentials redacted.
install_log_redaction()

defs = dg.Definitions.merge(
    umls.defs,
    kg.defs,
    qa.defs,
    text.defs,
    text_extraction.defs,
    embeddings.defs,
    models.defs,
    gsrm.defs,
    policy.defs,
    evaluation.defs,
    jobs.defs,
    sensors.defs,
    # In-process by default: on a laptop the per-step process start costs more than it buys,
    # and one process keeps DuckDB's single-writer lock uncontended. Deployments override it. Before its first
    # step, each run fails runs whose process is gone and frees their pool slots (jobs/executor.py).
    dg.Definitions(resources=build_resources(), executor=recovering_in_process_executor),
)
