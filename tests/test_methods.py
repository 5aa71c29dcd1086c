"""A2RAG, Graph-R1, SEMA-RAG and the baselines: control logic with a scripted model, then each end to end.

Control logic runs on the real tiny KG, corpus and encoder with replies written
by `ScriptedChatModel`, so routing, loop termination, GSRM expansion and parse
failures are checked exactly. The end-to-end tests run every method with the
real SmolLM2 on two questions and check that a result and a trace come out,
not accuracy.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import copy_warehouse

from medgraph.eval.evaluate import method_statistics
from medgraph.kg.graph import Triple
from medgraph.llm.base import Conversation, GenerationConfig
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import (
    KnowledgeTools,
    make_config,
    parse_answer,
    run_method,
    score_answer,
    trace_rows,
)
from medgraph.methods.a2rag import A2Rag, A2RagConfig, gsrm_refine, parse_tool_choice, record_gold_recall
from medgraph.methods.common import token_f1
from medgraph.methods.graph_r1 import GraphR1Config, GraphR1Env, is_well_formed, parse_action, restore_stop
from medgraph.methods.registry import ABLATIONS, METHODS, method_of
from medgraph.methods.sema_rag import parse_judgment, parse_schema
from medgraph.qa.item import QaItem, as_asked, gold_edge_ids
from medgraph.retrieval import Retriever
from medgraph.storage import Warehouse

AMLODIPINE, HYPERTENSION, SEIZURE, FABRY = "C9001289", "C0020538", "C0036572", "C9001444"
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?",
               {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}, "A")
ANGINA = QaItem("test", "angina", "Which of the following may treat Angina pectoris?",
                {"A": "insulin", "B": "amlodipine"}, "B")
FABRY_SEIZURE = QaItem("test", "fabry", "Is Seizure a manifestation of Fabry disease?", {"A": "yes", "B": "no"}, "A")
MECHANISM = QaItem("test", "mechanism", "What is the mechanism of action of amlodipine?", {},
                   "Calcium Channel Antagonists", acceptable_answers=("Calcium Channel Antagonists",
                                                                      "calcium channel blocker"))
QUERY = "Which drug may treat hypertension?"
# Small subgraphs: triples outside the embedded drug edges are encoded on the fly.
CHEAP_A2RAG = {"iterations": 1, "max_triples_per_relation": 3, "top_n": 20}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _question_index(conversation: Conversation) -> int:
    """Where the asked question is (after any demonstration exchange)."""
    return max(i for i, m in enumerate(conversation) if m.role == "user" and m.content.startswith("Question:"))


def question_of(conversation: Conversation) -> str:
    first_line = conversation[_question_index(conversation)].content.split("\n")[0].removeprefix("Question: ")
    return first_line.split(" (candidate answers: ")[0]  # A2RAG's AWC lists the options inline


def assistant_turns(conversation: Conversation) -> int:
    """The policy's turns so far on this question."""
    return sum(1 for m in conversation[_question_index(conversation):] if m.role == "assistant")


# --------------------------------------------------------------------------- answers, parsing, scoring


@pytest.mark.parametrize("reply, expected", [
    ("<answer>B</answer>", "B"),
    ("<think>A looks wrong</think><answer>(C)</answer>", "C"),
    ("Answer: D", "D"),
    ("The answer is (B) because it lowers pressure.", "B"),
    ("B", "B"),
    ("(A)", "A"),
    ("C. insulin", "C"),
    ("amlodipine", "A"),
    ("<answer>Amlodipine</answer>", "A"),
    ("<answer>B", "B"),  # generation stopped at </answer>
    ("amlodipine, because it blocks calcium channels", "A"),
    ("Hypertension may be treated with amlodipine.", "A"),  # names exactly one option
])
def test_parse_answer_reads_the_option_in_many_forms(reply: str, expected: str):
    assert parse_answer(reply, TREAT) == expected


@pytest.mark.parametrize("reply", ["", "I am not sure.", "It could be a drug.", "<answer>E</answer>", "Answer: Z",
                                   "All of them help somewhat.",
                                   "It may be insulin or amlodipine."])  # two options named: no guess
def test_parse_answer_returns_none_instead_of_guessing(reply: str):
    assert parse_answer(reply, TREAT) is None


# KG-derived items carry each option's concept in letter order; Graph-R1's observations list concepts by id.
KG_TREAT = QaItem("test", "kg_treat", TREAT.question, TREAT.options, "A",
                  extra={"option_cuis": [AMLODIPINE, "C9000101", "C9000102", "C9000103"]})


def test_an_answer_naming_one_options_concept_is_that_option():
    assert parse_answer("<think>it lowers glucose</think><answer>C9000102</answer>", KG_TREAT) == "C"
    assert parse_answer(f"<answer>{AMLODIPINE} (amlodipine)</answer>", KG_TREAT) == "A"
    assert parse_answer("<answer>c9000103</answer>", KG_TREAT) == "D"
    assert parse_answer("The answer is C9000101.", KG_TREAT) == "B"
    assert parse_answer("<answer>Insulin</answer>", KG_TREAT) == "C"  # an option's name
    # A concept that is no option (here the question's own), or two options' concepts: a parse failure.
    assert parse_answer(f"<answer>{HYPERTENSION}</answer>", KG_TREAT) is None
    assert parse_answer(f"<answer>{HYPERTENSION} amlodipine</answer>", KG_TREAT) is None
    assert parse_answer(f"<answer>{AMLODIPINE} or C9000102</answer>", KG_TREAT) is None
    assert parse_answer(f"<answer>{AMLODIPINE}</answer>", TREAT) is None  # no option concepts known
    assert score_answer(KG_TREAT, parse_answer(f"<answer>{AMLODIPINE}</answer>", KG_TREAT)) == (True, 1.0)


def test_a_yes_no_reply_is_read_from_its_first_word():
    assert parse_answer("Yes, seizures occur in Fabry disease.", FABRY_SEIZURE) == "A"
    assert parse_answer("<answer>no</answer>", FABRY_SEIZURE) == "B"
    assert parse_answer("There is no evidence either way.", FABRY_SEIZURE) is None  # "no" inside a sentence
    assert parse_answer("Seizures are common.", FABRY_SEIZURE) is None


def test_short_answers_are_text_and_scored_by_exact_match_and_f1():
    assert parse_answer("<answer>calcium channel blockers</answer>", MECHANISM) == "calcium channel blockers"
    assert parse_answer("Answer: calcium channel blocker.", MECHANISM) == "calcium channel blocker"
    assert parse_answer("The answer is: calcium channel blocker", MECHANISM) == "calcium channel blocker"
    assert parse_answer("Let me think.\nThis is long\nand has lines", MECHANISM) is None
    assert score_answer(MECHANISM, "Calcium channel blocker") == (True, 1.0)
    correct, f1 = score_answer(MECHANISM, "calcium channel")
    assert not correct and f1 == pytest.approx(token_f1("calcium channel", "Calcium Channel Antagonists"))
    assert score_answer(MECHANISM, None) == (False, 0.0)
    assert score_answer(TREAT, "A") == (True, 1.0) and score_answer(TREAT, "B") == (False, 0.0)


