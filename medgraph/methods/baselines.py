"""Baselines the three methods are compared with, on the same LLM, KG, corpus and scorer.

- `cot`: chain of thought without retrieval.
- `rag`: MedRAG (Xiong et al. 2024, "Benchmarking Retrieval-Augmented Generation for Medicine"):
  text only. The question is the query; BM25 and dense rankings of corpus chunks are fused by
  reciprocal rank fusion (`Retriever.search_text(mode="hybrid")`); the top-k snippets and the
  question go to one answer call.
- `rag-kg`: OUR variant, not a published baseline: `rag`'s snippets plus the KG triples of the
  concepts linked in the question and its options. The two rows differ only by the triples.
- `oracle-evidence`: not a method but each reader's ceiling: the reader is shown exactly the item's gold
  facts (KG-derived items) mixed with wrong-relation triples of the same concepts (for multiple choice the
  question concept's triples to the wrong options; otherwise as many as there are gold facts; a "no"
  question: the triples that do link its two concepts), and answers. A method whose accuracy is far below
  this ceiling lost in retrieval; one near it with the gold fact shown, or below it with the gold fact
  shown, tells a reading failure apart.
- `irag`: i-MedRAG (Xiong et al. 2024, "Improving Retrieval-Augmented Generation in Medicine with
  Iterative Follow-up Questions"; code: Teddy-XiongGZ/MedRAG `i_medrag_answer`): each round the
  model analyses what it knows and writes follow-up queries; EACH query is answered by the model
  from its own retrieved snippets (one MedRAG call per query); the (query, answer) pairs are the
  context of the next round and of the final answer.

Where we depart from the published code, and why:
- Snippets: MedRAG shows k=32 whole snippets (RRF constant 100); we show `text_k` snippets cut to
  `passage_chars` and fuse with RRF k=60 (`medgraph.retrieval.RRF_K`), so that prompts fit the
  small models of a demo. Set `text_k` to 32 for the paper's setting.
- i-MedRAG reads the queries of a reply with one more LLM call ("extract the queries as a JSON
  list"); we parse the "## Queries" section (or, when absent, the reply's lines) instead, which
  saves a call per round. A round whose reply holds no query searches with the question itself.
- i-MedRAG ends with a free "## Answer" section and one more call for the answer as JSON; we ask
  for the answer tag every method uses (and once more when that reply holds no readable answer, `answer_call`).
- Every call of a step is batched across questions and, for the per-query answers, across queries.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from medgraph.kg.graph import KnowledgeGraph, Triple
from medgraph.llm.base import ChatModel, Completion, Conversation, GenerationConfig, system, user
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
from medgraph.qa.item import QaItem, gold_edge_ids, gold_facts

EXPERT = "You are a medical expert. Answer the question; use the evidence when it is relevant."
PASSAGE_CHARS = 600  # characters of a passage a prompt shows (default of `passage_chars`)


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


# --------------------------------------------------------------------------- MedRAG and our KG variant


@dataclass(frozen=True)
class RagConfig:
    """MedRAG: text snippets only."""

    text_k: int = 5  # snippets shown (MedRAG: 32)
    passage_chars: int = PASSAGE_CHARS
    query_with_options: bool = False  # MedRAG retrieves with the question alone
    max_new_tokens: int = 64


@dataclass(frozen=True)
class RagKgConfig:
    """Our variant: MedRAG's snippets plus KG triples."""

    text_k: int = 5
    passage_chars: int = PASSAGE_CHARS
    query_with_options: bool = False
    triples_k: int = 15
    max_triples_per_relation: int | None = 50  # hub guard: edges kept per (concept, relation)
    max_new_tokens: int = 64


def retrieval_query(item: QaItem, with_options: bool = False) -> str:
    """The snippet query: the question (MedRAG), optionally followed by its options."""
    return " ".join([item.question, *item.options.values()]) if with_options else item.question


