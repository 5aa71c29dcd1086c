"""A2RAG: adaptive agentic graph RAG (docs/ARCHITECTURE.md "The three methods").

- AWC, the agent workflow controller: a ReAct loop in which the model picks one
  tool per step from {T_KG, T_Text, T_Final}; which sources a question used
  (KG-only, Text-only, KG+Text, none) is recorded.
- GSRM, graph self-refinement (T_KG): entities E_q of the question and
  options; G_init = their 1-hop triples; each triple is scored by
  cosine(emb("h r t"), emb(q)); the entities of triples scoring >= tau are
  expanded by one hop; K times; the top-N triples are returned.
- HIIM: the retrieved triples also enter the final answer call as graph tokens
  (a GAT plus a projection into the LLM's input embeddings) when a projector is
  registered and the backend takes `inputs_embeds`; otherwise the answer is
  text-only, and the result says which.

Ablations are configuration: `use_awc=False` runs the fixed plan
T_KG -> T_Text -> T_Final; `retrieval="one_hop"` scores G_init without
expansion and `retrieval="edge_search"` takes the nearest triples of the whole
edge index instead of GSRM; `use_hiim=False` answers from text only.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from medgraph.kg.graph import Triple
from medgraph.llm.base import ChatModel, GenerationConfig, Message, assistant, system, user
from medgraph.methods.agent import Episode, Generate, Request, ToolCall, ToolOutput, answer_call
from medgraph.methods.common import (
    EvidenceSeen,
    FinalReply,
    MethodResult,
    Step,
    answer_instruction,
    finish_result,
    format_passages,
    format_question,
    format_triples,
    step_from_completion,
)
from medgraph.methods.tools import KnowledgeTools, Passage
from medgraph.qa.item import QaItem, gold_edge_ids

if TYPE_CHECKING:
    from torch import Tensor

T_KG, T_TEXT, T_FINAL = "T_KG", "T_Text", "T_Final"


class GraphTokenEncoder(Protocol):
    """HIIM's encoder, as A2RAG uses it: triples -> graph tokens (n, llm.hidden_size) in the LLM's
    input-embedding space (implemented by `medgraph.gnn.graph_tokens.GraphTokenizer`)."""

    def encode(self, triples: Sequence[Triple]) -> Tensor: ...


@dataclass(frozen=True)
class A2RagConfig:
    use_awc: bool = True  # False: fixed plan T_KG -> T_Text -> T_Final
    retrieval: Literal["gsrm", "one_hop", "edge_search"] = "gsrm"  # the two others are "without GSRM"
    use_hiim: bool = True  # False: text-only answers even when a graph tokenizer is available
    max_steps: int = 4  # AWC decisions; the answer is forced after the last
    tau: float = 0.5  # GSRM expansion threshold (tune on validation only)
    iterations: int = 2  # GSRM K
    top_n: int = 50  # GSRM N
    # (dataset, tau, K, N) per benchmark (models/gsrm_params tunes each dataset's validation questions apart); an
    # item of another dataset uses tau, K, N above. Per dataset, not per question type: the type (one hop or two)
    # comes from the gold path, which a method never sees.
    gsrm_by_dataset: tuple[tuple[str, float, int, int], ...] = ()
    max_triples_per_relation: int | None = 50  # hub guard per (entity, relation); None: every edge
    text_k: int = 5  # passages per T_Text call
    observe_triples: int = 15  # triples an AWC observation shows (the answer sees `context_triples`)
    context_triples: int = 30
    max_new_tokens: int = 96
    # One worked AWC exchange before the question. Off: the route must be the model's own zero-shot choice, as
    # in the paper; a small model copies the example's tool (SmolLM2 routed 100% KG-only with it).
    demonstration: bool = False

    def __post_init__(self) -> None:  # run config and JSON give lists
        object.__setattr__(self, "gsrm_by_dataset", tuple((str(dataset), float(tau), int(k), int(n))
                                                          for dataset, tau, k, n in self.gsrm_by_dataset))

    def gsrm_for(self, item: QaItem) -> tuple[float, int, int]:
        """(tau, K, N) for this item: its dataset's, else the configured ones."""
        return next(((tau, k, n) for dataset, tau, k, n in self.gsrm_by_dataset if dataset == item.dataset),
                    (self.tau, self.iterations, self.top_n))