def test_an_unparseable_answer_is_a_recorded_parse_failure_not_option_a(tools: KnowledgeTools):
    llm = ScriptedChatModel(lambda conversation: "Hypertension is a common condition.")
    (result,) = run_method("cot", [TREAT], tools, llm)
    assert result.prediction is None and result.parse_failed and not result.correct
    assert result.steps[0].output == "Hypertension is a common condition."


# --------------------------------------------------------------------------- the lockstep driver


def test_each_step_is_one_batched_call_over_the_questions_still_running(tools: KnowledgeTools):
    """Four questions finish after 2, 3, 3 and 4 calls: the calls hold 4, 4, 3, 1 conversations."""
    scripts = {TREAT.question: ["Action: T_KG", "Action: T_Final"],
               MECHANISM.question: ["Thought: read.\nAction: T_Text[amlodipine mechanism]", "Action: T_Final"],
               FABRY_SEIZURE.question: ["Action: T_Final"],
               ANGINA.question: ["Action: T_KG", "Action: T_Text", "Action: T_Final"]}

    def reply(conversation: Conversation) -> str:
        if "Action:" not in conversation[0].content:  # the answer call
            return "<answer>calcium channel blocker</answer>" if "Options" not in conversation[1].content \
                else "<answer>A</answer>"
        return scripts[question_of(conversation)][assistant_turns(conversation)]

    llm = ScriptedChatModel(reply)
    results = run_method("a2rag", [TREAT, MECHANISM, FABRY_SEIZURE, ANGINA], tools, llm,
                         A2RagConfig(**CHEAP_A2RAG), batch_size=4)
    assert [len(call) for call in llm.calls] == [4, 4, 3, 1]
    assert [r.stats["routing"] for r in results] == ["KG-only", "Text-only", "none", "KG+Text"]
    assert [r.qid for r in results] == ["treat", "mechanism", "fabry", "angina"]
    assert [s.action for s in results[3].steps] == ["T_KG", "T_Text", "T_Final", "answer"]
    assert results[0].steps[0].observation.startswith("1. ") and "[1]" in results[1].steps[0].observation
    assert results[1].steps[0].arguments["query"] == "amlodipine mechanism"
    assert results[1].prediction == "calcium channel blocker" and results[1].correct


def test_batch_size_splits_the_questions_into_separate_lockstep_groups(tools: KnowledgeTools):
    llm = ScriptedChatModel(lambda conversation: "<answer>A</answer>")
    results = run_method("cot", [TREAT, ANGINA, FABRY_SEIZURE], tools, llm, batch_size=2)
    assert [len(call) for call in llm.calls] == [2, 1]
    assert [r.correct for r in results] == [True, False, True]


# --------------------------------------------------------------------------- A2RAG: AWC


@pytest.mark.parametrize("reply, expected", [
    ("Thought: need facts.\nAction: T_KG", ("T_KG", "")),
    ("Action: T_Text[drugs for gout]", ("T_Text", "drugs for gout")),
    ("action: text", ("T_Text", "")),
    ("I will use T-KG first.", ("T_KG", "")),
    ("Action: T_Final", ("T_Final", "")),
    ("<answer>B</answer>", ("T_Final", "")),
    ("hmm, let me think", None),
])
def test_awc_tool_choice_is_parsed_tolerantly(reply: str, expected: tuple[str, str] | None):
    assert parse_tool_choice(reply) == expected


def test_awc_answers_when_no_tool_is_named_and_records_it(tools: KnowledgeTools):
    def reply(conversation: Conversation) -> str:
        return "I do not know what to do." if "Action:" in conversation[0].content else "<answer>A</answer>"

    (result,) = run_method("a2rag", [TREAT], tools, ScriptedChatModel(reply), A2RagConfig(**CHEAP_A2RAG))
    assert result.stats["awc_unparsed"] == 1 and result.stats["routing"] == "none"
    assert [s.action for s in result.steps] == ["T_Final", "answer"] and "no tool named" in result.steps[0].notes
    assert result.prediction == "A"


def test_awc_routes_zero_shot_with_no_worked_example_in_the_prompt(tools: KnowledgeTools):
    """The paper's AWC decides from the tool descriptions alone: no demonstration whose tool a small model
    copies (with one, SmolLM2 routed every question KG-only)."""
    def reply(conversation: Conversation) -> str:
        first_decision = "Action:" in conversation[0].content and len(conversation) == 2
        return "Thought: passages.\nAction: T_Text[amlodipine]" if first_decision else "<answer>A</answer>"

    llm = ScriptedChatModel(reply)
    (result,) = run_method("a2rag", [TREAT], tools, llm, make_config("a2rag", CHEAP_A2RAG))
    first = llm.calls[0][0]
    assert [m.role for m in first] == ["system", "user"] and first[1].content.startswith("Question: ")
    assert not any(m.role == "assistant" for m in first)
    assert result.stats["routing"] == "Text-only"


def test_awc_stops_at_max_steps_and_answers_with_what_it_has(tools: KnowledgeTools):
    def reply(conversation: Conversation) -> str:
        return "Action: T_Text[amlodipine]" if "Action:" in conversation[0].content else "<answer>A</answer>"

    llm = ScriptedChatModel(reply)
    (result,) = run_method("a2rag", [TREAT], tools, llm, A2RagConfig(max_steps=2, **CHEAP_A2RAG))
    assert [s.action for s in result.steps] == ["T_Text", "T_Text", "answer"]
    assert result.steps[1].notes == "repeated query" and result.stats["awc_forced_final"]
    assert len(llm.calls) == 3


def test_without_awc_the_plan_is_kg_then_text_then_answer_in_one_model_call(tools: KnowledgeTools):
    llm = ScriptedChatModel(lambda conversation: "<answer>A</answer>")
    (result,) = run_method("a2rag-no-awc", [TREAT], tools, llm, make_config("a2rag-no-awc", CHEAP_A2RAG))
    assert [s.action for s in result.steps] == ["T_KG", "T_Text", "T_Final", "answer"]
    assert len(llm.calls) == 1 and result.stats["routing"] == "KG+Text"
    prompt = llm.calls[0][0][-1].content
    assert "Knowledge graph facts:" in prompt and "Text passages:" in prompt and "amlodipine" in prompt


# --------------------------------------------------------------------------- A2RAG: GSRM


def test_gsrm_with_tau_above_one_expands_nothing(tools: KnowledgeTools):
    (result,) = gsrm_refine(tools, [[AMLODIPINE]], [QUERY], tau=1.01, iterations=2, top_n=50)
    assert result.sizes == [5] and result.frontier_sizes == []
    assert {t.src_cui for t, _ in result.triples} == {AMLODIPINE}
    scores = [s for _, s in result.triples]
    assert scores == sorted(scores, reverse=True)


def test_gsrm_with_a_low_tau_expands_every_entity_it_reached(tools: KnowledgeTools):
    (result,) = gsrm_refine(tools, [[AMLODIPINE]], [QUERY], tau=-1.0, iterations=1, top_n=500,
                            per_relation_limit=3)
    neighbours = {t.dst_cui for t in tools.one_hop([[AMLODIPINE]])[0]}
    assert result.frontier_sizes == [len(neighbours)] and result.sizes[1] > result.sizes[0] == 5
    assert {t.src_cui for t in result.subgraph} == {AMLODIPINE} | neighbours