def medrag_snippets(tools: KnowledgeTools, items: Sequence[QaItem], config: RagConfig | RagKgConfig,
                    ) -> list[list[Passage]]:
    """MedRAG's retrieval, shared by `rag` and `rag-kg`: each question's `text_k` snippets for its query."""
    return tools.passages([retrieval_query(item, config.query_with_options) for item in items], k=config.text_k)


class MedRag:
    """MedRAG: one hybrid (BM25 + dense, RRF) snippet retrieval, one answer; no KG facts."""

    name = "rag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: RagConfig | RagKgConfig = RagConfig()):
        self.tools, self.config = tools, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def retrieve(self, items: list[QaItem]) -> list[tuple[list[Passage], list[Triple]]]:
        """Each question's snippets, and no triples."""
        return [(passages, []) for passages in medrag_snippets(self.tools, items, self.config)]

    def episode(self, item: QaItem) -> Episode:
        output = yield ToolCall(self.retrieve, item)
        passages, triples = output.value
        steps = [Step(index=0, action="retrieve",
                      arguments={"query": retrieval_query(item, self.config.query_with_options)},
                      retrieved_ids=[p.chunk_id for p in passages] + [t.edge_id for t in triples],
                      latency_s=output.latency_s)]
        evidence = EvidenceSeen()
        evidence.add_triples(triples)
        evidence.add_chunks([p.chunk_id for p in passages], self.config.passage_chars)
        steps[0].observation = evidence_sections(passages, triples, self.config.passage_chars)
        conversation = rag_prompt(item, passages, triples, self.config.passage_chars)
        reply = yield from answer_call(item, conversation, self.generation, steps)
        return finish_result(self.name, item, reply, steps, evidence=evidence)


def evidence_sections(passages: Sequence[Passage], triples: Sequence[Triple], passage_chars: int) -> str:
    """What `rag` and `rag-kg` show before the question: the KG facts, then MedRAG's documents ("" for none)."""
    sections = [kg_facts_section(triples)] if triples else []
    if passages:  # MedRAG's order: the documents, then the question
        sections.append(documents_section([(p.title, p.text) for p in passages], passage_chars))
    return "\n\n".join(sections)


def rag_prompt(item: QaItem, passages: Sequence[Passage], triples: Sequence[Triple],
               passage_chars: int = PASSAGE_CHARS) -> Conversation:
    """The answering call of `rag` and `rag-kg` (and the reader adapter's `rag_kg` examples)."""
    shown = evidence_sections(passages, triples, passage_chars)
    return [system(EXPERT), user("\n\n".join([*([shown] if shown else []), format_question(item),
                                              answer_instruction(item)]))]


class MedRagWithTriples(MedRag):
    """Our variant `rag-kg`: MedRAG's snippets (the same query) plus the `triples_k` 1-hop KG triples of
    the question's concepts most similar to the question."""

    name = "rag-kg"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: RagKgConfig = RagKgConfig()):
        super().__init__(tools, llm, config)
        self.kg_config = config

    def retrieve(self, items: list[QaItem]) -> list[tuple[list[Passage], list[Triple]]]:
        return rag_kg_evidence(self.tools, items, self.kg_config)


def rag_kg_evidence(tools: KnowledgeTools, items: Sequence[QaItem], config: RagKgConfig = RagKgConfig(),
                    ) -> list[tuple[list[Passage], list[Triple]]]:
    """`rag-kg`'s retrieval: each question's snippets (MedRAG's query) and its concepts' 1-hop triples ranked by
    similarity to the question, best first."""
    passages = medrag_snippets(tools, items, config)
    entities = tools.question_entities(items)
    triples = tools.ranked_triples(entities, [item.question for item in items], top=config.triples_k,
                                   per_relation_limit=config.max_triples_per_relation)
    return [(p, [t for t, _ in row]) for p, row in zip(passages, triples, strict=True)]


@dataclass(frozen=True)
class OracleEvidenceConfig:
    """The reading ceiling: gold facts plus wrong-relation triples of the same concepts, nothing else."""

    max_wrong: int = 6  # wrong-relation triples at most
    max_new_tokens: int = 64