@dataclass
class GsrmResult:
    """The refined subgraph of one question, how it grew, and how well it ranks the gold facts."""

    triples: list[tuple[Triple, float]]  # top-N, best first
    sizes: list[int]  # |G| at G_init and after each expansion
    frontier_sizes: list[int]  # entities expanded at each iteration
    entities: list[str]  # E_q
    # All of G before the top-N cut, in the order triples joined: G after iteration k is subgraph[:sizes[k]].
    subgraph: list[Triple] = field(default_factory=list, repr=False)
    # cosine(emb(triple), emb(q)) of each subgraph triple (a triple's score does not depend on k); [] when
    # the subgraph is already in rank order (the edge-search ablation).
    scores: list[float] = field(default_factory=list, repr=False)
    iterations: int = 0  # the configured K (refinement may stop earlier: G then stays as it is)
    top_n: int | None = None  # the configured N (None: as many as returned)
    gold_recall: float | None = None  # share of gold pairs connected by a triple of the top-N (when gold is known)
    # Recall@10 and Recall@N of the ranked list of G_k, k = 0..K (the seed's measure; see `ranked_recall`).
    recall_at10_by_iteration: list[float] | None = None
    recall_atN_by_iteration: list[float] | None = None

    def ranked(self, iteration: int) -> list[Triple]:
        """G_k's triples, best score first (ties by edge id, as the top-N cut); G_K beyond the last expansion."""
        size = self.sizes[min(iteration, len(self.sizes) - 1)] if self.sizes else len(self.subgraph)
        triples = self.subgraph[:size]
        if not self.scores:
            return triples
        order = sorted(range(len(triples)), key=lambda j: (-self.scores[j], triples[j].edge_id))
        return [triples[j] for j in order]

    def ranked_recall(self, pairs: Sequence[frozenset[str]], cutoffs: Sequence[int],
                      iterations: int | None = None) -> dict[int, list[float]]:
        """Recall@c for each cutoff c at k = 0..iterations (default: the configured K): the share of the
        gold concept pairs that some triple among the top c of G_k's ranked list connects (either
        direction, any relation)."""
        last = self.iterations if iterations is None else iterations
        curves: dict[int, list[float]] = {c: [] for c in cutoffs}
        for k in range(last + 1):
            ranked = self.ranked(k)
            for cutoff in cutoffs:
                curves[cutoff].append(_recall(pairs, ranked[:cutoff]))
        return curves

    def stats(self) -> dict[str, object]:
        return {"gsrm_sizes": self.sizes, "gsrm_frontiers": self.frontier_sizes,
                "gsrm_iterations": len(self.frontier_sizes), "gsrm_entities": len(self.entities),
                "gsrm_returned": len(self.triples), "gsrm_gold_recall": self.gold_recall,
                "gsrm_recall_at10_by_iteration": self.recall_at10_by_iteration,
                "gsrm_recall_atN_by_iteration": self.recall_atN_by_iteration}


