"""MLflow conventions of the platform (DESIGN.md "MLflow conventions").

One experiment per asset (`medgraph/<asset>`), runs tagged with where they came
from, models registered by name, and the `champion` alias moved only when a
candidate beats the current champion on a validation metric — the decision
and both numbers are logged on the candidate's run. Evaluation finds models by
alias (`models:/medgraph-gat@champion`), never by version number.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)

CHAMPION = "champion"


# MLflow accepts only alphanumerics, `_ - . : /` and spaces in metric names; our statistics use labels such as
# the routing class "KG+Text", which would fail the whole log_metrics batch.
_UNSAFE_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def metric_name(name: str) -> str:
    """`name` with every character MLflow rejects replaced by `_` ("a2rag/routing_share/KG+Text" -> "..._KG_Text")."""
    return _UNSAFE_METRIC_CHARS.sub("_", name)


@dataclass(frozen=True)
class Promotion:
    """The outcome of a champion gate."""

    model: str
    candidate_version: str
    candidate_value: float
    champion_version: str | None
    champion_value: float | None
    metric: str
    promoted: bool

    @property
    def reason(self) -> str:
        if self.champion_version is None:
            return f"no champion yet: version {self.candidate_version} becomes champion"
        verdict = "beats" if self.promoted else "does not beat"
        return (f"candidate v{self.candidate_version} {self.metric}={self.candidate_value:.4f} {verdict} "
                f"champion v{self.champion_version} {self.metric}={self.champion_value:.4f}")

    def as_metadata(self) -> dict[str, object]:
        return {
            "champion_gate_metric": self.metric,
            "candidate_version": self.candidate_version,
            "candidate_value": self.candidate_value,
            "previous_champion_version": self.champion_version or "none",
            "previous_champion_value": self.champion_value if self.champion_value is not None else float("nan"),
            "promoted": self.promoted,
            "decision": self.reason,
        }


@dataclass(frozen=True)
class Tracking:
    """A tracking server (any MLflow URI) and where new experiments keep their artifacts."""

    tracking_uri: str
    artifact_root: str  # a local directory or an s3:// prefix

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def experiment_id(self, asset: str) -> str:
        """The experiment `medgraph/<asset>`, created with its artifacts under `artifact_root`."""
        name = f"medgraph/{asset}"
        client = self.client
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = self.artifact_root.rstrip("/") + "/" + asset
        # A URI (s3://..., and mlflow-artifacts:/... of a server that proxies artifacts) goes to MLflow as it
        # is; anything else is a local directory.
        if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", location):
            Path(location).mkdir(parents=True, exist_ok=True)
            location = Path(location).resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            return client.get_experiment_by_name(name).experiment_id

    @contextmanager
    def start_run(self, asset: str, run_name: str | None = None,
                  tags: Mapping[str, str] | None = None) -> Iterator[mlflow.ActiveRun]:
        """A run in the asset's experiment, the active MLflow run inside the block."""
        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        with mlflow.start_run(experiment_id=self.experiment_id(asset), run_name=run_name,
                              tags=dict(tags or {})) as run:
            yield run

    def log_torch_model(self, model: object, name: str = "model", code_paths: list[str] | None = None,
                        metadata: Mapping[str, object] | None = None) -> str:
        """Log a PyTorch module in the active run; returns its model URI.

        Pickle format (our modules hold PyG layers that the traced pt2 export
        does not cover) with explicit requirements: letting MLflow infer them
        re-imports the model in a subprocess and costs ~30 s per call.
        """
        import importlib.metadata

        requirements = [f"torch=={importlib.metadata.version('torch').split('+')[0]}"]
        for package in ("torch-geometric", "numpy"):
            try:
                requirements.append(f"{package}=={importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                pass
        info = mlflow.pytorch.log_model(model, name=name, serialization_format="pickle",
                                        pip_requirements=requirements, code_paths=code_paths,
                                        metadata=dict(metadata or {}))
        return info.model_uri

    def register(self, model_uri: str, name: str, tags: Mapping[str, str] | None = None) -> str:
        """Register a logged model (`runs:/<id>/<path>` or `models:/m-...`) as a new version."""
        mlflow.set_registry_uri(self.tracking_uri)
        version = mlflow.register_model(model_uri, name, tags=dict(tags or {}))
        return str(version.version)

    def metric_of(self, name: str, version: str, metric: str) -> float:
        run_id = self.client.get_model_version(name, version).run_id
        value = self.client.get_run(run_id).data.metrics.get(metric)
        if value is None:
            raise KeyError(f"run {run_id} of {name} v{version} has no metric {metric!r}")
        return float(value)

    def champion_version(self, name: str, alias: str = CHAMPION) -> str | None:
        try:
            return str(self.client.get_model_version_by_alias(name, alias).version)
        except MlflowException:
            return None

    def promote_if_better(self, name: str, version: str, metric: str, higher_is_better: bool = True,
                          alias: str = CHAMPION) -> Promotion:
        """Move `alias` to `version` only if it beats the current holder on `metric`
        (strictly: a tie keeps the champion). Logs the decision on the candidate's run."""
        client = self.client
        candidate = self.metric_of(name, version, metric)
        current = self.champion_version(name, alias)
        current_value = self.metric_of(name, current, metric) if current is not None else None
        if current is None:
            promoted = True
        elif current == version:
            promoted = False
        else:
            promoted = candidate > current_value if higher_is_better else candidate < current_value
        promotion = Promotion(name, version, candidate, current, current_value, metric, promoted)
        if promoted:
            client.set_registered_model_alias(name, alias, version)
        run_id = client.get_model_version(name, version).run_id
        client.set_tag(run_id, "champion_gate.decision", promotion.reason)
        client.set_tag(run_id, "champion_gate.promoted", str(promoted).lower())
        client.log_metric(run_id, f"champion_gate.candidate_{metric}", candidate)
        if current_value is not None:
            client.log_metric(run_id, f"champion_gate.champion_{metric}", current_value)
        client.set_model_version_tag(name, version, "champion_gate", promotion.reason)
        log.info("%s: %s", name, promotion.reason)
        return promotion

    def model_uri(self, name: str, alias: str = CHAMPION) -> str:
        return f"models:/{name}@{alias}"