class OracleEvidence:
    """Each reader's ceiling on KG questions: the gold facts (the gold path's triples) and wrong-relation
    triples of the same concepts, shuffled (seeded by the question), as the only evidence, in `rag-kg`'s
    prompt layout."""

    name = "oracle-evidence"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: OracleEvidenceConfig = OracleEvidenceConfig()):
        self.tools, self.config = tools, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def episode(self, item: QaItem) -> Episode:
        output = yield ToolCall(self.retrieve, item)
        triples: list[Triple] = output.value
        steps = [Step(index=0, action="oracle_evidence", retrieved_ids=[t.edge_id for t in triples],
                      latency_s=output.latency_s)]
        evidence = EvidenceSeen()
        evidence.add_triples(triples)
        conversation = kg_facts_prompt(item, triples)
        steps[0].observation = kg_facts_section(triples)
        reply = yield from answer_call(item, conversation, self.generation, steps)
        return finish_result(self.name, item, reply, steps, {"oracle_facts": len(triples)}, evidence)

    def retrieve(self, items: list[QaItem]) -> list[list[Triple]]:
        return oracle_triples(self.tools.retriever.graph, items, self.config.max_wrong)


def documents_section(documents: Sequence[tuple[str, str]], passage_chars: int = PASSAGE_CHARS) -> str:
    """Numbered (title, text) documents under MedRAG's heading, as `rag` and `rag-kg` show their snippets."""
    return "Here are the relevant documents:\n" + format_passages(documents, max_chars=passage_chars)


def kg_facts_section(triples: Sequence[Triple]) -> str:
    """Numbered KG facts under their heading, as `rag-kg` and `oracle-evidence` show them ("" for none)."""
    return "Here are relevant knowledge graph facts:\n" + format_triples(triples) if triples else ""


def kg_facts_prompt(item: QaItem, triples: Sequence[Triple]) -> Conversation:
    """The answering call of `oracle-evidence`: the facts, the question and the answer instruction."""
    return rag_prompt(item, [], triples)


def stated_keys(item: QaItem, facts: Sequence[Triple]) -> set[str]:
    """"src|relation|dst" keys of the item's gold facts (its gold path's triples and every listing of them)."""
    stated = {f"{t.src_cui}|{t.relation}|{t.dst_cui}" for t in facts}
    return stated | {key for fact in gold_facts(item) or () for key in fact}


def oracle_triples(graph: KnowledgeGraph, items: Sequence[QaItem], max_wrong: int) -> list[list[Triple]]:
    """Per item: its gold facts (the gold path's triples) and at most `max_wrong` wrong-relation triples of
    the same concepts (for multiple choice the question concept's triples to the wrong options; otherwise as
    many as there are gold facts; a "no" question: the triples that do link its two concepts), shuffled with
    a seed from the question."""
    gold = {t.edge_id: t for t in graph.triples({e for item in items for e in gold_edge_ids(item) or ()})}
    concepts = {c for item in items for key in ("seed_cuis", "option_cuis") for c in item.extra.get(key) or ()}
    concepts |= {c for t in gold.values() for c in (t.src_cui, t.dst_cui)}
    by_concept: dict[str, list[Triple]] = {}
    for triple in graph.one_hop(sorted(concepts)):
        by_concept.setdefault(triple.src_cui, []).append(triple)
    shown = []
    for item in items:
        facts = [gold[e] for e in gold_edge_ids(item) or () if e in gold]
        stated = stated_keys(item, facts)
        ends = {c for t in facts for c in (t.src_cui, t.dst_cui)} | set(item.extra.get("seed_cuis") or ())
        answers = set(item.extra.get("answer_cuis") or ())
        wrong_options = [c for c in item.extra.get("option_cuis") or () if c not in answers]
        wrong = [t for c in sorted(ends) for t in by_concept.get(c, [])
                 if f"{t.src_cui}|{t.relation}|{t.dst_cui}" not in stated]
        rng = random.Random(item.qid)
        if wrong_options:  # multiple choice: the question concept's triples to each wrong option
            wrong = [t for t in wrong if t.dst_cui in wrong_options or t.src_cui in wrong_options]
        elif not facts:  # a "no": what does link the two concepts
            wrong = [t for t in wrong if {t.src_cui, t.dst_cui} <= ends]
        else:
            rng.shuffle(wrong)
            wrong = wrong[: len(facts)]
        row = facts + wrong[:max_wrong]
        rng.shuffle(row)
        shown.append(row)
    return shown


