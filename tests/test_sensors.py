"""Sensors evaluated directly with build_sensor_context and real resources."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import dagster as dg
import pytest

from resources import UmlsReleaseResource
from sensors.release import umls_release_sensor


def evaluate(release: UmlsReleaseResource, cursor: str | None) -> dg.SensorResult:
    context = dg.build_sensor_context(cursor=cursor, resources={"release": release})
    return umls_release_sensor(context)


def test_release_sensor_requests_ingestion_only_when_the_release_changes(tiny_release: Path, tmp_path: Path):
    release_dir = Path(shutil.copytree(tiny_release, tmp_path / "META"))
    release = UmlsReleaseResource(home=str(tmp_path), umls_dir=str(release_dir))

    first = evaluate(release, None)
    assert len(first.run_requests) == 1 and first.cursor
    assert first.run_requests[0].run_key == f"umls-release-{first.cursor}"

    unchanged = evaluate(release, first.cursor)
    assert not unchanged.run_requests and "unchanged" in unchanged.skip_reason.skip_message

    (release_dir / "MRDEF.RRF").touch()  # a new mtime, the same content: still nothing to do
    assert not evaluate(release, first.cursor).run_requests

    with open(release_dir / "MRDEF.RRF", "a", encoding="utf-8") as handle:
        handle.write("C0000001|A0000001|AT0000001||MSH|A new definition.|N||\n")
    changed = evaluate(release, first.cursor)
    assert len(changed.run_requests) == 1 and changed.cursor != first.cursor


def test_release_sensor_skips_while_the_release_is_missing(tmp_path: Path):
    missing = UmlsReleaseResource(home=str(tmp_path), umls_dir=str(tmp_path / "not-there"))
    result = evaluate(missing, None)
    assert not result.run_requests and "not a directory" in result.skip_reason.skip_message


def register_gat(tracking, auc: float) -> str:
    import mlflow
    import torch

    with tracking.start_run("gat_model"):
        mlflow.log_metric("valid_roc_auc", auc)
        uri = tracking.log_torch_model(torch.nn.Linear(2, 1))
    version = tracking.register(uri, "medgraph-gat")
    tracking.promote_if_better("medgraph-gat", version, "valid_roc_auc")
    return version


def test_champion_sensor_skips_the_tick_soon_when_the_registry_is_down(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """Issue 58: with an unreachable MLflow the tick ran into Dagster's 60 s sensor deadline and kept the code server
    busy for minutes. It now waits as the CLI does, skips with the reason, keeps its cursor and the env as it was."""
    import time

    from resources import MlflowResource
    from sensors.registry import champion_sensor

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    resource = MlflowResource(tracking_uri="http://127.0.0.1:1", artifact_root=str(tmp_path / "artifacts"))
    started = time.monotonic()
    result = champion_sensor(dg.build_sensor_context(cursor='{"medgraph-gat": "3"}',
                                                     resources={"mlflow_tracking": resource}))
    assert time.monotonic() - started < 40
    assert not result.run_requests and result.cursor is None  # the cursor is kept: nothing was learnt
    message = result.skip_reason.skip_message
    assert message.startswith("MLflow registry unavailable, the next tick asks again: ") and "127.0.0.1:1" in message
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_champion_sensor_requests_evaluations_only_when_an_alias_moves(mlflow_db: Path, tmp_path: Path):
    from platform_assets.partitions import DATASETS
    from resources import MlflowResource
    from sensors.registry import champion_sensor

    resource = MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}", artifact_root=str(tmp_path / "artifacts"))
    tracking = resource.tracking()

    def evaluate_registry(cursor: str | None) -> dg.SensorResult:
        return champion_sensor(dg.build_sensor_context(cursor=cursor, resources={"mlflow_tracking": resource}))

    empty = evaluate_registry(None)
    assert not empty.run_requests  # nothing registered: nothing to evaluate

    register_gat(tracking, 0.80)
    first = evaluate_registry(empty.cursor)
    assert sorted(r.partition_key for r in first.run_requests) == sorted(DATASETS.get_partition_keys())
    assert all("medgraph-gat=v1" in r.run_key for r in first.run_requests)

    assert not evaluate_registry(first.cursor).run_requests  # doing nothing requests nothing
    register_gat(tracking, 0.70)  # worse: registered, but the alias stays on v1
    assert not evaluate_registry(first.cursor).run_requests
    register_gat(tracking, 0.90)
    better = evaluate_registry(first.cursor)
    assert better.run_requests and all("medgraph-gat=v3" in r.run_key for r in better.run_requests)
