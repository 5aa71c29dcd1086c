"""Graph-R1: an agent that explores the knowledge graph with tagged actions (DESIGN.md "The three methods").

The environment is what GRPO rollouts reuse, so it is written for a trainer
first: `reset(item)` starts an episode, `step_batch([(state, text), ...])`
applies the policy's replies of many episodes at once (one retriever call per
action type), and the conversation in `state.messages` is the system prompt,
the question, then alternating assistant turns (the policy's tokens) and user
turns holding `<observation>...</observation>` (the environment's, which a
trainer masks out of the loss). `is_well_formed` is the r_fmt check.

A reply is `<think>...</think>` followed by exactly one action tag:
    <search>words</search>           concepts whose names/texts match (CUI and name)
    <traverse>CUI</traverse>         the concept's edges and neighbours
    <analyze>CUI, CUI</analyze>      the concepts' node texts (name, synonyms, definition, relations)
    <answer>B</answer>               the final answer; the episode ends
At most `max_steps` (10) replies. Actions can be disabled (ablations); the
answer action cannot. Any chat model can be the policy: the base model, or a
trained checkpoint from the registry.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from medgraph.kg.graph import Triple
from medgraph.kg.qa import QaItem
from medgraph.llm.base import ChatModel, Completion, GenerationConfig, Message, assistant, system, user
from medgraph.methods.agent import Episode, Generate, ToolCall, complete_cut_answer
from medgraph.methods.common import EvidenceSeen, Step, finish_result, format_question
from medgraph.retrieval import Retriever

ACTIONS = ("search", "traverse", "analyze", "answer")
TOOL_ACTIONS = ("search", "traverse", "analyze")
STOP = ("</search>", "</traverse>", "</analyze>", "</answer>")

_CUI = re.compile(r"\bC\d{7}\b")
_TAG = re.compile(r"<\s*(/?)\s*(think|search|traverse|analyze|answer)\s*>", re.IGNORECASE)
_THINK_BLOCK = re.compile(r"<\s*think\s*>.*?(?:<\s*/\s*think\s*>|$)", re.IGNORECASE | re.DOTALL)
_WELL_FORMED = re.compile(r"\s*<think>(.*?)</think>\s*<(search|traverse|analyze|answer)>(.*?)</\2>\s*", re.DOTALL)

DEMONSTRATION = (
    user("Question: Which of the following may treat gout?\nOptions:\nA. allopurinol\nB. insulin"),
    assistant("<think>I should find the concept first.</think><search>gout</search>"),
)

_ACTION_HELP = {
    "search": "<search>words</search> finds concepts matching the words (returns CUI and name)",
    "traverse": "<traverse>CUI</traverse> lists a concept's relations and neighbouring concepts",
    "analyze": "<analyze>CUI, CUI</analyze> reads the descriptions of concepts",
}


@dataclass(frozen=True)
class GraphR1Config:
    max_steps: int = 10
    actions: tuple[str, ...] = TOOL_ACTIONS  # enabled tool actions (answer is always enabled)
    search_k: int = 8  # concepts per search
    traverse_limit: int = 25  # edges per traverse
    analyze_max_nodes: int = 3
    analyze_chars: int = 600  # per node text
    max_new_tokens: int = 160
    temperature: float = 0.0
    # One worked turn (an example question and a well-formed search) before the question: helps an
    # untrained base model; off by default so a trained policy sees exactly its training layout.
    demonstration: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.actions) - set(TOOL_ACTIONS)
        if unknown:
            raise ValueError(f"unknown Graph-R1 actions {sorted(unknown)}; known: {', '.join(TOOL_ACTIONS)}")


def is_well_formed(text: str, actions: Sequence[str] = ACTIONS) -> bool:
    """r_fmt: exactly `<think>non-empty</think>` then exactly one non-empty action tag, nothing else."""
    match = _WELL_FORMED.fullmatch(text)
    if not match or match.group(2) not in actions or not match.group(1).strip() or not match.group(3).strip():
        return False
    return len(_TAG.findall(text)) == 4  # think open/close, action open/close: no other or nested tags


def parse_action(text: str) -> tuple[str, str] | None:
    """(action, argument) of the first action tag outside <think>; None when there is none."""
    visible = _THINK_BLOCK.sub(" ", text)
    match = re.search(r"<\s*(search|traverse|analyze|answer)\s*>(.*?)(?:<\s*/\s*\1\s*>|<|$)",
                      visible, re.IGNORECASE | re.DOTALL)
    if not match:
        return None
    return match.group(1).lower(), " ".join(match.group(2).split())


def restore_stop(completion: Completion) -> str:
    """The reply with the closing tag that generation stopped at put back.

    Backends cut the stop string (`</search>` ...) off; the policy did write it, and the
    conversation and the format check should see it. A reply cut by the token limit is
    left as it is (its open tag makes it ill-formed).
    """
    text = completion.text
    if completion.finish_reason == "length":
        return text
    tags = _TAG.findall(text)
    if tags and not tags[-1][0] and tags[-1][1].lower() in ACTIONS:
        return text.rstrip() + f"</{tags[-1][1].lower()}>"
    return text


@dataclass
class GraphR1State:
    """One episode: the question, the conversation so far, and the nodes the agent has seen."""

    item: QaItem
    messages: list[Message]
    prompt_turns: int = 2  # messages before the policy's first turn (system, [demonstration], question)
    turns: int = 0
    nodes: set[str] = field(default_factory=set)  # CUIs returned by searches and traversals
    actions: list[str] = field(default_factory=list)
    well_formed: list[bool] = field(default_factory=list)
    answer: str | None = None  # content of the answer tag
    done: bool = False
    truncated: bool = False  # ended at max_steps without an answer


@dataclass(frozen=True)
class EnvStep:
    """What one reply did."""

    action: str  # search | traverse | analyze | answer | invalid
    argument: str
    observation: str | None  # None when the episode ended
    done: bool
    well_formed: bool
    retrieved_ids: tuple[str, ...] = ()
    shown: EvidenceSeen | None = None  # what the observation put in the conversation (None: none shown)


class _Outcome(NamedTuple):
    """What an action returned: the observation text, the ids it retrieved, and the evidence it shows."""

    observation: str | None = None  # None: no tool ran (an answer, or an unavailable action)
    retrieved: tuple[str, ...] = ()
    shown: EvidenceSeen | None = None


class GraphR1Env:
    """The Graph-R1 environment over the shared retriever (KG concepts, edges and node texts)."""

    def __init__(self, retriever: Retriever, config: GraphR1Config = GraphR1Config()):
        self.retriever = retriever
        self.config = config

    # -- prompts ---------------------------------------------------------------------------------------
    def system_prompt(self, item: QaItem) -> str:
        answer = ("<answer>LETTER</answer> gives the final answer (one option letter) and stops"
                  if item.options else "<answer>short answer</answer> gives the final answer and stops")
        actions = [_ACTION_HELP[a] for a in TOOL_ACTIONS if a in self.config.actions] + [answer]
        return (
            "You answer a medical question by exploring a knowledge graph of medical concepts (UMLS).\n"
            "Each turn, first think inside <think>...</think>, then write exactly one action:\n"
            + "\n".join(f"- {a}" for a in actions)
            + "\nResults come back inside <observation>...</observation>. "
            f"You have at most {self.config.max_steps} turns."
        )

    def reset(self, item: QaItem) -> GraphR1State:
        demonstration = list(DEMONSTRATION) if self.config.demonstration and "search" in self.config.actions else []
        messages = [system(self.system_prompt(item)), *demonstration, user(format_question(item))]
        return GraphR1State(item=item, messages=messages, prompt_turns=len(messages))

    # -- stepping ----------------------------------------------------------------------------------------
    def step(self, state: GraphR1State, text: str) -> EnvStep:
        return self.step_batch([(state, text)])[0]

    def step_batch(self, moves: Sequence[tuple[GraphR1State, str]]) -> list[EnvStep]:
        """Apply each episode's reply: parse the action, run all searches/traversals/analyses of the batch
        together, append the reply and the observation to each conversation."""
        parsed = []
        for state, text in moves:
            if state.done:
                raise ValueError(f"episode {state.item.qid} is already done")
            parsed.append(parse_action(text))
        outcomes: list[_Outcome] = [_Outcome()] * len(moves)
        for i, p in enumerate(parsed):
            if p and p[0] in self.config.actions and not p[1]:
                outcomes[i] = _Outcome(f"(the <{p[0]}> tag is empty: write what to {p[0]} inside it)")
        for action in TOOL_ACTIONS:
            ids = [i for i, p in enumerate(parsed)
                   if p and p[0] == action and action in self.config.actions and p[1]]
            if ids:
                run = getattr(self, f"_{action}")
                for i, outcome in zip(ids, run([parsed[i][1] for i in ids])):
                    outcomes[i] = outcome
        return [self._record(state, text, action, outcome)
                for (state, text), action, outcome in zip(moves, parsed, outcomes)]

    def _record(self, state: GraphR1State, text: str, parsed: tuple[str, str] | None,
                outcome: _Outcome) -> EnvStep:
        """Advance one episode's state with its reply and observation."""
        action, argument = parsed or ("invalid", "")
        state.turns += 1
        state.actions.append(action)
        well_formed = is_well_formed(text, (*self.config.actions, "answer"))
        state.well_formed.append(well_formed)
        state.messages.append(assistant(text))
        observation, retrieved, shown = outcome
        if action == "answer":
            state.answer, state.done = argument, True
            return EnvStep(action, argument, None, True, well_formed)
        if observation is None:
            allowed = ", ".join(f"<{a}>" for a in (*self.config.actions, "answer"))
            observation = (f"Action <{action}> is not available. " if parsed else "No action found. ") + \
                f"Write <think>...</think> and then one of {allowed}."
        state.nodes.update(i for i in retrieved if _CUI.fullmatch(i))
        if state.turns >= self.config.max_steps:
            state.done = state.truncated = True
            return EnvStep(action, argument, None, True, well_formed, retrieved)
        if state.turns == self.config.max_steps - 1:
            observation += "\nThis is your last turn: give the answer now with <answer>...</answer>."
        state.messages.append(user(f"<observation>\n{observation}\n</observation>"))
        return EnvStep(action, argument, observation, False, well_formed, retrieved, shown)

    # -- actions (each over a batch of arguments) ----------------------------------------------------------
    def _search(self, queries: list[str]) -> list[_Outcome]:
        found = self.retriever.find_concepts(queries, k=self.config.search_k)
        names = self.retriever.nodes({c for row in found for c in row})
        outcomes = []
        for cuis in found:
            listed = [cui for cui in cuis if cui in names]
            lines = [f"{cui} {names[cui].name}" for cui in listed]
            shown = EvidenceSeen(concepts=listed)
            outcomes.append(_Outcome("\n".join(lines) if lines else "(no matching concepts)", tuple(cuis), shown))
        return outcomes

    def _traverse(self, arguments: list[str]) -> list[_Outcome]:
        targets = [refs[:1] for refs in self._node_references(arguments)]
        edges = self.retriever.one_hop(sorted({c for t in targets for c in t}))
        by_source: dict[str, list[Triple]] = {}
        for triple in edges:
            by_source.setdefault(triple.src_cui, []).append(triple)
        outcomes = []
        for argument, target in zip(arguments, targets):
            if not target:
                outcomes.append(_Outcome(f"(no concept {argument!r}; use a CUI from a search)"))
                continue
            triples = by_source.get(target[0], [])
            shown = _every_relation_first(triples, self.config.traverse_limit)
            lines = [f"{t.src_name} ({t.src_cui}) -{t.relation}-> {t.dst_name} ({t.dst_cui})" for t in shown]
            if len(triples) > len(shown):
                lines.append(f"({len(triples) - len(shown)} more edges not shown)")
            text = "\n".join(lines) if lines else f"({target[0]} has no edges)"
            seen = EvidenceSeen()
            seen.add_triples(shown)
            outcomes.append(_Outcome(text, tuple(dict.fromkeys([target[0]] + [t.dst_cui for t in shown])), seen))
        return outcomes

    def _analyze(self, arguments: list[str]) -> list[_Outcome]:
        targets = [refs[: self.config.analyze_max_nodes] for refs in self._node_references(arguments)]
        texts = self.retriever.node_texts({c for t in targets for c in t})
        outcomes = []
        for argument, target in zip(arguments, targets):
            shown = EvidenceSeen(concept_texts={cui: _cut(texts[cui], self.config.analyze_chars)
                                                for cui in target if cui in texts})
            lines = [f"{cui}: {text}" for cui, text in shown.concept_texts.items()]
            outcomes.append(_Outcome("\n".join(lines) if lines else f"(no concept {argument!r}; use a CUI from a search)",
                                     tuple(target), shown))
        return outcomes

    def _node_references(self, arguments: list[str]) -> list[list[str]]:
        """The concepts each argument names, in order: a CUI where a part of it is one, else the concept
        whose name the part is (exact name first, then BM25/dense)."""
        parts = [[p.strip() for p in re.split(r"[,;\n]", a) if p.strip()] for a in arguments]
        written = {c for row in parts for p in row for c in _CUI.findall(p.upper())}
        known = set(self.retriever.nodes(written))
        names = sorted({p for row in parts for p in row if not _CUI.search(p.upper())})
        by_name = dict(zip(names, self.retriever.find_concepts(names, k=1))) if names else {}
        references = []
        for row in parts:
            cuis: list[str] = []
            for part in row:
                found = [c for c in _CUI.findall(part.upper()) if c in known] if _CUI.search(part.upper()) \
                    else by_name.get(part, [])
                cuis += [c for c in found if c not in cuis]
            references.append(cuis)
        return references


