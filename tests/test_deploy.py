"""deploy/: the production instance on a real PostgreSQL, an MLflow server on it, and the launcher configs."""

# No `from __future__ import annotations`: an asset defined here resolves its resource annotations at runtime.
import json
import shutil
from pathlib import Path

import dagster as dg
import mlflow
import pytest
import yaml
from conftest import REPO_ROOT
from servers import mlflow_server, postgres_server

from platform_assets import umls
from resources import MlflowResource, UmlsReleaseResource, WarehouseResource

PRODUCTION = REPO_ROOT / "deploy" / "production"
ECS_ENV = {"MEDGRAPH_ECS_EXECUTION_ROLE_ARN": "arn:aws:iam::123456789012:role/exec",
           "MEDGRAPH_ECS_TASK_ROLE_ARN": "arn:aws:iam::123456789012:role/run", "MEDGRAPH_ECS_CLUSTER": "medgraph"}


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        server.create_database("dagster")
        server.create_database("mlflow")
        yield server


@pytest.fixture
def production_instance(postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    """deploy/production/dagster.yaml as it is, its settings from the environment (pointing at the test's
    PostgreSQL), loaded the way the webserver and daemon load it."""
    for name, value in {"DAGSTER_PG_HOST": postgres.host, "DAGSTER_PG_PORT": str(postgres.port),
                        "DAGSTER_PG_USERNAME": postgres.user, "DAGSTER_PG_PASSWORD": postgres.password,
                        "DAGSTER_PG_DB": "dagster", "AWS_DEFAULT_REGION": "eu-west-1", **ECS_ENV}.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PRODUCTION / "dagster.yaml", home / "dagster.yaml")
    instance = dg.DagsterInstance.from_config(str(home))
    yield instance
    instance.dispose()


def test_production_instance_config_validates_and_uses_postgres_and_the_queue(production_instance):
    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster_aws.ecs import EcsRunLauncher
    from dagster_postgres import PostgresRunStorage

    assert isinstance(production_instance.run_storage, PostgresRunStorage)
    assert isinstance(production_instance.run_coordinator, QueuedRunCoordinator)
    assert isinstance(production_instance.run_launcher, EcsRunLauncher)
    limits = production_instance.get_concurrency_config()
    assert limits.run_queue_config.max_concurrent_runs == 8
    assert {"key": "medgraph/accelerator", "value": "gpu", "limit": 1} in \
        limits.run_queue_config.tag_concurrency_limits
    assert limits.pool_config.default_pool_limit == 1


