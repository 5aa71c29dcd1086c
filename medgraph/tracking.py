"""MLflow conventions of the platform (docs/ARCHITECTURE.md "MLflow conventions").

One experiment per asset (`medgraph/<asset>`), runs tagged with where they came
from, models registered by name, and the `champion` alias moved only when a
candidate beats the current champion on a validation metric — the decision
and both numbers are logged on the candidate's run. Evaluation finds models by
alias (`models:/medgraph-gat@champion`), never by version number.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from medgraph.settings import Settings, redact_uri, redacted_error, redacting_errors

log = logging.getLogger(__name__)

CHAMPION = "champion"
# `data_version/<asset key>` tags on a run: the data version of each input it read (set by the Dagster resource).
DATA_VERSION_TAG = "data_version/"


# MLflow accepts only alphanumerics, `_ - . : /` and spaces in metric names; our statistics use labels such as
# the routing class "KG+Text", which would fail the whole log_metrics batch.
_UNSAFE_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def metric_name(name: str) -> str:
    """`name` with every character MLflow rejects replaced by `_` ("a2rag/routing_share/KG+Text" -> "..._KG_Text")."""
    return _UNSAFE_METRIC_CHARS.sub("_", name)


@dataclass(frozen=True)
class Gate:
    """What a candidate must do to become champion: strictly improve `metric`, for each metric of
    `not_worse` (same direction) not get worse, and keep each metric of `at_most` at or below its bound
    (an absolute limit, whatever the reference: e.g. the reader adapter's gain without evidence)."""

    metric: str
    higher_is_better: bool = True
    not_worse: tuple[str, ...] = ()
    at_most: tuple[tuple[str, float], ...] = ()
    # A gain on `metric` of at most this is no gain: a metric that moves from run to run of the same training
    # (float summation order) would otherwise promote a retrained but unchanged model by chance.
    min_gain: float = 0.0

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, *self.not_worse, *(name for name, _ in self.at_most))

    def better(self, candidate: float, reference: float) -> bool:
        gain = candidate - reference if self.higher_is_better else reference - candidate
        return gain > self.min_gain

    def not_worse_than(self, candidate: float, reference: float) -> bool:
        return candidate >= reference if self.higher_is_better else candidate <= reference


@dataclass(frozen=True)
class RegisteredModel:
    """A model the platform registers in MLflow: its registered name and the gate its `champion` alias
    moves by. Evaluation finds each by `<name>@champion`."""

    key: str
    name: str
    gate: Gate
    description: str


# GAT training's float sums can vary in order from run to run: before the CPU fit ran on deterministic kernels
# three runs of one home and commit gave valid ROC-AUC 0.93646263 / 0.93646269 / 0.93646273, and on CUDA (fast
# kernels, AMP) it still varies, so a gain under 1e-6 is that noise, not a better model.
GAT_MODEL = RegisteredModel(
    "gat", "medgraph-gat", Gate("valid_roc_auc", min_gain=1e-6),
    "the GAT pretrained by triple classification (models/gat_model); vs the same GAT untrained")
HIIM_PROJECTOR_MODEL = RegisteredModel(
    "hiim_projector", "medgraph-hiim-projector", Gate("valid_answer_nll", higher_is_better=False),
    "HIIM's W_proj (models/hiim_projector); vs A2RAG's text-only answer")
# Both Graph-R1 gates: the reward is the finer signal on few questions; accuracy guards against a format-only gain.
GRAPH_R1_SFT_MODEL = RegisteredModel(
    "graph_r1_sft", "medgraph-graph-r1-sft", Gate("valid_reward", not_worse=("valid_accuracy",)),
    "the cold-start SFT policy (models/graph_r1_sft); vs the base model")
GRAPH_R1_POLICY_MODEL = RegisteredModel(
    "graph_r1_policy", "medgraph-graph-r1-policy", Gate("valid_reward", not_worse=("valid_accuracy",)),
    "the GRPO policy (models/graph_r1_policy); vs its SFT start validated at step 0")

