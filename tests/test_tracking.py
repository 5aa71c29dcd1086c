"""MLflow conventions against a real SQLite registry: experiments, registration, champion gates."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

from medgraph.settings import load_settings
from medgraph.tracking import Baseline, Gate, RegisteredModel, Tracking, checkpoint_dir, metric_name

UNTRAINED = Baseline("untrained model", {"val_auc": 0.5})


@pytest.fixture
def tracking(mlflow_db: Path, tmp_path: Path) -> Tracking:
    return Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))


def log_candidate(tracking: Tracking, auc: float | None = None, **metrics: float) -> str:
    """Train nothing, log a tiny torch model with validation metrics, register it."""
    model = torch.nn.Linear(4, 1)
    with tracking.start_run("gat_model", tags={"dagster/run_id": "test"}) as run:
        mlflow.log_metrics({**({"val_auc": auc} if auc is not None else {}), **metrics})
        model_uri = tracking.log_torch_model(model)
    assert run.info.experiment_id == tracking.experiment_id("gat_model")
    return tracking.register(model_uri, "medgraph-test")


def test_champion_moves_only_when_a_candidate_is_better(tracking: Tracking):
    first = log_candidate(tracking, 0.80)
    assert tracking.promote_if_better("medgraph-test", first, "val_auc", baseline=UNTRAINED).promoted
    worse = log_candidate(tracking, 0.70)
    decision = tracking.promote_if_better("medgraph-test", worse, "val_auc", baseline=UNTRAINED)
    assert not decision.promoted and tracking.champion_version("medgraph-test") == first
    assert decision.champion_value == pytest.approx(0.80) and decision.candidate_value == pytest.approx(0.70)
    assert decision.as_metadata()["gate_reference"] == f"champion v{first}"
    run = tracking.client.get_run(tracking.client.get_model_version("medgraph-test", worse).run_id)
    assert run.data.tags["champion_gate.promoted"] == "false"
    assert run.data.metrics["champion_gate.champion_val_auc"] == pytest.approx(0.80)
    assert run.data.metrics["champion_gate.baseline_val_auc"] == pytest.approx(0.5)  # logged, not compared

    tie = log_candidate(tracking, 0.80)
    assert not tracking.promote_if_better("medgraph-test", tie, "val_auc", baseline=UNTRAINED).promoted
    better = log_candidate(tracking, 0.90)
    assert tracking.promote_if_better("medgraph-test", better, "val_auc", baseline=UNTRAINED).promoted
    assert tracking.champion_version("medgraph-test") == better


def test_a_gain_within_the_gates_noise_keeps_the_champion(tracking: Tracking):
    """The GAT retrained on unchanged data scores 1e-7 apart run to run: that must not move `champion` (and
    with it every evaluation the champion sensor would request)."""
    gate = Gate("val_auc", min_gain=1e-6)
    first = log_candidate(tracking, 0.9364626)
    assert tracking.promote_if_better("medgraph-test", first, gate, baseline=UNTRAINED).promoted
    rerun = log_candidate(tracking, 0.9364627)
    decision = tracking.promote_if_better("medgraph-test", rerun, gate, baseline=UNTRAINED)
    assert not decision.promoted and "does not beat the reference" in decision.reason
    better = log_candidate(tracking, 0.9364646)
    assert tracking.promote_if_better("medgraph-test", better, gate, baseline=UNTRAINED).promoted
    lower_is_better = Gate("val_nll", higher_is_better=False, min_gain=0.01)
    assert not lower_is_better.better(1.995, 2.0) and lower_is_better.better(1.98, 2.0)


def test_a_first_candidate_must_strictly_beat_the_baseline_it_starts_from(tracking: Tracking):
    worse = log_candidate(tracking, 0.40)
    decision = tracking.promote_if_better("medgraph-test", worse, Gate("val_auc"), baseline=UNTRAINED)
    assert not decision.promoted and tracking.champion_version("medgraph-test") is None
    metadata = decision.as_metadata()
    assert metadata["baseline_name"] == "untrained model" and metadata["baseline_value"] == pytest.approx(0.5)
    assert metadata["candidate_value"] == pytest.approx(0.40) and metadata["previous_champion_version"] == "none"
    assert "baseline untrained model" in metadata["decision"] and "val_auc=0.4000 vs 0.5000" in metadata["decision"]
    run = tracking.client.get_run(tracking.client.get_model_version("medgraph-test", worse).run_id)
    assert run.data.tags["champion_gate.baseline"] == "untrained model"
    assert run.data.metrics["champion_gate.baseline_val_auc"] == pytest.approx(0.5)
    assert run.data.metrics["champion_gate.candidate_val_auc"] == pytest.approx(0.40)
    version_tags = tracking.client.get_model_version("medgraph-test", worse).tags
    assert version_tags["champion_gate.baseline"] == "untrained model" and version_tags["champion_gate.promoted"] == "false"

    equal = log_candidate(tracking, 0.50)
    assert not tracking.promote_if_better("medgraph-test", equal, "val_auc", baseline=UNTRAINED).promoted
    missing = tracking.promote_if_better("medgraph-test", log_candidate(tracking, 0.9), "val_auc",
                                         baseline=Baseline("not measured", {}))
    assert not missing.promoted and "no reference value for val_auc" in missing.reason
    better = log_candidate(tracking, 0.60)
    assert tracking.promote_if_better("medgraph-test", better, "val_auc", baseline=UNTRAINED).promoted
    assert tracking.champion_version("medgraph-test") == better


def test_a_two_metric_gate_needs_the_first_better_and_the_second_not_worse(tracking: Tracking):
    gate = Gate("valid_reward", not_worse=("valid_accuracy",))
    start = Baseline("SFT start", {"valid_reward": 0.175, "valid_accuracy": 0.125})
    # The demo's first GRPO policy: reward below its SFT start, accuracy 0.
    demo = log_candidate(tracking, valid_reward=0.157, valid_accuracy=0.0)
    assert not tracking.promote_if_better("medgraph-test", demo, gate, baseline=start).promoted
    format_only = log_candidate(tracking, valid_reward=0.20, valid_accuracy=0.0)
    decision = tracking.promote_if_better("medgraph-test", format_only, gate, baseline=start)
    assert not decision.promoted and "valid_accuracy got worse" in decision.reason
    assert decision.compared == {"valid_reward": (pytest.approx(0.20), 0.175), "valid_accuracy": (0.0, 0.125)}
    good = log_candidate(tracking, valid_reward=0.20, valid_accuracy=0.125)
    assert tracking.promote_if_better("medgraph-test", good, gate, baseline=start).promoted
    # Against the champion, the same rule.
    less_accurate = log_candidate(tracking, valid_reward=0.30, valid_accuracy=0.0)
    assert not tracking.promote_if_better("medgraph-test", less_accurate, gate, baseline=start).promoted
    best = log_candidate(tracking, valid_reward=0.30, valid_accuracy=0.25)
    assert tracking.promote_if_better("medgraph-test", best, gate, baseline=start).promoted
    assert tracking.champion_version("medgraph-test") == best


def test_an_at_most_bound_holds_whatever_the_reference(tracking: Tracking):
    # The reader adapter's gate: read better with the evidence, and do not answer better without it.
    gate = Gate("valid_oracle_accuracy", at_most=(("valid_no_evidence_gain", 0.10),))
    base = Baseline("base reader", {"valid_oracle_accuracy": 0.25, "valid_no_evidence_gain": 0.0})
    memorised = log_candidate(tracking, valid_oracle_accuracy=0.9, valid_no_evidence_gain=0.25)
    decision = tracking.promote_if_better("medgraph-test", memorised, gate, baseline=base)
    assert not decision.promoted and "valid_no_evidence_gain = 0.2500 > 0.1" in decision.reason
    reads = log_candidate(tracking, valid_oracle_accuracy=0.5, valid_no_evidence_gain=0.10)
    assert tracking.promote_if_better("medgraph-test", reads, gate, baseline=base).promoted
    # Against the champion: the bound is still absolute (the champion's own gain is not the reference).
    better_but_memorised = log_candidate(tracking, valid_oracle_accuracy=0.6, valid_no_evidence_gain=0.125)
    assert not tracking.promote_if_better("medgraph-test", better_but_memorised, gate, baseline=base).promoted
    not_better = log_candidate(tracking, valid_oracle_accuracy=0.5, valid_no_evidence_gain=-0.1)
    assert not tracking.promote_if_better("medgraph-test", not_better, gate, baseline=base).promoted
    assert tracking.champion_version("medgraph-test") == reads


def test_models_load_by_alias_and_artifacts_stay_under_the_root(tracking: Tracking, tmp_path: Path):
    version = log_candidate(tracking, 0.6)
    tracking.promote_if_better("medgraph-test", version, "val_auc", baseline=UNTRAINED)
    mlflow.set_tracking_uri(tracking.tracking_uri)
    model = mlflow.pytorch.load_model(tracking.model_uri("medgraph-test"))
    assert isinstance(model, torch.nn.Linear)
    assert any((tmp_path / "artifacts" / "gat_model").rglob("MLmodel"))
    assert not Path("mlruns").exists() or not any(Path("mlruns").iterdir())


def test_lower_is_better_metrics_and_missing_metric_errors(tracking: Tracking):
    text_only = Baseline("text-only answer", {"val_auc": 0.35})
    first = log_candidate(tracking, 0.3)
    assert tracking.promote_if_better("medgraph-test", first, "val_auc", higher_is_better=False,
                                      baseline=text_only).promoted
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


def test_register_and_gate_reports_the_version_its_decision_and_the_champion(tracking: Tracking):
    model = RegisteredModel("test", "medgraph-test", Gate("val_auc"), "a test model")

    def train(auc: float):
        with tracking.start_run("gat_model") as run:
            mlflow.log_metrics({"val_auc": auc})
            uri = tracking.log_torch_model(torch.nn.Linear(4, 1))
            return run.info.run_id, tracking.register_and_gate(uri, model, UNTRAINED, tags={"dagster/run_id": "r"})

    run_id, first = train(0.8)
    metadata = first.as_metadata()
    assert list(metadata) == ["mlflow_run_id", "model_uri", "registered_model", "model_version", "champion_uri",
                              *first.promotion.as_metadata()]
    assert [metadata[k] for k in list(metadata)[:5]] == [run_id, "models:/medgraph-test/1", "medgraph-test", "1",
                                                         "models:/medgraph-test@champion"]
    assert metadata["decision"] == first.promotion.reason and metadata["baseline_name"] == "untrained model"
    assert first.promotion.promoted and first.data_version == "medgraph-test@champion=v1"
    _, worse = train(0.7)  # registered, not promoted: the data version stays the champion's
    assert (worse.version, worse.promotion.promoted, worse.data_version) == ("2", False, "medgraph-test@champion=v1")


def test_tracking_from_settings_honours_every_mlflow_setting(tmp_path: Path):
    home = {"MEDGRAPH_HOME": str(tmp_path)}
    assert Tracking.from_settings(load_settings(home)) == Tracking(f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                                   str(tmp_path / "artifacts"))
    remote = load_settings({**home, "MLFLOW_TRACKING_URI": "http://mlflow:5000",
                            "MEDGRAPH_MLFLOW_ARTIFACTS": "s3://bucket/mlflow"})
    assert Tracking.from_settings(remote) == Tracking("http://mlflow:5000", "s3://bucket/mlflow")


def test_a_checkpoint_folder_belongs_to_one_configuration_inputs_and_start(tmp_path: Path):
    class Run:  # what checkpoint_dir reads of an MLflow run: its tags
        def __init__(self, **tags: str):
            self.data = type("RunData", (), {"tags": {"dagster/run_id": "x", **tags}})()

    run = Run(**{"data_version/kg/kg_edges": "abc"})
    folder = checkpoint_dir(tmp_path, run, {"steps": 3, "device": "cuda", "progress": True})
    assert folder.parent == tmp_path
    assert folder == checkpoint_dir(tmp_path, Run(**{"data_version/kg/kg_edges": "abc", "other": "tag"}),
                                    {"steps": 3, "device": "cpu", "progress": False})  # how, not what, is trained
    assert folder != checkpoint_dir(tmp_path, run, {"steps": 4})
    assert folder != checkpoint_dir(tmp_path, Run(**{"data_version/kg/kg_edges": "def"}), {"steps": 3})
    assert folder != checkpoint_dir(tmp_path, run, {"steps": 3}, sft="models:/medgraph-graph-r1-sft/1")