# --------------------------------------------------------------------------- i-MedRAG


@dataclass(frozen=True)
class IterativeRagConfig:
    rounds: int = 4  # rounds of follow-up queries (i-MedRAG code: n_rounds=4)
    queries_per_round: int = 3  # follow-up queries asked per round (i-MedRAG code: n_queries=3)
    text_k: int = 3  # snippets retrieved to answer each follow-up query (i-MedRAG: k=32)
    passage_chars: int = PASSAGE_CHARS
    query_tokens: int = 128  # budget of a round's reply (analysis + queries)
    query_answer_tokens: int = 64  # budget of the answer to one follow-up query
    max_new_tokens: int = 96  # budget of the final answer


QUERY_SYSTEM = "You are a helpful medical assistant, and your task is to answer the given question following " \
               "the instructions given by the user."
QUERY_ANSWER_SYSTEM = "You are a medical expert. Answer the question using the relevant documents, briefly."

_QUERY_LINE = re.compile(r"^\s*(?:[-*]|\d+[.)]|query\s*\d*\s*[:.])?\s*(.+?)\s*$", re.IGNORECASE)
_QUERIES_HEADING = re.compile(r"#+\s*queries\b\s*:?", re.IGNORECASE)
_INLINE_ITEM = re.compile(r"\s+(?=(?:\d+[.)]|query\s*\d+\s*[:.])\s)", re.IGNORECASE)  # " 2. next query" on one line


def parse_queries(text: str, limit: int) -> list[str]:
    """Follow-up queries, one per line or numbered on one line ("Query 1: ...", "- ...", "1. ... 2. ..."),
    from the "## Queries" section when the reply has one (i-MedRAG's format), else from every line.
    Blank lines, headings ("## Analysis") and lines that are only a label ("Queries:") are skipped."""
    sections = _QUERIES_HEADING.split(text)
    text = sections[-1] if len(sections) > 1 else text
    queries = []
    for line in _INLINE_ITEM.sub("\n", text).splitlines():
        if line.lstrip().startswith("#"):
            continue
        match = _QUERY_LINE.match(line)
        query = match.group(1).strip().strip("\"'") if match else ""
        if query and not query.endswith(":") and len(query.split()) >= 2:
            queries.append(query)
    return list(dict.fromkeys(queries))[:limit]


def format_query_answers(pairs: Sequence[tuple[str, str]]) -> str:
    """i-MedRAG's context: "Query: ...\\nAnswer: ..." per follow-up query, in the order asked."""
    return "\n\n".join(f"Query: {query}\nAnswer: {' '.join(answer.split())}" for query, answer in pairs)


def query_answer_prompt(query: str, passages: Sequence[Passage], passage_chars: int) -> str:
    """One follow-up query answered MedRAG style: its own snippets, then the query (no original question)."""
    documents = format_passages([(p.title, p.text) for p in passages], max_chars=passage_chars) or "(none found)"
    return f"Here are the relevant documents:\n{documents}\n\nHere is the question:\n{query}\n\nAnswer in one or " \
           "two sentences."


