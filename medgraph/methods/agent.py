"""The shared agent loop: many questions advance in lockstep, one batched model call per step.

Each method writes one question's run as a generator (an *episode*) that
reads top to bottom like a single-question agent: it yields a `Generate`
request when it needs the model and a `ToolCall` when it needs a tool, and
receives the completion or the tool's output back. `run_lockstep` drives a
batch of episodes: it first runs every pending tool call, grouped by tool so
that each tool is called once with a list of arguments (the retriever is
batched), and then answers every pending model request with ONE
`llm.generate` call. Questions that are finished drop out; a question that
is ahead (already answering while others still retrieve) simply shares the
next call. This is what makes evaluation several times faster than one
question at a time on a CPU, and what a vLLM server needs to be used well.

`answer_call` is every method's final answer call: when that reply holds no
readable answer (cut at its token budget, or written in no form the parser
reads), the model is asked once more, briefly, for the answer alone (a
recorded step "final_answer"). For a multiple-choice item that second call is
constrained to the option tags (`GenerationConfig.choices`, vLLM's
`guided_choice`), so a budget or a format slip does not decide the answer; the
share of questions that needed it is reported (`answer_retry_rate`) beside
the parse failures, which are what is left unreadable in the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from medgraph.llm.base import ChatModel, Completion, Conversation, GenerationConfig, assistant, user
from medgraph.methods.common import (
    FinalReply,
    MethodResult,
    Step,
    answer_instruction,
    parse_answer,
    step_from_completion,
)
from medgraph.qa.item import QaItem

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Generate:
    """Ask the model to continue one conversation (optionally with HIIM graph tokens)."""

    conversation: Conversation
    config: GenerationConfig
    graph_tokens: Tensor | None = None
    answering: bool = False  # the answering call: the reader answers it when one is given (`run_lockstep`)


@dataclass(frozen=True)
class ToolCall:
    """Run `tool` on `argument`. `tool` takes a list of arguments and returns one output each,
    so the calls of all questions in a step are one call."""

    tool: Callable[[list[Any]], list[Any]]
    argument: Any


@dataclass(frozen=True)
class ToolOutput:
    value: Any
    latency_s: float  # wall time of the batched tool call


Request = Generate | ToolCall
Episode = Generator[Request, Any, MethodResult]


# --------------------------------------------------------------------------- the final answer

# Neither a token budget nor a format slip may decide the answer: a reply without a readable answer is
# asked once more for the answer alone, with a budget that fits an answer tag and little else.
CUT_OFF_NOTE = "Your reply was cut off at the length limit. Reply with only the final answer."
UNREADABLE_NOTE = "Your reply did not state the final answer in the form asked. Reply with only the final answer."
FINAL_ANSWER_TOKENS = 24


def answer_choices(item: QaItem) -> tuple[str, ...]:
    """The replies a final-answer call may give: one answer tag per option letter of a multiple-choice
    item; none (free text) for a short answer."""
    return tuple(f"<answer>{letter}</answer>" for letter in item.options)


def answer_call(item: QaItem, conversation: Conversation, config: GenerationConfig, steps: list[Step],
                graph_tokens: Tensor | None = None, arguments: dict[str, object] | None = None,
                retrieved_ids: Sequence[str] = ()) -> Generator[Request, Any, FinalReply]:
    """Ask for the final answer (a step "answer"), and once more if the reply holds no readable answer."""
    completion = yield Generate(conversation, config, graph_tokens, answering=True)
    step = step_from_completion(len(steps), "answer", completion, arguments)
    step.retrieved_ids = list(retrieved_ids)
    steps.append(step)
    return (yield from complete_final_answer(item, conversation, completion, config, steps, completion.text,
                                             graph_tokens))


def complete_final_answer(item: QaItem, conversation: Conversation, completion: Completion,
                          config: GenerationConfig, steps: list[Step], reply: str | None,
                          graph_tokens: Tensor | None = None,
                          answering: bool = True) -> Generator[Request, Any, FinalReply]:
    """The final reply: `reply` (what the method reads its answer from, None for no answer) when an answer
    can be read from it; otherwise the same conversation, `completion`'s reply and a request for only the
    answer go to the model once more (a step "final_answer", constrained to the option tags for a
    multiple-choice item) and that reply counts.

    `conversation` is what `completion` answered (without the reply); `answering`: the second call goes to
    the reader (False where the agent's own model answers, as Graph-R1's policy does).
    """
    if reply is not None and parse_answer(reply, item) is not None:
        return FinalReply(reply)
    cut = completion.finish_reason == "length"
    note = CUT_OFF_NOTE if cut else UNREADABLE_NOTE
    retry = [*conversation, assistant(completion.text), user(f"{note}\n{answer_instruction(item)}")]
    again = yield Generate(retry, config.but(max_new_tokens=FINAL_ANSWER_TOKENS, choices=answer_choices(item),
                                             stop=()), graph_tokens, answering=answering)
    readable = parse_answer(again.text, item) is not None
    why = (f"the answer reply was cut at {config.max_new_tokens} tokens without an answer" if cut
           else "no readable answer in the reply")
    steps.append(step_from_completion(len(steps), "final_answer", again,
                                      notes=f"{why}: asked once more" + ("" if readable else "; still no readable answer")))
    return FinalReply(again.text, truncated=cut, extra_answer_call=True)


# --------------------------------------------------------------------------- driving episodes


def run_lockstep(episodes: Sequence[Episode], llm: ChatModel, reader: ChatModel | None = None) -> list[MethodResult]:
    """Drive the episodes to completion together; results in the order of `episodes`. With a `reader`, the
    answering calls (`Generate.answering`) go to it and every other call to `llm`."""
    results: list[MethodResult | None] = [None] * len(episodes)
    pending: dict[int, Request] = {}
    for i, episode in enumerate(episodes):
        _advance(episodes, i, None, pending, results, first=True)
    while pending:
        _run_tools(episodes, pending, results)
        _run_model(episodes, pending, results, llm, reader)
    return [r for r in results if r is not None]


def _advance(episodes: Sequence[Episode], i: int, value: object, pending: dict[int, Request],
             results: list[MethodResult | None], first: bool = False) -> None:
    """Send `value` into episode i; record its next request, or its result when it is done."""
    try:
        request = next(episodes[i]) if first else episodes[i].send(value)
    except StopIteration as done:
        pending.pop(i, None)
        results[i] = done.value
        return
    if not isinstance(request, Generate | ToolCall):
        raise TypeError(f"an episode yielded {type(request).__name__}; expected Generate or ToolCall")
    pending[i] = request


def _run_tools(episodes: Sequence[Episode], pending: dict[int, Request], results: list[MethodResult | None]) -> None:
    """Run tool calls (each tool once over all its arguments) until every episode waits for the model."""
    while True:
        by_tool: dict[Callable, list[int]] = {}
        for i, request in pending.items():
            if isinstance(request, ToolCall):
                by_tool.setdefault(request.tool, []).append(i)
        if not by_tool:
            return
        for tool, ids in by_tool.items():
            started = time.perf_counter()
            outputs = tool([pending[i].argument for i in ids])
            latency = time.perf_counter() - started
            if len(outputs) != len(ids):
                raise RuntimeError(f"tool {tool!r} returned {len(outputs)} outputs for {len(ids)} calls")
            for i, output in zip(ids, outputs):
                _advance(episodes, i, ToolOutput(output, latency), pending, results)


def _run_model(episodes: Sequence[Episode], pending: dict[int, Request], results: list[MethodResult | None],
               llm: ChatModel, reader: ChatModel | None = None) -> None:
    """One batched `generate` per distinct decoding config and model (a method uses one config per step)."""
    by_call: dict[tuple[GenerationConfig, bool], list[int]] = {}
    for i, request in pending.items():
        if isinstance(request, Generate):
            by_call.setdefault((request.config, reader is not None and request.answering), []).append(i)
    for (config, to_reader), ids in by_call.items():
        requests = [pending[i] for i in ids]
        tokens = [r.graph_tokens for r in requests]
        model = (reader if to_reader else None) or llm
        completions: list[Completion] = model.generate(
            [r.conversation for r in requests], config,
            graph_tokens=tokens if any(t is not None for t in tokens) else None,
        )
        for i, completion in zip(ids, completions, strict=True):
            _advance(episodes, i, completion, pending, results)
