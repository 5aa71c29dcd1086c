"""The trained Graph-R1 policies in MLflow: log them, gate them, load them, pick the one evaluation runs.

Two registered models: the cold-start SFT policy (`medgraph-graph-r1-sft`,
gated against the base model) and the GRPO policy (`medgraph-graph-r1-policy`,
gated against its SFT start). Both gates: validation reward strictly higher
and validation accuracy not lower, on the same validation questions (the
reward is the finer signal on few questions; accuracy guards against a
format-only gain; the gates are in the registry of `medgraph.tracking`, the
baselines here). `choose_policy` says which policy a Graph-R1 method or
ablation runs with: `graph-r1` the GRPO champion, else the SFT champion, else
the base LLM; `graph-r1-sft-only` the SFT champion or nothing (skipped);
`graph-r1-no-sft` the base LLM.

A policy is an `mlflow.pyfunc` model whose one artifact is the plain Hugging
Face checkpoint directory (weights, tokenizer, chat template), and whose
loader returns a `TransformersChatModel`: `mlflow.transformers` would try to
reach the Hub for model cards and tokenizer files, which an offline platform
must not do. Requirements are given explicitly (inferring them re-imports the
model in a subprocess). `predict` answers a list of conversations, so the
model also serves from `mlflow models serve`; in-process users take the chat
model itself from `load_policy`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow

from medgraph.llm.base import ChatModel, GenerationConfig, Message
from medgraph.llm.hf import TransformersChatModel, autocast
from medgraph.methods.graph_r1 import GraphR1Env
from medgraph.qa.item import QaItem
from medgraph.rl.grpo import GrpoConfig, GrpoResult, training_curves_figure
from medgraph.rl.model import save_policy
from medgraph.rl.rollout import evaluate
from medgraph.settings import redact_uri
from medgraph.tracking import GRAPH_R1_POLICY_MODEL, GRAPH_R1_SFT_MODEL, Baseline, Tracking

log = logging.getLogger(__name__)

CHECKPOINT_ARTIFACT = "checkpoint"
VALIDATION_KEY_TAG = "validation_key"  # on a policy's run: `rollout.validation_key` of its valid_* metrics


def sft_start_baseline(metrics: Mapping[str, float], sft_uri: str) -> Baseline:
    """The GRPO gate's baseline: the SFT policy it started from, validated at step 0 (`valid_*_start`)."""
    return Baseline(f"SFT start {sft_uri}", {m: metrics[f"{m}_start"] for m in GRAPH_R1_POLICY_MODEL.gate.metrics
                                             if f"{m}_start" in metrics})


def recorded_validation(tracking: Tracking, model_uri: str, key: str) -> dict[str, float] | None:
    """The `valid_*` metrics the run that logged the registered `models:/<name>/<version>` recorded for its
    policy, if that validation has `key` (`rollout.validation_key`); else None (measure it again)."""
    name, _, version = model_uri.removeprefix("models:/").partition("/")
    if not model_uri.startswith("models:/") or not version.isdigit():
        return None
    client = tracking.client
    run = client.get_run(client.get_model_version(name, version).run_id)
    if run.data.tags.get(VALIDATION_KEY_TAG) != key:
        return None
    return {k: v for k, v in run.data.metrics.items() if k.startswith("valid_") and not k.startswith("valid_base_")}


def base_model_baseline(before: Mapping[str, float], base_name: str) -> Baseline:
    """The SFT gate's baseline: the base model on the same validation questions (`evaluate`'s keys)."""
    return Baseline(f"base model {base_name}", {m: before[m.removeprefix("valid_")]
                                                for m in GRAPH_R1_SFT_MODEL.gate.metrics
                                                if m.removeprefix("valid_") in before})