class IterativeRag:
    """i-MedRAG: rounds of follow-up queries, each answered from its own snippets; the query-answer
    pairs are the context of the next round and of the final answer.

    LLM calls per question: rounds x (1 + queries_per_round) + 1 (+1 when the final reply is cut
    off); per batch of questions, 2 batched calls per round + 1.
    """

    name = "irag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: IterativeRagConfig = IterativeRagConfig()):
        self.tools, self.llm, self.config = tools, llm, config
        self.query_generation = GenerationConfig(max_new_tokens=config.query_tokens)
        self.query_answer_generation = GenerationConfig(max_new_tokens=config.query_answer_tokens)
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    # Tools: each is called once per agent step with the requests of every question in the batch.
    def search(self, query_sets: list[tuple[str, ...]]) -> list[list[list[Passage]]]:
        """The snippets of each follow-up query of each question (one hybrid search for all)."""
        found = iter(self.tools.passages([q for queries in query_sets for q in queries], k=self.config.text_k))
        return [[next(found) for _ in queries] for queries in query_sets]

    def answer_queries(self, requests: list[tuple[tuple[str, list[Passage]], ...]]) -> list[list[Completion]]:
        """Each follow-up query answered from its snippets: ONE batched model call for every query of
        every question."""
        prompts = [[system(QUERY_ANSWER_SYSTEM), user(query_answer_prompt(q, p, self.config.passage_chars))]
                   for queries in requests for q, p in queries]
        completions = iter(self.llm.generate(prompts, self.query_answer_generation) if prompts else [])
        return [[next(completions) for _ in queries] for queries in requests]

    def round_prompt(self, item: QaItem, pairs: Sequence[tuple[str, str]]) -> str:
        context = f"Follow-up queries asked so far and their answers:\n{format_query_answers(pairs)}\n\n" if pairs else ""
        return (f"{context}{format_question(item)}\n\nFirst analyze all the information in a section named "
                f"Analysis (## Analysis). Then, using key terms from previous answers, write "
                f"{self.config.queries_per_round} concise, specific queries to search for more information in a "
                "medical knowledge base, one per line, in a section named Queries (## Queries).")

    def episode(self, item: QaItem) -> Episode:
        config = self.config
        steps: list[Step] = []
        pairs: list[tuple[str, str]] = []  # (follow-up query, its answer), every round's
        snippets: dict[str, None] = {}  # chunks the per-query answers were given (ordered set)
        for _ in range(config.rounds):
            conversation = [system(QUERY_SYSTEM), user(self.round_prompt(item, pairs))]
            completion = yield Generate(conversation, self.query_generation)
            queries = parse_queries(completion.text, config.queries_per_round)
            note = "" if queries else "no query readable: searching with the question"
            queries = queries or [item.question]
            step = step_from_completion(len(steps), "follow_up", completion, {"queries": queries}, note)
            steps.append(step)
            searched = yield ToolCall(self.search, tuple(queries))
            step.latency_s += searched.latency_s
            answered = yield ToolCall(self.answer_queries, tuple(zip(queries, searched.value)))
            for j, (query, passages, reply) in enumerate(zip(queries, searched.value, answered.value)):
                answer = step_from_completion(len(steps), "query_answer", reply, {"query": query})
                # One batched call answered every query: its wall time counts once per question.
                answer.latency_s = answered.latency_s if j == 0 else 0.0
                answer.retrieved_ids = [p.chunk_id for p in passages]
                answer.observation = format_passages([(p.title, p.text) for p in passages],
                                                     max_chars=config.passage_chars)
                steps.append(answer)
                pairs.append((query, reply.text.strip()))
                snippets.update(dict.fromkeys(answer.retrieved_ids))
        context = f"Follow-up queries and their answers:\n{format_query_answers(pairs)}\n\n" if pairs else ""
        prompt = (f"{context}{format_question(item)}\n\nThink step by step about all the information, briefly. "
                  f"Then: {answer_instruction(item)}")
        # Evidence is what was retrieved, never what a model wrote: the final call reads the model's answers
        # to the follow-up queries, so what i-MedRAG's retrieval showed is the snippets those answers were
        # written from (each cut as its prompt cut it).
        evidence = EvidenceSeen()
        evidence.add_chunks(snippets, config.passage_chars)
        reply = yield from answer_call(item, [system(EXPERT), user(prompt)], self.generation, steps)
        stats = {"follow_up_rounds": config.rounds, "follow_up_queries": len(pairs), "query_snippets": len(snippets)}
        return finish_result(self.name, item, reply, steps, stats, evidence)