def test_materialization_on_the_postgres_instance_with_mlflow_server_on_postgres(
        production_instance, postgres, synthetic_release: Path, tmp_path: Path):
    home = tmp_path / "home"
    with mlflow_server(postgres.url("mlflow"), tmp_path / "mlflow-artifacts") as mlflow_url:
        tracking = MlflowResource(tracking_uri=mlflow_url, artifact_root="mlflow-artifacts:/medgraph")

        @dg.asset(deps=[umls.UMLS_TABLE_KEYS[1]], pool="gpu")
        def tiny_model(context: dg.AssetExecutionContext, mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
            with mlflow_tracking.start_asset_run(context, [umls.UMLS_TABLE_KEYS[1]]) as run:
                mlflow.log_param("hidden_dim", 64)
                mlflow.log_metric("valid_roc_auc", 0.91)
                mlflow.log_dict({"weights": [0.1, 0.2]}, "model/weights.json")
            client = mlflow_tracking.tracking().client
            client.create_registered_model("medgraph-deploy-test")
            version = client.create_model_version("medgraph-deploy-test", f"{run.info.artifact_uri}/model",
                                                  run_id=run.info.run_id).version
            client.set_registered_model_alias("medgraph-deploy-test", "champion", version)
            return dg.MaterializeResult(metadata={"mlflow_run_id": run.info.run_id, "version": version})

        production_instance.event_log_storage.set_concurrency_slots("gpu", 2)
        result = dg.materialize(
            [*umls.umls_tables, tiny_model], instance=production_instance,
            resources={"warehouse": WarehouseResource(home=str(home)), "mlflow_tracking": tracking,
                       "release": UmlsReleaseResource(home=str(home), umls_dir=str(synthetic_release))})
        run_id = result.run_id
        run_tags = mlflow.MlflowClient(mlflow_url).get_run(
            result.asset_materializations_for_node("tiny_model")[0].metadata["mlflow_run_id"].value).data.tags

    # The run, its events and the pool limit are rows in PostgreSQL, not files under DAGSTER_HOME.
    assert postgres.query("dagster", f"SELECT status FROM runs WHERE run_id = '{run_id}'") == [("SUCCESS",)]
    materialized = postgres.query("dagster", "SELECT DISTINCT asset_key FROM event_logs WHERE "
                                  f"run_id = '{run_id}' AND dagster_event_type = 'ASSET_MATERIALIZATION'")
    assert {json.loads(k)[-1] for (k,) in materialized} == {"mrconso", "mrrel", "mrsty", "mrdef", "mrsab",
                                                                    "tiny_model"}
    assert production_instance.event_log_storage.get_concurrency_info("gpu").slot_count == 2
    # MLflow's runs and registry are rows in PostgreSQL too, tagged with the Dagster run and the input's version.
    assert run_tags["dagster/run_id"] == run_id and run_tags["data_version/umls/mrrel"] != "unknown"
    assert postgres.query("mlflow", "SELECT name, version FROM model_versions") == [("medgraph-deploy-test", 1)]
    assert postgres.query("mlflow", "SELECT alias, version FROM registered_model_aliases") == [("champion", 1)]
    assert postgres.query("mlflow", "SELECT value FROM params WHERE key = 'hidden_dim'") == [("64",)]
    # Artifacts went through the server (--serve-artifacts) into its destination, not into a local path
    # named after the URI.
    assert [p.name for p in (tmp_path / "mlflow-artifacts").rglob("weights.json")] == ["weights.json"]
    assert not Path("mlflow-artifacts:").exists()


def test_ecs_launcher_config_validates_against_dagster_aws_schema(monkeypatch: pytest.MonkeyPatch):
    from dagster._config import process_config
    from dagster_aws.ecs import EcsRunLauncher

    config = yaml.safe_load((PRODUCTION / "dagster.yaml").read_text())["run_launcher"]
    assert (config["module"], config["class"]) == ("dagster_aws.ecs", "EcsRunLauncher")
    for name, value in ECS_ENV.items():
        monkeypatch.setenv(name, value)
    processed = process_config(EcsRunLauncher.config_type(), config["config"])
    assert processed.success, [e.message for e in processed.errors]
    broken = {**config["config"], "gpu_task_definition": "medgraph-run-gpu"}  # not a launcher field
    assert not process_config(EcsRunLauncher.config_type(), broken).success


def test_gpu_jobs_carry_the_launcher_tags_that_select_the_gpu_task_definition():
    from jobs import gpu_run_tags

    ecs = gpu_run_tags({"MEDGRAPH_GPU_RUN_TAGS": str(PRODUCTION / "ecs" / "gpu_run_tags.yaml")})
    assert ecs["medgraph/accelerator"] == "gpu"
    kwargs = json.loads(ecs["ecs/run_task_kwargs"])
    task_definition = json.loads((PRODUCTION / "ecs" / "gpu-task-definition.json").read_text())
    assert kwargs["taskDefinition"] == task_definition["family"]
    assert kwargs["capacityProviderStrategy"][0]["capacityProvider"]
    assert task_definition["containerDefinitions"][0]["resourceRequirements"] == [{"type": "GPU", "value": "1"}]
    assert json.loads(ecs["ecs/container_overrides"])["resourceRequirements"][0]["type"] == "GPU"

    k8s = gpu_run_tags({"MEDGRAPH_GPU_RUN_TAGS": str(REPO_ROOT / "deploy" / "kubernetes" / "gpu_run_tags.yaml")})
    limits = json.loads(k8s["dagster-k8s/config"])["container_config"]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert gpu_run_tags({}) == {"medgraph/accelerator": "gpu"}
    with pytest.raises(FileNotFoundError, match="MEDGRAPH_GPU_RUN_TAGS=/nope is not a file"):
        gpu_run_tags({"MEDGRAPH_GPU_RUN_TAGS": "/nope"})


def test_gpu_jobs_select_the_gpu_assets():
    import definitions

    for name in ("retrain_models", "evaluate_methods"):
        job = definitions.defs.resolve_job_def(name)
        assert job.tags["medgraph/accelerator"] == "gpu"


def test_kubernetes_values_and_compose_describe_the_same_services():
    values = yaml.safe_load((REPO_ROOT / "deploy" / "kubernetes" / "values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    queue = values["dagsterDaemon"]["runCoordinator"]
    assert queue["type"] == "QueuedRunCoordinator"
    assert {"key": "medgraph/accelerator", "value": "gpu", "limit": 1} in \
        queue["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"]
    compose = yaml.safe_load((PRODUCTION / "compose.yaml").read_text())
    assert {"postgres", "mlflow", "vllm", "dagster-webserver", "dagster-daemon"} <= set(compose["services"])
    assert "--backend-store-uri postgresql+psycopg2://" in compose["services"]["mlflow"]["command"]
    assert "--artifacts-destination s3://" in compose["services"]["mlflow"]["command"]
    llm = compose["services"]["dagster-webserver"]["environment"]["MEDGRAPH_LLM"]
    assert llm == "openai:qwen2.5-7b-instruct@http://vllm:8000/v1"
    assert "--served-model-name qwen2.5-7b-instruct" in compose["services"]["vllm"]["command"]


def test_every_variable_the_ecs_launcher_passes_on_is_set_in_compose():
    """The ECS run launcher copies each listed variable from the daemon's environment into run tasks and fails
    the launch when one is unset: MEDGRAPH_ENCODER was listed but not set."""
    launcher = yaml.safe_load((PRODUCTION / "dagster.yaml").read_text())["run_launcher"]["config"]
    listed = {name.split("=")[0] for name in launcher["env_vars"]}
    compose = yaml.safe_load((PRODUCTION / "compose.yaml").read_text())
    for service in ("dagster-webserver", "dagster-daemon"):
        assert listed <= set(compose["services"][service]["environment"]), service