def test_gsrm_expands_exactly_the_entities_of_triples_scoring_at_least_tau(tools: KnowledgeTools):
    g_init = tools.one_hop([[AMLODIPINE]])[0]
    scores = tools.score_triples(g_init, tools.query_vectors([QUERY])[0])
    tau = float(sorted(scores, reverse=True)[1])  # the two best triples pass
    (result,) = gsrm_refine(tools, [[AMLODIPINE]], [QUERY], tau=tau, iterations=1, top_n=500)
    passing = {t.dst_cui for t, s in zip(g_init, scores) if s >= tau}
    assert len(passing) == 2 and result.frontier_sizes == [2]
    assert {t.src_cui for t in result.subgraph} == {AMLODIPINE} | passing
    assert HYPERTENSION in passing  # "amlodipine may treat Hypertension" is about the query


def test_gsrm_runs_at_most_k_iterations(tools: KnowledgeTools):
    for iterations in (0, 1, 2):
        (result,) = gsrm_refine(tools, [[AMLODIPINE]], [QUERY], tau=-1.0, iterations=iterations, top_n=10,
                                per_relation_limit=1)
        assert len(result.frontier_sizes) == iterations and len(result.sizes) == iterations + 1
        assert result.sizes == sorted(result.sizes)


def test_gsrm_returns_the_top_n_triples_of_the_grown_subgraph(tools: KnowledgeTools):
    (result,) = gsrm_refine(tools, [[AMLODIPINE]], [QUERY], tau=-1.0, iterations=1, top_n=3, per_relation_limit=3)
    assert len(result.triples) == 3 and len(result.subgraph) > 3
    every = tools.score_triples(result.subgraph, tools.query_vectors([QUERY])[0])
    assert [s for _, s in result.triples] == pytest.approx(sorted(every, reverse=True)[:3], abs=1e-6)


def test_gsrm_advances_a_batch_of_questions_together(tools: KnowledgeTools):
    both = gsrm_refine(tools, [[AMLODIPINE], [FABRY]], [QUERY, FABRY_SEIZURE.question], tau=1.01, iterations=2,
                       top_n=10, per_relation_limit=2)
    grown = gsrm_refine(tools, [[AMLODIPINE], [FABRY]], [QUERY, FABRY_SEIZURE.question], tau=-1.0, iterations=1,
                        top_n=10, per_relation_limit=2)
    alone = gsrm_refine(tools, [[FABRY]], [FABRY_SEIZURE.question], tau=-1.0, iterations=1, top_n=10,
                        per_relation_limit=2)
    assert {t.src_cui for t, _ in both[0].triples} == {AMLODIPINE} and both[1].frontier_sizes == []
    assert [t.edge_id for t, _ in grown[1].triples] == [t.edge_id for t, _ in alone[0].triples]
    assert grown[1].sizes == alone[0].sizes


def _edge(tools: KnowledgeTools, src: str, relation: str, dst: str) -> Triple:
    return next(t for t in tools.one_hop([[src]])[0] if t.relation == relation and t.dst_cui == dst)


def test_t_kg_records_recall_of_the_gold_path_when_it_is_known(tools: KnowledgeTools):
    treats = _edge(tools, AMLODIPINE, "may_treat", HYPERTENSION)
    elsewhere = _edge(tools, FABRY, "has_manifestation", SEIZURE)
    known = QaItem("test", "gold", MECHANISM.question, {}, "x", extra={"gold_path": [treats.edge_id]})
    unreachable = QaItem("test", "far", MECHANISM.question, {}, "x", extra={"gold_path": [elsewhere.edge_id]})
    a2rag = A2Rag(tools, ScriptedChatModel([]), A2RagConfig(retrieval="one_hop", top_n=500))
    items = [known, unreachable, MECHANISM]
    found, missed, unknown = a2rag.knowledge_graph(items)
    record_gold_recall(tools, [found, missed, unknown], [gold_edge_ids(item) for item in items])
    assert (found.gold_recall, found.recall_atN_by_iteration) == (1.0, [1.0])
    assert (missed.gold_recall, missed.recall_atN_by_iteration) == (0.0, [0.0])
    assert unknown.gold_recall is None


def test_gsrm_recall_by_iteration_shows_when_a_two_hop_gold_path_is_reached(tools: KnowledgeTools):
    """amlodipine -may_treat-> Hypertension -manifestation_of-> X: the second edge joins G at iteration 1
    (Recall@N of the ranked list, N = 500: the whole of G)."""
    treats = _edge(tools, AMLODIPINE, "may_treat", HYPERTENSION)
    second = tools.one_hop([[HYPERTENSION]], per_relation_limit=3)[0][-1]
    item = QaItem("test", "two-hop", MECHANISM.question, {}, "x", extra={"gold_path": [treats.edge_id, second.edge_id]})
    a2rag = A2Rag(tools, ScriptedChatModel([]), A2RagConfig(tau=-1.0, iterations=1, top_n=500,
                                                            max_triples_per_relation=3))
    (result,) = a2rag.knowledge_graph([item])
    record_gold_recall(tools, [result], [gold_edge_ids(item)])
    assert result.recall_atN_by_iteration == [0.5, 1.0] and result.stats()["gsrm_recall_atN_by_iteration"] == [0.5, 1.0]


def test_question_entities_come_from_the_question_and_its_options(tools: KnowledgeTools):
    treat, fabry = tools.question_entities([TREAT, FABRY_SEIZURE])
    assert HYPERTENSION in treat and AMLODIPINE in treat and "C9001356" in treat  # salbutamol, an option
    assert set(fabry) >= {SEIZURE, FABRY}  # yes/no options name no concept


def test_edge_search_ablation_takes_the_nearest_triples_of_the_edge_index(tools: KnowledgeTools):
    a2rag = A2Rag(tools, ScriptedChatModel([]), make_config("a2rag-edge-search", {"top_n": 5}))
    (result,) = a2rag.knowledge_graph([TREAT])
    assert len(result.triples) == 5 and result.frontier_sizes == []
    assert any(t.relation in ("may_treat", "may_be_treated_by") for t, _ in result.triples)


# --------------------------------------------------------------------------- A2RAG: HIIM


class GraphTokenModel(ScriptedChatModel):
    """A scripted model that takes graph tokens and records what it was given."""

    supports_graph_tokens = True
    hidden_size = 8

    def __init__(self, reply):
        super().__init__(reply)
        self.graph_tokens: list[Sequence[torch.Tensor | None] | None] = []

    def generate(self, conversations, config: GenerationConfig | None = None, graph_tokens=None):
        self.graph_tokens.append(graph_tokens)
        return super().generate(conversations, config)


class OnesTokenizer:
    def encode(self, triples: Sequence[Triple]) -> torch.Tensor:
        return torch.ones(len(triples), GraphTokenModel.hidden_size)


def test_hiim_passes_one_graph_token_per_retrieved_triple_to_the_answer_call(tools: KnowledgeTools):
    llm = GraphTokenModel(lambda conversation: "<answer>A</answer>")
    config = make_config("a2rag-no-awc", CHEAP_A2RAG)
    (result,) = run_method("a2rag", [TREAT], tools, llm, config, graph_tokenizer=OnesTokenizer())
    (tokens,) = llm.graph_tokens[0]
    assert result.stats["hiim"] == "graph-tokens"
    assert tokens.shape == (len(result.steps[0].retrieved_ids), 8) and tokens.shape[0] > 0


