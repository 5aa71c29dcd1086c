"""The trained Graph-R1 policy in MLflow: log it, load it, find the champion.

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
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow

from medgraph.llm.base import ChatModel, GenerationConfig, Message
from medgraph.llm.hf import TransformersChatModel

log = logging.getLogger(__name__)

POLICY_MODEL_NAME = "medgraph-graph-r1-policy"
POLICY_GATE_METRIC = "valid_accuracy"
CHECKPOINT_ARTIFACT = "checkpoint"


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


def load_policy(model_uri: str) -> TransformersChatModel:
    """The chat model of a logged policy (`models:/medgraph-graph-r1-policy@champion`, `models:/m-...`)."""
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().chat


def download_checkpoint(model_uri: str, out_dir: Path) -> Path:
    """The policy's Hugging Face checkpoint directory, copied under `out_dir` (to train from it)."""
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(out_dir)))
    found = [p.parent for p in local.rglob("config.json") if p.parent.parent.name == "artifacts"]
    if len(found) != 1:
        raise FileNotFoundError(f"{model_uri}: expected one checkpoint under artifacts/, found {len(found)}")
    return found[0]


def load_champion_policy(tracking_uri: str | None = None, home: Path | None = None) -> ChatModel | None:
    """The registered champion policy as a chat model, or None when nothing is registered.

    `tracking_uri` defaults to the settings' (MLFLOW_TRACKING_URI, else the SQLite file under
    `home`, default MEDGRAPH_HOME).
    """
    from medgraph.settings import load_settings
    from medgraph.tracking import Tracking

    env = dict(os.environ)
    if home is not None:
        env["MEDGRAPH_HOME"] = str(home)
    settings = load_settings(env)
    tracking = Tracking(tracking_uri or settings.mlflow_tracking_uri, str(settings.home / "artifacts"))
    version = tracking.champion_version(POLICY_MODEL_NAME)
    if version is None:
        log.info("no %s@champion in %s", POLICY_MODEL_NAME, tracking.tracking_uri)
        return None
    mlflow.set_tracking_uri(tracking.tracking_uri)
    mlflow.set_registry_uri(tracking.tracking_uri)
    chat = load_policy(tracking.model_uri(POLICY_MODEL_NAME))
    log.info("Graph-R1 policy: %s v%s (%s)", POLICY_MODEL_NAME, version, chat.name)
    return chat