class GraphR1PolicyModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: the checkpoint artifact loaded as a chat model."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        config = dict(context.model_config or {})
        self.chat = TransformersChatModel(context.artifacts[CHECKPOINT_ARTIFACT], name=config.get("name"),
                                          device=os.environ.get("MEDGRAPH_POLICY_DEVICE", "auto"))

    def predict(self, context: mlflow.pyfunc.PythonModelContext, model_input: list[list[dict[str, str]]],
                params: dict[str, object] | None = None) -> list[str]:
        """Replies to conversations, each a list of {"role", "content"} messages; params:
        max_new_tokens, temperature, stop."""
        conversations = [[Message(m["role"], m["content"]) for m in row] for row in model_input]
        params = dict(params or {})
        config = GenerationConfig(max_new_tokens=int(params.get("max_new_tokens", 160)),
                                  temperature=float(params.get("temperature", 0.0)),
                                  stop=tuple(params.get("stop") or ()))
        return [c.text for c in self.chat.generate(conversations, config)]


def _requirements() -> list[str]:
    requirements = []
    for package in ("torch", "transformers", "safetensors", "tokenizers"):
        try:
            requirements.append(f"{package}=={importlib.metadata.version(package).split('+')[0]}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return requirements


def log_policy(checkpoint_dir: Path, name: str, metadata: Mapping[str, object] | None = None,
               artifact_path: str = "policy") -> str:
    """Log a checkpoint directory as a pyfunc policy in the active run; returns its model URI."""
    info = mlflow.pyfunc.log_model(
        name=artifact_path, python_model=GraphR1PolicyModel(),
        artifacts={CHECKPOINT_ARTIFACT: str(checkpoint_dir)}, model_config={"name": name},
        pip_requirements=_requirements(), metadata=dict(metadata or {}),
    )
    return info.model_uri


def validate(policy: TransformersChatModel, env: GraphR1Env, valid: list[QaItem], bf16: bool) -> dict[str, float]:
    """`rollout.evaluate` of `policy` on the validation questions, generating under the training's autocast."""
    with autocast(policy.device, bf16, generation=True):
        return evaluate(policy, env, valid)


def log_grpo_result(result: GrpoResult, config: GrpoConfig, policy_dir: Path, sft_uri: str) -> str:
    """Log a GRPO run's outcome in the active run (its final training metrics, the validation ones having been
    logged as measured; history; training curves; the merged policy, saved to `policy_dir`); returns the
    logged model's URI."""
    mlflow.log_metrics({k: v for k, v in result.metrics.items() if not k.startswith("valid_")}, step=config.steps)
    mlflow.log_dict({"history": result.history}, "training.json")
    mlflow.log_figure(training_curves_figure(result.history), "training_curves.png")
    return log_policy(save_policy(result.policy, policy_dir), result.policy.name, metadata={
        "sft_model_uri": sft_uri, "graph_r1_config": config.as_dict()})


# What to do when a registered policy cannot be read, besides restoring or retraining it.
_WITHOUT_POLICY = "or answer with the base LLM instead (--method graph-r1-no-sft)"


def load_policy(model_uri: str, tracking: Tracking | None = None) -> TransformersChatModel:
    """The chat model of a logged policy (`models:/medgraph-graph-r1-policy@champion`, `models:/m-...`), read
    from its files without writing anything (`Tracking.load_model`; default: the active MLflow tracking URI);
    a policy that cannot be read is a ModelUnavailableError naming it, its files and what to do."""
    tracking = tracking or Tracking(mlflow.get_tracking_uri(), "")
    return tracking.load_model(model_uri, lambda path: mlflow.pyfunc.load_model(path).unwrap_python_model().chat,
                               what_to_do=_WITHOUT_POLICY)


def download_checkpoint(model_uri: str, out_dir: Path) -> Path:
    """The policy's Hugging Face checkpoint directory, copied under `out_dir` (to train from it)."""
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(out_dir)))
    found = [p.parent for p in local.rglob("config.json") if p.parent.parent.name == "artifacts"]
    if len(found) != 1:
        raise FileNotFoundError(f"{model_uri}: expected one checkpoint under artifacts/, found {len(found)}")
    return found[0]