# The reader must read better with the gold facts shown and must not answer better than the base reader without
# them (by more than 0.10): that gain could only come from memorising the KG (medgraph/rl/reader.py).
READER_ADAPTER_MODEL = RegisteredModel(
    "reader_adapter", "medgraph-reader-adapter",
    Gate("valid_oracle_accuracy", at_most=(("valid_no_evidence_gain", 0.10),)),
    "the reader adapted to read evidence (models/reader_adapter); vs the base reader")

# Every registered model of the platform, by key.
MODELS: dict[str, RegisteredModel] = {model.key: model for model in
                                      (GAT_MODEL, HIIM_PROJECTOR_MODEL, GRAPH_R1_SFT_MODEL, GRAPH_R1_POLICY_MODEL,
                                       READER_ADAPTER_MODEL)}


@dataclass(frozen=True)
class Baseline:
    """The starting point a candidate was trained from (untrained GAT, base model, SFT start, text-only
    answer), measured by the training code on the same validation items as the candidate. With no
    champion yet, a candidate must beat it to become champion."""

    name: str
    values: Mapping[str, float]  # gate metric -> the baseline's value


@dataclass(frozen=True)
class Promotion:
    """The outcome of a champion gate: the candidate against the champion, or, with none yet, the baseline."""

    model: str
    candidate_version: str
    candidate_value: float
    champion_version: str | None
    champion_value: float | None
    metric: str
    promoted: bool
    baseline_name: str | None = None
    baseline_value: float | None = None
    # Every gate metric: (candidate, reference) where reference is the champion's or the baseline's value.
    compared: Mapping[str, tuple[float, float | None]] = field(default_factory=dict)
    verdict: str = ""

    @property
    def reference(self) -> str:
        if self.champion_version is not None:
            return f"champion v{self.champion_version}"
        return f"baseline {self.baseline_name}" if self.baseline_name else "nothing (no champion, no baseline)"

    @property
    def reason(self) -> str:
        if self.champion_version is None and self.baseline_name is None:
            return f"no champion yet and no baseline given: version {self.candidate_version} becomes champion unchecked"
        numbers = "; ".join(f"{m}={c:.4f} vs {'n/a' if r is None else f'{r:.4f}'}"
                            for m, c, r in ((m, *v) for m, v in self.compared.items()))
        outcome = "promoted" if self.promoted else "not promoted"
        return f"candidate v{self.candidate_version} vs {self.reference}: {numbers}: {self.verdict} ({outcome})"

    def as_metadata(self) -> dict[str, object]:
        nan = float("nan")
        return {
            "champion_gate_metric": self.metric,
            "candidate_version": self.candidate_version,
            "candidate_value": self.candidate_value,
            "previous_champion_version": self.champion_version or "none",
            "previous_champion_value": self.champion_value if self.champion_value is not None else nan,
            "baseline_name": self.baseline_name or "none",
            "baseline_value": self.baseline_value if self.baseline_value is not None else nan,
            "gate_reference": self.reference,
            "promoted": self.promoted,
            "decision": self.reason,
        }


@dataclass(frozen=True)
class Registration:
    """A logged model registered as a new version and gated: what a model asset reports."""

    model: RegisteredModel
    run_id: str  # the MLflow run that logged the model
    version: str
    promotion: Promotion
    champion_version: str | None  # after the gate: `version` if it was promoted, else the previous champion

    @property
    def model_uri(self) -> str:
        return f"models:/{self.model.name}/{self.version}"

    @property
    def champion_uri(self) -> str:
        return f"models:/{self.model.name}@{CHAMPION}"

    @property
    def data_version(self) -> str:
        """`<name>@champion=v<N>`: downstream assets load the champion, so a version that does not beat it
        leaves the model asset's data version, and everything below it, unchanged."""
        return f"{self.model.name}@{CHAMPION}=v{self.champion_version}"

    def as_metadata(self) -> dict[str, object]:
        return {
            "mlflow_run_id": self.run_id,
            "model_uri": self.model_uri,
            "registered_model": self.model.name,
            "model_version": self.version,
            "champion_uri": self.champion_uri,
            **self.promotion.as_metadata(),
        }


