"""MLflow conventions against a real SQLite registry: experiments, registration, champion gate."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

from medgraph.tracking import Tracking, metric_name


@pytest.fixture
def tracking(mlflow_db: Path, tmp_path: Path) -> Tracking:
    return Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))


def log_candidate(tracking: Tracking, auc: float) -> str:
    """Train nothing, log a tiny torch model with a validation metric, register it."""
    model = torch.nn.Linear(4, 1)
    with tracking.start_run("gat_model", tags={"dagster/run_id": "test"}) as run:
        mlflow.log_metric("val_auc", auc)
        model_uri = tracking.log_torch_model(model)
    assert run.info.experiment_id == tracking.experiment_id("gat_model")
    return tracking.register(model_uri, "medgraph-test")


def test_champion_moves_only_when_a_candidate_is_better(tracking: Tracking):
    first = log_candidate(tracking, 0.80)
    assert tracking.promote_if_better("medgraph-test", first, "val_auc").promoted
    worse = log_candidate(tracking, 0.70)
    decision = tracking.promote_if_better("medgraph-test", worse, "val_auc")
    assert not decision.promoted and tracking.champion_version("medgraph-test") == first
    assert decision.champion_value == pytest.approx(0.80) and decision.candidate_value == pytest.approx(0.70)
    run = tracking.client.get_run(tracking.client.get_model_version("medgraph-test", worse).run_id)
    assert run.data.tags["champion_gate.promoted"] == "false"
    assert run.data.metrics["champion_gate.champion_val_auc"] == pytest.approx(0.80)

    tie = log_candidate(tracking, 0.80)
    assert not tracking.promote_if_better("medgraph-test", tie, "val_auc").promoted
    better = log_candidate(tracking, 0.90)
    assert tracking.promote_if_better("medgraph-test", better, "val_auc").promoted
    assert tracking.champion_version("medgraph-test") == better


def test_models_load_by_alias_and_artifacts_stay_under_the_root(tracking: Tracking, tmp_path: Path):
    version = log_candidate(tracking, 0.5)
    tracking.promote_if_better("medgraph-test", version, "val_auc")
    mlflow.set_tracking_uri(tracking.tracking_uri)
    model = mlflow.pytorch.load_model(tracking.model_uri("medgraph-test"))
    assert isinstance(model, torch.nn.Linear)
    assert any((tmp_path / "artifacts" / "gat_model").rglob("MLmodel"))
    assert not Path("mlruns").exists() or not any(Path("mlruns").iterdir())


def test_lower_is_better_metrics_and_missing_metric_errors(tracking: Tracking):
    first = log_candidate(tracking, 0.3)
    tracking.promote_if_better("medgraph-test", first, "val_auc", higher_is_better=False)
    second = log_candidate(tracking, 0.2)
    assert tracking.promote_if_better("medgraph-test", second, "val_auc", higher_is_better=False).promoted
    with pytest.raises(KeyError, match="no metric 'val_loss'"):
        tracking.promote_if_better("medgraph-test", second, "val_loss")


def test_statistic_labels_become_valid_metric_names(tracking: Tracking):
    """The routing class "KG+Text" made MLflow reject the whole batch of an A2RAG evaluation (seen in `make demo`)."""
    names = ["a2rag/routing_share/KG+Text", "a2rag/routing_share/KG-only", "sema-rag/rounds_share/2", "a2rag/p50 latency: s.1"]
    with tracking.start_run("eval_a2rag"):
        with pytest.raises(mlflow.exceptions.MlflowException, match="KG\\+Text"):
            mlflow.log_metrics({names[0]: 0.5})
        mlflow.log_metrics({metric_name(n): 0.5 for n in names})
        logged = set(mlflow.get_run(mlflow.active_run().info.run_id).data.metrics)
    assert logged == {"a2rag/routing_share/KG_Text", *names[1:]}