def load_champion_policy(tracking: Tracking, name: str = GRAPH_R1_POLICY_MODEL.name) -> ChatModel | None:
    """The registered champion of `name` (the GRPO policy by default, or GRAPH_R1_SFT_MODEL.name) as a chat
    model, or None when nothing is registered."""
    version = tracking.champion_version(name)
    if version is None:
        log.info("no %s@champion in %s", name, redact_uri(tracking.tracking_uri))
        return None
    chat = load_policy(f"models:/{name}/{version}", tracking)
    log.info("Graph-R1 policy: %s v%s (%s)", name, version, chat.name)
    return chat


# Which policy a Graph-R1 method or ablation runs with, in order of preference ("base": the base LLM).
POLICY_PREFERENCE: dict[str, tuple[str, ...]] = {
    "graph-r1-no-sft": ("base",),  # no SFT, no GRPO
    "graph-r1-sft-only": ("sft",),  # SFT, no GRPO: without an SFT champion the run is skipped, not faked
}
DEFAULT_PREFERENCE = ("grpo", "sft", "base")  # graph-r1 and its action ablations
_REGISTERED = {"grpo": (GRAPH_R1_POLICY_MODEL.name, "GRPO champion"), "sft": (GRAPH_R1_SFT_MODEL.name, "SFT champion")}


@dataclass(frozen=True)
class PolicyChoice:
    """The policy one Graph-R1 method or ablation runs with."""

    method: str
    source: str | None  # "grpo" | "sft" | "base"; None: no acceptable policy is registered (skip the method)
    model_uri: str | None  # models:/<name>/<version>; None for the base LLM
    description: str  # for lineage and results, e.g. "medgraph-graph-r1-sft v2 (SFT champion)"


def choose_policy(method: str, tracking: Tracking) -> PolicyChoice:
    """The policy `method` runs with (see POLICY_PREFERENCE), pinned to the champion's version now."""
    uri = tracking.tracking_uri
    no_database = uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists()
    preference = POLICY_PREFERENCE.get(method, DEFAULT_PREFERENCE)
    for source in preference:
        if source == "base":
            return PolicyChoice(method, "base", None, "base LLM (no SFT, no GRPO)")
        name, role = _REGISTERED[source]
        version = None if no_database else tracking.champion_version(name)  # do not create a database by asking
        if version is not None:
            return PolicyChoice(method, source, f"models:/{name}/{version}", f"{name} v{version} ({role})")
    wanted = " or ".join(f"{_REGISTERED[s][0]}@champion" for s in preference)
    return PolicyChoice(method, None, None, f"skipped: no {wanted} in {redact_uri(uri)}")


def policy_environment(model_uri: str | None, tracking: Tracking) -> dict[str, object]:
    """The Graph-R1 environment a registered policy was trained and validated in (its logged
    `graph_r1_config`, env_* fields), as GraphR1Config overrides: a policy is evaluated in the environment
    it learned (turn budget, tokens per turn, observation sizes), not the method's defaults. `actions` is
    left out (ablations set it). {} for the base LLM or a policy that records none."""
    if model_uri is None:
        return {}
    # The MLmodel file itself: mlflow.models.get_model_info also looks the logged model up in the active
    # tracking server (a default ./mlflow.db when none is set).
    metadata = tracking.load_model(model_uri, lambda path: mlflow.models.Model.load(path).metadata,
                                   what_to_do=_WITHOUT_POLICY)
    config = (metadata or {}).get("graph_r1_config") or {}
    return {key.removeprefix("env_"): tuple(value) if isinstance(value, list) else value
            for key, value in config.items() if key.startswith("env_") and key != "env_actions"}


def load_chosen_policy(choice: PolicyChoice, tracking: Tracking) -> ChatModel | None:
    """The chat model of a choice; None for the base LLM (and for a skipped method)."""
    if choice.model_uri is None:
        return None
    return load_policy(choice.model_uri, tracking)