def checkpoint_dir(root: Path, run: mlflow.entities.Run, config: Mapping[str, object], **identity: str) -> Path:
    """The folder under `root` for a training run's checkpoints, one per (settings in `config`, input data
    versions tagged on the MLflow `run`, and `identity`, e.g. the starting policy): a retry resumes its own
    interrupted run, never another's. `progress` and `device` change how a model is trained, not which."""
    inputs = {key.removeprefix(DATA_VERSION_TAG): value for key, value in run.data.tags.items()
              if key.startswith(DATA_VERSION_TAG)}
    settings = {key: value for key, value in config.items() if key not in ("progress", "device")}
    key = json.dumps({"config": settings, **identity, "inputs": inputs}, sort_keys=True, default=str)
    return Path(root) / hashlib.sha256(key.encode()).hexdigest()[:16]


# What an interactive command (`medgraph models`, `medgraph ask`) waits for an MLflow server that does not
# answer, unless the environment sets these itself. MLflow's own defaults (7 retries with backoff factor 2,
# 120 s per request) made `medgraph models list` wait ~4 minutes on a refused connection.
INTERACTIVE_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                           "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# MLflow error codes that mean "no such model / version / alias" (anything else is a real failure).
_NOT_FOUND = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"})


def limit_registry_waits(env: MutableMapping[str, str] | None = None) -> None:
    """Bound how long MLflow's HTTP client retries a server that does not answer (INTERACTIVE_HTTP_LIMITS,
    for the variables `env` does not set); for commands a person waits on."""
    env = os.environ if env is None else env
    for name, value in INTERACTIVE_HTTP_LIMITS.items():
        env.setdefault(name, value)


