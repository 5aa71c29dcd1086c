"""What every method shares: how a question is shown, how an answer is read and scored, what a trace holds.

One prompt format, one answer parser and one scorer for all methods and
baselines, so that differences between methods come from the methods. An
answer that cannot be read is a parse failure, recorded as such and scored
wrong; it is never mapped to a default option. A result also says whether its
answer reply was cut at the token budget (`truncated`, see
`agent.answer_call`) and what evidence the answering call was shown
(`EvidenceSeen`), from which evidence recall is computed after the run.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from medgraph.kg.graph import Triple
from medgraph.llm.base import Completion
from medgraph.qa.item import QaItem

# --------------------------------------------------------------------------- prompts


def format_question(item: QaItem) -> str:
    """The question and, for multiple choice, its lettered options, one per line."""
    if not item.options:
        return f"Question: {item.question.strip()}"
    options = "\n".join(f"{letter}. {text}" for letter, text in item.options.items())
    return f"Question: {item.question.strip()}\nOptions:\n{options}"


def answer_instruction(item: QaItem) -> str:
    """How the final answer must be written: one option letter, or a short phrase, in an answer tag."""
    if item.options:
        letters = ", ".join(item.options)
        return (f"Give the final answer as one option letter ({letters}) inside <answer></answer>, "
                "e.g. <answer>A</answer>.")
    return "Give the final answer as a short phrase inside <answer></answer>, e.g. <answer>aspirin</answer>."


def format_triples(triples: Sequence[Triple], start: int = 1) -> str:
    """Numbered facts, "1. amlodipine may treat Hypertension"."""
    return "\n".join(f"{i}. {t.text}" for i, t in enumerate(triples, start=start))


def format_passages(passages: Sequence[tuple[str, str]], start: int = 1, max_chars: int = 600) -> str:
    """Numbered (title, text) passages, "[1] title: text", each cut to `max_chars`."""
    lines = []
    for i, (title, text) in enumerate(passages, start=start):
        body = " ".join(text.split())
        body = body if len(body) <= max_chars else body[:max_chars].rsplit(" ", 1)[0] + " ..."
        lines.append(f"[{i}] {title}: {body}" if title and not body.startswith(title) else f"[{i}] {body}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tolerant parsing


def tag_contents(text: str, tag: str) -> list[str]:
    """Contents of every `<tag>...</tag>` in order; a last tag left open (generation stopped at its
    closing string, or ran out) counts up to the end of the text."""
    pattern = re.compile(rf"<\s*{tag}\s*>(.*?)(?:<\s*/\s*{tag}\s*>|$)", re.IGNORECASE | re.DOTALL)
    return [m.group(1).strip() for m in pattern.finditer(text)]


def _normalize_text(text: str) -> str:
    """Lowercase, no punctuation, no articles, single spaces (SQuAD's answer normalization)."""
    text = text.lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


# "B", "(B)", "B. text", "B:" or a letter alone on the reply's first line ("A\n\nThe evidence ...").
_LETTER_ALONE = re.compile(r"^\W*\(?([A-Za-z])\)?[ \t]*(?:[.:)\]]|\n|$)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=|-)?\s*(?:option\s*)?\(?\**\s*(?-i:([A-Z]))\b\)?", re.IGNORECASE)
_CUI = re.compile(r"\bC\d{7}\b", re.IGNORECASE)  # a UMLS concept id, as Graph-R1's observations list them


def _option_letter(candidate: str, options: Mapping[str, str],
                   option_cuis: Sequence[str] | None = None) -> str | None:
    """A letter from one candidate answer string: "B", "(B)", "B. text", an option's exact text, or the
    concept id of exactly one option (`option_cuis`: each option's concept, in letter order). A candidate
    that names concept ids but not exactly one option's is unreadable: it names another concept."""
    candidate = candidate.strip().strip("*").strip()
    letter = _LETTER_ALONE.match(candidate)
    if letter and letter.group(1).upper() in options:
        return letter.group(1).upper()
    cuis = [str(cui).upper() for cui in option_cuis] if option_cuis is not None else []
    by_cui = dict(zip(cuis, options)) if len(cuis) == len(options) else {}
    named = {cui.upper() for cui in _CUI.findall(candidate)} if by_cui else set()
    if named:
        letters = {by_cui.get(cui) for cui in named}
        return letters.pop() if len(letters) == 1 and None not in letters else None
    normalized = _normalize_text(candidate)
    if not normalized:
        return None
    by_text = [k for k, v in options.items() if _normalize_text(v) == normalized]
    if len(by_text) == 1:
        return by_text[0]
    # "Yes, it is ..." / "amlodipine, because ...": the reply opens with exactly one option's text
    # (the longest, when one option's text begins another's).
    opening = [(len(_normalize_text(v)), k) for k, v in options.items()
               if _normalize_text(v) and (normalized + " ").startswith(_normalize_text(v) + " ")]
    opening.sort(reverse=True)
    if opening and (len(opening) == 1 or opening[0][0] > opening[1][0]):
        return opening[0][1]
    # "Cardiogenic shock is a manifestation of Hypotension.": the reply names exactly one option's text
    # (as whole words; an option named only inside another named option's text does not count). Not for
    # yes/no: "there is no evidence that ..." does not answer "no".
    padded = f" {normalized} "
    named = {k: _normalize_text(v) for k, v in options.items() if _normalize_text(v) not in ("", "yes", "no")
             and f" {_normalize_text(v)} " in padded}
    named = {k: v for k, v in named.items() if not any(v != w and f" {v} " in f" {w} " for w in named.values())}
    return next(iter(named)) if len(named) == 1 else None


def parse_answer(text: str, item: QaItem) -> str | None:
    """The answer in a model's reply, or None when it cannot be read.

    Multiple choice: the option letter from `<answer>B</answer>`, "Answer: B", "the answer is
    (B)", a bare letter, an option's exact text, a reply that opens with exactly one option's
    text ("Yes, because ..."), a reply that names exactly one option's text ("X is a manifestation
    of Hypotension."; two options named is unreadable), or the concept id of one option (KG-derived items carry each
    option's concept in `extra["option_cuis"]`; Graph-R1's observations list concepts by id).
    Short answer: the text of the answer tag, of an "Answer:" line, or a reply that is itself
    one short line.
    """
    if item.options:
        return _parse_option(text, item.options, item.extra.get("option_cuis"))
    return _parse_short_answer(text)


def _parse_option(text: str, options: Mapping[str, str], option_cuis: Sequence[str] | None = None) -> str | None:
    for content in reversed(tag_contents(text, "answer")):
        letter = _option_letter(content, options, option_cuis)
        if letter:
            return letter
    visible = re.sub(r"<\s*think\s*>.*?<\s*/\s*think\s*>", " ", text, flags=re.IGNORECASE | re.DOTALL)
    said = [m.group(1).upper() for m in _ANSWER_IS.finditer(visible) if m.group(1).upper() in options]
    if said:
        return said[-1]
    return _option_letter(visible, options, option_cuis)


def _parse_short_answer(text: str) -> str | None:
    for content in reversed(tag_contents(text, "answer")):
        if content:
            return content
    line = re.search(r"answer\s*(?:is\s*:?|:)\s*(.+)", text, re.IGNORECASE)
    if line and line.group(1).strip(" .*"):
        return line.group(1).strip(" .*")
    reply = text.strip().strip(".").strip()
    if reply and "\n" not in reply and len(reply.split()) <= 12 and "<" not in reply:
        return reply
    return None


def parse_json_object(text: str) -> dict[str, object] | None:
    """The first JSON object in a reply (inside a code fence or not), or None."""
    start = text.find("{")
    while start >= 0:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start:end + 1])
                except json.JSONDecodeError:
                    break
                return value if isinstance(value, dict) else None
        start = text.find("{", start + 1)
    return None


