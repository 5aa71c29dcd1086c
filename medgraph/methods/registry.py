"""Methods by name, their configurations, named ablations, and running a method over a list of questions.

Evaluation assets, the CLI and benchmarks all go through `run_method`, so a
method is run the same way everywhere: batches of `batch_size` questions in
lockstep (one model call per step), one shared set of retrieval tools. After
the run, each result's evidence recall is measured on what its answering call
was shown (`record_evidence_recall`), which separates retrieval from reading.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from medgraph.llm.base import ChatModel
from medgraph.llm.hf import release_freed_memory
from medgraph.methods.a2rag import A2Rag, A2RagConfig, GraphTokenEncoder, record_gsrm_gold_recall
from medgraph.methods.agent import Episode, run_lockstep
from medgraph.methods.baselines import (
    ChainOfThought,
    CotConfig,
    IterativeRag,
    IterativeRagConfig,
    MedRag,
    MedRagWithTriples,
    OracleEvidence,
    OracleEvidenceConfig,
    RagConfig,
    RagKgConfig,
)
from medgraph.methods.common import (
    EvidenceMetrics,
    MethodResult,
    ShownUnit,
    evidence_metrics,
    gold_doc_recall,
    score_against,
)
from medgraph.methods.graph_r1 import GraphR1, GraphR1Config
from medgraph.methods.sema_rag import SemaRag, SemaRagConfig
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.item import QaItem, answer_cuis, as_asked, gold_doc_ids, gold_facts
from medgraph.retrieval import Retriever
from medgraph.text.corpus import documents_in_corpus

log = logging.getLogger(__name__)


class Method(Protocol):
    name: str

    def episode(self, item: QaItem) -> Episode: ...


Builder = Callable[[KnowledgeTools, ChatModel, Any, GraphTokenEncoder | None], Method]


@dataclass(frozen=True)
class MethodSpec:
    config_type: type
    build: Builder
    description: str
    # The reading ceiling is built from the gold facts; every method is given the question as a user would ask
    # it (`qa.item.as_asked`) and is scored against the item afterwards.
    reads_gold: bool = False
    # What a method measures of its own retrieval against gold (A2RAG's GSRM recall), set after the run.
    record_gold: Callable[[KnowledgeTools, Sequence[QaItem], Sequence[MethodResult]], None] | None = None


METHODS: dict[str, MethodSpec] = {
    "a2rag": MethodSpec(A2RagConfig, lambda tools, llm, config, gt: A2Rag(tools, llm, config, gt),
                        "A2RAG: AWC tool routing, GSRM subgraph refinement, HIIM graph tokens",
                        record_gold=record_gsrm_gold_recall),
    "graph-r1": MethodSpec(GraphR1Config, lambda tools, llm, config, gt: GraphR1(tools.retriever, llm, config),
                           "Graph-R1 agent: search / traverse / analyze / answer over the KG"),
    "sema-rag": MethodSpec(SemaRagConfig, lambda tools, llm, config, gt: SemaRag(tools, llm, config),
                           "SEMA-RAG: I-Agent schema, E-Agent sufficiency loop, A-Agent evidence report"),
    "cot": MethodSpec(CotConfig, lambda tools, llm, config, gt: ChainOfThought(tools, llm, config),
                      "chain of thought, no retrieval"),
    "rag": MethodSpec(RagConfig, lambda tools, llm, config, gt: MedRag(tools, llm, config),
                      "MedRAG: text snippets only (BM25 + dense fused by RRF), one answer call"),
    "rag-kg": MethodSpec(RagKgConfig, lambda tools, llm, config, gt: MedRagWithTriples(tools, llm, config),
                         "our variant of MedRAG: the same snippets plus the question concepts' KG triples"),
    "oracle-evidence": MethodSpec(
        OracleEvidenceConfig, lambda tools, llm, config, gt: OracleEvidence(tools, llm, config),
        "the reading ceiling: the gold facts and wrong-relation triples of the same concepts, nothing else",
        reads_gold=True),
    "irag": MethodSpec(IterativeRagConfig, lambda tools, llm, config, gt: IterativeRag(tools, llm, config),
                       "i-MedRAG: rounds of follow-up queries, each answered from its own snippets; "
                       "the query-answer pairs are the next round's and the final answer's context"),
}

# Named ablations (docs/ARCHITECTURE.md "Evaluation protocol"): a method and the configuration fields it changes.
ABLATIONS: dict[str, tuple[str, dict[str, object]]] = {
    "a2rag-no-awc": ("a2rag", {"use_awc": False}),
    "a2rag-no-gsrm": ("a2rag", {"retrieval": "one_hop"}),
    "a2rag-edge-search": ("a2rag", {"retrieval": "edge_search"}),
    "a2rag-no-hiim": ("a2rag", {"use_hiim": False}),
    "graph-r1-no-search": ("graph-r1", {"actions": ("traverse", "analyze")}),
    "graph-r1-no-traverse": ("graph-r1", {"actions": ("search", "analyze")}),
    "graph-r1-no-analyze": ("graph-r1", {"actions": ("search", "traverse")}),
    # Training ablations: the same agent, another policy (medgraph.rl.policy.choose_policy picks it by name).
    "graph-r1-no-sft": ("graph-r1", {}),  # the base LLM as policy: no SFT, no GRPO
    "graph-r1-sft-only": ("graph-r1", {}),  # the SFT champion, no GRPO (skipped when none is registered)
    "sema-rag-no-i-agent": ("sema-rag", {"use_i_agent": False}),
    "sema-rag-no-e-agent": ("sema-rag", {"use_e_agent": False}),
    "sema-rag-no-a-agent": ("sema-rag", {"use_a_agent": False}),
    "sema-rag-no-early-stop": ("sema-rag", {"early_stop": False}),
}


def make_config(name: str, overrides: Mapping[str, object] | None = None) -> Any:
    """The configuration of a method or a named ablation, with `overrides` applied.

    Unknown field names are an error, so a typo in run config cannot silently run the default.
    """
    method, preset = ABLATIONS.get(name, (name, {}))
    if method not in METHODS:
        raise ValueError(f"unknown method {name!r}; methods: {', '.join(METHODS)}; ablations: {', '.join(ABLATIONS)}")
    config_type = METHODS[method].config_type
    fields = {f.name for f in dataclasses.fields(config_type)}
    changes = {**preset, **(overrides or {})}
    unknown = set(changes) - fields
    if unknown:
        raise ValueError(f"{method}: unknown configuration fields {sorted(unknown)}; known: {sorted(fields)}")
    return config_type(**changes)


def method_of(name: str) -> str:
    """The method a method or ablation name runs."""
    return ABLATIONS.get(name, (name, {}))[0]


def build_method(name: str, tools: KnowledgeTools, llm: ChatModel, config: object | None = None,
                 graph_tokenizer: GraphTokenEncoder | None = None) -> Method:
    spec = METHODS[method_of(name)]
    config = config if config is not None else make_config(name)
    if not isinstance(config, spec.config_type):
        raise TypeError(f"{name} takes a {spec.config_type.__name__}, got {type(config).__name__}")
    return spec.build(tools, llm, config, graph_tokenizer)


def run_method(name: str, items: Sequence[QaItem], retriever: Retriever | KnowledgeTools, llm: ChatModel,
               config: object | None = None, batch_size: int = 8,
               graph_tokenizer: GraphTokenEncoder | None = None,
               reader: ChatModel | None = None) -> list[MethodResult]:
    """Answer `items` with a method (or named ablation), `batch_size` questions in lockstep at a time.

    Pass a `KnowledgeTools` instead of a Retriever to share its caches (concept dictionary,
    triple vectors) across several runs. The LLM's prefix cache is not shared: each run starts
    with it empty, so a method's prompt tokens computed and its latency are its own (an ablation
    run after its full method would otherwise reuse the full method's prompts).

    `reader`: a model for the answering calls only (`agent.Generate.answering`; e.g. the adapted reader of
    `medgraph.rl.reader`); retrieval, routing, queries and agent turns stay with `llm`. Graph-R1's policy
    answers itself.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tools = retriever if isinstance(retriever, KnowledgeTools) else KnowledgeTools(retriever)
    spec = METHODS[method_of(name)]
    method = build_method(name, tools, llm, config, graph_tokenizer)
    _empty_prefix_caches(llm, reader)
    asked = list(items) if spec.reads_gold else [as_asked(item) for item in items]
    results: list[MethodResult] = []
    for start in range(0, len(asked), batch_size):
        batch = asked[start:start + batch_size]
        results += run_lockstep([method.episode(item) for item in batch], llm, reader)
    for result, item in zip(results, items, strict=True):
        result.method = name
        score_against(result, item)
    if spec.record_gold is not None:
        spec.record_gold(tools, items, results)
    record_evidence_recall(tools, items, results)
    record_gold_doc_recall(tools, items, results)
    # The next run starts with empty caches anyway: give their keys/values (up to 1 GB a model) back now, not
    # after the next run's first call (a long Dagster run's process otherwise carries them from step to step).
    _empty_prefix_caches(llm, reader)
    release_freed_memory()
    return results


