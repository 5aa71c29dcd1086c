"""Watch the UMLS release location; request `umls_ingest` when its content fingerprint changes.

The cursor is the fingerprint last acted on, so an unchanged release (or one
touched without a content change) requests nothing, and the run key makes a
repeated evaluation of the same change idempotent. A change is also recorded as an
observation of `umls_release` (data version = the fingerprint) before the run starts,
so the ingested tables get new data versions and automation propagates the change
(platform_assets/automation.py); without it their versions would stay those of the
last observed release.
"""

import dagster as dg

from jobs import umls_ingest_job
from medgraph.umls.release import MissingRrfFileError
from resources import UmlsReleaseResource
from resources.mlflow import DAGSTER_DATA_VERSION_TAG


@dg.sensor(job=umls_ingest_job, minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Requests UMLS ingestion when the release at MEDGRAPH_UMLS_DIR appears or changes.")
def umls_release_sensor(context: dg.SensorEvaluationContext, release: UmlsReleaseResource) -> dg.SensorResult:
    try:
        fingerprint, path = release.fingerprint()  # on S3: from the listing, nothing downloaded
    except (FileNotFoundError, MissingRrfFileError) as error:
        return dg.SensorResult(skip_reason=f"no complete release: {error}")
    if fingerprint == context.cursor:
        return dg.SensorResult(skip_reason=f"release at {path} unchanged ({fingerprint})")
    context.log.info(f"release at {path}: fingerprint {context.cursor or 'none'} -> {fingerprint}")
    observation = dg.AssetObservation(asset_key="umls_release", tags={DAGSTER_DATA_VERSION_TAG: fingerprint},
                                      metadata={"path": dg.MetadataValue.path(path), "fingerprint": fingerprint,
                                                "profile": release.profile})
    return dg.SensorResult(
        asset_events=[observation],
        run_requests=[dg.RunRequest(run_key=f"umls-release-{fingerprint}",
                                    tags={"medgraph/release_fingerprint": fingerprint, "medgraph/release_path": path})],
        cursor=fingerprint,
    )