_JSON_FIELD = re.compile(
    r'"([A-Za-z_ -]{1,40})"\s*:\s*("(?:[^"\\]|\\.)*"?|\[[^\]]*\]?|true|false|null|-?\d+(?:\.\d+)?)')


def parse_json_fields(text: str) -> dict[str, object]:
    """`"key": value` pairs of a JSON object that may be cut off (a reply that ran out of tokens):
    strings, lists of strings, booleans and numbers, each read as far as it goes."""
    fields: dict[str, object] = {}
    for key, raw in _JSON_FIELD.findall(text):
        if raw.startswith("["):
            value: object = re.findall(r'"((?:[^"\\]|\\.)*)"', raw)
        elif raw.startswith('"'):
            value = raw[1:-1] if raw.endswith('"') and len(raw) > 1 else raw[1:]
        else:
            value = json.loads(raw)
        fields[key.strip().lower().replace(" ", "_").replace("-", "_")] = value
    return fields


def parse_fields(text: str) -> dict[str, object]:
    """The fields of a structured reply: a JSON object, else a cut-off JSON object, else `key: value`
    lines. Keys are lowercased with underscores."""
    found = parse_json_object(text)
    if found:
        return {str(k).strip().lower().replace(" ", "_").replace("-", "_"): v for k, v in found.items()}
    return parse_json_fields(text) or dict(parse_key_values(text))


