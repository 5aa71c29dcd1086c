"""Optional in-process llama.cpp backend: runs a GGUF file as it is (quantized, no conversion).

For CPU machines where the quantized kernels beat float32 transformers. Needs
the extra `llamacpp` (`pip install 'medgraph[llamacpp]'`); PyPI ships
llama-cpp-python as source only, so that install compiles llama.cpp. The
conversations of a batch run one after another: llama-cpp-python has no
batched chat completion.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from medgraph.llm.base import (
    ChatModel,
    Completion,
    Conversation,
    GenerationConfig,
    check_no_graph_tokens,
    truncate_at_stop,
)

INSTALL_HINT = "pip install 'medgraph[llamacpp]'  (from a checkout: pip install -e '.[llamacpp]')"


def import_llama_cpp() -> object:
    """The `llama_cpp` module, or an ImportError that says which extra to install."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError(f"the llama.cpp backend needs llama-cpp-python: install it with `{INSTALL_HINT}`") from error
    return llama_cpp


class LlamaCppChatModel(ChatModel):
    """A GGUF model run by llama.cpp in this process (the chat template is the one stored in the file)."""

    def __init__(self, gguf: str | Path, *, name: str | None = None, n_ctx: int = 4096,
                 n_threads: int | None = None, n_gpu_layers: int = 0):
        llama_cpp = import_llama_cpp()
        gguf = Path(gguf).expanduser().resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {gguf}")
        self.name = name or gguf.stem
        self.gguf = gguf
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads or os.cpu_count(),
                                   n_gpu_layers=n_gpu_layers, verbose=False)
        self.hidden_size = self.llm.n_embd()

    def __repr__(self) -> str:
        return f"LlamaCppChatModel({self.name!r}, gguf={str(self.gguf)!r})"

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[object] | None = None) -> list[Completion]:
        """One chat completion per conversation, sequentially."""
        check_no_graph_tokens(self, graph_tokens)
        config = config or GenerationConfig()
        started = time.perf_counter()
        replies = []
        for conversation in conversations:
            options: dict[str, object] = {"max_tokens": config.max_new_tokens, "temperature": config.temperature,
                                          "top_p": config.top_p, "top_k": 0, "stop": list(config.stop) or None}
            if config.seed is not None:
                options["seed"] = config.seed
            replies.append(self.llm.create_chat_completion(messages=[m.as_dict() for m in conversation], **options))
        latency = time.perf_counter() - started
        completions = []
        for reply in replies:
            choice = reply["choices"][0]
            text, stopped = truncate_at_stop(choice["message"].get("content") or "", config.stop)
            usage = reply.get("usage") or {}
            completions.append(Completion(
                text=text,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
                latency_s=latency,
                finish_reason="stop" if stopped or choice.get("finish_reason") != "length" else "length",
                model=self.name,
            ))
        return completions

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and hasattr(llm, "close"):
            llm.close()