def gsrm_refine(tools: KnowledgeTools, entity_sets: Sequence[Sequence[str]], queries: Sequence[str],
                tau: float = 0.5, iterations: int = 2, top_n: int = 50,
                per_relation_limit: int | None = None) -> list[GsrmResult]:
    """Graph self-refinement for a batch of questions: grow each 1-hop subgraph through the entities
    of triples scoring >= tau, `iterations` times, then keep each question's top_n triples.

    Each result keeps its whole subgraph in join order with every triple's score, so the ranked list
    of G_k (and its Recall@c) is known for every k <= K from this one run."""
    query_vectors = tools.query_vectors(queries)
    graphs = [{t.edge_id: t for t in hop} for hop in tools.one_hop(entity_sets, per_relation_limit)]
    expanded = [set(entities) for entities in entity_sets]
    results = [GsrmResult([], [len(g)], [], list(e), iterations=iterations, top_n=top_n)
               for g, e in zip(graphs, entity_sets)]
    scored: list[dict[str, float]] = [{} for _ in graphs]  # edge id -> score: each triple is scored once
    active = set(range(len(graphs)))
    for _ in range(iterations):
        tools.triple_vectors([t for i in active for t in graphs[i].values()])  # one encode for the batch
        frontiers: dict[int, set[str]] = {}
        for i in sorted(active):
            new = [t for t in graphs[i].values() if t.edge_id not in scored[i]]
            scored[i].update(zip((t.edge_id for t in new), tools.score_triples(new, query_vectors[i]).tolist()))
            reached = {c for t in graphs[i].values() if scored[i][t.edge_id] >= tau for c in (t.src_cui, t.dst_cui)}
            if reached - expanded[i]:
                frontiers[i] = reached - expanded[i]
        active = set(frontiers)
        if not active:
            break
        hops = tools.one_hop([sorted(frontiers[i]) for i in sorted(active)], per_relation_limit)
        for i, hop in zip(sorted(active), hops):
            graphs[i].update((t.edge_id, t) for t in hop)
            expanded[i] |= frontiers[i]
            results[i].sizes.append(len(graphs[i]))
            results[i].frontier_sizes.append(len(frontiers[i]))
    tools.triple_vectors([t for g in graphs for t in g.values()])
    for i, graph in enumerate(graphs):
        triples = list(graph.values())
        new = [t for t in triples if t.edge_id not in scored[i]]
        scored[i].update(zip((t.edge_id for t in new), tools.score_triples(new, query_vectors[i]).tolist()))
        scores = [float(scored[i][t.edge_id]) for t in triples]
        order = sorted(range(len(triples)), key=lambda j: (-scores[j], triples[j].edge_id))[:top_n]
        results[i].triples = [(triples[j], scores[j]) for j in order]
        results[i].subgraph, results[i].scores = triples, scores
    return results


