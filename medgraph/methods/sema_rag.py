"""SEMA-RAG: self-evolving multi-agent RAG for medical QA (docs/ARCHITECTURE.md "The three methods").

- I-Agent: the question becomes a clinical schema tuple (intent, entities,
  constraints, initial query), linearized into the retrieval query.
- E-Agent: round t retrieves with the query set Q_t (hybrid text search plus
  KG triples of the linked entities), compares the accumulated evidence with
  the schema and judges sufficiency; when insufficient it names the gap and
  writes follow-up queries Q_{t+1}. The loop stops when the evidence is
  sufficient, at `max_rounds`, or when no new query appears.
- A-Agent: writes an evidence report (agreements, conflicts, numbered source
  citations such as [1], [3]) and then picks one option.

Ablations are configuration: without the I-Agent the question itself is the
query; without the E-Agent there is one retrieval round; without the A-Agent
the answer is given straight from the evidence.

Prompt layout: the agents are separate calls that see what the method says
they see (the E-Agent the evidence and the schema, the A-Agent the evidence),
but every call starts with the same short system prompt and the same context
block (question, then the numbered evidence, which only ever grows at its
end) and puts the agent's role and task last (the I-Agent's worked example
sits between its system prompt and the question: its one call is the exception). So each call continues the keys/values
of the previous one in the LLM's prefix cache and computes only what is new
(the next round's sources, the agent's task), instead of re-reading the
question and all evidence once per agent.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from medgraph.kg.graph import Triple
from medgraph.kg.shortcuts import content_words
from medgraph.llm.base import ChatModel, GenerationConfig, assistant, system, user
from medgraph.methods.agent import Episode, Generate, Request, ToolCall, answer_call, answer_choices
from medgraph.methods.common import (
    EvidenceSeen,
    FinalReply,
    Step,
    answer_instruction,
    as_string_list,
    finish_result,
    format_question,
    parse_answer,
    parse_fields,
    step_from_completion,
)
from medgraph.methods.tools import KnowledgeTools, Passage
from medgraph.qa.item import QaItem


@dataclass(frozen=True)
class SemaRagConfig:
    use_i_agent: bool = True
    use_e_agent: bool = True
    use_a_agent: bool = True
    max_rounds: int = 3
    # False: a "sufficient" judgment does not end the loop (the ablation the early-stop claim is measured
    # against). The next round searches the E-Agent's own follow-up queries, as the full method's rounds do; when
    # it wrote none new the loop ends ("no_new_query"). Only the stop rule changes: the ablation asks no query the
    # full method could not have asked (a small reader that writes no queries with "sufficient" makes the two
    # the same: the report's claims row then shows equal rounds).
    early_stop: bool = True
    max_queries_per_round: int = 3
    text_k: int = 3  # passages per query
    triples_per_round: int = 8
    max_triples_per_relation: int | None = 50  # hub guard: edges kept per (concept, relation)
    max_new_tokens: int = 160
    # The A-Agent's evidence report (what the sources say about every option) has its own budget: a capable model's
    # report runs longer than the other agents' JSON turns. Not raised by default: the small readers run into any
    # budget (SmolLM2-135M loops; Qwen2.5-0.5B copies the sources out: 5 of 6 validation reports cut at 400 tokens).
    report_max_new_tokens: int = 160
    # One worked I-Agent exchange before the question. Without it SmolLM2-135M, decoded to the schema's JSON, copies
    # the instruction's placeholders into every schema ("a search query for the evidence needed", 12 of 12
    # validation questions); with it the schema names the question's concepts, and a copied example concept
    # ("gout") is dropped as not about the question (`parse_schema`).
    demonstration: bool = True
    # Each agent's reply is decoded to its format (`GenerationConfig.pattern`: the schema's and the judgment's JSON,
    # the report's one line per option), with every field's length bounded so that a reply ends within its budget.
    # SmolLM2-135M wrote a readable schema for 0 of 24 validation questions and cut all 24 reports at 160 tokens
    # unconstrained. Backends that cannot constrain decoding (llama.cpp, Bedrock) generate freely.
    constrained: bool = True


# --------------------------------------------------------------------------- the schema (I-Agent)


@dataclass(frozen=True)
class ClinicalSchema:
    intent: str
    entities: tuple[str, ...]
    constraints: tuple[str, ...]
    query: str
    parsed: bool = True  # False: the I-Agent's reply could not be read and the question stands in
    # False: its query names nothing of the question or options (a small model copies the instruction's
    # placeholders, "a search query for the evidence needed"), and the question stands in.
    grounded: bool = True

    def linearize(self) -> str:
        """The retrieval query: the initial query, then the schema's entities and constraints."""
        parts = [self.query]
        if self.entities:
            parts.append("entities: " + ", ".join(self.entities))
        if self.constraints:
            parts.append("constraints: " + ", ".join(self.constraints))
        return " | ".join(p for p in parts if p)

    def describe(self) -> str:
        return (f"intent: {self.intent or '-'}; entities: {', '.join(self.entities) or '-'}; "
                f"constraints: {', '.join(self.constraints) or '-'}; query: {self.query}")


