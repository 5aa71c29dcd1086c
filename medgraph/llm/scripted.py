"""A chat model whose replies are written by a program: control-logic tests and replays.

Methods are tested with it (tool routing, loop termination, parse failures)
without an LLM's randomness; every method also runs end to end with a real
model elsewhere. Token counts are whitespace word counts, so cost reporting
paths are exercised too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from medgraph.llm.base import (
    ChatModel,
    Completion,
    Conversation,
    GenerationConfig,
    check_no_graph_tokens,
    truncate_at_stop,
)

Reply = Callable[[Conversation], str]


class ScriptedChatModel(ChatModel):
    """Replies from `reply(conversation)`; records every conversation it was asked to complete."""

    def __init__(self, reply: Reply | Sequence[str], name: str = "scripted"):
        if callable(reply):
            self._reply = reply
        else:
            queue = list(reply)

            def from_queue(_: Conversation) -> str:
                if not queue:
                    raise RuntimeError("ScriptedChatModel ran out of scripted replies")
                return queue.pop(0)

            self._reply = from_queue
        self.name = name
        self.calls: list[list[Conversation]] = []  # one entry per batched call
        self.configs: list[GenerationConfig] = []  # ... and its decoding settings

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[object] | None = None) -> list[Completion]:
        check_no_graph_tokens(self, graph_tokens)
        config = config or GenerationConfig()
        started = time.perf_counter()
        self.calls.append([list(c) for c in conversations])
        self.configs.append(config)
        texts = [self._reply(conversation) for conversation in conversations]
        latency = time.perf_counter() - started
        completions = []
        for conversation, text in zip(conversations, texts, strict=True):
            text, stopped = truncate_at_stop(text, config.stop)
            words = text.split()
            finish = "stop"
            if len(words) > config.max_new_tokens:
                text, finish = " ".join(words[: config.max_new_tokens]), "length"
            completions.append(Completion(
                text=text,
                prompt_tokens=sum(len(m.content.split()) for m in conversation),
                completion_tokens=min(len(words), config.max_new_tokens),
                latency_s=latency,
                finish_reason=finish if not stopped else "stop",
                model=self.name,
            ))
        return completions
