"""Watch the MLflow registry: a `champion` alias pointing at a new version requests re-evaluation.

The cursor holds the champion version of each watched model; only a change of
those requests runs (one per benchmark dataset partition), keyed by the new
versions so that a repeated evaluation of the same change does nothing.
"""

import json

import dagster as dg

from mlflow.exceptions import MlflowException

from jobs import evaluate_job
from medgraph.settings import redact_uri
from medgraph.tracking import MODELS, RegistryUnavailableError, registry_waits_limited
from platform_assets.partitions import DATASETS
from resources import MlflowResource

# Every registered model evaluation loads by alias (the SFT policy plays Graph-R1 while no GRPO policy is champion).
WATCHED_MODELS = tuple(model.name for model in MODELS.values())


@dg.sensor(job=evaluate_job, minimum_interval_seconds=120, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Requests evaluation of all methods when a champion alias moves to a new version.")
def champion_sensor(context: dg.SensorEvaluationContext, mlflow_tracking: MlflowResource) -> dg.SensorResult:
    tracking = mlflow_tracking.tracking()
    try:
        with registry_waits_limited():  # the CLI's short waits: a registry that is down skips the tick
            champions = {name: tracking.champion_version(name) for name in WATCHED_MODELS}
    except (MlflowException, RegistryUnavailableError) as error:
        reason = redact_uri(str(error)).splitlines()[0][:400]
        return dg.SensorResult(skip_reason=f"MLflow registry unavailable, the next tick asks again: {reason}")
    previous = json.loads(context.cursor) if context.cursor else {}
    changed = {name: version for name, version in champions.items()
               if version is not None and previous.get(name) != version}
    if not changed:
        return dg.SensorResult(skip_reason="no champion alias moved", cursor=json.dumps(champions, sort_keys=True))
    versions = ",".join(f"{name}=v{champions[name]}" for name in WATCHED_MODELS if champions[name])
    context.log.info(f"new champions: {changed}")
    requests = [dg.RunRequest(run_key=f"{versions}:{dataset}", partition_key=dataset,
                              tags={"medgraph/champions": versions})
                for dataset in DATASETS.get_partition_keys()]
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(champions, sort_keys=True))