@pytest.mark.parametrize("use_hiim, llm_type, reason", [
    (False, GraphTokenModel, "disabled by configuration"),
    (True, ScriptedChatModel, "takes text only"),
])
def test_hiim_falls_back_to_text_and_says_why(tools: KnowledgeTools, use_hiim: bool, llm_type: type, reason: str):
    llm = llm_type(lambda conversation: "<answer>A</answer>")
    config = make_config("a2rag-no-awc", {**CHEAP_A2RAG, "use_hiim": use_hiim})
    (result,) = run_method("a2rag", [TREAT], tools, llm, config, graph_tokenizer=OnesTokenizer())
    assert result.stats["hiim"] == "text-only" and reason in result.stats["hiim_reason"]
    assert getattr(llm, "graph_tokens", [None]) == [None]


# --------------------------------------------------------------------------- SEMA-RAG


def sema_reply(judgments: Sequence[str]):
    """A SEMA-RAG script: a JSON schema, then the given E-Agent judgments in turn, a report, an answer."""
    judged = iter(judgments)

    def reply(conversation: Conversation) -> str:
        last = conversation[-1].content
        if "You are a clinical information specialist" in last:
            return ('{"intent": "treatment", "entities": ["Hypertension"], "constraints": ["adults"], '
                    '"query": "drugs that treat hypertension"}')
        if "You are an evidence reviewer" in last:
            return next(judged)
        if "evidence report" in last:
            return "Sources [1] and [2] agree that amlodipine treats hypertension; [99] is not a source."
        return "<answer>A</answer>"
    return reply


def test_sema_rag_stops_at_round_one_when_the_evidence_is_sufficient(tools: KnowledgeTools):
    llm = ScriptedChatModel(sema_reply(['{"sufficient": true, "gap": "", "queries": []}']))
    (result,) = run_method("sema-rag", [TREAT], tools, llm)
    assert result.stats["rounds"] == 1 and result.stats["stop_reason"] == "sufficient" and result.stats["early_stop"]
    assert [s.action for s in result.steps] == ["i_agent", "retrieve", "e_agent", "a_agent_report", "answer"]
    assert result.steps[1].arguments["queries"] == [("drugs that treat hypertension | entities: Hypertension | "
                                                   "constraints: adults")]
    assert result.stats["cited_sources"] == [1, 2] and result.prediction == "A"


def test_sema_rag_agents_decode_to_their_formats_and_the_scripted_replies_match_them(tools: KnowledgeTools):
    """Each agent's call carries its reply format (the schema's and judgment's JSON, the report's line per option,
    then one option tag); unconstrained, none does. The formats accept what a capable model writes."""
    import regex

    from medgraph.methods.agent import answer_choices
    from medgraph.methods.sema_rag import JUDGMENT_PATTERN, SCHEMA_PATTERN, report_pattern

    report = "A: [11] amlodipine may treat it\nB: no source\nC: no source\nD: no source\nAgree: [1], [11]\nConflict: none"
    llm = ScriptedChatModel(lambda c: report if "evidence report" in c[-1].content
                            else sema_reply(['{"sufficient": true, "gap": "none", "queries": []}'])(c))
    (result,) = run_method("sema-rag", [TREAT], tools, llm)
    schema, judgment, report_config, pick = llm.configs
    assert (schema.pattern, judgment.pattern, report_config.pattern) == (SCHEMA_PATTERN, JUDGMENT_PATTERN,
                                                                         report_pattern(TREAT))
    assert pick.choices == answer_choices(TREAT) and result.prediction == "A" and not result.stats["report_cut"]
    assert regex.fullmatch(SCHEMA_PATTERN, '{"intent": "treatment", "entities": ["Hypertension"], '
                                           '"constraints": ["adults"], "query": "drugs that treat hypertension"}')
    assert regex.fullmatch(JUDGMENT_PATTERN, '{"sufficient": false, "gap": "dose", "queries": ["amlodipine dose"]}')
    assert regex.fullmatch(report_pattern(TREAT), report)
    free = ScriptedChatModel(sema_reply(['{"sufficient": true}']))
    run_method("sema-rag", [TREAT], tools, free, make_config("sema-rag", {"constrained": False}))
    assert all(c.pattern is None and not c.choices for c in free.configs)


def test_sema_rag_that_is_never_satisfied_stops_at_max_rounds(tools: KnowledgeTools):
    judgments = [json.dumps({"sufficient": False, "gap": f"gap {i}", "queries": [f"amlodipine question {i}"]})
                 for i in range(5)]
    llm = ScriptedChatModel(sema_reply(judgments))
    (result,) = run_method("sema-rag", [TREAT], tools, llm, make_config("sema-rag", {"max_rounds": 3}))
    assert result.stats["rounds"] == 3 and result.stats["stop_reason"] == "max_rounds"
    assert not result.stats["early_stop"] and result.stats["sufficiency"] == [False, False]
    retrieves = [s for s in result.steps if s.action == "retrieve"]
    assert [s.arguments["queries"] for s in retrieves[1:]] == [["amlodipine question 0"], ["amlodipine question 1"]]


def test_sema_rag_agents_share_one_growing_context_so_each_call_continues_the_last(tools: KnowledgeTools):
    """The layout the prefix cache needs: one system prompt, the question and the evidence first, the agent's
    task last, so a later agent's prompt starts with everything an earlier one read before its task."""
    judgments = [json.dumps({"sufficient": False, "gap": "more", "queries": [f"amlodipine question {i}"]})
                 for i in range(2)]
    llm = ScriptedChatModel(sema_reply(judgments))
    (result,) = run_method("sema-rag", [TREAT], tools, llm, make_config("sema-rag", {"max_rounds": 3}))
    (i_call,), (e1,), (e2,), (report,), (answer,) = llm.calls
    assert len({c[0].content for c in (i_call, e1, e2, report, answer)}) == 1  # one system prompt for every agent

    def context(conversation):  # the user message without the agent's task
        return conversation[1].content.rsplit("\n\nYou are ", 1)[0].split("\n\nSchema: ")[0]
    question = i_call[-1].content.split("\n\nYou are ")[0]  # after the I-Agent's worked example
    assert context(e1).startswith(question + "\n\nEvidence:\n[1] ")
    assert context(e2).startswith(context(e1)) and len(context(e2)) > len(context(e1))  # round 2 appended
    assert context(report).startswith(context(e2)) and len(context(report)) > len(context(e2))  # round 3: A only
    assert answer[:2] == report and result.stats["rounds"] == 3  # the answer continues the report's conversation


def test_sema_rag_without_early_stop_keeps_searching_after_a_sufficient_judgment(tools: KnowledgeTools):
    judgments = [json.dumps({"sufficient": True, "gap": "", "queries": [f"amlodipine question {i}"]})
                 for i in range(3)]
    (result,) = run_method("sema-rag-no-early-stop", [TREAT], tools, ScriptedChatModel(sema_reply(judgments)),
                           make_config("sema-rag-no-early-stop", {"max_rounds": 3}))
    assert result.stats["rounds"] == 3 and result.stats["stop_reason"] == "max_rounds"
    assert not result.stats["early_stop"] and result.stats["sufficiency"] == [True, True]