def _first(fields: dict[str, object], *names: str) -> object:
    return next((fields[n] for n in names if fields.get(n) not in (None, "", [])), None)


def _names(value: object) -> list[str]:
    """Entity names from strings or objects such as {"name": ..., "type": ...}."""
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        value = [next((str(v[k]) for k in ("name", "entity", "text") if k in v), "") if isinstance(v, dict) else v
                 for v in value]
    return as_string_list(value)


def asked_words(item: QaItem) -> set[str]:
    """The content words of the question and its options: what a schema or a query must be about."""
    return content_words(" ".join([item.question, *item.options.values()]))


def parse_schema(text: str, item: QaItem) -> ClinicalSchema:
    """The I-Agent's schema from JSON or `key: value` lines; the question itself when neither is there. Entities
    and a query that share no content word with the question or its options are dropped (the question stands in
    for such a query)."""
    fields = parse_fields(text)
    query = _first(fields, "initial_query", "query", "search_query", "retrieval_query")
    intent = _first(fields, "intent", "clinical_intent")
    entities = _first(fields, "entities", "entity", "key_entities")
    constraints = _first(fields, "constraints", "constraint", "conditions")
    if query is None and intent is None and entities is None:
        return ClinicalSchema("", (), (), item.question, parsed=False)
    asked = asked_words(item)
    query = str(query or "").strip()
    grounded = bool(content_words(query) & asked)
    return ClinicalSchema(
        intent=str(intent or "").strip(),
        entities=tuple(e for e in _names(entities) if content_words(e) & asked),
        constraints=tuple(as_string_list(constraints)),  # conditions on the answer need not repeat the question
        query=query if grounded else item.question,
        grounded=grounded,
    )


# --------------------------------------------------------------------------- sufficiency (E-Agent)


@dataclass(frozen=True)
class Judgment:
    sufficient: bool | None  # None: the reply did not say
    gap: str
    queries: tuple[str, ...]


_YES = ("yes", "true", "sufficient", "enough")
_NO = ("no", "false", "insufficient", "not", "partial")


