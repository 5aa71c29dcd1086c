"""Graph-R1: an agent that explores the chunk-entity hypergraph with tagged actions (docs/ARCHITECTURE.md "The three methods").

The knowledge hypergraph has two kinds of nodes: KG concepts (CUIs) and text
chunks of the corpus (`text.corpus_chunks`). Each chunk is a hyperedge over
the concepts it mentions (`kg.kg_chunk_mentions`), chunks that share a
concept are linked (`kg.kg_chunk_links`), and the KG's edges stay. Chunks are
shown to the policy by short references, `T1`, `T2`, ..., numbered per episode
in the order they first appear in its observations (chunk ids are 32 hex
digits: costly to copy for a small model). The numbering depends only on the
episode's own history, so it is the same batched or alone; a raw chunk id is
accepted too.

The environment is what GRPO rollouts reuse, so it is written for a trainer
first: `reset(item)` starts an episode, `step_batch([(state, text), ...])`
applies the policy's replies of many episodes at once (one retriever call per
action type and query kind), and the conversation in `state.messages` is the
system prompt, the question, then alternating assistant turns (the policy's
tokens) and user turns holding `<observation>...</observation>` (the
environment's, which a trainer masks out of the loss). `is_well_formed` is
the r_fmt check.

A reply is `<think>...</think>` followed by exactly one action tag:
    <search>words</search>        concepts whose names/texts match (CUI and name) and text chunks
                                  (hybrid BM25 + dense, RRF) with a snippet of each
    <traverse>CUI or T1</traverse>  from a concept: its KG edges and a few chunks that mention it
                                  (those naming more of its neighbours first); from a chunk: the
                                  concepts it mentions and its most strongly linked chunks
    <analyze>CUI, T1</analyze>    the text of chunks (each cut at `analyze_chunk_chars`) and of
                                  concepts (node texts: name, synonyms, definition, relations)
    <answer>B</answer>            the final answer; the episode ends. For a multiple-choice question an
                                  answer that names no option (its letter, text or concept id) is
                                  refused while turns remain, with the option letters in the observation
Text caps are characters, a proxy for tokens: English biomedical prose runs
at about 4 characters per token in the tokenizers used here, so the default
2000 characters per analyzed chunk is the seed's 500 tokens; a cut ends at a
word boundary and is marked " ...". At most `max_steps` (10) replies.
Actions can be disabled (ablations); the answer action cannot. Any chat model
can be the policy: the base model, or a trained checkpoint from the registry.

Evidence (`EnvStep.shown`): search snippets and analyzed chunks count as the
chunk's first N characters shown (evidence recall counts a chunk only where
both concepts of a gold pair are named within what was shown); traversals
show triples, listed concepts, and chunk titles as plain text.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from medgraph.kg.graph import Node, Triple
from medgraph.llm.base import ChatModel, Completion, GenerationConfig, Message, assistant, system, user
from medgraph.methods.agent import Episode, Generate, ToolCall, complete_final_answer
from medgraph.methods.common import EvidenceSeen, Step, finish_result, format_question, parse_answer
from medgraph.qa.item import QaItem
from medgraph.retrieval import RetrievedChunk, Retriever

ACTIONS = ("search", "traverse", "analyze", "answer")
TOOL_ACTIONS = ("search", "traverse", "analyze")
STOP = ("</search>", "</traverse>", "</analyze>", "</answer>")

_CUI = re.compile(r"\bC\d{7}\b")
_CHUNK_REF = re.compile(r"\bT(\d+)\b", re.IGNORECASE)  # a chunk's per-episode reference
_TAG = re.compile(r"<\s*(/?)\s*(think|search|traverse|analyze|answer)\s*>", re.IGNORECASE)
_THINK_BLOCK = re.compile(r"<\s*think\s*>.*?(?:<\s*/\s*think\s*>|$)", re.IGNORECASE | re.DOTALL)
_TITLE_CHARS = 80  # a chunk's title as listed by search and traverse
_WELL_FORMED = re.compile(r"\s*<think>(.*?)</think>\s*<(search|traverse|analyze|answer)>(.*?)</\2>\s*", re.DOTALL)

DEMONSTRATION = (
    user("Question: Which of the following may treat gout?\nOptions:\nA. allopurinol\nB. insulin"),
    assistant("<think>I should find the concept first.</think><search>gout</search>"),
)

_ACTION_HELP = {
    "search": "<search>words</search> finds concepts (CUI and name) and texts (T1, T2, ... with a snippet) "
              "matching the words",
    "traverse": "<traverse>CUI or T1</traverse> lists a concept's relations, neighbouring concepts and texts "
                "mentioning it; or a text's concepts and related texts",
    "analyze": "<analyze>CUI, T1</analyze> reads the full texts and the descriptions of concepts",
}


@dataclass(frozen=True)
class GraphR1Config:
    max_steps: int = 10
    actions: tuple[str, ...] = TOOL_ACTIONS  # enabled tool actions (answer is always enabled)
    search_k: int = 8  # concepts per search
    search_chunks: int = 3  # text chunks per search (0: concepts only)
    snippet_chars: int = 120  # of each chunk a search lists (~30 tokens)
    traverse_limit: int = 25  # edges per traverse (and concepts listed from a chunk)
    traverse_chunks: int = 3  # chunks listed from a concept, linked chunks listed from a chunk
    analyze_max_nodes: int = 3
    analyze_chars: int = 600  # per node text
    analyze_chunk_chars: int = 2000  # per chunk: ~500 tokens at ~4 characters per token (the seed's cap)
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
    visited: list[str] = field(default_factory=list)  # CUIs traversed or analyzed, in order
    chunk_refs: dict[str, str] = field(default_factory=dict)  # "T1" -> chunk id, in order of first showing
    chunk_aliases: dict[str, str] = field(default_factory=dict)  # chunk id -> "T1"
    actions: list[str] = field(default_factory=list)
    well_formed: list[bool] = field(default_factory=list)
    answer: str | None = None  # content of the answer tag
    refused_answers: int = 0  # answers that named no option of a multiple-choice question
    done: bool = False
    truncated: bool = False  # ended at max_steps without an answer

    def chunk_alias(self, chunk_id: str) -> str:
        """The chunk's reference in this episode (`T<n>`, numbered in order of first showing)."""
        if chunk_id not in self.chunk_aliases:
            alias = f"T{len(self.chunk_refs) + 1}"
            self.chunk_refs[alias], self.chunk_aliases[chunk_id] = chunk_id, alias
        return self.chunk_aliases[chunk_id]


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