def _empty_prefix_caches(*models: ChatModel | None) -> None:
    for model in models:
        if model is not None:
            model.clear_prefix_cache()


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences of a text."""
    spans, start = [], 0
    for boundary in _SENTENCE_END.finditer(text):
        spans.append((start, boundary.start()))
        start = boundary.end()
    return spans + [(start, len(text))]


def _chunk_unit(text: str, mentions: Sequence[tuple[str, int, int]], limit: int | None) -> ShownUnit:
    """A chunk shown up to `limit` characters: the concepts each of its sentences names within them."""
    spans = _sentence_spans(text)
    by_sentence: list[set[str]] = [set() for _ in spans]
    for cui, start, end in mentions:
        if limit is not None and end > limit:
            continue
        index = next((k for k, (a, b) in enumerate(spans) if a <= start < max(b, a + 1)), len(spans) - 1)
        by_sentence[index].add(cui)
    together = tuple(frozenset(s) for s in by_sentence if len(s) > 1)
    return ShownUnit(frozenset(), together, frozenset().union(*by_sentence))


def _concept_text_states(cui: str, text: str, facts: Sequence[frozenset[str]], names: dict[str, str]) -> frozenset[str]:
    """The fact keys a KG concept text states: "<relation words> <object name>" of the concept's own
    edges, as `kg_node_text` writes its relations."""
    lowered = text.lower()
    stated = set()
    for key in (k for fact in facts for k in fact):
        head, relation, tail = key.split("|")
        if head == cui and tail in names and f"{relation.replace('_', ' ')} {names[tail]}".lower() in lowered:
            stated.add(key)
    return frozenset(stated)


def record_evidence_recall(tools: KnowledgeTools, items: Sequence[QaItem], results: Sequence[MethodResult]) -> None:
    """Set each result's `gold_fact_seen`, `gold_fact_top10` and `answer_seen` (also in its stats) from
    the evidence its answering call was shown as text (`common.evidence_metrics`), and the share of gold facts
    among its graph tokens' triples (stats `gold_fact_in_graph_tokens`, A2RAG with HIIM): one mentions lookup
    for every shown chunk, one dictionary pass over the sentences of every other shown text. None where the item
    carries no gold facts / answer concepts (e.g. MIRAGE items, a "no" question's facts)."""
    gold = [(gold_facts(item), answer_cuis(item)) for item in items]
    measured = [i for i, (facts, answers) in enumerate(gold) if facts or answers]
    is_measured = set(measured)
    chunk_ids = sorted({c for i in measured for c in results[i].evidence.chunks})
    mentions = tools.chunk_mentions(chunk_ids)
    chunk_texts = {chunk_id: chunk.text for chunk_id, chunk in tools.retriever.chunks(chunk_ids).items()}
    heads_and_tails = {part for i in measured for fact in gold[i][0] or () for key in fact
                       for part in key.split("|")[::2]}
    names = {cui: node.name for cui, node in tools.retriever.nodes(sorted(heads_and_tails)).items()}
    sentences = [(i, k, sentence) for i in measured for k, text in enumerate(results[i].evidence.texts)
                 for sentence in _SENTENCE_END.split(text)]
    sentences += [(i, cui, sentence) for i in measured for cui, text in results[i].evidence.concept_texts.items()
                  for sentence in _SENTENCE_END.split(text)]
    in_sentences: dict[tuple[int, object], list[set[str]]] = defaultdict(list)
    for (i, key, _), cuis in zip(sentences, tools.mentioned_concepts([t for *_, t in sentences]) if sentences else []):
        in_sentences[(i, key)].append(set(cuis))
    for i, result in enumerate(results):
        metrics = EvidenceMetrics(None, None, None)
        if i in is_measured:
            evidence, facts = result.evidence, gold[i][0] or ()
            units = []
            for kind, key in evidence.order:
                if kind == "triple":
                    src, relation, dst = evidence.triples[key]
                    units.append(ShownUnit(frozenset({f"{src}|{relation}|{dst}"}), (), frozenset({src, dst})))
                elif kind == "chunk":
                    units.append(_chunk_unit(chunk_texts.get(key, ""), mentions.get(key, []), evidence.chunks[key]))
                elif kind == "concept_text":  # about the concept even where it never names it
                    named = frozenset({key}).union(*in_sentences.get((i, key), []))
                    states = _concept_text_states(key, evidence.concept_texts[key], facts, names)
                    units.append(ShownUnit(states, (), named))
                else:
                    together = tuple(frozenset(s) for s in in_sentences.get((i, int(key)), []))
                    units.append(ShownUnit(frozenset(), together, frozenset().union(*together)))
            units.append(ShownUnit(frozenset(), (), frozenset(evidence.concepts)))  # listed by name only
            metrics = evidence_metrics(units, gold[i][0], gold[i][1])
            if evidence.graph_tokens and facts:
                as_tokens = {"|".join(triple) for triple in evidence.graph_tokens.values()}
                result.stats["gold_fact_in_graph_tokens"] = sum(bool(f & as_tokens) for f in facts) / len(facts)
        result.gold_fact_seen, result.gold_fact_top10 = metrics.gold_fact_seen, metrics.gold_fact_top10
        result.answer_seen = metrics.answer_seen
        result.stats.update(gold_fact_seen=metrics.gold_fact_seen, gold_fact_top10=metrics.gold_fact_top10,
                            answer_seen=metrics.answer_seen)


def record_gold_doc_recall(tools: KnowledgeTools, items: Sequence[QaItem], results: Sequence[MethodResult]) -> None:
    """Set each result's `gold_doc_recall` (also in its stats): whether a chunk of the question's own
    document (`gold_doc_ids`, e.g. its PubMed abstract) was among the passages its answering call was
    shown. Not measured (None) where the item names no document, or none of its documents is in the
    corpus (then the stats say `gold_doc_in_corpus: false` and a warning names how many)."""
    gold = {i: docs for i, item in enumerate(items) if (docs := gold_doc_ids(item))}
    if not gold:
        return
    in_corpus = documents_in_corpus(tools.retriever.graph.con, [d for docs in gold.values() for d in docs])
    missing = [items[i].qid for i, docs in gold.items() if not in_corpus.intersection(docs)]
    if missing:
        log.warning("%d of %d questions have no gold document in text.corpus_chunks (e.g. %s): their gold-doc "
                    "recall is not measured; add their abstracts to the corpus (corpus_files) to measure it",
                    len(missing), len(gold), ", ".join(missing[:3]))
    shown = {c for i in gold for c in results[i].evidence.chunks}
    doc_of_chunk = {chunk_id: chunk.doc_id for chunk_id, chunk in tools.retriever.chunks(sorted(shown)).items()}
    for i, docs in gold.items():
        result = results[i]
        present = in_corpus.intersection(docs)
        result.gold_doc_recall = gold_doc_recall(result.evidence, sorted(present), doc_of_chunk) if present else None
        result.stats.update(gold_doc_recall=result.gold_doc_recall, gold_doc_in_corpus=bool(present))