def _truth(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    words = str(value).strip().lower().split()
    if not words:
        return None
    if words[0].strip(".,") in _NO:
        return False
    return True if words[0].strip(".,") in _YES else None


def parse_judgment(text: str) -> Judgment:
    """The E-Agent's sufficiency, gap and follow-up queries from JSON or `key: value` lines."""
    fields = parse_fields(text)
    sufficient = _truth(_first(fields, "sufficient", "sufficiency", "is_sufficient", "enough"))
    if sufficient is None:  # a sentence instead of a field: "The evidence is (not) sufficient ..."
        if re.search(r"\b(insufficient|not (?:yet )?(?:sufficient|enough))\b", text, re.IGNORECASE):
            sufficient = False
        elif re.search(r"\b(sufficient|enough)\b", text, re.IGNORECASE):
            sufficient = True
    gap = str(_first(fields, "gap", "missing", "missing_information") or "").strip()
    queries = as_string_list(_first(fields, "queries", "follow_up_queries", "follow_up", "followup_queries",
                                    "next_queries", "query"))
    return Judgment(sufficient, gap, tuple(queries))


def _query_key(query: str) -> str:
    return " ".join(re.findall(r"\w+", query.lower()))


# --------------------------------------------------------------------------- evidence


PASSAGE_CHARS = 500  # characters of a passage a source shows


@dataclass
class _Evidence:
    """Numbered sources (passages and KG facts), each once. Every source is in the answering
    prompt (the evidence report's and the direct answer's), so `seen` holds them all."""

    sources: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    seen: EvidenceSeen = field(default_factory=EvidenceSeen)

    def add(self, passages: Sequence[Passage], triples: Sequence[Triple]) -> list[str]:
        new = []
        for source_id, text in [(p.chunk_id, f"{p.title}: {_cut(p.text, PASSAGE_CHARS)}") for p in passages] + \
                [(t.edge_id, f"KG fact: {t.text}") for t in triples]:
            if source_id not in self.ids:
                self.ids.append(source_id)
                self.sources.append(text)
                new.append(source_id)
        self.seen.add_chunks([p.chunk_id for p in passages], PASSAGE_CHARS)
        self.seen.add_triples(triples)
        return new

    def render(self, since: int = 0) -> str:
        """The sources from number `since` + 1 on, "[n] text" per line."""
        lines = [f"[{i}] {s}" for i, s in enumerate(self.sources, start=1) if i > since]
        return "\n".join(lines) or ("(no evidence found)" if not since else "(no new evidence)")


def _cut(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


@dataclass(frozen=True)
class _Retrieval:
    item: QaItem
    entity_names: tuple[str, ...]
    queries: tuple[str, ...]


# --------------------------------------------------------------------------- prompts

# One short system prompt for every agent, the agent's role and task last: see the module docstring (prefix
# caching). The roles open the task, where the separate system prompts used to name them: a long team
# description in the system prompt made SmolLM2 recite it instead of doing the task.
SYSTEM = "You are a medical expert."
I_INSTRUCTION = ('You are a clinical information specialist. Turn the question into a structured search schema: '
                 'describe what it asks as a clinical schema. Reply with JSON only:\n'
                 '{"intent": "what is asked, e.g. treatment, diagnosis, mechanism", '
                 '"entities": ["medical concepts in the question"], '
                 '"constraints": ["conditions the answer must meet"], '
                 '"query": "a search query for the evidence needed"}')
I_DEMONSTRATION = (
    user("Question: Which of the following may treat gout?\nOptions:\nA. allopurinol\nB. insulin\n\n"
         + I_INSTRUCTION),
    assistant('{"intent": "treatment", "entities": ["gout", "allopurinol", "insulin"], "constraints": [], '
              '"query": "drugs that treat gout"}'),
)
E_INSTRUCTION = ('You are an evidence reviewer. Decide whether the evidence above is enough to answer the question: '
                 'is it sufficient? Reply with JSON only:\n'
                 '{"sufficient": true or false, "gap": "what is missing", '
                 '"queries": ["follow-up search queries for the gap"]}')
A_REPORT = ("You are a careful clinician. You weigh evidence before you answer. Write a short evidence report: one "
            "line per option with what the sources say about it, citing them by their numbers like [1], [3]; then a "
            "line 'Agree:' naming the sources that agree and a line 'Conflict:' naming those that conflict.")


def _text(most: int) -> str:
    """A JSON string of 1 to `most` characters, none a quote, backslash or line break."""
    return rf'"[^"\\\n]{{1,{most}}}"'


def _texts(most: int, count: int) -> str:
    """A JSON list of at most `count` such strings."""
    return rf"\[(?:{_text(most)}(?:, ?{_text(most)}){{0,{count - 1}}})?\]"


_SPACE = r"[ \n]{0,4}"  # between JSON fields, as a model lays them out
# The I-Agent's schema and the E-Agent's judgment, bounded to end within `max_new_tokens` (160) at ~3 characters
# a token: the longest schema is ~400 characters, the longest judgment ~420.
SCHEMA_PATTERN = (rf'\{{{_SPACE}"intent": ?{_text(30)},{_SPACE}"entities": ?{_texts(30, 4)},{_SPACE}'
                  rf'"constraints": ?{_texts(30, 2)},{_SPACE}"query": ?{_text(100)}{_SPACE}\}}')
JUDGMENT_PATTERN = (rf'\{{{_SPACE}"sufficient": ?(?:true|false),{_SPACE}"gap": ?{_text(80)},{_SPACE}'
                    rf'"queries": ?{_texts(80, 3)}{_SPACE}\}}')


ANSWER_TAG_PATTERN = r"<answer>[^<\n]{1,80}</answer>"  # a short answer's pick after the report


def report_pattern(item: QaItem) -> str:
    """The A-Agent's report: a line per option (`A: ...`; one `Findings:` line for a short answer), then `Agree:`
    and `Conflict:` lines, each bounded (the longest report for four options is ~410 characters)."""
    lines = [rf"{regex.escape(letter)}: [^\n]{{1,70}}" for letter in item.options] or [r"Findings: [^\n]{1,200}"]
    return r"\n".join([*lines, r"Agree: [^\n]{1,50}", r"Conflict: [^\n]{1,50}"])


_STATES_ANSWER = re.compile(r"<\s*answer\s*>|\banswer\s*(?:is|:)", re.IGNORECASE)


def _context(item: QaItem, evidence: _Evidence | None = None) -> str:
    """The block every agent's message starts with: the question, then the evidence so far."""
    question = format_question(item)
    return question if evidence is None else f"{question}\n\nEvidence:\n{evidence.render()}"


class SemaRag:
    """Builds one SEMA-RAG episode per question; retrieval is batched across questions."""

    name = "sema-rag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: SemaRagConfig = SemaRagConfig()):
        self.tools, self.llm, self.config = tools, llm, config
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    def _formatted(self, pattern: str) -> GenerationConfig:
        """An agent's decoding: constrained to its reply format unless the config says otherwise."""
        return self.generation.but(pattern=pattern) if self.config.constrained else self.generation

    def retrieve(self, requests: list[_Retrieval]) -> list[tuple[list[Passage], list[Triple]]]:
        """One round for a batch: passages for every query, and the KG triples of each question's
        linked entities ranked against its queries."""
        queries = [q for r in requests for q in r.queries]
        found = iter(self.tools.passages(queries, k=self.config.text_k))
        passages = [[p for _ in r.queries for p in next(found)] for r in requests]
        entities = self.tools.question_entities([r.item for r in requests])
        named = iter(self.tools.named_concepts([n for r in requests for n in r.entity_names]))
        linked = [list(dict.fromkeys(e + [c for _ in r.entity_names for c in next(named)[:1]]))
                  for r, e in zip(requests, entities)]
        ranked = self.tools.ranked_triples(linked, [" ".join(r.queries) for r in requests],
                                           top=self.config.triples_per_round,
                                           per_relation_limit=self.config.max_triples_per_relation)
        return [(p, [t for t, _ in row]) for p, row in zip(passages, ranked)]

    def episode(self, item: QaItem) -> Episode:
        config = self.config
        steps: list[Step] = []
        schema = ClinicalSchema("", (), (), item.question, parsed=False)
        if config.use_i_agent:
            demonstration = list(I_DEMONSTRATION) if config.demonstration else []
            conversation = [system(SYSTEM), *demonstration, user(f"{_context(item)}\n\n{I_INSTRUCTION}")]
            completion = yield Generate(conversation, self._formatted(SCHEMA_PATTERN))
            schema = parse_schema(completion.text, item)
            steps.append(step_from_completion(len(steps), "i_agent", completion, {"schema": schema.describe()},
                                     "" if schema.parsed else "schema not readable: the question is the query"))
        queries = [schema.linearize()]
        asked = {_query_key(queries[0])}
        evidence = _Evidence()
        sufficiency: list[bool | None] = []
        stop = "single_round"
        for round_index in range(1, config.max_rounds + 1):
            output = yield ToolCall(self.retrieve, _Retrieval(item, schema.entities, tuple(queries)))
            passages, triples = output.value
            new = evidence.add(passages, triples)
            steps.append(Step(index=len(steps), action="retrieve", latency_s=output.latency_s,
                              arguments={"round": round_index, "queries": list(queries)}, retrieved_ids=new,
                              observation=evidence.render(since=len(evidence.ids) - len(new))))
            if not config.use_e_agent:
                break
            if round_index == config.max_rounds:
                stop = "max_rounds"
                break
            prompt = f"{_context(item, evidence)}\n\nSchema: {schema.describe()}\n\n{E_INSTRUCTION}"
            completion = yield Generate([system(SYSTEM), user(prompt)], self._formatted(JUDGMENT_PATTERN))
            judgment = parse_judgment(completion.text)
            sufficiency.append(judgment.sufficient)
            steps.append(step_from_completion(len(steps), "e_agent", completion,
                                     {"sufficient": judgment.sufficient, "gap": judgment.gap,
                                      "queries": list(judgment.queries)},
                                     "" if judgment.sufficient is not None else "sufficiency not stated"))
            if judgment.sufficient and config.early_stop:
                stop = "sufficient"
                break
            # A follow-up query about nothing the question asks is the instruction's placeholder copied out.
            fresh = [q for q in dict.fromkeys(judgment.queries) if _query_key(q) and _query_key(q) not in asked
                     and content_words(q) & asked_words(item)]
            if not fresh:
                stop = "no_new_query"
                break
            queries = fresh[: config.max_queries_per_round]
            asked.update(_query_key(q) for q in queries)
        stats: dict[str, object] = {
            "rounds": sum(1 for s in steps if s.action == "retrieve"), "stop_reason": stop,
            "early_stop": stop in ("sufficient", "no_new_query"), "sufficiency": sufficiency,
            "schema": schema.describe(), "schema_parsed": schema.parsed, "schema_grounded": schema.grounded,
            "sources": len(evidence.ids),
        }
        reply = yield from self._answer(item, evidence, steps, stats)
        return finish_result(self.name, item, reply, steps, stats, evidence.seen)

    def _answer(self, item: QaItem, evidence: _Evidence, steps: list[Step],
                stats: dict[str, object]) -> Generator[Request, Any, FinalReply]:
        """A-Agent: an evidence report, then one option; without it, a direct answer from the evidence.

        A report cut at its token budget: an answer it states is read; else the report is dropped and the
        A-Agent answers from the evidence directly (the no-report prompt), and an unreadable answer gets the shared
        short retry (`agent.complete_final_answer`). SmolLM2's cut reports are mostly loops ("The evidence report
        for the option [1] is: ..." over and over) that it went on repeating when asked for the answer after
        them, even with the short budget: 6 of 16 validation items unreadable that way (see issue 26's note)."""
        context = _context(item, evidence)
        direct = [system(SYSTEM), user(f"{context}\n\n{answer_instruction(item)}")]
        if not self.config.use_a_agent:
            return (yield from answer_call(item, direct, self.generation, steps))
        conversation = [system(SYSTEM), user(f"{context}\n\n{A_REPORT}")]
        report = yield Generate(conversation, self._formatted(report_pattern(item)).but(
            max_new_tokens=self.config.report_max_new_tokens))
        cited = sorted({int(n) for n in re.findall(r"\[(\d+)\]", report.text) if 0 < int(n) <= len(evidence.ids)})
        stats["cited_sources"] = cited
        steps.append(step_from_completion(len(steps), "a_agent_report", report, {"cited": cited}))
        stats["report_cut"] = report.finish_reason == "length"
        if stats["report_cut"]:
            # Only an answer the report states counts (what follows "the answer is" or an answer tag), not the
            # option its survey of the options opens with.
            statement = _STATES_ANSWER.search(report.text)
            stated = report.text[statement.start():] if statement else None
            if stated is not None and parse_answer(stated, item) is not None:
                return FinalReply(stated)
            return (yield from answer_call(item, direct, self.generation, steps, arguments={"report": "cut, dropped"}))
        # The A-Agent picks one option after its report: decoded to an answer tag where the agents are constrained
        # (a report's per-option lines, repeated as the answer, read as the first option's letter).
        pick = (self.generation.but(choices=answer_choices(item)) if self.config.constrained and item.options
                else self._formatted(ANSWER_TAG_PATTERN))
        return (yield from answer_call(item, conversation + [assistant(report.text), user(answer_instruction(item))],
                                       pick, steps))