@contextmanager
def registry_waits_limited() -> Iterator[None]:
    """INTERACTIVE_HTTP_LIMITS (where not set) while the block runs, the environment as it was after: for a sensor
    tick, which Dagster cuts off after 60 s, inside a code server whose runs must keep MLflow's patient defaults.
    MLflow reads these variables at each request."""
    saved = {name: os.environ.get(name) for name in INTERACTIVE_HTTP_LIMITS}
    limit_registry_waits()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def registry_wait_limit(env: Mapping[str, str] | None = None) -> str:
    """How long MLflow's HTTP client waits for a server at most, as its variables in `env` set it."""
    env = os.environ if env is None else env
    timeout = int(env.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "120"))
    retries = int(env.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7"))
    backoff = int(env.get("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "2"))
    pauses = sum(backoff * 2 ** i + 1 for i in range(retries))  # urllib3's backoff plus MLflow's 1 s jitter
    return (f"{retries + 1} attempts of at most {timeout} s, about {(retries + 1) * timeout + pauses:.0f} s in all "
            f"(MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES)")


class RegistryUnavailableError(RuntimeError):
    """The MLflow tracking server / model registry did not answer."""


def _reason(error: BaseException) -> str:
    """The short cause of a request that got no answer, e.g. "[Errno 111] Connection refused", "timed out"."""
    text = str(error)
    found = re.findall(r"\[Errno -?\d+\][^'\")]*", text)
    if found:
        return found[-1].strip()
    return "timed out" if "timeout" in text.lower() or "timed out" in text.lower() else "no answer"


def _unreachable(error: BaseException) -> bool:
    """Whether an MLflow error is a request that got no answer (refused, timed out, retries spent)."""
    import requests

    seen: list[BaseException] = []
    while error is not None and error not in seen:
        if isinstance(error, requests.exceptions.RequestException):
            return True
        seen.append(error)
        error = error.__cause__ or error.__context__
    return False


def registry_call(tracking_uri: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` (an MLflow client or fluent call against `tracking_uri`) with its errors made
    fit to show: a server that does not answer is a RegistryUnavailableError naming the (redacted) URI, the
    limit it was given and what to check; any other error loses the credentials its message holds."""
    try:
        return call(*args, **kwargs)
    except Exception as error:
        if _unreachable(error):
            raise RegistryUnavailableError(
                f"the MLflow tracking server at {redact_uri(tracking_uri)} did not answer ({_reason(error)}; "
                f"{registry_wait_limit()}): check that it is running and that MLFLOW_TRACKING_URI points at it"
            ) from None
        replacement = redacted_error(error)
        if replacement is None:
            raise
        raise replacement from None


class _RegistryClient:
    """An MlflowClient whose every method call goes through `registry_call`."""

    def __init__(self, client: MlflowClient, tracking_uri: str):
        self._client, self._tracking_uri = client, tracking_uri

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        return functools.partial(registry_call, self._tracking_uri, attribute)


class ModelUnavailableError(RuntimeError):
    """A registered model whose files cannot be read (missing, moved, corrupt); the message names the model,
    its files and what to do."""


@dataclass(frozen=True)
class ModelFiles:
    """Where a registered (or logged) model's files are, as the registry says and as this process reads them."""

    uri: str  # as asked: models:/<name>@<alias>, models:/<name>/<version>, models:/m-<id>, runs:/<run>/<path>
    label: str  # e.g. "medgraph-gat v3 (models:/medgraph-gat@champion)"
    location: str  # the artifact location the registry holds (credentials redacted)
    path: Path  # a local directory holding the model's MLmodel file


def _local_path(location: str) -> Path | None:
    """The local path of an artifact location (`file://...` or a plain path); None for a remote one."""
    if location.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(location).path))
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", location):
        return None
    return Path(location)


def redacted_tags(tags: Mapping[str, object] | None) -> dict[str, str]:
    """MLflow tags with any credentials in URI-like values redacted (tags are shown in the UI and logs)."""
    return {key: redact_uri(str(value)) for key, value in (tags or {}).items()}


@dataclass(frozen=True)
class Tracking:
    """A tracking server (any MLflow URI) and where new experiments keep their artifacts."""

    tracking_uri: str
    artifact_root: str  # a local directory or an s3:// prefix

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracking:
        """MLFLOW_TRACKING_URI (default: SQLite under MEDGRAPH_HOME); artifacts under MEDGRAPH_MLFLOW_ARTIFACTS
        (e.g. s3://bucket/mlflow: MLflow then writes through boto3, with MLFLOW_S3_ENDPOINT_URL for an
        S3-compatible server), default `$MEDGRAPH_HOME/artifacts`. A tracking server started with
        --serve-artifacts needs neither: it stores artifacts itself."""
        return cls(settings.mlflow_tracking_uri, settings.mlflow_artifacts or str(settings.layout.artifacts))

    @property
    def client(self) -> MlflowClient:
        """The MLflow client of this server; its errors never show the URI's credentials, and one that gets no
        answer is a RegistryUnavailableError (`registry_call`)."""
        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        return _RegistryClient(client, self.tracking_uri)  # type: ignore[return-value]

    def experiment_id(self, asset: str) -> str:
        """The experiment `medgraph/<asset>`, created with its artifacts under `artifact_root`."""
        name = f"medgraph/{asset}"
        client = self.client
        location = self.artifact_root.rstrip("/") + "/" + asset
        # A URI (s3://..., and mlflow-artifacts:/... of a server that proxies artifacts) goes to MLflow as it
        # is; anything else is a local directory.
        if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", location):
            Path(location).mkdir(parents=True, exist_ok=True)
            location = Path(location).resolve().as_uri()
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.artifact_location != location:
                self._move_artifact_location(experiment.experiment_id, experiment.artifact_location, location)
            return experiment.experiment_id
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            return client.get_experiment_by_name(name).experiment_id

    def _move_artifact_location(self, experiment_id: str, old: str, new: str) -> None:
        """Point a local experiment of this home's SQLite registry at `new`, this process's folder for the asset,
        and each of its runs, logged models and model versions whose files are there too.

        MLflow stores absolute artifact locations and has no call to change one: in a copied MEDGRAPH_HOME
        every new run would write into the original home (and fail when that is read-only). The rows are
        rewritten in one transaction, as the warehouse's views are re-pointed at the home's own lake on open.
        A row whose files are only at the old place (an artifact root moved by a setting, not a copied home)
        keeps pointing there. A tracking server, or an artifact root that is not local, is left alone."""
        import sqlite3

        if not self.tracking_uri.startswith("sqlite:///") or _local_path(old) is None or _local_path(new) is None:
            return
        old, new = old.rstrip("/"), new.rstrip("/")
        with closing(sqlite3.connect(self.tracking_uri.removeprefix("sqlite:///"), timeout=30)) as con, con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, experiment_id))
            for table, column in (("runs", "artifact_uri"), ("logged_models", "artifact_location"),
                                  ("model_versions", "storage_location"), ("model_versions", "source")):
                rows = con.execute(f"SELECT rowid, {column} FROM {table} WHERE substr({column}, 1, ?) = ?",
                                   (len(old) + 1, old + "/")).fetchall()
                for rowid, value in rows:
                    moved = new + value[len(old):]
                    if _local_path(moved).exists():
                        con.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (moved, rowid))
        log.info("MLflow experiment %s: artifacts now under %s (was %s)", experiment_id, new, old)

    @contextmanager
    def start_run(self, asset: str, run_name: str | None = None,
                  tags: Mapping[str, str] | None = None) -> Iterator[mlflow.ActiveRun]:
        """A run in the asset's experiment, the active MLflow run inside the block."""
        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        with redacting_errors(), mlflow.start_run(experiment_id=self.experiment_id(asset), run_name=run_name,
                                                  tags=redacted_tags(tags)) as run:
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
        version = registry_call(self.tracking_uri, mlflow.register_model, model_uri, name, tags=redacted_tags(tags))
        return str(version.version)

    def metric_of(self, name: str, version: str, metric: str) -> float:
        run_id = self.client.get_model_version(name, version).run_id
        value = self.client.get_run(run_id).data.metrics.get(metric)
        if value is None:
            raise KeyError(f"run {run_id} of {name} v{version} has no metric {metric!r}")
        return float(value)

    def champion_version(self, name: str, alias: str = CHAMPION) -> str | None:
        """The version `alias` points at; None when the model or the alias does not exist (a server that does
        not answer is a RegistryUnavailableError, not "no champion")."""
        try:
            return str(self.client.get_model_version_by_alias(name, alias).version)
        except MlflowException as error:
            if error.error_code in _NOT_FOUND:
                return None
            raise

    def register_and_gate(self, model_uri: str, model: RegisteredModel, baseline: Baseline,
                          tags: Mapping[str, str] | None = None) -> Registration:
        """Register a logged model as a new version of `model`, run its champion gate against the champion
        or, with none, `baseline`, and read the champion back: every model training ends with this."""
        version = self.register(model_uri, model.name, tags)
        promotion = self.promote_if_better(model.name, version, model.gate, baseline=baseline)
        run_id = self.client.get_model_version(model.name, version).run_id
        return Registration(model, run_id, version, promotion, self.champion_version(model.name))

    def metrics_of(self, name: str, version: str) -> dict[str, float]:
        run_id = self.client.get_model_version(name, version).run_id
        return {k: float(v) for k, v in self.client.get_run(run_id).data.metrics.items()}

    def promote_if_better(self, name: str, version: str, gate: Gate | str, higher_is_better: bool = True,
                          alias: str = CHAMPION, *, baseline: Baseline | None = None) -> Promotion:
        """Move `alias` to `version` only if it passes `gate` against the current holder, or, with no holder
        yet, against `baseline` (the starting point it was trained from). Strict on the gate's metric: a tie
        keeps the champion, and a candidate that only equals its baseline does not become champion.

        The decision, every compared number and the baseline's name are logged on the candidate's run
        (`champion_gate.*` tags and metrics) and on the model version's tags. A gate given as a metric
        name is `Gate(metric, higher_is_better)`. Without a baseline and a champion the candidate is
        promoted unchecked (logged as such); every platform model passes its baseline.
        """
        gate = gate if isinstance(gate, Gate) else Gate(gate, higher_is_better)
        client = self.client
        candidate = self.metrics_of(name, version)
        if gate.metric not in candidate:
            raise KeyError(f"run of {name} v{version} has no metric {gate.metric!r}")
        current = self.champion_version(name, alias)
        champion = self.metrics_of(name, current) if current is not None else None
        if champion is not None and gate.metric not in champion:
            raise KeyError(f"run of {name} v{current} has no metric {gate.metric!r}")
        reference = champion if champion is not None else (dict(baseline.values) if baseline else None)
        compared = {m: (candidate[m], None if reference is None else reference.get(m))
                    for m in gate.metrics if m in candidate}
        promoted, verdict = self._judge(gate, compared, reference, current == version)
        promotion = Promotion(
            name, version, candidate[gate.metric], current, None if champion is None else champion[gate.metric],
            gate.metric, promoted, baseline.name if baseline else None,
            baseline.values.get(gate.metric) if baseline else None, compared, verdict)
        if promoted:
            client.set_registered_model_alias(name, alias, version)
        run_id = client.get_model_version(name, version).run_id
        tags = {"champion_gate.decision": promotion.reason, "champion_gate.promoted": str(promoted).lower(),
                "champion_gate.reference": promotion.reference,
                "champion_gate.baseline": baseline.name if baseline else "none"}
        for key, value in tags.items():
            client.set_tag(run_id, key, redact_uri(value))
        for metric, (value, _) in compared.items():
            client.log_metric(run_id, f"champion_gate.candidate_{metric}", value)
            if champion is not None and metric in champion:
                client.log_metric(run_id, f"champion_gate.champion_{metric}", champion[metric])
            if baseline is not None and metric in baseline.values:
                client.log_metric(run_id, f"champion_gate.baseline_{metric}", float(baseline.values[metric]))
        client.set_model_version_tag(name, version, "champion_gate", promotion.reason)
        client.set_model_version_tag(name, version, "champion_gate.baseline", tags["champion_gate.baseline"])
        client.set_model_version_tag(name, version, "champion_gate.promoted", tags["champion_gate.promoted"])
        log.info("%s: %s", name, promotion.reason)
        return promotion

    @staticmethod
    def _judge(gate: Gate, compared: Mapping[str, tuple[float, float | None]],
               reference: Mapping[str, float] | None, is_champion: bool) -> tuple[bool, str]:
        """(promoted, why) for the compared (candidate, reference) values of each gate metric."""
        if is_champion:
            return False, "already champion"
        if reference is None:
            return True, "no champion and no baseline"
        bounded = {name for name, _ in gate.at_most}
        missing = [m for m in gate.metrics if m not in compared or (compared[m][1] is None and m not in bounded)]
        if missing:
            return False, f"no reference value for {', '.join(missing)}"
        value, ref = compared[gate.metric]
        if not gate.better(value, ref):
            return False, f"{gate.metric} does not beat the reference"
        worse = [m for m in gate.not_worse if not gate.not_worse_than(*compared[m])]
        if worse:
            return False, f"{gate.metric} is better but {', '.join(worse)} got worse"
        over = [f"{m} = {compared[m][0]:.4f} > {bound}" for m, bound in gate.at_most if compared[m][0] > bound]
        if over:
            return False, f"{gate.metric} is better but {'; '.join(over)}"
        guards = f" and {', '.join(gate.not_worse)} not worse" if gate.not_worse else ""
        guards += "".join(f" and {m} <= {bound}" for m, bound in gate.at_most)
        return True, f"{gate.metric} beats the reference{guards}"

    def model_uri(self, name: str, alias: str = CHAMPION) -> str:
        return f"models:/{name}@{alias}"

    def _artifact_location(self, model_uri: str) -> tuple[str, str, str | None]:
        """(label, artifact location, experiment id) of a model URI, as the registry holds them."""
        client = self.client
        body = model_uri.removeprefix("models:/")
        label = model_uri
        if model_uri.startswith("models:/") and not body.startswith("m-"):
            name, _, version = body.partition("/")
            name, _, alias = name.partition("@")
            if not version and not alias:
                raise ValueError(f"{model_uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
            try:
                found = (client.get_model_version(name, version) if version
                         else client.get_model_version_by_alias(name, alias))
            except MlflowException as error:
                if error.error_code in _NOT_FOUND:
                    raise ModelUnavailableError(f"{model_uri} is not registered in {redact_uri(self.tracking_uri)} "
                                                f"({error.message})") from None
                raise
            label = f"{name} v{found.version}" + (f" ({model_uri})" if alias else "")
            source = found.source
        else:
            source = model_uri
        if source.startswith("models:/m-"):
            logged = client.get_logged_model(source.removeprefix("models:/").split("/", 1)[0])
            return label, logged.artifact_location, logged.experiment_id
        if source.startswith("runs:/"):
            run_id, _, path = source.removeprefix("runs:/").partition("/")
            run = client.get_run(run_id)
            return label, run.info.artifact_uri.rstrip("/") + ("/" + path if path else ""), run.info.experiment_id
        return label, source, None

    def _in_this_home(self, location: Path, experiment_id: str | None) -> Path | None:
        """The same files under this tracking's artifact root, when the registry names another home's: a
        copied or moved MEDGRAPH_HOME keeps its models under its own `artifacts/<asset>/...`, while its
        registry still holds the absolute paths of the home they were logged in."""
        root = _local_path(self.artifact_root) if self.artifact_root else None
        if root is None or experiment_id is None:
            return None
        experiment = self.client.get_experiment(experiment_id)
        logged_root = _local_path(experiment.artifact_location)
        if logged_root is None or not experiment.name.startswith("medgraph/"):
            return None
        try:
            relative = location.relative_to(logged_root)
        except ValueError:
            return None
        candidate = root / experiment.name.removeprefix("medgraph/") / relative
        return candidate if candidate != location else None

    @contextmanager
    def model_files(self, model_uri: str, what_to_do: str = "") -> Iterator[ModelFiles]:
        """A local directory with the files of a registered or logged model, for reading only: the home's
        own copy of them, else the folder the registry names, else (remote artifacts) a private temporary
        download that is deleted afterwards. Nothing is ever written next to the registered artifacts
        (MLflow's own `models:/` download writes `registered_model_meta` there). Files that cannot be found are
        a ModelUnavailableError that says where it looked and what to do (`what_to_do` adds the caller's way)."""
        hint = f"; {what_to_do}" if what_to_do else ""
        label, location, experiment_id = self._artifact_location(model_uri)
        shown = redact_uri(location)
        local = _local_path(location)
        if local is not None:
            own = self._in_this_home(local, experiment_id)
            path = own if own is not None and (own / "MLmodel").is_file() else local
            if not (path / "MLmodel").is_file():
                where = f"{local}" + (f" nor {own}" if own is not None else "")
                raise ModelUnavailableError(
                    f"{label}: its files are missing: no MLmodel in {where} (registered at {shown}). Restore that "
                    f"folder (a copied or moved MEDGRAPH_HOME keeps it under artifacts/), or train and register the "
                    f"model again{hint}")
            yield ModelFiles(model_uri, label, shown, path)
            return
        import tempfile

        with tempfile.TemporaryDirectory(prefix="medgraph-model-") as scratch:
            try:
                path = registry_call(self.tracking_uri, mlflow.artifacts.download_artifacts, artifact_uri=location,
                                     dst_path=scratch, tracking_uri=self.tracking_uri)
            except RegistryUnavailableError:
                raise
            except Exception as error:  # noqa: BLE001 - named with the model and what to do
                raise ModelUnavailableError(f"{label}: cannot download its files from {shown} "
                                            f"({redact_uri(str(error))}){hint}") from None
            yield ModelFiles(model_uri, label, shown, Path(path))

    def load_model(self, model_uri: str, load: Any, *, what_to_do: str = "") -> Any:
        """`load(local_dir)` over `model_files(model_uri)`; a model that cannot be read is a ModelUnavailableError
        naming the model, its files and what to do (`what_to_do` adds the caller's way around it)."""
        with self.model_files(model_uri, what_to_do) as files:
            try:
                return load(str(files.path))
            except Exception as error:  # noqa: BLE001 - a raw MlflowException / SafetensorError named nothing
                hint = f"; {what_to_do}" if what_to_do else ""
                raise ModelUnavailableError(
                    f"{files.label}: cannot load {files.path} ({type(error).__name__}: "
                    f"{redact_uri(str(error))}). Its files are damaged or incomplete: restore them, or train and "
                    f"register the model again{hint}") from None