def _every_relation_first(triples: Sequence[Triple], limit: int) -> list[Triple]:
    """Up to `limit` triples taken round-robin over relations, so a hub's hundreds of edges of one
    relation do not hide its few edges of another (e.g. treatments behind manifestations)."""
    by_relation: dict[str, list[Triple]] = {}
    for triple in triples:
        by_relation.setdefault(triple.relation, []).append(triple)
    picked: list[Triple] = []
    for rank in range(max((len(group) for group in by_relation.values()), default=0)):
        for group in by_relation.values():
            if rank < len(group) and len(picked) < limit:
                picked.append(group[rank])
    return picked


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


class GraphR1:
    """Graph-R1 as an evaluated method: the environment driven by any chat model, in lockstep. An
    episode whose last reply was cut at its token budget without an answer gets one short extra call
    for the answer alone (outside the environment, so rollouts and rewards are unchanged)."""

    name = "graph-r1"

    def __init__(self, retriever: Retriever, llm: ChatModel, config: GraphR1Config = GraphR1Config()):
        self.env = GraphR1Env(retriever, config)
        self.llm, self.config = llm, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                           stop=STOP)

    def episode(self, item: QaItem) -> Episode:
        state = self.env.reset(item)
        steps: list[Step] = []
        seen = EvidenceSeen()  # every observation stays in the conversation the answer is given in
        while not state.done:
            asked = list(state.messages)
            completion = yield Generate(asked, self.generation)
            text = restore_stop(completion)
            output = yield ToolCall(self.env.step_batch, (state, text))
            outcome: EnvStep = output.value
            steps.append(Step(
                index=len(steps), action=outcome.action, arguments={"argument": outcome.argument},
                retrieved_ids=list(outcome.retrieved_ids), prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                latency_s=completion.latency_s + output.latency_s, output=text, observation=outcome.observation or "",
                notes="" if outcome.well_formed else "ill-formed reply",
            ))
            if outcome.shown is not None:
                seen.add(outcome.shown)
        answer = f"<answer>{state.answer}</answer>" if state.answer is not None else None
        # The episode (the RL environment's) is over; only a last reply cut at its budget without an
        # answer is asked once more, outside the environment, for just the answer.
        reply = yield from complete_cut_answer(item, asked, completion, self.generation, steps, answer)
        stats = {
            "turns": state.turns, "out_of_turns": state.truncated, "actions": state.actions,
            "well_formed_turns": sum(state.well_formed), "format_ok": all(state.well_formed),
            "nodes_seen": len(state.nodes),
        }
        return finish_result(self.name, item, reply, steps, stats, seen)