def parse_key_values(text: str) -> dict[str, str]:
    """`key: value` lines (keys lowercased, markdown bullets and bold removed); later keys win."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(?:[-*]\s*)?\**\s*([A-Za-z][A-Za-z _-]{0,30}?)\s*\**\s*[:=]\s*(.*)$", line)
        if match:
            found[match.group(1).strip().lower().replace(" ", "_").replace("-", "_")] = match.group(2).strip()
    return found


def as_string_list(value: object) -> list[str]:
    """A list of non-empty strings from a JSON list, or a string separated by ';', ',' or newlines."""
    if value is None:
        return []
    if isinstance(value, str):
        parts = re.split(r"[;\n]|,(?![^()]*\))", value)
    elif isinstance(value, Iterable):
        parts = [str(v) for v in value if v is not None]
    else:
        parts = [str(value)]
    cleaned = [p.strip().strip("\"'[]").strip() for p in parts]
    return [p for p in cleaned if p and p.lower() not in ("none", "n/a", "null")]


# --------------------------------------------------------------------------- scoring


def token_f1(prediction: str, gold: str) -> float:
    """Token overlap F1 of normalized answers (SQuAD)."""
    predicted, expected = _normalize_text(prediction).split(), _normalize_text(gold).split()
    common = Counter(predicted) & Counter(expected)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


def score_answer(item: QaItem, prediction: str | None) -> tuple[bool, float]:
    """(correct, f1): option-letter exact match for multiple choice; for short answers, exact match
    of the normalized text against any acceptable answer, and the best token F1."""
    if prediction is None:
        return False, 0.0
    if item.options:
        correct = prediction == item.answer
        return correct, float(correct)
    golds = item.gold_answers
    correct = any(_normalize_text(prediction) == _normalize_text(g) for g in golds)
    return correct, max((token_f1(prediction, g) for g in golds), default=0.0)


# --------------------------------------------------------------------------- evidence the answering model saw


@dataclass
class EvidenceSeen:
    """What a method retrieved and put in front of the model that gives the final answer, and nothing else:
    the triples, chunks and concept texts of that call's context (for a conversation, of every turn still
    in it), in the order they were shown. Never text a model wrote: a model's summary of a passage is not
    the passage. Evidence metrics are computed from it after the run (`registry.record_evidence_recall`)."""

    triples: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # edge id -> (src, relation, dst)
    chunks: dict[str, int | None] = field(default_factory=dict)  # chunk id -> characters shown (None: all)
    concept_texts: dict[str, str] = field(default_factory=dict)  # CUI -> its text as shown
    concepts: list[str] = field(default_factory=list)  # CUIs listed by name (search hits)
    texts: list[str] = field(default_factory=list)  # other retrieved text shown (e.g. a chunk's title)
    order: list[tuple[str, str]] = field(default_factory=list)  # (kind, id) of each unit, first shown first
    # Triples that reached the model only as graph tokens (A2RAG's HIIM): input embeddings, not text. Not part of
    # what "gold fact seen" counts; measured apart (`gold_fact_in_graph_tokens`).
    graph_tokens: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def _shown(self, kind: str, key: str) -> None:
        if (kind, key) not in self.order:
            self.order.append((kind, key))

    def add_triples(self, triples: Iterable[Triple]) -> None:
        for t in triples:
            self.triples[t.edge_id] = (t.src_cui, t.relation, t.dst_cui)
            self._shown("triple", t.edge_id)

    def add_graph_tokens(self, triples: Iterable[Triple]) -> None:
        for t in triples:
            self.graph_tokens[t.edge_id] = (t.src_cui, t.relation, t.dst_cui)

    def add_chunks(self, chunk_ids: Iterable[str], shown_chars: int | None = None) -> None:
        """Chunks shown up to `shown_chars` characters (a passage cut for the prompt)."""
        for chunk_id in chunk_ids:
            before = self.chunks.get(chunk_id, 0)
            self.chunks[chunk_id] = None if before is None or shown_chars is None else max(before, shown_chars)
            self._shown("chunk", chunk_id)

    def add_concept_text(self, cui: str, text: str) -> None:
        self.concept_texts[cui] = f"{self.concept_texts[cui]}\n{text}" if cui in self.concept_texts else text
        self._shown("concept_text", cui)

    def add_concepts(self, cuis: Iterable[str]) -> None:
        self.concepts += [c for c in cuis if c not in self.concepts]

    def add_text(self, text: str) -> None:
        if text.strip():
            self.texts.append(text)
            self._shown("text", str(len(self.texts) - 1))

    def add(self, other: EvidenceSeen) -> None:
        """Everything `other` holds as well (evidence shown by several steps of one conversation)."""
        offset = len(self.texts)
        for kind, key in other.order:
            if kind == "triple":
                self.triples[key] = other.triples[key]
            elif kind == "chunk":
                self.add_chunks([key], other.chunks[key])
                continue
            elif kind == "concept_text":
                self.add_concept_text(key, other.concept_texts[key])
                continue
            else:
                self.texts.append(other.texts[int(key)])
                key = str(offset + int(key))
            self._shown(kind, key)
        self.add_concepts(other.concepts)
        self.graph_tokens.update(other.graph_tokens)

    @property
    def empty(self) -> bool:
        return not (self.triples or self.chunks or self.concept_texts or self.concepts or self.texts)


TOP_SHOWN = 10  # "gold fact in the top 10 shown": among the first ten evidence units


@dataclass(frozen=True)
class ShownUnit:
    """One evidence unit as the evidence metrics read it: the gold-fact keys it states and the concepts it
    names (a triple: its two ends; a text: every concept a sentence of it mentions)."""

    states: frozenset[str]  # "src|relation|dst" keys stated (a triple: itself; a text: see `text_states`)
    cooccurring: tuple[frozenset[str], ...]  # concepts named together in one sentence (texts)
    concepts: frozenset[str]


def fact_stated(fact: frozenset[str], unit: ShownUnit) -> bool:
    """A gold fact (its alternative keys) is stated by a unit: a triple that is one of the keys (the same
    relation, in either listing), or a text that states one (a KG concept text listing that relation to
    that concept, or one sentence naming both concepts). A triple of another relation between the same
    two concepts does not state it."""
    if fact & unit.states:
        return True
    ends = {frozenset((key.split("|")[0], key.split("|")[2])) for key in fact}
    return any(pair <= together for pair in ends for together in unit.cooccurring)


@dataclass(frozen=True)
class EvidenceMetrics:
    gold_fact_seen: float | None  # share of the gold facts stated anywhere in what was shown
    gold_fact_top10: float | None  # ... within the first TOP_SHOWN units shown
    answer_seen: float | None  # 1.0 when an answer concept is named in what was shown


def evidence_metrics(units: Sequence[ShownUnit], facts: Sequence[frozenset[str]] | None,
                     answers: Sequence[str] | None) -> EvidenceMetrics:
    """The evidence metrics of one result from its shown units (in the order shown). None where the item
    has no gold facts / answer concepts."""
    seen = top = answer = None
    if facts:
        seen = sum(any(fact_stated(f, u) for u in units) for f in facts) / len(facts)
        top = sum(any(fact_stated(f, u) for u in units[:TOP_SHOWN]) for f in facts) / len(facts)
    if answers:
        named = set().union(*(u.concepts for u in units)) if units else set()
        answer = float(any(c in named for c in answers))
    return EvidenceMetrics(seen, top, answer)


def gold_doc_recall(evidence: EvidenceSeen, gold_docs: Sequence[str],
                    doc_of_chunk: Mapping[str, str]) -> float:
    """1.0 when a chunk of one of the gold documents was among the passages shown to the answering
    call (a passage cut for the prompt counts: it was retrieved and shown), else 0.0. For a method
    that shows its top-k passages once (rag), this is recall@k of the gold document."""
    shown_docs = {doc_of_chunk.get(chunk_id) for chunk_id in evidence.chunks}
    return float(any(doc in shown_docs for doc in gold_docs))


# --------------------------------------------------------------------------- traces and results


@dataclass
class Step:
    """One step of one question's run: a model call and/or a tool call, and what it cost."""

    index: int
    action: str  # the tool or agent role, e.g. "T_KG", "search", "i_agent", "answer"
    arguments: dict[str, object] = field(default_factory=dict)
    retrieved_ids: list[str] = field(default_factory=list)  # edge ids, chunk ids or CUIs
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0  # wall time of the batched calls this step took part in
    output: str = ""  # the raw model output ("" for a step without a model call)
    observation: str = ""  # what the tool returned, as the model was shown it
    notes: str = ""
    # Prompt tokens the model ran (a prefix cache served the others, see Completion); None: prompt_tokens.
    prompt_tokens_computed: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens_computed is None:
            self.prompt_tokens_computed = self.prompt_tokens


