"""Asset jobs and schedules."""

import dagster as dg

umls_ingest_job = dg.define_asset_job(
    "umls_ingest",
    selection=dg.AssetSelection.groups("umls"),
    description="Ingest the UMLS release into the lake and the warehouse (umls.* tables).",
)

defs = dg.Definitions(jobs=[umls_ingest_job])