def test_sema_rag_without_early_stop_asks_only_what_the_full_method_would(tools: KnowledgeTools):
    """Only the stop rule changes: a "sufficient" judgment that names no follow-up query ends the ablation's loop
    too ("no_new_query"), with the same queries and rounds as the full method; no query of its own."""
    judgments = [json.dumps({"sufficient": True, "gap": "dosing", "queries": []})] * 2
    (ablation,) = run_method("sema-rag-no-early-stop", [TREAT], tools, ScriptedChatModel(sema_reply(judgments)),
                             make_config("sema-rag-no-early-stop", {"max_rounds": 3}))
    (full,) = run_method("sema-rag", [TREAT], tools, ScriptedChatModel(sema_reply(judgments)))
    assert (full.stats["rounds"], full.stats["stop_reason"]) == (1, "sufficient")
    assert (ablation.stats["rounds"], ablation.stats["stop_reason"]) == (1, "no_new_query")
    queries = [[s.arguments["queries"] for s in r.steps if s.action == "retrieve"] for r in (full, ablation)]
    assert queries[0] == queries[1]


@pytest.mark.parametrize("judgment", [
    "Sufficient: no\nGap: dosing\nQueries: none",
    ('{"sufficient": false, "gap": "x", "queries": ["Drugs that treat hypertension | entities: Hypertension | '
    'constraints: adults"]}'),
])
def test_sema_rag_stops_when_no_new_query_appears(tools: KnowledgeTools, judgment: str):
    (result,) = run_method("sema-rag", [TREAT], tools, ScriptedChatModel(sema_reply([judgment])))
    assert result.stats["rounds"] == 1 and result.stats["stop_reason"] == "no_new_query"
    assert result.stats["early_stop"]


def test_sema_rag_report_has_its_own_token_budget(tools: KnowledgeTools):
    """The evidence report is decoded with `report_max_new_tokens`, every other agent turn with `max_new_tokens`:
    a 175-word report that a 160-token turn would cut is read whole and answered after, in its conversation."""
    report = "Source [1] says amlodipine lowers blood pressure. " * 25

    def reply(conversation: Conversation) -> str:
        if "evidence report" in conversation[-1].content:
            return report
        return sema_reply(['{"sufficient": true}'])(conversation)

    llm = ScriptedChatModel(reply)
    config = make_config("sema-rag", {"max_new_tokens": 160, "report_max_new_tokens": 320})
    (result,) = run_method("sema-rag", [TREAT], tools, llm, config)
    assert [s.action for s in result.steps] == ["i_agent", "retrieve", "e_agent", "a_agent_report", "answer"]
    assert not result.stats["report_cut"] and result.steps[3].completion_tokens == 175 and result.correct
    report_calls = [i for i, calls in enumerate(llm.calls) if "evidence report" in calls[0][-1].content]
    assert [llm.configs[i].max_new_tokens for i in report_calls] == [320]
    assert {c.max_new_tokens for i, c in enumerate(llm.configs) if i not in report_calls} == {160}
    answer_prompt = llm.calls[-1][0]
    assert [m.role for m in answer_prompt] == ["system", "user", "assistant", "user"]
    assert answer_prompt[2].content.strip() == report.strip()


def test_sema_rag_answers_a_cut_report_from_the_evidence(tools: KnowledgeTools):
    """A report cut at its budget without a stated answer is dropped: the answer call is the direct answer
    from the evidence (no report in its conversation); an answer the cut report states is read without
    another call."""
    def reply(conversation: Conversation) -> str:
        if "evidence report" in conversation[-1].content:
            return "Source [1] says amlodipine lowers blood pressure; " * 40
        if "Give the final answer" in conversation[-1].content:
            return "<answer>A</answer> " + "because it blocks calcium channels " * 10
        return sema_reply(['{"sufficient": true}'])(conversation)

    llm = ScriptedChatModel(reply)
    (result,) = run_method("sema-rag", [TREAT], tools, llm)
    assert [s.action for s in result.steps] == ["i_agent", "retrieve", "e_agent", "a_agent_report", "answer"]
    assert result.steps[3].completion_tokens == 160 and result.steps[4].arguments == {"report": "cut, dropped"}
    assert result.stats["report_cut"] and result.correct and not result.truncated
    assert method_statistics([result])["report_cut_rate"] == 1.0
    answer_prompt = llm.calls[-1][0]
    assert [m.role for m in answer_prompt] == ["system", "user"]  # the cut report is not in it
    assert "Evidence:" in answer_prompt[-1].content and "Give the final answer" in answer_prompt[-1].content

    def states(conversation: Conversation) -> str:
        if "evidence report" in conversation[-1].content:
            return "A. amlodipine: [1]. B. salbutamol: [2]. So the answer is B. " + "Source [2] adds detail. " * 60
        return sema_reply(['{"sufficient": true}'])(conversation)

    (stated,) = run_method("sema-rag", [TREAT], tools, ScriptedChatModel(states))
    assert [s.action for s in stated.steps][-1] == "a_agent_report" and stated.prediction == "B"


def test_sema_rag_ablations_drop_their_agent(tools: KnowledgeTools):
    no_i = run_method("sema-rag-no-i-agent", [TREAT], tools,
                      ScriptedChatModel(sema_reply(['{"sufficient": true}'])))[0]
    assert no_i.steps[0].action == "retrieve" and no_i.steps[0].arguments["queries"] == [TREAT.question]
    no_e = run_method("sema-rag-no-e-agent", [TREAT], tools, ScriptedChatModel(sema_reply([])))[0]
    assert [s.action for s in no_e.steps] == ["i_agent", "retrieve", "a_agent_report", "answer"]
    no_a = run_method("sema-rag-no-a-agent", [TREAT], tools,
                      ScriptedChatModel(sema_reply(['{"sufficient": true}'])))[0]
    assert [s.action for s in no_a.steps] == ["i_agent", "retrieve", "e_agent", "answer"]


def test_schema_and_judgment_are_read_from_json_or_key_value_lines():
    lines = parse_schema("Intent: treatment\nEntities: hypertension, amlodipine\nQuery: drugs for hypertension", TREAT)
    assert (lines.intent, lines.entities, lines.query) == ("treatment", ("hypertension", "amlodipine"),
                                                           "drugs for hypertension")
    fenced = parse_schema('```json\n{"intent": "dx", "entities": [{"name": "insulin"}], "query": "insulin"}\n```', TREAT)
    assert fenced.entities == ("insulin",) and fenced.parsed and fenced.grounded
    cut_off = parse_schema('{"intent": "treatment", "entities": ["hypertension", "amlodipine"], "query": "amlo', TREAT)
    assert cut_off.entities == ("hypertension", "amlodipine") and cut_off.query == TREAT.question
    # The instruction's placeholders copied out (SmolLM2 decoded to the JSON): read, but about nothing asked.
    copied = parse_schema('{"intent": "what is asked", "entities": ["medical concepts in the question", "gout"], '
                          '"constraints": [], "query": "a search query for the evidence needed"}', TREAT)
    assert copied.parsed and not copied.grounded and copied.entities == () and copied.linearize() == TREAT.question
    unreadable = parse_schema("I cannot do that.", TREAT)
    assert not unreadable.parsed and unreadable.linearize() == TREAT.question
    judgment = parse_judgment("- **Sufficient**: No\n- Gap: dose\n- Follow-up queries: a b; c d")
    assert (judgment.sufficient, judgment.gap, judgment.queries) == (False, "dose", ("a b", "c d"))
    assert parse_judgment("no idea").sufficient is None
    assert parse_judgment("The evidence is sufficient to answer.").sufficient is True
    assert parse_judgment("The evidence is not sufficient: dosing is missing.").sufficient is False


