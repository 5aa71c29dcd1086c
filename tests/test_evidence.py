"""Evidence recall and cut-off answers: what each method put in front of its answering call, and what a budget did.

Scripted episodes on the real tiny KG and corpus with known evidence: a gold
fact is covered when a shown triple joins its two concepts or one shown text
mentions both; the answer concept is in the evidence when a shown triple, a
listed concept or a shown text names it. A reply cut at its token budget
without an answer is asked once more for the answer alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import duckdb
import pytest
import torch
from conftest import copy_warehouse

from medgraph.eval.evaluate import markdown_table, result_rows, summarize, write_partition
from medgraph.eval.questions import QaItem
from medgraph.kg.graph import Triple
from medgraph.llm.base import Conversation
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import KnowledgeTools, make_config, run_method
from medgraph.methods.agent import CUT_OFF_NOTE
from medgraph.methods.common import EvidenceSeen, MethodResult, finish_result
from medgraph.methods.registry import record_evidence_recall
from medgraph.retrieval import Retriever
from medgraph.storage import Warehouse
from medgraph.text.mentions import link_chunk_mentions

AMLODIPINE, HYPERTENSION = "C9001289", "C0020538"
OPTIONS = {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}
# A KG question as the QA generator writes it: its gold fact as an unordered concept pair, its answer concept.
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?", OPTIONS, "A",
               extra={"gold_pairs": [sorted([AMLODIPINE, HYPERTENSION])], "answer_cuis": [AMLODIPINE],
                      "seed_cuis": [HYPERTENSION]})
NO_GOLD = QaItem("test", "mirage", "Which of the following may treat Hypertension?", OPTIONS, "A")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def answer_a(conversation: Conversation) -> str:
    return "<answer>A</answer>"


# --------------------------------------------------------------------------- evidence recall per method


def test_rag_kg_that_shows_the_gold_fact_has_full_recall_and_an_item_without_gold_has_none(tools: KnowledgeTools):
    treat, no_gold = run_method("rag-kg", [TREAT, NO_GOLD], tools, ScriptedChatModel(answer_a))
    assert any({src, dst} == {AMLODIPINE, HYPERTENSION} for src, dst in treat.evidence.triples.values())
    assert treat.evidence.chunks and all(chars == 600 for chars in treat.evidence.chunks.values())
    assert (treat.evidence_pair_recall, treat.evidence_answer_recall) == (1.0, 1.0)
    assert treat.stats["evidence_pair_recall"] == 1.0 and treat.stats["evidence_answer_recall"] == 1.0
    assert (no_gold.evidence_pair_recall, no_gold.evidence_answer_recall) == (None, None)
    assert "evidence" not in treat.as_dict() and treat.as_dict()["evidence_pair_recall"] == 1.0


def test_cot_shows_no_evidence_so_its_recall_is_zero(tools: KnowledgeTools):
    (result,) = run_method("cot", [TREAT], tools, ScriptedChatModel(answer_a))
    assert result.correct and result.evidence.empty
    assert (result.evidence_pair_recall, result.evidence_answer_recall) == (0.0, 0.0)


def graph_r1_script(*turns: str):
    def reply(conversation: Conversation) -> str:
        return turns[sum(1 for m in conversation if m.role == "assistant")]
    return reply


def test_graph_r1_recall_counts_what_its_observations_showed(tools: KnowledgeTools):
    traverses = graph_r1_script(f"<think>edges</think><traverse>{HYPERTENSION}</traverse>",
                                "<think>done</think><answer>A</answer>")
    searches = graph_r1_script("<think>find</think><search>amlodipine</search>", "<think>done</think><answer>A</answer>")
    analyzes = graph_r1_script(f"<think>read</think><analyze>{AMLODIPINE}</analyze>",
                               "<think>done</think><answer>A</answer>")
    (traversed,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(traverses))
    (searched,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(searches))
    (analyzed,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(analyzes))
    # The traversal of the question's concept shows the gold edge (stored as Hypertension -may_be_treated_by->).
    assert (traversed.evidence_pair_recall, traversed.evidence_answer_recall) == (1.0, 1.0)
    # A search lists the answer concept by name, but no fact joins it to the question's concept.
    assert AMLODIPINE in searched.evidence.concepts and not searched.evidence.triples
    assert (searched.evidence_pair_recall, searched.evidence_answer_recall) == (0.0, 1.0)
    # A concept's text counts as mentioning the concept itself (and what the text names).
    assert set(analyzed.evidence.concept_texts) == {AMLODIPINE} and analyzed.evidence_answer_recall == 1.0


def test_graph_r1_observation_not_shown_at_the_last_turn_is_not_evidence(tools: KnowledgeTools):
    script = graph_r1_script(f"<think>edges</think><traverse>{HYPERTENSION}</traverse>")
    (result,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(script), make_config("graph-r1", {"max_steps": 1}))
    assert result.parse_failed and result.stats["out_of_turns"] and result.evidence.empty
    assert result.evidence_pair_recall == 0.0 and not result.extra_answer_call  # not cut: no second call


class GraphTokenModel(ScriptedChatModel):
    """A scripted model that takes graph tokens (and ignores them)."""

    supports_graph_tokens, hidden_size = True, 8

    def generate(self, conversations, config=None, graph_tokens=None):
        return super().generate(conversations, config)


class OnesTokenizer:
    def encode(self, triples: Sequence[Triple]) -> torch.Tensor:
        return torch.ones(len(triples), GraphTokenModel.hidden_size)


def test_a2rag_counts_the_triples_given_as_graph_tokens_beyond_the_text_context(tools: KnowledgeTools):
    config = make_config("a2rag-no-awc", {"iterations": 1, "max_triples_per_relation": 3, "top_n": 20,
                                           "context_triples": 2})
    (text_only,) = run_method("a2rag", [TREAT], tools, ScriptedChatModel(answer_a), config)
    (tokens,) = run_method("a2rag", [TREAT], tools, GraphTokenModel(answer_a), config, graph_tokenizer=OnesTokenizer())
    retrieved = text_only.steps[0].retrieved_ids
    assert list(text_only.evidence.triples) == retrieved[:2] == text_only.steps[-1].retrieved_ids
    assert tokens.stats["hiim"] == "graph-tokens" and set(tokens.evidence.triples) == set(retrieved)
    assert text_only.evidence.chunks  # the fixed plan also searched the text


def test_sema_rag_recall_is_over_the_sources_its_a_agent_was_shown(tools: KnowledgeTools):
    def reply(conversation: Conversation) -> str:
        prompt = conversation[-1].content
        if "clinical schema" in prompt:
            return '{"intent": "treatment", "entities": ["Hypertension"], "query": "drugs for hypertension"}'
        if "sufficient" in prompt:
            return '{"sufficient": true}'
        return "<answer>A</answer>" if "final answer" in prompt else "Sources [1] and [2] agree."

    (result,) = run_method("sema-rag", [TREAT], tools, ScriptedChatModel(reply))
    assert result.correct and result.stats["sources"] == len(result.evidence.triples) + len(result.evidence.chunks)
    assert result.evidence_answer_recall == 1.0 and result.evidence_pair_recall is not None


# --------------------------------------------------------------------------- chunk mentions


@pytest.fixture(scope="module")
def mentions_warehouse(retrieval_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path_factory.mktemp("mentions") / "home")
    link_chunk_mentions(warehouse)
    return warehouse


def test_a_chunk_covers_a_pair_it_mentions_within_the_characters_shown(mentions_warehouse: Warehouse,
                                                                       tools: KnowledgeTools, encoder):
    with duckdb.connect(str(mentions_warehouse.path), read_only=True) as con:
        chunk_id, first, second, second_end = con.execute(
            """SELECT a.chunk_id, a.cui, b.cui, b.end_char FROM kg.kg_chunk_mentions a
               JOIN kg.kg_chunk_mentions b ON a.chunk_id = b.chunk_id AND a.end_char < b.start_char AND a.cui <> b.cui
               WHERE a.score = 1 AND b.score = 1 AND b.end_char < 500
                 AND b.start_char = (SELECT min(start_char) FROM kg.kg_chunk_mentions c  -- b's first mention
                                     WHERE c.chunk_id = b.chunk_id AND c.cui = b.cui)
               ORDER BY a.chunk_id, a.start_char, b.start_char LIMIT 1""").fetchone()
    item = QaItem("test", "pair", "?", OPTIONS, "A", extra={"gold_pairs": [[first, second]], "answer_cuis": [second]})

    def recall(shown_chars: int | None, tables: KnowledgeTools) -> tuple[float | None, float | None]:
        result = finish_result("rag", item, "A", [], evidence=EvidenceSeen())
        result.evidence.add_chunks([chunk_id], shown_chars)
        record_evidence_recall(tables, [item], [result])
        return result.evidence_pair_recall, result.evidence_answer_recall

    with Retriever(mentions_warehouse, encoder) as retriever:
        from_table = KnowledgeTools(retriever)
        assert recall(None, from_table) == recall(second_end, from_table) == (1.0, 1.0)
        assert recall(second_end - 1, from_table) == (0.0, 0.0)  # the second mention was cut off the prompt
    # Without the mentions table the same dictionary matcher runs over the chunk: the same answer.
    assert recall(second_end, tools) == (1.0, 1.0) and recall(second_end - 1, tools) == (0.0, 0.0)


def test_free_text_covers_a_pair_only_when_it_names_both_concepts(tools: KnowledgeTools):
    both, one = finish_result("x", TREAT, "A", []), finish_result("x", TREAT, "A", [])
    both.evidence.add_text("Amlodipine is given for hypertension.")
    one.evidence.add_text("Amlodipine is a calcium channel blocker.")
    record_evidence_recall(tools, [TREAT, TREAT], [both, one])
    assert (both.evidence_pair_recall, both.evidence_answer_recall) == (1.0, 1.0)
    assert (one.evidence_pair_recall, one.evidence_answer_recall) == (0.0, 1.0)


# --------------------------------------------------------------------------- cut-off answers


def cut_then(answer: str):
    """A model that reasons past any small budget, and gives `answer` when asked for the answer alone."""
    def reply(conversation: Conversation) -> str:
        if CUT_OFF_NOTE in conversation[-1].content:
            return answer
        return "Let us think step by step about which of these drugs lowers blood pressure " * 4
    return reply


def test_a_reply_cut_at_its_budget_is_asked_once_more_for_the_answer(tools: KnowledgeTools):
    llm = ScriptedChatModel(cut_then("<answer>A</answer>"))
    (result,) = run_method("cot", [TREAT], tools, llm, make_config("cot", {"max_new_tokens": 8}))
    assert result.correct and result.truncated and result.extra_answer_call and not result.parse_failed
    assert [s.action for s in result.steps] == ["answer", "final_answer"] and "cut at 8 tokens" in result.steps[1].notes
    retry = llm.calls[1][0]
    assert [m.role for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2].content == result.steps[0].output and "option letter" in retry[3].content


def test_a_reply_cut_and_still_unreadable_is_a_truncated_parse_failure(tools: KnowledgeTools):
    llm = ScriptedChatModel(cut_then("I cannot tell."))
    (result,) = run_method("rag", [TREAT], tools, llm, make_config("rag", {"max_new_tokens": 8}))
    assert result.parse_failed and result.truncated and result.extra_answer_call and not result.correct
    assert len(llm.calls) == 2 and "still no readable answer" in result.steps[-1].notes


def test_a_cut_reply_that_already_holds_an_answer_and_an_uncut_unreadable_reply_are_not_retried(tools: KnowledgeTools):
    answered_first = ScriptedChatModel(lambda c: "<answer>A</answer> because amlodipine is a calcium channel blocker")
    (cut,) = run_method("cot", [TREAT], tools, answered_first, make_config("cot", {"max_new_tokens": 4}))
    (unreadable,) = run_method("cot", [TREAT], tools, ScriptedChatModel(lambda c: "No idea."))
    assert cut.correct and not cut.truncated and len(cut.steps) == 1
    assert unreadable.parse_failed and not unreadable.truncated and not unreadable.extra_answer_call


def test_graph_r1_cut_at_its_last_turn_is_asked_for_the_answer_outside_the_environment(tools: KnowledgeTools):
    llm = ScriptedChatModel(cut_then("<answer>A"))  # stopped at </answer>
    config = make_config("graph-r1", {"max_steps": 2, "max_new_tokens": 8})
    (result,) = run_method("graph-r1", [TREAT], tools, llm, config)
    assert [s.action for s in result.steps] == ["invalid", "invalid", "final_answer"]
    assert result.correct and result.truncated and result.stats["turns"] == 2 and result.stats["out_of_turns"]


@pytest.mark.parametrize("method, overrides", [
    ("irag", {"rounds": 1}), ("sema-rag-no-e-agent", {}), ("sema-rag-no-a-agent", {"use_e_agent": False}),
    ("a2rag-no-awc", {"iterations": 0, "max_triples_per_relation": 3, "top_n": 5}),
])
def test_every_method_retries_its_cut_answer(tools: KnowledgeTools, method: str, overrides: dict):
    def reply(conversation: Conversation) -> str:
        if CUT_OFF_NOTE in conversation[-1].content:
            return "<answer>A</answer>"
        if "answer" in conversation[-1].content.lower() and "<answer>" in conversation[-1].content:
            return "Considering the evidence carefully, the drug that lowers blood pressure is " * 3
        return '{"intent": "treatment"}' if "schema" in conversation[-1].content else "1. amlodipine uses\n2. x y"

    (result,) = run_method(method, [TREAT], tools, ScriptedChatModel(reply),
                           make_config(method, {**overrides, "max_new_tokens": 12}))
    assert result.steps[-1].action == "final_answer" and result.truncated and result.correct


# --------------------------------------------------------------------------- summaries and tables


def test_summary_reports_evidence_recall_with_its_standard_error_and_truncation_apart(warehouse: Warehouse):
    item = QaItem("ds", "q", "Which?", {"A": "x", "B": "y"}, "A")
    results: list[MethodResult] = []
    for pair, answer, truncated in [(1.0, 1.0, True), (0.0, 0.0, False), (0.5, 1.0, False), (None, None, True)]:
        result = finish_result("m", item, "A" if not truncated else None, [])
        result.evidence_pair_recall, result.evidence_answer_recall, result.truncated = pair, answer, truncated
        results.append(result)
    (summary,) = summarize(results)
    assert (summary.evidence_pair_recall, summary.evidence_pair_recall_n) == (0.5, 3)
    assert summary.evidence_pair_recall_se == pytest.approx(0.5 / math.sqrt(3))  # sample s.d. 0.5
    assert (summary.answer_in_evidence, summary.answer_in_evidence_n) == (pytest.approx(2 / 3), 3)
    assert (summary.truncation_rate, summary.parse_failure_rate) == (0.5, 0.5)
    assert "| 0.500 ± 0.289 (n=3) | 0.667 ± 0.333 (n=3) |" in markdown_table([summary])
    (empty,) = summarize([finish_result("m", item, "A", [])])
    assert math.isnan(empty.evidence_pair_recall) and empty.evidence_pair_recall_n == 0
    assert "| 0.0% | 0.0% | - | - |" in markdown_table([empty])

    # A partition whose items carry no gold still types the recall columns as nullable doubles.
    write_partition(warehouse, "m_results", "ds", result_rows(results[3:]))
    with warehouse.connect(read_only=True) as con:
        types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'm_results'").fetchall())
        row = con.execute("SELECT evidence_pair_recall, truncated, extra_answer_call FROM eval.m_results").fetchone()
    assert types["evidence_pair_recall"] == types["evidence_answer_recall"] == "DOUBLE"
    assert types["truncated"] == types["extra_answer_call"] == "BOOLEAN" and row == (None, True, False)
