"""Baselines the three methods are compared with, on the same LLM, KG, corpus and scorer.

- `cot`: chain of thought without retrieval.
- `rag`: one retrieval round, MedRAG style: BM25 and dense rankings of corpus
  chunks fused by reciprocal rank fusion for the question and its options,
  plus the KG triples of the concepts linked in them; then one answer.
- `irag`: fixed-iteration follow-up RAG, i-MedRAG style: for a fixed number of
  iterations the model writes follow-up queries, each query's passages are
  added to the context, then one answer. (i-MedRAG also answers each
  follow-up query with an LLM call; here the passages themselves are the
  context, which keeps one model call per iteration.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from medgraph.kg.qa import QaItem
from medgraph.llm.base import ChatModel, GenerationConfig, Message, assistant, system, user
from medgraph.methods.agent import Episode, Generate, ToolCall, answer_call
from medgraph.methods.common import (
    EvidenceSeen,
    Step,
    answer_instruction,
    finish_result,
    format_passages,
    format_question,
    format_triples,
    step_from_completion,
)
from medgraph.methods.tools import KnowledgeTools, Passage

EXPERT = "You are a medical expert. Answer the question; use the evidence when it is relevant."
PASSAGE_CHARS = 600  # characters of a passage a prompt shows


@dataclass(frozen=True)
class CotConfig:
    max_new_tokens: int = 192


class ChainOfThought:
    """Think step by step, then answer: no retrieval."""

    name = "cot"

    def __init__(self, tools: KnowledgeTools | None, llm: ChatModel, config: CotConfig = CotConfig()):
        self.config = config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def episode(self, item: QaItem) -> Episode:
        prompt = f"{format_question(item)}\n\nThink step by step, briefly. Then: {answer_instruction(item)}"
        steps: list[Step] = []
        reply = yield from answer_call(item, [system("You are a medical expert."), user(prompt)], self.generation,
                                       steps)
        return finish_result(self.name, item, reply, steps)  # nothing retrieved: no evidence


@dataclass(frozen=True)
class RagConfig:
    text_k: int = 5
    triples_k: int = 15
    max_triples_per_relation: int | None = 50  # hub guard: edges kept per (concept, relation)
    max_new_tokens: int = 64


def retrieval_query(item: QaItem) -> str:
    """What MedRAG retrieves with: the question followed by its options."""
    return " ".join([item.question, *item.options.values()])


class SingleRoundRag:
    """One hybrid retrieval (chunks and triples), one answer."""

    name = "rag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: RagConfig = RagConfig()):
        self.tools, self.config = tools, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def retrieve(self, items: list[QaItem]) -> list[tuple[list[Passage], list]]:
        queries = [retrieval_query(item) for item in items]
        passages = self.tools.passages(queries, k=self.config.text_k)
        entities = self.tools.question_entities(items)
        triples = self.tools.ranked_triples(entities, [item.question for item in items], top=self.config.triples_k,
                                               per_relation_limit=self.config.max_triples_per_relation)
        return [(p, [t for t, _ in row]) for p, row in zip(passages, triples)]

    def episode(self, item: QaItem) -> Episode:
        output = yield ToolCall(self.retrieve, item)
        passages, triples = output.value
        steps = [Step(index=0, action="retrieve", arguments={"query": retrieval_query(item)},
                      retrieved_ids=[p.chunk_id for p in passages] + [t.edge_id for t in triples],
                      latency_s=output.latency_s)]
        sections = [format_question(item)]
        evidence = EvidenceSeen()
        if triples:
            sections.append("Knowledge graph facts:\n" + format_triples(triples))
            evidence.add_triples(triples)
        if passages:
            sections.append("Text passages:\n" + format_passages([(p.title, p.text) for p in passages],
                                                                max_chars=PASSAGE_CHARS))
            evidence.add_chunks([p.chunk_id for p in passages], PASSAGE_CHARS)
        steps[0].observation = "\n\n".join(sections[1:])
        sections.append(answer_instruction(item))
        reply = yield from answer_call(item, [system(EXPERT), user("\n\n".join(sections))], self.generation, steps)
        return finish_result(self.name, item, reply, steps, evidence=evidence)


@dataclass(frozen=True)
class IterativeRagConfig:
    iterations: int = 2
    queries_per_iteration: int = 2
    text_k: int = 3
    max_new_tokens: int = 96


_QUERY_LINE = re.compile(r"^\s*(?:[-*]|\d+[.)]|query\s*\d*\s*[:.])?\s*(.+?)\s*$", re.IGNORECASE)


def parse_queries(text: str, limit: int) -> list[str]:
    """Follow-up queries, one per line ("Query 1: ...", "- ...", "1. ..."); blank lines and
    lines that are only a heading are skipped."""
    queries = []
    for line in text.splitlines():
        match = _QUERY_LINE.match(line)
        query = match.group(1).strip().strip("\"'") if match else ""
        if query and not query.endswith(":") and len(query.split()) >= 2:
            queries.append(query)
    return list(dict.fromkeys(queries))[:limit]


class IterativeRag:
    """A fixed number of rounds of model-written follow-up queries, then one answer."""

    name = "irag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: IterativeRagConfig = IterativeRagConfig()):
        self.tools, self.config = tools, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def search(self, query_sets: list[tuple[str, ...]]) -> list[list[Passage]]:
        """The passages of each question's queries (one search for the whole batch)."""
        found = iter(self.tools.passages([q for queries in query_sets for q in queries], k=self.config.text_k))
        return [[p for _ in queries for p in next(found)] for queries in query_sets]

    def episode(self, item: QaItem) -> Episode:
        config = self.config
        steps: list[Step] = []
        conversation: list[Message] = [system(EXPERT), user(
            f"{format_question(item)}\n\nTo answer, you may search medical texts. Write "
            f"{config.queries_per_iteration} short search queries, one per line.")]
        seen: set[str] = set()
        numbered: list[Passage] = []
        evidence = EvidenceSeen()  # every round's passages stay in the conversation
        for iteration in range(config.iterations):
            completion = yield Generate(list(conversation), self.generation)
            queries = parse_queries(completion.text, config.queries_per_iteration)
            note = "" if queries else "no query readable: searching with the question"
            queries = queries or [item.question]
            step = step_from_completion(len(steps), "follow_up", completion, {"queries": queries}, note)
            steps.append(step)
            output = yield ToolCall(self.search, tuple(queries))
            step.latency_s += output.latency_s
            found = list({p.chunk_id: p for p in output.value if p.chunk_id not in seen}.values())
            seen.update(p.chunk_id for p in found)
            step.retrieved_ids = [p.chunk_id for p in found]
            start = len(numbered) + 1
            numbered += found
            observation = format_passages([(p.title, p.text) for p in found], start=start,
                                          max_chars=PASSAGE_CHARS) or "(no new passages)"
            evidence.add_chunks([p.chunk_id for p in found], PASSAGE_CHARS)
            step.observation = observation
            more = ("Write more search queries, one per line, for what is still unclear."
                    if iteration + 1 < config.iterations else answer_instruction(item))
            conversation += [assistant(completion.text), user(f"Search results:\n{observation}\n\n{more}")]
        reply = yield from answer_call(item, list(conversation), self.generation, steps)
        return finish_result(self.name, item, reply, steps, {"iterations": config.iterations}, evidence)