# --------------------------------------------------------------------------- Graph-R1


@pytest.fixture(scope="module")
def env(retriever: Retriever) -> GraphR1Env:
    return GraphR1Env(retriever, GraphR1Config(max_steps=4))


def test_graph_r1_actions_return_observations_as_user_turns(env: GraphR1Env):
    state = env.reset(TREAT)
    assert [m.role for m in state.messages] == ["system", "user"] and "<traverse>" in state.messages[0].content
    search = env.step(state, "<think>find the disease</think><search>hypertension</search>")
    assert f"{HYPERTENSION} Hypertension" in search.observation and HYPERTENSION in search.retrieved_ids
    traverse = env.step(state, f"<think>its edges</think><traverse>{HYPERTENSION}</traverse>")
    assert f"-may_be_treated_by-> amlodipine ({AMLODIPINE})" in traverse.observation
    analyze = env.step(state, f"<think>read</think><analyze>{AMLODIPINE}, Hypertension</analyze>")
    assert analyze.retrieved_ids == (AMLODIPINE, HYPERTENSION) and "amlodipine" in analyze.observation.lower()
    answer = env.step(state, "<think>amlodipine</think><answer>A</answer>")
    assert answer.done and answer.observation is None and state.answer == "A" and state.done
    assert [m.role for m in state.messages] == ["system", "user"] + ["assistant", "user"] * 3 + ["assistant"]
    assert all(m.content.startswith("<observation>") and m.content.endswith("</observation>")
               for m in state.messages[3::2])
    assert {HYPERTENSION, AMLODIPINE} <= state.nodes and all(state.well_formed)


def test_graph_r1_demonstration_comes_before_the_question_and_is_counted_as_prompt(retriever: Retriever):
    state = GraphR1Env(retriever, GraphR1Config(demonstration=True)).reset(TREAT)
    assert [m.role for m in state.messages] == ["system", "user", "assistant", "user"] and state.prompt_turns == 4
    assert is_well_formed(state.messages[2].content) and state.messages[3].content.startswith("Question:")


def test_graph_r1_ends_without_an_answer_at_max_steps(env: GraphR1Env):
    state = env.reset(TREAT)
    outcomes = [env.step(state, "<think>again</think><search>hypertension</search>") for _ in range(4)]
    assert [o.done for o in outcomes] == [False, False, False, True]
    assert "last turn" in outcomes[2].observation and state.truncated and state.answer is None
    with pytest.raises(ValueError, match="already done"):
        env.step(state, "<answer>A</answer>")


def test_graph_r1_refuses_a_multiple_choice_answer_that_names_no_option(env: GraphR1Env):
    """An answer naming an option (letter, text) ends the episode; one naming another concept is refused
    with the option letters while turns remain, and ends the episode unreadable on the last turn."""
    state = env.reset(TREAT)
    refused = env.step(state, f"<think>read</think><answer>{HYPERTENSION}</answer>")
    assert not refused.done and state.answer is None and state.refused_answers == 1
    assert "not one of the options" in refused.observation and "A, B, C, D" in refused.observation
    by_text = env.step(state, "<think>amlodipine</think><answer>amlodipine</answer>")
    assert by_text.done and state.answer == "amlodipine"

    short = env.reset(MECHANISM)  # no options: any answer ends the episode
    assert env.step(short, "<think>x</think><answer>Hypertension</answer>").done

    last = env.reset(TREAT)
    for _ in range(3):
        env.step(last, "<think>again</think><search>hypertension</search>")
    assert "one option letter: A, B, C, D" in last.messages[-1].content
    final = env.step(last, "<think>x</think><answer>Hypertension</answer>")
    assert final.done and last.answer == "Hypertension" and not last.truncated


def test_graph_r1_reports_invalid_and_disabled_actions(retriever: Retriever):
    env = GraphR1Env(retriever, make_config("graph-r1-no-traverse"))
    state = env.reset(TREAT)
    assert "<traverse>" not in state.messages[0].content
    disabled = env.step(state, f"<think>x</think><traverse>{HYPERTENSION}</traverse>")
    assert "not available" in disabled.observation and disabled.retrieved_ids == ()
    invalid = env.step(state, "I think the answer is amlodipine")
    assert invalid.action == "invalid" and "No action found" in invalid.observation and not invalid.well_formed
    empty = env.step(state, "<think>x</think><search></search>")
    assert "is empty" in empty.observation and empty.retrieved_ids == ()


@pytest.mark.parametrize("text, ok", [
    ("<think>look it up</think><search>hypertension</search>", True),
    ("<think>a</think>\n<answer>B</answer>\n", True),
    ("<search>hypertension</search>", False),  # no think
    ("<think></think><search>x</search>", False),  # empty think
    ("<think>a</think><search>x</search><answer>B</answer>", False),  # two actions
    ("<think>a</think><search>x</search> and more", False),
    ("<think>a</think><lookup>x</lookup>", False),
])
def test_graph_r1_format_checker(text: str, ok: bool):
    assert is_well_formed(text) is ok


def test_graph_r1_reply_parsing_and_stop_restoring():
    assert parse_action("<think>I could <search>x</search></think><traverse>C0020538</traverse>") == \
        ("traverse", "C0020538")
    assert parse_action("no tags") is None
    from medgraph.llm.base import Completion

    stopped = Completion("<think>a</think><search>hypertension", 5, 5, 0.1, finish_reason="stop")
    assert restore_stop(stopped) == "<think>a</think><search>hypertension</search>"
    cut = Completion("<think>a</think><search>hyper", 5, 5, 0.1, finish_reason="length")
    assert restore_stop(cut) == cut.text


def test_graph_r1_method_steps_questions_in_lockstep(tools: KnowledgeTools):
    def reply(conversation: Conversation) -> str:
        if question_of(conversation) == FABRY_SEIZURE.question:
            return "<think>known</think><answer>A"  # stopped at </answer>
        turns = assistant_turns(conversation)
        return ["<think>find</think><search>hypertension", "<think>edges</think><traverse>C0020538",
                "<think>done</think><answer>A"][turns]

    llm = ScriptedChatModel(reply)
    fabry, treat = run_method("graph-r1", [FABRY_SEIZURE, TREAT], tools, llm)
    assert [len(call) for call in llm.calls] == [2, 1, 1]
    assert llm.calls[0][0][-1].content.startswith("Question:")
    assert (fabry.prediction, fabry.stats["turns"], treat.stats["turns"]) == ("A", 1, 3)
    assert treat.stats["actions"] == ["search", "traverse", "answer"] and treat.stats["format_ok"]
    assert treat.steps[0].output.endswith("</search>")


# --------------------------------------------------------------------------- baselines, registry, traces


# MedRAG, rag-kg and i-MedRAG prompts and calls: tests/test_baselines.py.


def test_configs_are_validated_and_ablations_are_presets():
    assert make_config("a2rag-no-gsrm").retrieval == "one_hop"
    assert make_config("a2rag", {"tau": 0.7}).tau == 0.7
    assert make_config("graph-r1-no-analyze").actions == ("search", "traverse")
    with pytest.raises(ValueError, match="unknown configuration fields"):
        make_config("a2rag", {"taux": 0.7})
    with pytest.raises(ValueError, match="unknown method"):
        make_config("nope")
    with pytest.raises(ValueError, match="unknown Graph-R1 actions"):
        make_config("graph-r1", {"actions": ("fly",)})


