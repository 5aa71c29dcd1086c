"""Credentials come only from the environment or Secrets Manager and never land in logs, metadata, MLflow
params/tags, reports or dbt's files. Canary values are planted, the platform runs, every output is scanned."""

import json
import time
import uuid
from pathlib import Path

import boto3
import dagster as dg
import pytest
from conftest import REPO_ROOT
from test_monitoring import result_row, summary_row

from medgraph.eval.evaluate import write_partition
from medgraph.s3 import SecretValueError
from medgraph.settings import load_settings
from platform_assets import evaluation, kg, umls
from resources import build_resources
from resources.warehouse import S3Access

CANARY_KEY_ID = "AKIACANARY0MEDGRAPH7"
CANARY_SECRET = "canary-s3-secret-Zq81xWv0pLk"
CANARY_LLM_KEY = "canary-llm-api-key-Pp93Tt"
CANARIES = (CANARY_KEY_ID, CANARY_SECRET, CANARY_LLM_KEY)


@pytest.fixture
def secret_env(s3_server: str, aws_env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """A bucket and a Secrets Manager secret with the lake's keys on the loopback server, and the settings
    that point the platform at them. Only the secret's *id* is configuration."""
    bucket = f"medgraph-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    secret_id = f"medgraph/lake-keys-{uuid.uuid4().hex[:6]}"
    boto3.client("secretsmanager", endpoint_url=s3_server).create_secret(
        Name=secret_id, SecretString=json.dumps({"aws_access_key_id": CANARY_KEY_ID,
                                                 "aws_secret_access_key": CANARY_SECRET}))
    monkeypatch.setenv("AWS_ENDPOINT_URL_SECRETS_MANAGER", s3_server)  # boto3's own per-service endpoint
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("MEDGRAPH_LLM_API_KEY", CANARY_LLM_KEY)
    return {"MEDGRAPH_HOME": str(tmp_path / "home"), "MEDGRAPH_PROFILE": "tiny",
            "MEDGRAPH_LAKE": f"s3://{bucket}/lake", "MEDGRAPH_S3_ENDPOINT_URL": s3_server,
            "MEDGRAPH_AWS_SECRET_ID": secret_id, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "MEDGRAPH_MLFLOW_ARTIFACTS": f"s3://{bucket}/mlflow",
            "MEDGRAPH_LLM": "openai:qwen2.5-7b-instruct@http://127.0.0.1:9/v1", "bucket": bucket}


def scan(paths: list[Path], texts: list[str]) -> list[str]:
    """Where any canary occurs: file paths (bytes, any format) and labelled texts."""
    found = []
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            data = file.read_bytes()
            found += [f"{file}: {c}" for c in CANARIES if c.encode() in data]
    for i, text in enumerate(texts):
        found += [f"text {i}: {c}" for c in CANARIES if c in text]
    return found


@pytest.mark.slow
def test_no_secret_reaches_logs_metadata_mlflow_reports_or_dbt_files(
        secret_env: dict[str, str], synthetic_release: Path, tmp_path: Path, capfd, caplog):
    started = time.time()
    env = {**secret_env, "MEDGRAPH_UMLS_DIR": str(synthetic_release)}
    resources = build_resources(load_settings(env))
    # The lake's keys really are the secret's (and the resource config holds only the secret's id).
    warehouse = resources["warehouse"].get_warehouse()
    assert (warehouse.lake.options.key_id, warehouse.lake.options.secret) == (CANARY_KEY_ID, CANARY_SECRET)
    config_dump = json.dumps({k: getattr(r, "model_dump", dict)() for k, r in resources.items()}, default=str)
    assert not scan([], [config_dump, repr(warehouse)])

    # Evaluation tables on the S3 lake, for the report.
    write_partition(warehouse, "eval_a2rag_summary", "kg", [summary_row("a2rag", 3.0, 1200, 90)])
    write_partition(warehouse, "eval_a2rag_results", "kg", [result_row("a2rag", "q1", steps=3)])

    (tmp_path / "dagster_home").mkdir()
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster_home"))
    result = dg.materialize([*umls.umls_tables, kg.kg_dbt_models, evaluation.evaluation_report,
                             *[c for c in evaluation.eval_checks if "eval_a2rag" in str(c.check_keys)]],
                            resources=resources, instance=instance, raise_on_error=False)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    report = result.asset_materializations_for_node("eval__evaluation_report")[0]
    assert (tmp_path / "home" / "reports" / "report.html").is_file()

    events = [json.dumps(dg.serialize_value(e), default=str) for e in instance.all_logs(result.run_id)]
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    mlflow_texts = [json.dumps({"params": r.data.params, "tags": r.data.tags})
                    for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert mlflow_texts, "the report logged an MLflow run"
    s3 = boto3.client("s3", endpoint_url=env["MEDGRAPH_S3_ENDPOINT_URL"])
    artifacts = [s3.get_object(Bucket=env["bucket"], Key=o["Key"])["Body"].read().decode("utf-8", "replace")
                 for o in s3.list_objects_v2(Bucket=env["bucket"], Prefix="")["Contents"]
                 if o["Key"].endswith((".md", ".html", ".json"))]
    assert any("a2rag" in a for a in artifacts), "the report reached MLflow's S3 artifact store"
    dbt_files = [p for p in (REPO_ROOT / "dbt" / "target").glob("kg_dbt_models-*") if p.stat().st_mtime >= started]
    assert dbt_files, "dbt wrote its logs and artifacts for this run"
    out, err = capfd.readouterr()
    leaks = scan([tmp_path / "dagster_home", tmp_path / "home", tmp_path / "mlflow.db", *dbt_files],
                 [*events, *mlflow_texts, *artifacts, repr(report.metadata), out, err, caplog.text])
    assert not leaks, leaks
    assert scan([], [f"key={CANARY_SECRET}"]), "the scan itself finds a planted value"


def test_a_bad_secret_is_a_clear_error_that_names_the_secret_not_its_value(secret_env: dict[str, str]):
    sm = boto3.client("secretsmanager", endpoint_url=secret_env["MEDGRAPH_S3_ENDPOINT_URL"])
    sm.create_secret(Name="medgraph/half", SecretString=json.dumps({"aws_access_key_id": CANARY_KEY_ID}))
    with pytest.raises(SecretValueError, match=r"'medgraph/half' lacks the keys \['aws_secret_access_key'\]") as e:
        S3Access(credentials_secret_id="medgraph/half").client()
    assert CANARY_KEY_ID not in str(e.value)
    with pytest.raises(SecretValueError, match="cannot read secret 'medgraph/absent'"):
        S3Access(credentials_secret_id="medgraph/absent").client()


URL_PASSWORD = "canary-url-password-Hh27Kq"


def test_a_password_in_a_url_setting_is_kept_nowhere_in_the_home_and_not_shown(
        synthetic_release: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 58 case 1: with a password in the LLM's URL (or any URL setting), a launch kept it in Dagster's
    run storage (the run's snapshot holds the resources' config) and the UI's resource page showed it. Now
    such settings reach Dagster by variable name only; the run still reads the value."""
    from dagster._core.remote_representation.external_data import RepositorySnap

    from medgraph.home import HomeLayout

    home = tmp_path / "home"
    env = {"MEDGRAPH_HOME": str(home), "MEDGRAPH_PROFILE": "tiny", "MEDGRAPH_UMLS_DIR": str(synthetic_release),
           "MEDGRAPH_LLM": f"openai:served@http://bob:{URL_PASSWORD}@127.0.0.1:9/v1",
           "MEDGRAPH_S3_ENDPOINT_URL": f"http://bob:{URL_PASSWORD}@127.0.0.1:9",
           "MLFLOW_TRACKING_URI": f"http://bob:{URL_PASSWORD}@127.0.0.1:9"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    resources = build_resources()
    assert resources["llm"].spec == dg.EnvVar("MEDGRAPH_LLM")
    definitions = dg.Definitions(assets=[*umls.umls_tables], resources=resources)
    ui_snapshot = json.dumps(dg.serialize_value(RepositorySnap.from_def(definitions.get_repository_def())))
    assert "MEDGRAPH_LLM" in ui_snapshot and URL_PASSWORD not in ui_snapshot

    (tmp_path / "dagster_home").mkdir()
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster_home"))
    result = dg.materialize([*umls.umls_tables], resources=resources, instance=instance)
    assert result.success
    events = [json.dumps(dg.serialize_value(e), default=str) for e in instance.all_logs(result.run_id)]
    stored = [p.read_bytes() for root in (tmp_path / "dagster_home", home) for p in root.rglob("*") if p.is_file()]
    assert stored and HomeLayout(home).warehouse.is_file()
    assert not [e for e in events if URL_PASSWORD in e]
    assert not [i for i, data in enumerate(stored) if URL_PASSWORD.encode() in data]
    assert URL_PASSWORD in resources["llm"].process_config_and_initialize().spec  # what a run's resource reads
