"""The one chat interface every method, baseline and trainer talks to.

A call takes a *batch* of conversations and returns one completion each: an
agent step over a batch of questions is one call, which is what makes batched
evaluation several times faster than one question at a time on a CPU and
what a vLLM server needs to be used well. Backends differ in how they run the
model (transformers in-process, an OpenAI-compatible server, Bedrock,
llama.cpp); they all count tokens and time the call the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Self

if TYPE_CHECKING:  # torch is only needed by backends that take graph tokens
    from torch import Tensor

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


Conversation = Sequence[Message]


def system(content: str) -> Message:
    return Message("system", content)


def user(content: str) -> Message:
    return Message("user", content)


def assistant(content: str) -> Message:
    return Message("assistant", content)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings of one batched call (the same for every conversation in it)."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # generation ends at the first of these; the stop string is not returned
    seed: int | None = 0  # sampling seed (ignored when greedy); None: not reproducible
    # A closed set of replies (e.g. the option tags of a multiple-choice answer): decoding is constrained
    # to produce exactly one of them, as vLLM's `guided_choice` does. Backends that cannot constrain
    # decoding (llama.cpp, Bedrock) generate freely and the caller parses what comes back.
    choices: tuple[str, ...] = ()
    # A regular expression the whole reply must match (the `regex` module's syntax), as vLLM's `guided_regex`: the
    # in-process backend decodes, at each step, the token the model ranks first among those that keep the reply a
    # prefix of a match, and ends it once it matches and nothing may follow. A bounded pattern (repetitions with
    # an upper count) bounds the reply. Backends that cannot constrain decoding generate freely.
    pattern: str | None = None

    def but(self, **changes: object) -> GenerationConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class Completion:
    """One generated reply and what it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float  # wall time of the batched call this completion came from
    finish_reason: Literal["stop", "length", "error"] = "stop"
    model: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    # Prompt tokens the model actually ran: fewer than `prompt_tokens` (the tokens sent) when a prefix
    # cache served the start of the prompt. None (backends that do not know): `prompt_tokens`.
    prompt_tokens_computed: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens_computed is None:
            object.__setattr__(self, "prompt_tokens_computed", self.prompt_tokens)


class ChatModel(abc.ABC):
    """A chat LLM that completes batches of conversations."""

    name: str  # what reports and MLflow tags call the model (e.g. "smollm2-135m-instruct")
    # Whether `generate` accepts HIIM graph tokens (soft tokens in the LLM's input-embedding
    # space). Only in-process backends can; the others serve text and A2RAG falls back to it.
    supports_graph_tokens: bool = False
    hidden_size: int | None = None  # input-embedding width, where the backend knows it

    @abc.abstractmethod
    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[Tensor | None] | None = None) -> list[Completion]:
        """One completion per conversation, in order.

        `graph_tokens[i]` (n_i, hidden_size), when given, is placed after the text of
        conversation i's last user message (before the chat template's end-of-turn and
        generation prompt), as `inputs_embeds`. Backends without support raise
        `GraphTokensUnsupported`.
        """

    def complete(self, conversation: Conversation, config: GenerationConfig | None = None) -> Completion:
        return self.generate([conversation], config)[0]

    def clear_prefix_cache(self) -> None:
        """Forget cached prompts (the in-process backend's prefix cache); nothing to do elsewhere."""

    def close(self) -> None:
        """Release whatever the backend holds (a model in memory, an HTTP session)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GraphTokensUnsupported(TypeError):
    """The backend serves text only (an HTTP server, Bedrock): graph tokens cannot be passed."""


def check_no_graph_tokens(model: ChatModel, graph_tokens: Sequence[object] | None) -> None:
    if graph_tokens is not None and any(t is not None for t in graph_tokens):
        raise GraphTokensUnsupported(f"{model.name}: this backend takes text only, not HIIM graph tokens")


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cut `text` at the earliest stop string; whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