def gsrm_items(tools: KnowledgeTools, items: Sequence[QaItem], config: A2RagConfig) -> list[GsrmResult]:
    """A2RAG's T_KG retrieval for a batch of questions: E_q linked, then GSRM with each item's tau, K and N
    (`A2RagConfig.gsrm_for`; K = 0 for the `one_hop` ablation), one `gsrm_refine` per distinct setting."""
    entities = tools.question_entities(items)
    groups: dict[tuple[float, int, int], list[int]] = {}
    for i, item in enumerate(items):
        tau, iterations, top_n = config.gsrm_for(item)
        groups.setdefault((tau, iterations if config.retrieval == "gsrm" else 0, top_n), []).append(i)
    results: list[GsrmResult | None] = [None] * len(items)
    for (tau, iterations, top_n), ids in groups.items():
        found = gsrm_refine(tools, [entities[i] for i in ids], [items[i].question for i in ids], tau, iterations,
                            top_n, config.max_triples_per_relation)
        for i, result in zip(ids, found, strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def record_gold_recall(tools: KnowledgeTools, results: Sequence[GsrmResult],
                       gold_paths: Sequence[Sequence[str] | None]) -> None:
    """Set each result's recall of its gold facts: the unordered concept pairs of its gold-path edges
    (UMLS stores most facts in both directions and some under two relations; any triple joining the
    pair counts). `gold_recall` is over the returned top-N; the by-iteration lists are Recall@10 and
    Recall@N of the ranked list of G_k, k = 0..K."""
    wanted = {edge for path in gold_paths if path for edge in path}
    pairs_of = {t.edge_id: frozenset((t.src_cui, t.dst_cui)) for t in tools.retriever.graph.triples(wanted)}
    for result, path in zip(results, gold_paths):
        pairs = list(dict.fromkeys(pairs_of[e] for e in path or () if e in pairs_of))
        if not pairs:
            continue
        top_n = result.top_n or len(result.triples)
        result.gold_recall = _recall(pairs, [t for t, _ in result.triples])
        curves = result.ranked_recall(pairs, (10, top_n))
        result.recall_at10_by_iteration, result.recall_atN_by_iteration = curves[10], curves[top_n]


def record_gsrm_gold_recall(tools: KnowledgeTools, items: Sequence[QaItem], results: Sequence[MethodResult]) -> None:
    """After a run: each A2RAG result's GSRM recall of its item's gold facts (`record_gold_recall`), into its
    stats. The episode answered the item as asked; its GSRM result waits in `MethodResult.retrieval`."""
    searched = [(result, item) for result, item in zip(results, items, strict=True)
                if isinstance(result.retrieval, GsrmResult)]
    record_gold_recall(tools, [result.retrieval for result, _ in searched],
                       [gold_edge_ids(item) for _, item in searched])
    for result, _ in searched:
        result.stats.update(result.retrieval.stats())


def _recall(pairs: Sequence[frozenset[str]], triples: Sequence[Triple]) -> float:
    """Share of the concept pairs that some triple connects (either direction, any relation)."""
    connected = {frozenset((t.src_cui, t.dst_cui)) for t in triples}
    return sum(pair in connected for pair in pairs) / len(pairs) if pairs else 0.0


# --------------------------------------------------------------------------- prompts and parsing

AWC_SYSTEM = f"""You are a medical expert who answers questions with the help of tools.
Tools:
{T_KG}: facts (head, relation, tail) about the question's concepts from the UMLS knowledge graph.
{T_TEXT}: passages from medical texts; you may give a search query in brackets, e.g. {T_TEXT}[drugs for gout].
{T_FINAL}: you have enough evidence; stop and answer.
Each turn, reply with exactly two lines:
Thought: <one short sentence>
Action: {T_KG} or {T_TEXT}[query] or {T_FINAL}"""

# The AWC's task closes its first message. Zero-shot, a question shown with an "Options:" list is answered
# rather than routed: SmolLM2-135M answered all 8 validation questions so, under three system-prompt wordings
# and with this task after the list; with the options inline as candidate answers and this task last, it named a
# tool for 4 of 8 (the order of the tools listed here is the order that did not name the first one every time).
AWC_TASK = (f"Which tool do you use first? Reply with two lines:\nThought: <one short sentence>\n"
            f"Action: {T_TEXT}[query] or {T_KG} or {T_FINAL}")


def awc_question(item: QaItem) -> str:
    """The AWC's first message: the question, its options inline as candidate answers, then the task."""
    candidates = f" (candidate answers: {'; '.join(item.options.values())})" if item.options else ""
    return f"Question: {item.question.strip()}{candidates}\n\n{AWC_TASK}"


# Opt-in (`demonstration=True`): small models follow a format they are shown far more reliably than one they
# are told, but they also copy the shown choice, so the routing statistics would measure the example.
AWC_DEMONSTRATION = (
    user(awc_question(QaItem("demo", "gout", "Which of the following may treat gout?",
                             {"A": "allopurinol", "B": "insulin"}, "A"))),
    assistant(f"Thought: I need facts about gout and these drugs.\nAction: {T_KG}"),
)

ANSWER_SYSTEM = "You are a medical expert. Answer the question; use the evidence when it is relevant."
GRAPH_TOKENS_NOTE = " The knowledge-graph facts are also given as graph tokens after the question."
PASSAGE_CHARS = 600  # characters of a passage the answer prompt shows


def answer_conversation(item: QaItem, triples: Sequence[Triple], passages: Sequence[Passage],
                        graph_tokens: bool = False) -> list[Message]:
    """T_Final's prompt: the question, the knowledge-graph facts (`triples`, already cut to
    `context_triples`) and the passages as text, and the answer instruction; the system prompt says
    when graph tokens follow (HIIM). The HIIM projector trains and validates on this same prompt."""
    sections = [format_question(item)]
    if triples:
        sections.append("Knowledge graph facts:\n" + format_triples(triples))
    if passages:
        sections.append("Text passages:\n" + format_passages([(p.title, p.text) for p in passages],
                                                            max_chars=PASSAGE_CHARS))
    sections.append(answer_instruction(item))
    note = GRAPH_TOKENS_NOTE if graph_tokens else ""
    return [system(ANSWER_SYSTEM + note), user("\n\n".join(sections))]

_TOOL_NAMES = {"kg": T_KG, "text": T_TEXT, "final": T_FINAL, "answer": T_FINAL}
_ACTION = re.compile(r"action\s*[:=]?\s*\**\s*(?:t[_\- ]?)?(kg|text|final|answer)\b\s*(?:[\[(](.*?)[\])])?",
                     re.IGNORECASE)
_ANY_TOOL = re.compile(r"\bt[_\- ]?(kg|text|final)\b", re.IGNORECASE)


def parse_tool_choice(text: str) -> tuple[str, str] | None:
    """(tool, argument) from an AWC reply: "Action: T_Text[query]" (or T-KG, KG, Final ...), else the
    first tool named anywhere, else an answer tag (T_Final); None when no tool is named."""
    match = _ACTION.search(text) or _ANY_TOOL.search(text)
    if match:
        argument = match.group(2) if match.re is _ACTION and match.group(2) else ""
        return _TOOL_NAMES[match.group(1).lower()], argument.strip().strip("\"'")
    if re.search(r"<\s*answer\s*>", text, re.IGNORECASE):
        return T_FINAL, ""
    return None


def routing_of(tools_used: set[str]) -> str:
    """KG-only, Text-only, KG+Text or none: which knowledge sources a question drew on."""
    kg, text = T_KG in tools_used, T_TEXT in tools_used
    return "KG+Text" if kg and text else "KG-only" if kg else "Text-only" if text else "none"


@dataclass
class _Evidence:
    gsrm: GsrmResult | None = None  # T_KG's result (kept whole for the recall of gold facts measured after the run)
    passages: list[Passage] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)

    @property
    def triples(self) -> list[tuple[Triple, float]]:
        return self.gsrm.triples if self.gsrm is not None else []

    def add_passages(self, found: Sequence[Passage]) -> list[Passage]:
        seen = {p.chunk_id for p in self.passages}
        new = [p for p in found if p.chunk_id not in seen]
        self.passages += new
        return new


