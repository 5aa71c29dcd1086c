"""Model assets in-process with real resources: DuckDB warehouse, SQLite MLflow registry, PyTorch."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import mlflow
import pytest
import torch
from conftest import copy_warehouse

from medgraph.gnn.model import GatModel
from medgraph.storage import Warehouse
from medgraph.tracking import GAT_MODEL
from platform_assets.models import ReaderAdapterConfig, gat_model
from resources import MlflowResource, TrainingResource, WarehouseResource


@pytest.fixture
def home(gat_warehouse: Warehouse, tmp_path: Path) -> Path:
    copy_warehouse(gat_warehouse, tmp_path / "home")
    return tmp_path / "home"


@pytest.fixture
def resources(home: Path, mlflow_db: Path) -> dict[str, dg.ConfigurableResource]:
    return {"warehouse": WarehouseResource(home=str(home)),
            "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                              artifact_root=str(home / "artifacts")),
            "training": TrainingResource(profile="tiny")}


def train(resources: dict, instance: dg.DagsterInstance, **config: object) -> dict[str, dg.MetadataValue]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny GAT's small sparse ops; set back after: it used to stay for later modules
    try:
        result = dg.materialize([gat_model], resources=resources, instance=instance, run_config=dg.RunConfig(
            ops={"models__gat_model": {"config": {"profile": "tiny", **config}}}))
    finally:
        torch.set_num_threads(previous)
    (materialization,) = result.asset_materializations_for_node("models__gat_model")
    return materialization.metadata


def test_gat_model_must_beat_the_untrained_gat_then_the_champion(resources: dict, home: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    import torch.nn.functional as F

    instance = dg.DagsterInstance.ephemeral()
    # A first candidate worse than no training at all: trained with the labels flipped (real triples as false).
    loss = F.binary_cross_entropy_with_logits
    with monkeypatch.context() as patch:
        patch.setattr(F, "binary_cross_entropy_with_logits", lambda logits, labels, **kw: loss(logits, 1 - labels, **kw))
        sabotaged = train(resources, instance, epochs=1, steps_per_epoch=25)
    assert sabotaged["promoted"].value is False and sabotaged["model_version"].value == "1"
    assert sabotaged["previous_champion_version"].value == "none"
    assert sabotaged["baseline_name"].value.startswith("untrained GAT")
    assert sabotaged["candidate_value"].value < sabotaged["baseline_value"].value
    assert sabotaged["baseline_value"].value == sabotaged["valid_roc_auc_untrained"].value
    tracking = resources["mlflow_tracking"].tracking()
    assert tracking.champion_version(GAT_MODEL.name) is None

    first = train(resources, instance, epochs=3, steps_per_epoch=25)
    assert first["promoted"].value is True and first["model_version"].value == "2"
    # The same untrained network on the same validation edges: the baseline does not depend on training.
    assert first["baseline_value"].value == sabotaged["baseline_value"].value
    assert first["candidate_value"].value > first["baseline_value"].value
    assert first["test_roc_auc"].value > 0.7  # well above chance (0.5); the exact value is in the run
    run_id = first["mlflow_run_id"].value

    run = tracking.client.get_run(run_id)
    assert {"valid_roc_auc", "test_roc_auc", "test_mrr", "test_hits_at_10", "valid_accuracy",
            "valid_roc_auc_untrained", "champion_gate.baseline_valid_roc_auc"} <= set(run.data.metrics)
    assert run.data.tags["champion_gate.baseline"].startswith("untrained GAT")
    assert run.data.tags["dagster/asset_key"] == "models/gat_model"
    assert {"data_version/kg/kg_edges", "data_version/umls_release"} <= set(run.data.tags)
    assert tracking.client.get_experiment(run.info.experiment_id).name == "medgraph/gat_model"
    artifacts = {a.path for a in tracking.client.list_artifacts(run_id)}
    assert {"training_curve.png", "training.json"} <= artifacts
    assert not any((home / "checkpoints" / "gat_model").glob("*/last.pt"))  # cleaned after success

    worse = train(resources, instance, epochs=1, steps_per_epoch=1, seed=1)
    assert worse["promoted"].value is False and worse["model_version"].value == "3"
    assert worse["candidate_value"].value < worse["previous_champion_value"].value
    assert worse["gate_reference"].value == "champion v2"
    assert tracking.champion_version(GAT_MODEL.name) == "2"
    # The data version follows the champion, so a run that loses the gate changes nothing downstream.
    records = instance.fetch_materializations(dg.AssetKey(["models", "gat_model"]), limit=2).records
    versions = {r.asset_materialization.tags["dagster/data_version"] for r in records}
    assert versions == {f"{GAT_MODEL.name}@champion=v2"}

    mlflow.set_tracking_uri(tracking.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{GAT_MODEL.name}@champion")
    assert isinstance(model, GatModel) and model.relation_names and model.feature_table
    assert model.relation_codes(model.relation_names[:2]).tolist() == [0, 1]


def test_a_failed_training_run_registers_nothing_and_is_marked_failed(resources: dict,
                                                                     monkeypatch: pytest.MonkeyPatch):
    import medgraph.gnn.train as train_module

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated crash after the first epoch")

    monkeypatch.setattr(train_module, "evaluate", crash)  # training runs, then the validation pass fails
    result = dg.materialize([gat_model], resources=resources, raise_on_error=False, run_config=dg.RunConfig(
        ops={"models__gat_model": {"config": {"profile": "tiny", "epochs": 1, "steps_per_epoch": 5}}}))
    assert not result.success
    tracking = resources["mlflow_tracking"].tracking()
    assert tracking.champion_version(GAT_MODEL.name) is None
    (run,) = tracking.client.search_runs([tracking.experiment_id("gat_model")])
    assert run.info.status == "FAILED"


def test_reader_adapter_config_overrides_only_what_it_names():
    """The asset's run config reaches the reader's examples and fit; what it leaves out keeps the profile's value."""
    default = ReaderAdapterConfig().reader_config("demo")
    config = ReaderAdapterConfig(no_evidence_share=0.3, layouts={"kg_facts": 1.0}, steps=5,
                                 one_hop_copies=3, baited_copies=2).reader_config("demo")
    assert (config.no_evidence_share, config.layouts, config.fit.steps, config.one_hop_copies,
            config.baited_copies) == (0.3, (("kg_facts", 1.0),), 5, 3, 2)
    assert (config.gold_share, config.fit.lr, config.valid_items) == (default.gold_share, default.fit.lr,
                                                                      default.valid_items)
    assert default.no_evidence_share == 0.1