class _Ref(NamedTuple):
    """A node an argument names: a concept (CUI) or a chunk (its chunk id)."""

    kind: str  # "concept" | "chunk"
    id: str


class GraphR1Env:
    """The Graph-R1 environment over the shared retriever: KG concepts, edges and node texts, and the
    corpus chunks with their mentions and links."""

    def __init__(self, retriever: Retriever, config: GraphR1Config = GraphR1Config()):
        self.retriever = retriever
        self.config = config

    # -- prompts ---------------------------------------------------------------------------------------
    def system_prompt(self, item: QaItem) -> str:
        answer = ("<answer>LETTER</answer> gives the final answer (one option letter) and stops"
                  if item.options else "<answer>short answer</answer> gives the final answer and stops")
        actions = [_ACTION_HELP[a] for a in TOOL_ACTIONS if a in self.config.actions] + [answer]
        return (
            "You answer a medical question by exploring a knowledge graph of medical concepts (UMLS, with CUIs "
            "like C0020538) and the medical texts that mention them (T1, T2, ...).\n"
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
                for i, outcome in zip(ids, run([(moves[i][0], parsed[i][1]) for i in ids]), strict=True):
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
        # A multiple-choice answer must name an option: one that does not (a concept the agent read, not one
        # of the choices) is refused like an unavailable action while turns remain, so the policy can still
        # answer; on the last turn it ends the episode unreadable.
        refused = (action == "answer" and state.item.options and state.turns < self.config.max_steps
                   and parse_answer(f"<answer>{argument}</answer>", state.item) is None)
        if action == "answer" and not refused:
            state.answer, state.done = argument, True
            return EnvStep(action, argument, None, True, well_formed)
        if refused:
            state.refused_answers += 1
            observation = f"{argument!r} is not one of the options. Give the answer with <answer>...</answer>" \
                f"{_letters(state.item)}."
        elif observation is None:
            allowed = ", ".join(f"<{a}>" for a in (*self.config.actions, "answer"))
            observation = (f"Action <{action}> is not available. " if parsed else "No action found. ") + \
                f"Write <think>...</think> and then one of {allowed}."
        state.nodes.update(i for i in retrieved if _CUI.fullmatch(i))
        if state.turns >= self.config.max_steps:
            state.done = state.truncated = True
            return EnvStep(action, argument, None, True, well_formed, retrieved)
        if state.turns == self.config.max_steps - 1:
            observation += f"\nThis is your last turn: give the answer now with <answer>...</answer>{_letters(state.item)}."
        state.messages.append(user(f"<observation>\n{observation}\n</observation>"))
        return EnvStep(action, argument, observation, False, well_formed, retrieved, shown)

    # -- actions (each over a batch of (episode, argument)) ---------------------------------------------------
    def _search(self, moves: list[tuple[GraphR1State, str]]) -> list[_Outcome]:
        queries = [argument for _, argument in moves]
        found = self.retriever.find_concepts(queries, k=self.config.search_k)
        names = self.retriever.nodes({c for row in found for c in row})
        hits = self._search_chunks(queries)
        chunks = self.retriever.chunks([c for row in hits for c in row])
        outcomes = []
        for (state, _), cuis, chunk_ids in zip(moves, found, hits, strict=True):
            listed = [cui for cui in cuis if cui in names]
            shown = EvidenceSeen(concepts=listed)
            concept_lines = [f"{cui} {names[cui].name}" for cui in listed]
            text_lines = []
            for chunk_id in (c for c in chunk_ids if c in chunks):
                snippet, shown_chars = _snippet(chunks[chunk_id], self.config.snippet_chars)
                text_lines.append(f"{state.chunk_alias(chunk_id)} {snippet}")
                shown.add_chunks([chunk_id], shown_chars)
            if not text_lines:
                text = "\n".join(concept_lines) or "(no matching concepts)"
            else:
                text = "Concepts:\n" + ("\n".join(concept_lines) or "(none)") + "\nTexts:\n" + "\n".join(text_lines)
            outcomes.append(_Outcome(text, tuple(cuis) + tuple(c for c in chunk_ids if c in chunks), shown))
        return outcomes

    def _search_chunks(self, queries: list[str]) -> list[list[str]]:
        """Chunk ids per query (hybrid BM25 + dense); none when chunk search is off or there is no corpus."""
        if self.config.search_chunks <= 0 or not self.retriever.has_table("text", "corpus_chunks"):
            return [[] for _ in queries]
        mode = "hybrid" if self.retriever.encoder is not None else "bm25"
        return [[c for c, _ in row] for row in self.retriever.search_text(queries, k=self.config.search_chunks, mode=mode)]

    def _traverse(self, moves: list[tuple[GraphR1State, str]]) -> list[_Outcome]:
        targets = [refs[:1] for refs in self._node_references(moves)]
        concepts = sorted({t[0].id for t in targets if t and t[0].kind == "concept"})
        chunk_ids = sorted({t[0].id for t in targets if t and t[0].kind == "chunk"})
        by_source: dict[str, list[Triple]] = {}
        for triple in self.retriever.one_hop(concepts):
            by_source.setdefault(triple.src_cui, []).append(triple)
        neighbours = {cui: {t.dst_cui for t in triples} for cui, triples in by_source.items()}
        mentioning = self.retriever.chunks_mentioning(concepts, self.config.traverse_chunks, neighbours)
        in_chunks = self.retriever.chunk_concepts(chunk_ids)
        linked = self.retriever.linked_chunks(chunk_ids, self.config.traverse_chunks)
        titled = self.retriever.chunks({c for row in mentioning.values() for c in row}
                                       | {c for row in linked.values() for c, _ in row} | set(chunk_ids))
        named = self.retriever.nodes({c for row in in_chunks.values() for c in row[: self.config.traverse_limit]}
                                     | {c for row in linked.values() for _, shared in row for c in shared[:3]})
        outcomes = []
        for (state, argument), target in zip(moves, targets, strict=True):
            if not target:
                outcomes.append(_Outcome(f"(no concept or text {argument!r}; use a CUI or T-number from a search)"))
            elif target[0].kind == "concept":
                state.visited.append(target[0].id)
                outcomes.append(self._traverse_concept(state, target[0].id, by_source.get(target[0].id, []),
                                                       mentioning.get(target[0].id, []), titled))
            else:
                outcomes.append(self._traverse_chunk(state, target[0].id, in_chunks.get(target[0].id, []),
                                                     linked.get(target[0].id, []), titled, named))
        return outcomes

    def _traverse_concept(self, state: GraphR1State, cui: str, triples: list[Triple], chunk_ids: list[str],
                          chunks: dict[str, RetrievedChunk]) -> _Outcome:
        shown = _every_relation_first(triples, self.config.traverse_limit)
        lines = [f"{t.src_name} ({t.src_cui}) -{t.relation}-> {t.dst_name} ({t.dst_cui})" for t in shown]
        if len(triples) > len(shown):
            lines.append(f"({len(triples) - len(shown)} more edges not shown)")
        if not lines:
            lines.append(f"({cui} has no edges)")
        seen = EvidenceSeen()
        seen.add_triples(shown)
        listed = [c for c in chunk_ids if c in chunks]
        if listed:
            lines.append("Texts mentioning it:")
            for chunk_id in listed:
                title = _cut(chunks[chunk_id].title or chunks[chunk_id].text, _TITLE_CHARS)
                lines.append(f"{state.chunk_alias(chunk_id)} {title}")
                seen.add_text(title)
        retrieved = tuple(dict.fromkeys([cui] + [t.dst_cui for t in shown])) + tuple(listed)
        return _Outcome("\n".join(lines), retrieved, seen)

    def _traverse_chunk(self, state: GraphR1State, chunk_id: str, cuis: list[str],
                        linked: list[tuple[str, list[str]]], chunks: dict[str, RetrievedChunk],
                        names: dict[str, Node]) -> _Outcome:
        alias = state.chunk_alias(chunk_id)
        listed = [c for c in cuis[: self.config.traverse_limit] if c in names]
        seen = EvidenceSeen(concepts=listed)
        title = _cut(chunks[chunk_id].title, _TITLE_CHARS) if chunk_id in chunks else ""
        lines = [f"{alias} {title} mentions:" if title else f"{alias} mentions:"]
        lines += [f"{names[c].name} ({c})" for c in listed] or ["(no known concepts)"]
        if len(cuis) > len(listed):
            lines.append(f"({len(cuis) - len(listed)} more concepts not shown)")
        others = [(other, shared) for other, shared in linked if other in chunks]
        if others:
            lines.append("Related texts:")
            for other, shared in others:
                other_title = _cut(chunks[other].title or chunks[other].text, _TITLE_CHARS)
                common = ", ".join(names[c].name for c in shared[:3] if c in names)
                lines.append(f"{state.chunk_alias(other)} {other_title}" + (f" (shares {common})" if common else ""))
                seen.add_text(other_title)
        return _Outcome("\n".join(lines), (chunk_id, *listed, *(o for o, _ in others)), seen)

    def _analyze(self, moves: list[tuple[GraphR1State, str]]) -> list[_Outcome]:
        targets = [refs[: self.config.analyze_max_nodes] for refs in self._node_references(moves)]
        texts = self.retriever.node_texts({r.id for t in targets for r in t if r.kind == "concept"})
        chunks = self.retriever.chunks([r.id for t in targets for r in t if r.kind == "chunk"])
        outcomes = []
        for (state, argument), target in zip(moves, targets, strict=True):
            shown, lines, retrieved = EvidenceSeen(), [], []
            for ref in target:
                if ref.kind == "concept" and ref.id in texts:
                    state.visited.append(ref.id)
                    text = _cut(texts[ref.id], self.config.analyze_chars)
                    shown.add_concept_text(ref.id, text)
                    lines.append(f"{ref.id}: {text}")
                elif ref.kind == "chunk" and ref.id in chunks:
                    chunk = chunks[ref.id]
                    text, shown_chars = _prefix(chunk.text, self.config.analyze_chunk_chars)
                    shown.add_chunks([ref.id], shown_chars)
                    title = _cut(chunk.title, _TITLE_CHARS)
                    heading = f"{state.chunk_alias(ref.id)} ({title})" if title and not chunk.text.startswith(chunk.title) \
                        else state.chunk_alias(ref.id)
                    lines.append(f"{heading}: {text}")
                else:
                    continue
                retrieved.append(ref.id)
            outcomes.append(_Outcome("\n".join(lines) if lines else
                                     f"(no concept or text {argument!r}; use a CUI or T-number from a search)",
                                     tuple(retrieved), shown))
        return outcomes

    def _node_references(self, moves: list[tuple[GraphR1State, str]]) -> list[list[_Ref]]:
        """The nodes each argument names, in order. Each comma-separated part: the episode's chunk
        references (T1) in it, else the CUIs in it, else a chunk id, else the concept whose name the
        part is (exact name first, then BM25/dense). A T-number the episode has shown wins over a
        concept of that name ("T3" the hormone): its CUI names it unambiguously."""
        parts = [[p.strip() for p in re.split(r"[,;\n]", argument) if p.strip()] for _, argument in moves]
        by_part: list[list[list[_Ref]]] = []
        unresolved: set[str] = set()
        written: set[str] = set()
        for (state, _), row in zip(moves, parts, strict=True):
            resolved = []
            for part in row:
                refs = [_Ref("chunk", state.chunk_refs[f"T{n}"]) for n in _CHUNK_REF.findall(part)
                        if f"T{n}" in state.chunk_refs]
                if not refs and _CUI.search(part.upper()):
                    refs = [_Ref("concept", c) for c in _CUI.findall(part.upper())]
                    written |= {r.id for r in refs}
                if not refs and part in state.chunk_aliases:
                    refs = [_Ref("chunk", part)]
                if not refs:
                    unresolved.add(part)
                resolved.append(refs)
            by_part.append(resolved)
        known = set(self.retriever.nodes(written))
        names = sorted(unresolved)
        corpus_ids = set(self.retriever.chunks(names)) if names and self.retriever.has_table("text", "corpus_chunks") \
            else set()
        names = [n for n in names if n not in corpus_ids]
        by_name = dict(zip(names, self.retriever.find_concepts(names, k=1), strict=True)) if names else {}
        references = []
        for row, resolved in zip(parts, by_part, strict=True):
            refs: list[_Ref] = []
            for part, found in zip(row, resolved, strict=True):
                if not found:
                    found = [_Ref("chunk", part)] if part in corpus_ids else \
                        [_Ref("concept", c) for c in by_name.get(part, [])]
                refs += [r for r in found if (r.kind == "chunk" or r.id in known or r.id in by_name.get(part, []))
                         and r not in refs]
            references.append(refs)
        return references


def _letters(item: QaItem) -> str:
    """What an answer tag holds, for the environment's notes: ' (one option letter: A, B, C, D)', or ''
    for a question without options."""
    return f" (one option letter: {', '.join(item.options)})" if item.options else ""


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


def _prefix(text: str, limit: int) -> tuple[str, int | None]:
    """The text's first `limit` characters, cut at a word boundary and with whitespace collapsed for the
    prompt, and how many characters of the original that is (None: all of it), for evidence recall."""
    if len(text) <= limit:
        return " ".join(text.split()), None
    cut = text[:limit]
    if text[limit - 1].isalnum() and text[limit].isalnum():  # mid-word: drop the partial word
        cut = re.sub(r"\w+$", "", cut) if cut.strip().count(" ") else cut
    cut = cut.rstrip()
    return " ".join(cut.split()) + " ...", len(cut)


def _snippet(chunk: RetrievedChunk, limit: int) -> tuple[str, int | None]:
    """A search hit as listed: the title (unless the text starts with it) and the text's first `limit`
    characters; and how many characters of the text were shown."""
    text, shown_chars = _prefix(chunk.text, limit)
    title = _cut(chunk.title, _TITLE_CHARS)
    if title and not " ".join(chunk.text.split()).startswith(title.removesuffix(" ...")):
        text = f"{title}: {text}"
    return text, shown_chars


class GraphR1:
    """Graph-R1 as an evaluated method: the environment driven by any chat model, in lockstep. An
    episode that ends without a readable answer (out of turns, a cut reply, an answer naming no option)
    gets one short extra call for the answer alone, constrained to the option tags for multiple choice
    (`agent.complete_final_answer`; outside the environment, so rollouts and rewards are unchanged)."""

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
                prompt_tokens_computed=completion.prompt_tokens_computed, completion_tokens=completion.completion_tokens,
                latency_s=completion.latency_s + output.latency_s, output=text, observation=outcome.observation or "",
                notes="" if outcome.well_formed else "ill-formed reply",
            ))
            if outcome.shown is not None:
                seen.add(outcome.shown)
        answer = f"<answer>{state.answer}</answer>" if state.answer is not None else None
        # The episode (the RL environment's) is over; one that gave no readable answer is asked once more,
        # outside the environment, for just the answer.
        # The policy answers, as the paper trains it to: no separate reader, not even for the retry.
        reply = yield from complete_final_answer(item, asked, completion, self.generation, steps, answer,
                                                 answering=False)
        stats = {
            "turns": state.turns, "out_of_turns": state.truncated, "actions": state.actions,
            "well_formed_turns": sum(state.well_formed), "format_ok": all(state.well_formed),
            "nodes_seen": len(state.nodes), "chunks_seen": len(state.chunk_refs),
            "refused_answers": state.refused_answers,
        }
        named = set(item.extra.get("seed_cuis") or ())
        if named:  # did the agent walk from the concept the question names (found by an exact-name search)?
            stats["visited_named_concept"] = bool(named & set(state.visited))
        return finish_result(self.name, item, reply, steps, stats, seen)
