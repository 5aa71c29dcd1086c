"""MLflow tracking and registry: our own small resource (dagster-mlflow is a legacy op-era resource).

The conventions (experiment per asset, champion gate, lookup by alias) live in
`medgraph.tracking`; this resource adds what only Dagster knows: the run id,
the asset key, its code version and the data versions of the inputs, which
tag every MLflow run so a model can be traced back to the release it saw.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import dagster as dg
import mlflow

from medgraph.tracking import DATA_VERSION_TAG, Tracking

# Where Dagster keeps an event's data version: a tag of the materialization or observation (the public
# `EventLogEntry.tags`; Dagster's own constant lives in a private module).
DAGSTER_DATA_VERSION_TAG = "dagster/data_version"


def latest_data_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str:
    """The data version of the asset's latest materialization or observation; "unknown" when it has none."""
    record = instance.get_latest_data_version_record(key)
    return (record.event_log_entry.tags or {}).get(DAGSTER_DATA_VERSION_TAG, "unknown") if record else "unknown"


def input_data_versions(context: dg.AssetExecutionContext, keys: Sequence[dg.AssetKey]) -> dict[str, str]:
    """The latest data version of each input asset (materialization or observation), by key."""
    return {key.to_user_string(): latest_data_version(context.instance, key) for key in keys}


class MlflowResource(dg.ConfigurableResource):
    """Tracking URI (default: SQLite under MEDGRAPH_HOME) and where new experiments keep artifacts."""

    tracking_uri: str
    artifact_root: str

    def tracking(self) -> Tracking:
        return Tracking(self.tracking_uri, self.artifact_root)

    @contextmanager
    def start_asset_run(self, context: dg.AssetExecutionContext, inputs: Sequence[dg.AssetKey] = (),
                        run_name: str | None = None) -> Iterator[mlflow.ActiveRun]:
        """An MLflow run in `medgraph/<asset name>`, tagged with its Dagster provenance."""
        key = context.asset_key
        tags = {
            "dagster/run_id": context.run.run_id,
            "dagster/asset_key": key.to_user_string(),
            "dagster/code_version": context.assets_def.code_versions_by_key.get(key) or "none",
        }
        tags.update({f"{DATA_VERSION_TAG}{name}": version
                     for name, version in input_data_versions(context, inputs).items()})
        with self.tracking().start_run(key.path[-1], run_name=run_name or context.run.run_id[:8],
                                       tags=tags) as run:
            yield run
