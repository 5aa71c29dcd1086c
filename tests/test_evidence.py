"""Evidence recall and cut-off answers: what each method put in front of its answering call, and what a budget did.

Scripted episodes on the real tiny KG and corpus with known evidence: a gold
fact is seen when a shown triple IS it (its relation, in either listing) or a
shown text states it (one sentence naming both concepts, or a KG concept text
listing that relation); a triple of another relation between the same concepts
is not the fact, and text a model wrote never counts. The answer concept is seen
when a shown triple, a listed concept or a shown text names it. A reply cut at its token budget
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
from medgraph.kg.graph import Triple
from medgraph.llm.base import Conversation
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import KnowledgeTools, make_config, run_method
from medgraph.methods.agent import CUT_OFF_NOTE, UNREADABLE_NOTE
from medgraph.methods.common import EvidenceSeen, MethodResult, finish_result
from medgraph.methods.registry import record_evidence_recall
from medgraph.qa.item import QaItem
from medgraph.retrieval import Retriever
from medgraph.storage import Warehouse
from medgraph.text.mentions import link_chunk_mentions

AMLODIPINE, HYPERTENSION = "C9001289", "C0020538"
OPTIONS = {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}
# A KG question as the QA generator writes it: its gold fact in both listings, its answer concept.
GOLD_FACT = [f"{HYPERTENSION}|may_be_treated_by|{AMLODIPINE}", f"{AMLODIPINE}|may_treat|{HYPERTENSION}"]
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?", OPTIONS, "A",
               extra={"gold_pairs": [sorted([AMLODIPINE, HYPERTENSION])], "gold_facts": [GOLD_FACT],
                      "answer_cuis": [AMLODIPINE], "seed_cuis": [HYPERTENSION]})
NO_GOLD = QaItem("test", "mirage", "Which of the following may treat Hypertension?", OPTIONS, "A")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def answer_a(conversation: Conversation) -> str:
    return "<answer>A</answer>"


# --------------------------------------------------------------------------- evidence recall per method


def test_rag_kg_that_shows_the_gold_fact_has_full_recall_and_an_item_without_gold_has_none(tools: KnowledgeTools):
    treat, no_gold = run_method("rag-kg", [TREAT, NO_GOLD], tools, ScriptedChatModel(answer_a))
    assert any({src, dst} == {AMLODIPINE, HYPERTENSION} for src, _, dst in treat.evidence.triples.values())
    assert treat.evidence.chunks and all(chars == 600 for chars in treat.evidence.chunks.values())
    assert (treat.gold_fact_seen, treat.answer_seen) == (1.0, 1.0)
    assert treat.stats["gold_fact_seen"] == 1.0 and treat.stats["answer_seen"] == 1.0
    assert (no_gold.gold_fact_seen, no_gold.answer_seen) == (None, None)
    assert "evidence" not in treat.as_dict() and treat.as_dict()["gold_fact_seen"] == 1.0


def test_cot_shows_no_evidence_so_its_recall_is_zero(tools: KnowledgeTools):
    (result,) = run_method("cot", [TREAT], tools, ScriptedChatModel(answer_a))
    assert result.correct and result.evidence.empty
    assert (result.gold_fact_seen, result.answer_seen) == (0.0, 0.0)


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
    assert (traversed.gold_fact_seen, traversed.answer_seen) == (1.0, 1.0)
    # A search lists the answer concept by name, but no fact joins it to the question's concept.
    assert AMLODIPINE in searched.evidence.concepts and not searched.evidence.triples
    assert (searched.gold_fact_seen, searched.answer_seen) == (0.0, 1.0)
    # A concept's text counts as mentioning the concept itself (and what the text names).
    assert set(analyzed.evidence.concept_texts) == {AMLODIPINE} and analyzed.answer_seen == 1.0


def test_graph_r1_observation_not_shown_at_the_last_turn_is_not_evidence(tools: KnowledgeTools):
    script = graph_r1_script(f"<think>edges</think><traverse>{HYPERTENSION}</traverse>", "<answer>A</answer>")
    (result,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(script), make_config("graph-r1", {"max_steps": 1}))
    assert result.stats["out_of_turns"] and result.evidence.empty and result.gold_fact_seen == 0.0
    # Out of turns without an answer: asked once more outside the environment (not cut, so not "truncated").
    assert result.extra_answer_call and not result.truncated and result.steps[-1].action == "final_answer"


class GraphTokenModel(ScriptedChatModel):
    """A scripted model that takes graph tokens (and ignores them)."""

    supports_graph_tokens, hidden_size = True, 8

    def generate(self, conversations, config=None, graph_tokens=None):
        return super().generate(conversations, config)


class OnesTokenizer:
    def encode(self, triples: Sequence[Triple]) -> torch.Tensor:
        return torch.ones(len(triples), GraphTokenModel.hidden_size)


def test_a2rag_counts_as_seen_the_text_it_showed_and_its_graph_tokens_apart(tools: KnowledgeTools):
    """"Gold fact seen" is what the answering call showed as text (the first `context_triples`); the triples
    that reached the model only as graph tokens are their own measure, `gold_fact_in_graph_tokens`."""
    config = make_config("a2rag-no-awc", {"iterations": 1, "max_triples_per_relation": 3, "top_n": 20,
                                           "context_triples": 2})
    (text_only,) = run_method("a2rag", [TREAT], tools, ScriptedChatModel(answer_a), config)
    (tokens,) = run_method("a2rag", [TREAT], tools, GraphTokenModel(answer_a), config, graph_tokenizer=OnesTokenizer())
    retrieved = text_only.steps[0].retrieved_ids
    assert list(text_only.evidence.triples) == retrieved[:2] == text_only.steps[-1].retrieved_ids
    assert tokens.stats["hiim"] == "graph-tokens" and list(tokens.evidence.triples) == retrieved[:2]
    assert set(tokens.evidence.graph_tokens) == set(retrieved) and not text_only.evidence.graph_tokens
    assert tokens.gold_fact_seen == text_only.gold_fact_seen
    gold_edge = {f"{src}|{relation}|{dst}" for src, relation, dst in tokens.evidence.graph_tokens.values()} & set(GOLD_FACT)
    assert tokens.stats["gold_fact_in_graph_tokens"] == float(bool(gold_edge))
    assert "gold_fact_in_graph_tokens" not in text_only.stats
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
    assert result.answer_seen == 1.0 and result.gold_fact_seen is not None


# --------------------------------------------------------------------------- chunk mentions


@pytest.fixture(scope="module")
def mentions_warehouse(retrieval_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path_factory.mktemp("mentions") / "home")
    link_chunk_mentions(warehouse)
    return warehouse


def test_a_chunk_states_a_fact_when_one_sentence_names_both_concepts_within_the_characters_shown(
        mentions_warehouse: Warehouse, tools: KnowledgeTools, encoder):
    from medgraph.methods.registry import _sentence_spans

    with duckdb.connect(str(mentions_warehouse.path), read_only=True) as con:
        mentions = con.execute("SELECT chunk_id, cui, start_char, end_char FROM kg.kg_chunk_mentions WHERE score = 1 "
                               "ORDER BY chunk_id, start_char").fetchall()
        texts = dict(con.execute("SELECT chunk_id, text FROM text.corpus_chunks").fetchall())

    def first_pair_in_one_sentence() -> tuple[str, str, str, int]:
        by_chunk: dict[str, list] = {}
        for chunk_id, cui, start, end in mentions:
            by_chunk.setdefault(chunk_id, []).append((cui, start, end))
        for chunk_id, found in sorted(by_chunk.items()):
            spans = _sentence_spans(texts[chunk_id])
            for a_start, a_end in spans:
                inside = [m for m in found if a_start <= m[1] < a_end and m[2] < 500]
                first_of = {}
                for cui, start, end in inside:
                    first_of.setdefault(cui, (start, end))
                if len(first_of) >= 2 and all(first_of[c] == min((m[1], m[2]) for m in found if m[0] == c)
                                              for c in first_of):
                    (one, _), (two, (_, end)) = sorted(first_of.items(), key=lambda kv: kv[1])[:2]
                    return chunk_id, one, two, end
        raise AssertionError("no chunk names two concepts in one sentence")

    chunk_id, first, second, second_end = first_pair_in_one_sentence()
    item = QaItem("test", "pair", "?", OPTIONS, "A", extra={"gold_facts": [[f"{first}|related_to|{second}"]],
                                                              "answer_cuis": [second]})

    def seen(shown_chars: int | None, tables: KnowledgeTools) -> tuple[float | None, float | None]:
        result = finish_result("rag", item, "A", [], evidence=EvidenceSeen())
        result.evidence.add_chunks([chunk_id], shown_chars)
        record_evidence_recall(tables, [item], [result])
        return result.gold_fact_seen, result.answer_seen

    with Retriever(mentions_warehouse, encoder) as retriever:
        from_table = KnowledgeTools(retriever)
        assert seen(None, from_table) == seen(second_end, from_table) == (1.0, 1.0)
        assert seen(second_end - 1, from_table) == (0.0, 0.0)  # the second mention was cut off the prompt
    # Without the mentions table the same dictionary matcher runs over the chunk: the same answer.
    assert seen(second_end, tools) == (1.0, 1.0) and seen(second_end - 1, tools) == (0.0, 0.0)


def test_free_text_states_a_fact_only_when_one_sentence_names_both_concepts(tools: KnowledgeTools):
    both, one, apart = (finish_result("x", TREAT, "A", []) for _ in range(3))
    both.evidence.add_text("Amlodipine is given for hypertension.")
    one.evidence.add_text("Amlodipine is a calcium channel blocker.")
    apart.evidence.add_text("Amlodipine is a calcium channel blocker. Hypertension is common.")
    record_evidence_recall(tools, [TREAT] * 3, [both, one, apart])
    assert (both.gold_fact_seen, both.answer_seen) == (1.0, 1.0)
    assert (one.gold_fact_seen, one.answer_seen) == (0.0, 1.0)
    assert (apart.gold_fact_seen, apart.answer_seen) == (0.0, 1.0)


def triple(src: str, relation: str, dst: str) -> Triple:
    return Triple(f"{src}{relation}{dst}", src, src, relation, dst, dst)


def test_a_triple_of_another_relation_between_the_gold_concepts_is_not_the_gold_fact(tools: KnowledgeTools):
    wrong, reverse, gold = (finish_result("x", TREAT, "A", []) for _ in range(3))
    wrong.evidence.add_triples([triple(AMLODIPINE, "contraindicated_with_disease", HYPERTENSION)])
    reverse.evidence.add_triples([triple(AMLODIPINE, "may_treat", HYPERTENSION)])  # the other listing
    gold.evidence.add_triples([triple(HYPERTENSION, "may_be_treated_by", AMLODIPINE)])
    record_evidence_recall(tools, [TREAT] * 3, [wrong, reverse, gold])
    assert (wrong.gold_fact_seen, wrong.answer_seen) == (0.0, 1.0)  # the answer concept is there, the fact is not
    assert reverse.gold_fact_seen == gold.gold_fact_seen == 1.0


def test_gold_fact_in_top_10_counts_only_the_first_ten_units_shown(tools: KnowledgeTools):
    late, early = finish_result("x", TREAT, "A", []), finish_result("x", TREAT, "A", [])
    filler = [triple(f"C00000{i:02d}", "isa", HYPERTENSION) for i in range(10)]
    late.evidence.add_triples([*filler, triple(HYPERTENSION, "may_be_treated_by", AMLODIPINE)])
    early.evidence.add_triples([triple(HYPERTENSION, "may_be_treated_by", AMLODIPINE), *filler])
    record_evidence_recall(tools, [TREAT] * 2, [late, early])
    assert (late.gold_fact_seen, late.gold_fact_top10) == (1.0, 0.0)
    assert (early.gold_fact_seen, early.gold_fact_top10) == (1.0, 1.0)


def test_a_kg_concept_text_states_the_relations_it_lists(tools: KnowledgeTools):
    listed, named = finish_result("x", TREAT, "A", []), finish_result("x", TREAT, "A", [])
    listed.evidence.add_concept_text(HYPERTENSION, "Hypertension. Relations: may be treated by amlodipine.")
    named.evidence.add_concept_text(HYPERTENSION, "Hypertension. Relations: has contraindicated drug amlodipine.")
    record_evidence_recall(tools, [TREAT] * 2, [listed, named])
    assert listed.gold_fact_seen == 1.0 and named.gold_fact_seen == 0.0 and named.answer_seen == 1.0


def test_model_written_text_never_counts_as_evidence(tools: KnowledgeTools):
    """i-MedRAG's final call reads the model's own answers to its follow-up queries: those answers name
    amlodipine and hypertension in one sentence, but only the snippets retrieval showed count."""
    def reply(conversation: Conversation) -> str:
        prompt = conversation[-1].content
        if "## Queries" in prompt:
            return "## Queries\nwhat treats high blood pressure"
        if "Answer in one or two sentences" in prompt:
            return "Amlodipine may treat hypertension."
        return "<answer>A</answer>"

    (result,) = run_method("irag", [TREAT], tools, ScriptedChatModel(reply), make_config("irag", {"rounds": 1}))
    assert any("Amlodipine may treat hypertension." in s.output for s in result.steps)
    assert not result.evidence.texts and result.evidence.chunks  # the snippets, never the model's answers
    query_answers = [s for s in result.steps if s.action == "query_answer"]
    assert set(result.evidence.chunks) == {c for s in query_answers for c in s.retrieved_ids}


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


def test_a_cut_reply_that_already_holds_an_answer_is_not_retried(tools: KnowledgeTools):
    answered_first = ScriptedChatModel(lambda c: "<answer>A</answer> because amlodipine is a calcium channel blocker")
    (cut,) = run_method("cot", [TREAT], tools, answered_first, make_config("cot", {"max_new_tokens": 4}))
    assert cut.correct and not cut.truncated and len(cut.steps) == 1 and len(answered_first.calls) == 1


def test_an_unreadable_reply_is_asked_once_more_constrained_to_the_option_tags(tools: KnowledgeTools):
    def reply(conversation: Conversation) -> str:
        return "<answer>A</answer>" if UNREADABLE_NOTE in conversation[-1].content else "No idea."
    llm = ScriptedChatModel(reply)
    (result,) = run_method("cot", [TREAT], tools, llm)
    assert result.correct and result.extra_answer_call and not result.truncated and not result.parse_failed
    assert [s.action for s in result.steps] == ["answer", "final_answer"]
    assert "no readable answer" in result.steps[1].notes
    assert llm.configs[1].choices == tuple(f"<answer>{letter}</answer>" for letter in TREAT.options)
    assert llm.configs[0].choices == ()  # the method's own answer call is free text
    still = ScriptedChatModel(lambda c: "No idea.")  # a backend that cannot constrain may still fail to answer
    (unreadable,) = run_method("cot", [TREAT], tools, still)
    assert unreadable.parse_failed and unreadable.extra_answer_call and len(still.calls) == 2


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
        result.gold_fact_seen, result.answer_seen, result.truncated = pair, answer, truncated
        results.append(result)
    (summary,) = summarize(results)
    assert (summary.gold_fact_seen, summary.gold_fact_seen_n) == (0.5, 3)
    assert summary.gold_fact_seen_se == pytest.approx(0.5 / math.sqrt(3))  # sample s.d. 0.5
    assert (summary.answer_seen, summary.answer_seen_n) == (pytest.approx(2 / 3), 3)
    assert (summary.truncation_rate, summary.parse_failure_rate) == (0.5, 0.5)
    assert "| 0.500 ± 0.289 (n=3) | - | 0.667 ± 0.333 (n=3) |" in markdown_table([summary])  # no top-10 values
    (empty,) = summarize([finish_result("m", item, "A", [])])
    assert math.isnan(empty.gold_fact_seen) and empty.gold_fact_seen_n == 0
    assert "| 0.0% | 0.0% | - | - |" in markdown_table([empty])

    # A partition whose items carry no gold still types the recall columns as nullable doubles.
    write_partition(warehouse, "m_results", "ds", result_rows(results[3:]))
    with warehouse.connect(read_only=True) as con:
        types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'm_results'").fetchall())
        row = con.execute("SELECT gold_fact_seen, truncated, extra_answer_call FROM eval.m_results").fetchone()
    assert types["gold_fact_seen"] == types["answer_seen"] == "DOUBLE"
    assert types["truncated"] == types["extra_answer_call"] == "BOOLEAN" and row == (None, True, False)