# --------------------------------------------------------------------------- the method


class A2Rag:
    """Builds one A2RAG episode per question; tools run batched across the questions of a step."""

    name = "a2rag"

    def __init__(self, tools: KnowledgeTools, llm: ChatModel, config: A2RagConfig = A2RagConfig(),
                 graph_tokenizer: GraphTokenEncoder | None = None):
        self.tools, self.llm, self.config = tools, llm, config
        self.graph_tokenizer = graph_tokenizer
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens)

    # -- batched tools --------------------------------------------------------------------------------
    def knowledge_graph(self, items: list[QaItem]) -> list[GsrmResult]:
        """T_KG for a batch of questions: GSRM (or an ablation's retrieval)."""
        config = self.config
        if config.retrieval == "edge_search":
            hits = self.tools.retriever.search_edges([item.question for item in items], k=config.top_n)
            results = [GsrmResult(list(row), [len(row)], [], [], [t for t, _ in row]) for row in hits]
        else:
            results = gsrm_items(self.tools, items, config)
        return results

    def text(self, queries: list[str]) -> list[list[Passage]]:
        """T_Text for a batch of queries."""
        return self.tools.passages(queries, k=self.config.text_k)

    # -- one question ----------------------------------------------------------------------------------
    def episode(self, item: QaItem) -> Episode:
        config = self.config
        steps: list[Step] = []
        evidence = _Evidence()
        tools_used: set[str] = set()
        stats: dict[str, object] = {"awc_unparsed": 0}
        demonstration = list(AWC_DEMONSTRATION) if config.demonstration else []
        conversation: list[Message] = [system(AWC_SYSTEM), *demonstration, user(awc_question(item))]
        plan = [T_KG, T_TEXT, T_FINAL] if not config.use_awc else []
        for index in range(len(plan) if plan else config.max_steps):
            if plan:
                step, argument = Step(index=index, action=plan[index]), ""
            else:
                step, argument = yield from self._decide(conversation, index, stats)
            steps.append(step)
            if step.action == T_FINAL:
                break
            step.observation = yield from self._use_tool(item, step, argument, evidence, tools_used, stats)
            conversation += [assistant(step.output or f"Action: {step.action}"),
                             user(f"Observation:\n{step.observation}")]
        else:
            if not plan:
                stats["awc_forced_final"] = True
        stats["routing"] = routing_of(tools_used)
        stats["tools_used"] = sorted(tools_used)
        seen = EvidenceSeen()
        reply = yield from self._answer(item, evidence, steps, stats, seen)
        result = finish_result(self.name, item, reply, steps, stats, seen)
        result.retrieval = evidence.gsrm
        return result

    def _decide(self, conversation: list[Message], index: int,
                stats: dict[str, object]) -> Generator[Request, Any, tuple[Step, str]]:
        """AWC: the model names the next tool (and T_Text's query); no tool named means answer now."""
        completion = yield Generate(list(conversation), self.generation)
        choice = parse_tool_choice(completion.text)
        notes = ""
        if choice is None:
            stats["awc_unparsed"] = int(stats["awc_unparsed"]) + 1
            choice, notes = (T_FINAL, ""), "no tool named: answering with the evidence so far"
        tool, argument = choice
        return step_from_completion(index, tool, completion, notes=notes), argument

    def _use_tool(self, item: QaItem, step: Step, argument: str, evidence: _Evidence, tools_used: set[str],
                  stats: dict[str, object]) -> Generator[Request, Any, str]:
        """Run T_KG or T_Text for this question (batched with the others by the driver); the observation."""
        if step.action == T_KG:
            return (yield from self._search_graph(item, step, evidence, tools_used, stats))
        return (yield from self._search_text(argument or item.question, step, evidence, tools_used))

    def _search_graph(self, item: QaItem, step: Step, evidence: _Evidence, tools_used: set[str],
                      stats: dict[str, object]) -> Generator[Request, Any, str]:
        config = self.config
        tau, iterations, top_n = config.gsrm_for(item)
        step.arguments = {"retrieval": config.retrieval, "top_n": top_n}
        if config.retrieval == "gsrm":
            step.arguments.update(tau=tau, iterations=iterations)
        if T_KG in tools_used:
            step.notes = "knowledge graph already searched"
            return f"(the knowledge graph was already searched; its facts are above. Choose {T_TEXT} or {T_FINAL}.)"
        output: ToolOutput = yield ToolCall(self.knowledge_graph, item)
        result: GsrmResult = output.value
        step.latency_s += output.latency_s
        step.retrieved_ids = [t.edge_id for t, _ in result.triples]
        evidence.gsrm = result
        tools_used.add(T_KG)
        stats.update(result.stats())
        shown = [t for t, _ in result.triples[: config.observe_triples]]
        return format_triples(shown) if shown else "(no facts found for these concepts)"

    def _search_text(self, query: str, step: Step, evidence: _Evidence,
                     tools_used: set[str]) -> Generator[Request, Any, str]:
        step.arguments = {"query": query, "k": self.config.text_k}
        if query in evidence.queries:
            step.notes = "repeated query"
            return f"(this query was already searched; its passages are above. Choose another query or {T_FINAL}.)"
        output: ToolOutput = yield ToolCall(self.text, query)
        step.latency_s += output.latency_s
        evidence.queries.append(query)
        new = evidence.add_passages(output.value)
        step.retrieved_ids = [p.chunk_id for p in output.value]
        tools_used.add(T_TEXT)
        start = len(evidence.passages) - len(new) + 1
        return format_passages([(p.title, p.text) for p in new], start=start) if new else "(no new passages)"

    def _answer(self, item: QaItem, evidence: _Evidence, steps: list[Step], stats: dict[str, object],
                seen: EvidenceSeen) -> Generator[Request, Any, FinalReply]:
        """T_Final: one answer call with the evidence as text, plus graph tokens under HIIM; `seen`
        gets what that call is shown as text (triples and passages) and, apart, the graph tokens' triples."""
        context = [t for t, _ in evidence.triples[: self.config.context_triples]]
        tokens, stats["hiim"], reason = self._graph_tokens([t for t, _ in evidence.triples])
        if reason:
            stats["hiim_reason"] = reason
        seen.add_triples(context)
        if tokens is not None:  # every retrieved triple reaches the model as a graph token
            seen.add_graph_tokens(t for t, _ in evidence.triples)
        seen.add_chunks([p.chunk_id for p in evidence.passages], PASSAGE_CHARS)
        conversation = answer_conversation(item, context, evidence.passages, graph_tokens=tokens is not None)
        return (yield from answer_call(
            item, conversation, self.generation, steps, graph_tokens=tokens,
            arguments={"hiim": stats["hiim"], "graph_tokens": 0 if tokens is None else len(tokens)},
            retrieved_ids=[t.edge_id for t in context]))

    def _graph_tokens(self, triples: Sequence[Triple]) -> tuple[Tensor | None, str, str]:
        """(graph tokens or None, "graph-tokens" | "text-only", why text-only)."""
        if not self.config.use_hiim:
            return None, "text-only", "disabled by configuration"
        if self.graph_tokenizer is None:
            return None, "text-only", "no graph tokenizer (no HIIM projector registered)"
        if not self.llm.supports_graph_tokens:
            return None, "text-only", f"backend {self.llm.name} takes text only"
        if not triples:
            return None, "text-only", "no triples retrieved"
        return self.graph_tokenizer.encode(list(triples)), "graph-tokens", ""