@dataclass
class MethodResult:
    """One question answered by one method: the prediction, its score, the trace and method statistics."""

    method: str
    dataset: str
    qid: str
    answer: str  # the gold answer
    prediction: str | None
    parse_failed: bool
    correct: bool
    f1: float
    steps: list[Step]
    stats: dict[str, object] = field(default_factory=dict)
    truncated: bool = False  # the answer reply hit its token budget without a readable answer
    extra_answer_call: bool = False  # ... so the model was asked once more for just the answer
    gold_fact_seen: float | None = None  # set after the run (see `evidence_metrics`)
    gold_fact_top10: float | None = None
    answer_seen: float | None = None
    gold_doc_recall: float | None = None  # a chunk of the question's own document was shown
    # What the answering model was shown; kept out of `as_dict` and the traces (the steps hold it as text).
    evidence: EvidenceSeen = field(default_factory=EvidenceSeen, repr=False)
    # A method's own retrieval result, for what it measures against gold after the run (`MethodSpec.record_gold`).
    retrieval: object | None = field(default=None, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def prompt_tokens_computed(self) -> int:
        return sum(s.prompt_tokens_computed for s in self.steps)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)

    @property
    def latency_s(self) -> float:
        return sum(s.latency_s for s in self.steps)

    @property
    def llm_calls(self) -> int:
        return sum(1 for s in self.steps if s.output or s.completion_tokens)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: every field plus the token and latency totals."""
        return {
            **{k: v for k, v in asdict(replace(self, evidence=EvidenceSeen(), retrieval=None)).items()
               if k not in ("evidence", "retrieval")},
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "completion_tokens": self.completion_tokens,
            "latency_s": round(self.latency_s, 4),
            "llm_calls": self.llm_calls,
        }


def step_from_completion(index: int, action: str, completion: Completion,
                         arguments: dict[str, object] | None = None, notes: str = "") -> Step:
    """The trace step of one model call that needs no tool."""
    return Step(index=index, action=action, arguments=arguments or {}, prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens, latency_s=completion.latency_s,
                output=completion.text, notes=notes, prompt_tokens_computed=completion.prompt_tokens_computed)


@dataclass(frozen=True)
class FinalReply:
    """The reply an answer is read from, and whether it took a second call (see `agent.answer_call`)."""

    text: str | None  # None: no answer was given
    truncated: bool = False  # the answer reply was cut at its token budget without a readable answer
    extra_answer_call: bool = False  # ... and the model was asked once more for just the answer


def finish_result(method: str, item: QaItem, reply: str | FinalReply | None, steps: list[Step],
                  stats: Mapping[str, object] | None = None,
                  evidence: EvidenceSeen | None = None) -> MethodResult:
    """Parse the final reply, score it and package the run; `reply=None` means no answer was given."""
    final = reply if isinstance(reply, FinalReply) else FinalReply(reply)
    prediction = parse_answer(final.text, item) if final.text is not None else None
    correct, f1 = score_answer(item, prediction)
    return MethodResult(
        method=method, dataset=item.dataset, qid=item.qid, answer=item.answer, prediction=prediction,
        parse_failed=prediction is None, correct=correct, f1=f1, steps=steps, stats=dict(stats or {}),
        truncated=final.truncated, extra_answer_call=final.extra_answer_call, evidence=evidence or EvidenceSeen(),
    )


def score_against(result: MethodResult, item: QaItem) -> None:
    """Score a result against the item with its gold answer (the method answered the item as asked)."""
    if (result.qid, result.dataset) != (item.qid, item.dataset):
        raise ValueError(f"result for {result.dataset}/{result.qid} scored against {item.dataset}/{item.qid}")
    result.answer = item.answer
    result.correct, result.f1 = score_answer(item, result.prediction)


TRACE_COLUMNS = ("method", "dataset", "qid", "step", "action", "arguments", "retrieved_ids", "prompt_tokens",
                 "prompt_tokens_computed", "completion_tokens", "latency_s", "output", "observation", "notes")


def trace_rows(results: Iterable[MethodResult]) -> list[dict[str, object]]:
    """One flat row per step (arguments as JSON text): the rows of a Parquet traces table."""
    rows = []
    for result in results:
        for step in result.steps:
            rows.append({
                "method": result.method, "dataset": result.dataset, "qid": result.qid, "step": step.index,
                "action": step.action, "arguments": json.dumps(step.arguments, ensure_ascii=False, default=str),
                "retrieved_ids": list(step.retrieved_ids), "prompt_tokens": step.prompt_tokens,
                "prompt_tokens_computed": step.prompt_tokens_computed, "completion_tokens": step.completion_tokens,
                "latency_s": step.latency_s,
                "output": step.output, "observation": step.observation, "notes": step.notes,
            })
    return rows