def test_trace_rows_flatten_every_step(tools: KnowledgeTools):
    llm = ScriptedChatModel(lambda conversation: "<answer>A</answer>")
    results = run_method("rag", [TREAT, ANGINA], tools, llm)
    rows = trace_rows(results)
    assert len(rows) == 4 and [r["step"] for r in rows] == [0, 1, 0, 1]
    assert rows[0]["method"] == "rag" and rows[0]["qid"] == "treat"
    assert json.loads(rows[0]["arguments"])["query"].startswith("Which")
    totals = results[0].as_dict()
    assert totals["prompt_tokens"] == sum(s.prompt_tokens for s in results[0].steps) > 0


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def ask_home(retrieval_warehouse: Warehouse, encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MEDGRAPH_HOME holding a copy of the tiny warehouse; the session encoder; a scripted LLM."""
    home = tmp_path / "home"
    copy_warehouse(retrieval_warehouse, home)
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    monkeypatch.setattr("medgraph.embed.encoder.load_encoder", lambda spec, **options: encoder)
    monkeypatch.setattr("medgraph.llm.load_llm", lambda spec=None, **options: ScriptedChatModel(
        lambda conversation: "<answer>A</answer>"))
    return home


def test_ask_json_prints_the_result_with_its_trace(ask_home: Path, capsys: pytest.CaptureFixture):
    from medgraph.cli import main

    code = main(["ask", "Which drug may treat hypertension?", "--option", "A=amlodipine", "--option", "B=insulin",
                 "--method", "rag", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["prediction"] == "A" and payload["method"] == "rag"
    assert [s["action"] for s in payload["steps"]] == ["retrieve", "answer"] and "correct" not in payload


def test_ask_trace_prints_each_step_and_the_answer(ask_home: Path, capsys: pytest.CaptureFixture):
    from medgraph.cli import main

    code = main(["ask", "Which drug may treat hypertension?", "--option", "A=amlodipine", "--option", "B=insulin",
                 "--method", "cot", "--trace"])
    out = capsys.readouterr().out
    assert code == 0 and "step 0: answer" in out and out.strip().endswith("answer: A. amlodipine")
    assert main(["ask", "x", "--method", "a2rag", "--set", "taux=1"]) == 2


# --------------------------------------------------------------------------- end to end with SmolLM2

E2E_CONFIGS = {  # few steps and tokens: this checks that each method runs on a real model, not how well
    "a2rag": {"max_steps": 2, "iterations": 1, "max_triples_per_relation": 3, "top_n": 15, "context_triples": 10,
              "observe_triples": 5, "text_k": 1, "max_new_tokens": 24},
    "graph-r1": {"max_steps": 2, "max_new_tokens": 24, "search_k": 4, "traverse_limit": 8, "demonstration": True},
    "sema-rag": {"max_rounds": 2, "max_new_tokens": 16, "report_max_new_tokens": 24, "text_k": 1,
                 "triples_per_round": 3},
    "cot": {"max_new_tokens": 16},
    "rag": {"text_k": 2, "max_new_tokens": 16},
    "rag-kg": {"text_k": 2, "triples_k": 5, "max_new_tokens": 16},
    "irag": {"rounds": 1, "queries_per_round": 1, "text_k": 1, "query_tokens": 24, "query_answer_tokens": 16,
             "max_new_tokens": 16},
}


@pytest.mark.slow
def test_the_methods_run_over_the_openai_compatible_backend_against_a_loopback_server(tools: KnowledgeTools,
                                                                                     smollm2):
    """The same methods with the HTTP backend: a real OpenAI-compatible server on 127.0.0.1 serving SmolLM2."""
    from medgraph.llm.openai_http import OpenAIChatModel
    from medgraph.llm.serve import serve

    with serve(smollm2, port=0) as server:
        remote = OpenAIChatModel("smollm2-135m-instruct", server.url)
        for method in ("a2rag", "graph-r1", "sema-rag"):
            config = make_config(method, E2E_CONFIGS[method])
            (result,) = run_method(method, [TREAT], tools, remote, config, batch_size=1)
            assert result.steps and result.prompt_tokens > 0
            assert result.stats.get("hiim", "text-only") == "text-only"  # HTTP serves text only
        remote.close()
    assert server.batches  # the requests went over HTTP to the loopback server


# Every method end to end on SmolLM2: tests/test_prefix_cache.py runs each with the cache on and off (one
# real-model run per method serves both checks; they were the two slowest groups of the suite).


@pytest.mark.slow
def test_a2rag_gives_smollm2_graph_tokens_as_input_embeddings(tools: KnowledgeTools, smollm2):
    class SmallRandomTokens:  # a stand-in projector: the point is the inputs_embeds path, not the values
        def encode(self, triples: Sequence[Triple]) -> torch.Tensor:
            return torch.randn(len(triples), smollm2.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.05

    config = make_config("a2rag-no-awc", {**CHEAP_A2RAG, "top_n": 10, "max_new_tokens": 8})
    results = run_method("a2rag", [TREAT, MECHANISM], tools, smollm2, config, graph_tokenizer=SmallRandomTokens())
    for result in results:
        answer = result.steps[-1]
        assert result.stats["hiim"] == "graph-tokens" and answer.arguments["graph_tokens"] == 10
        assert answer.completion_tokens > 0


# --------------------------------------------------------------------------- a separate reader


@pytest.mark.parametrize("method", ["cot", "rag", "irag", "a2rag-no-hiim", "sema-rag", "graph-r1"])
def test_a_reader_takes_the_answering_call_and_nothing_else(tools: KnowledgeTools, method: str):
    """`reader=` (e.g. the adapted reader) changes only who answers: the method's own model gets exactly the
    calls it gets alone, less the answering call, and the reader gets that call and nothing else. Graph-R1's
    policy answers itself (the paper trains it to), so its reader is never asked."""
    def script():
        sema = sema_reply(['{"sufficient": true, "gap": "", "queries": []}'])

        def reply(conversation: Conversation) -> str:
            if "Action:" in conversation[0].content:  # A2RAG's AWC turn
                return "Action: T_Final"
            if "<search>" in conversation[0].content:  # Graph-R1's policy
                return "<think>amlodipine treats it.</think>\n<answer>A</answer>"
            return sema(conversation) if method == "sema-rag" else "<answer>A</answer>"
        return reply

    config = make_config(method, CHEAP_A2RAG if method.startswith("a2rag") else None)
    alone = ScriptedChatModel(script())
    (result_alone,) = run_method(method, [TREAT], tools, alone, config)
    calls_alone = [c for call in alone.calls for c in call]

    agent, reader = ScriptedChatModel(script()), ScriptedChatModel(lambda conversation: "<answer>B</answer>")
    (result,) = run_method(method, [TREAT], tools, agent, config, reader=reader)
    to_agent = [c for call in agent.calls for c in call]
    to_reader = [c for call in reader.calls for c in call]
    if method == "graph-r1":
        assert to_reader == [] and to_agent == calls_alone and result.prediction == result_alone.prediction == "A"
        return
    assert to_agent == calls_alone[:-1] and to_reader == calls_alone[-1:]
    assert result_alone.prediction == "A" and result.prediction == "B"


# --------------------------------------------------------------------------- methods are blind to gold
# Every built-in method and ablation runs twice on the same questions with a scripted model that uses the tools
# (A2RAG routes to the graph, Graph-R1 searches, SEMA-RAG asks for more rounds): once on the items, once on
# copies whose answers, gold paths, facts, pairs, hop counts, question types, answer concepts and PMIDs are
# scrambled. Everything the model was asked and everything each method retrieved and answered must be the same.
# The reading ceiling (`oracle-evidence`) is built from gold, and must change: the scramble is real.

INSULIN, SALBUTAMOL, ASPIRIN = "C0021641", "C0001927", "C0004057"
SEEN_BY_METHODS = {"seed_cuis", "option_cuis"}


def _gold_items(tools: KnowledgeTools) -> list[QaItem]:
    graph = tools.retriever.graph
    treats = next(t for t in graph.one_hop([AMLODIPINE]) if t.dst_cui == HYPERTENSION)
    other = next(t for t in graph.one_hop([HYPERTENSION]) if t.dst_cui != AMLODIPINE)
    gold = {"question_type": "mc", "hops": 1, "gold_path": [treats.edge_id], "answer_cuis": [AMLODIPINE],
            "gold_pairs": [[AMLODIPINE, HYPERTENSION]],
            "gold_facts": [[f"{AMLODIPINE}|may_treat|{HYPERTENSION}", f"{HYPERTENSION}|may_be_treated_by|{AMLODIPINE}"]]}
    treat = QaItem("kgqa_mc", "treat", "Which of the following may treat Hypertension?",
                   {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}, "A", pmids=("123",),
                   extra={**gold, "seed_cuis": [HYPERTENSION], "option_cuis": [AMLODIPINE, SALBUTAMOL, INSULIN, ASPIRIN]})
    mechanism = QaItem("kgqa_short", "mechanism", "What is the mechanism of action of amlodipine?", {},
                       "Calcium Channel Antagonists", acceptable_answers=("calcium channel blocker",),
                       extra={**gold, "question_type": "short_1hop", "gold_path": [other.edge_id],
                              "seed_cuis": [AMLODIPINE]})
    return [treat, mechanism]


def _scrambled(item: QaItem, other: QaItem) -> QaItem:
    """The item with every gold field replaced: the other item's, or a wrong answer."""
    answer = next((letter for letter in item.options if letter != item.answer), "Insulin")
    swapped = {key: value for key, value in other.extra.items() if key not in SEEN_BY_METHODS}
    return replace(item, answer=answer, acceptable_answers=("something else",), pmids=("999",),
                   extra={**{k: v for k, v in item.extra.items() if k in SEEN_BY_METHODS}, **swapped,
                          "hops": 2, "question_type": "mc_2hop"})


def _tool_using_script() -> ScriptedChatModel:
    def reply(conversation: Conversation) -> str:
        first, last = conversation[0].content, conversation[-1].content
        turns = sum(m.role == "assistant" for m in conversation)
        if "Action:" in first:  # A2RAG's AWC: the graph, then the text, then answer
            return ["Action: T_KG", "Action: T_Text\nQuery: amlodipine", "Action: T_Final"][min(turns, 2)]
        if "<search>" in first:  # Graph-R1's policy
            return ["<think>find</think><search>hypertension", "<think>edges</think><traverse>C0020538",
                    "<think>done</think><answer>A"][min(turns, 2)]
        if "You are a clinical information specialist" in last:
            return '{"intent": "treatment", "entities": ["Hypertension"], "constraints": [], "query": "hypertension"}'
        if "You are an evidence reviewer" in last:
            return '{"sufficient": false, "gap": "dosing", "queries": ["amlodipine dose"]}'
        if "evidence report" in last:
            return "Sources [1] and [2] say amlodipine treats hypertension."
        return "<answer>A</answer>"
    return ScriptedChatModel(reply)


def _what_it_did(name: str, tools: KnowledgeTools) -> tuple[list, list, Counter]:
    """One run over the items and their scrambled copies together (other qids): what the method did for each
    original and for each copy, and how often each conversation was sent to the model (each twice when the
    copies changed nothing a method reads)."""
    items = _gold_items(tools)
    scrambled = [replace(_scrambled(items[0], items[1]), qid="treat-scrambled"),
                 replace(_scrambled(items[1], items[0]), qid="mechanism-scrambled")]
    assert [(i.answer, i.extra) for i in scrambled] != [(i.answer, i.extra) for i in items]
    overrides = {"iterations": 1, "max_triples_per_relation": 3, "top_n": 20,
                 "gsrm_by_dataset": [["kgqa_mc", 0.6, 1, 10]]} if method_of(name) == "a2rag" else None
    if method_of(name) == "sema-rag":
        overrides = {"max_rounds": 2}
    llm = _tool_using_script()
    results = run_method(name, items + scrambled, tools, llm, make_config(name, overrides))
    done = [(r.prediction, r.truncated, r.extra_answer_call,
             [(s.action, s.arguments, s.retrieved_ids, s.output, s.observation, s.notes) for s in r.steps])
            for r in results]
    return done[:2], done[2:], Counter(repr(c) for call in llm.calls for c in call)


BLIND = sorted(name for name in (*METHODS, *ABLATIONS) if not METHODS[method_of(name)].reads_gold)


@pytest.mark.parametrize("name", BLIND)
def test_a_method_does_the_same_whatever_the_gold_fields_say(tools: KnowledgeTools, name: str):
    asked, asked_scrambled, sent = _what_it_did(name, tools)
    assert asked_scrambled == asked
    assert sent and all(count % 2 == 0 for count in sent.values())


def test_the_reading_ceiling_reads_gold_so_the_scramble_reaches_it(tools: KnowledgeTools):
    _, _, sent = _what_it_did("oracle-evidence", tools)
    assert any(count % 2 for count in sent.values())


def test_methods_are_scored_against_the_gold_they_never_saw(tools: KnowledgeTools):
    items = _gold_items(tools)
    (result,) = run_method("cot", items[:1], tools, _tool_using_script())
    assert (result.prediction, result.answer, result.correct) == ("A", "A", True)
    (wrong,) = run_method("cot", [replace(items[0], answer="B")], tools, _tool_using_script())
    assert (wrong.prediction, wrong.answer, wrong.correct) == ("A", "B", False)


def test_an_item_as_asked_keeps_the_question_and_drops_everything_derived_from_the_answer(tools: KnowledgeTools):
    treat = _gold_items(tools)[0]
    asked = as_asked(treat)
    assert (asked.question, asked.options, asked.dataset, asked.qid) == (treat.question, treat.options,
                                                                         treat.dataset, treat.qid)
    assert (asked.answer, asked.acceptable_answers, asked.pmids) == ("", (), ())
    assert set(asked.extra) == SEEN_BY_METHODS


def test_a2rags_gsrm_recall_of_the_gold_path_is_measured_after_the_run(tools: KnowledgeTools):
    items = _gold_items(tools)
    config = make_config("a2rag-no-awc", {"retrieval": "one_hop", "top_n": 500})
    found, _ = run_method("a2rag-no-awc", items, tools, _tool_using_script(), config)
    assert found.stats["gsrm_gold_recall"] == 1.0 and found.stats["gsrm_recall_atN_by_iteration"] == [1.0]
