"""The baselines as published, and our variant named as ours: MedRAG (`rag`), `rag-kg`, i-MedRAG (`irag`).

Scripted replies on the real tiny KG, corpus and encoder: what each prompt
holds (snippets, triples, query-answer pairs), how many model calls a
question takes and how they are batched, and what counts as evidence.
"""

from __future__ import annotations

import re

import pytest

from medgraph.llm.base import Conversation
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import KnowledgeTools, make_config, run_method
from medgraph.methods.baselines import format_query_answers, parse_queries
from medgraph.qa.item import QaItem

AMLODIPINE, HYPERTENSION = "C9001289", "C0020538"
OPTIONS = {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?", OPTIONS, "A",
               extra={"gold_pairs": [sorted([AMLODIPINE, HYPERTENSION])], "answer_cuis": [AMLODIPINE],
                      "gold_facts": [[f"{HYPERTENSION}|may_be_treated_by|{AMLODIPINE}",
                                      f"{AMLODIPINE}|may_treat|{HYPERTENSION}"]],
                      "seed_cuis": [HYPERTENSION]})
ANGINA = QaItem("test", "angina", "Which of the following may treat Angina pectoris?",
                {"A": "insulin", "B": "amlodipine"}, "B")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def answer_a(conversation: Conversation) -> str:
    return "<answer>A</answer>"


# --------------------------------------------------------------------------- MedRAG and rag-kg


def test_rag_is_medrag_the_question_s_rrf_snippets_and_no_triples(tools: KnowledgeTools):
    llm = ScriptedChatModel(answer_a)
    (result,) = run_method("rag", [TREAT], tools, llm, make_config("rag", {"text_k": 4}))
    assert [s.action for s in result.steps] == ["retrieve", "answer"] and len(llm.calls) == 1
    retrieve = result.steps[0]
    assert retrieve.arguments == {"query": TREAT.question}  # MedRAG queries with the question alone
    # The snippets are the hybrid search's: BM25 and dense fused by RRF, best first.
    expected = [p.chunk_id for p in tools.passages([TREAT.question], k=4, mode="hybrid")[0]]
    assert retrieve.retrieved_ids == expected and len(expected) == 4
    prompt = llm.calls[0][0][-1].content
    assert prompt.startswith("Here are the relevant documents:\n[1] ") and prompt.index("[4] ") < prompt.index(
        "Question: Which of the following may treat Hypertension?")
    assert "knowledge graph" not in prompt.lower() and not result.evidence.triples
    assert list(result.evidence.chunks) == expected


def test_rag_kg_is_the_same_snippets_plus_kg_triples(tools: KnowledgeTools):
    rag_llm, kg_llm = ScriptedChatModel(answer_a), ScriptedChatModel(answer_a)
    (rag,) = run_method("rag", [TREAT], tools, rag_llm)
    (rag_kg,) = run_method("rag-kg", [TREAT], tools, kg_llm)
    assert rag_kg.method == "rag-kg" and rag_kg.prediction == "A"
    triples = [i for i in rag_kg.steps[0].retrieved_ids if i not in rag.steps[0].retrieved_ids]
    assert rag_kg.steps[0].retrieved_ids[:len(rag.steps[0].retrieved_ids)] == rag.steps[0].retrieved_ids
    assert 0 < len(triples) <= make_config("rag-kg").triples_k and set(triples) == set(rag_kg.evidence.triples)
    prompt = kg_llm.calls[0][0][-1].content
    facts = prompt.split("Here are relevant knowledge graph facts:\n")[1].split("\n\n")[0]
    assert len(facts.splitlines()) == len(triples) and "hypertension may be treated by amlodipine" in facts.lower()
    # Without the triples the prompts are the same.
    assert prompt.replace(f"Here are relevant knowledge graph facts:\n{facts}\n\n", "") == rag_llm.calls[0][0][-1].content
    assert any({src, dst} == {AMLODIPINE, HYPERTENSION} for src, _, dst in rag_kg.evidence.triples.values())


# --------------------------------------------------------------------------- i-MedRAG


def test_parse_queries_reads_the_queries_section_and_skips_headings():
    reply = ("## Analysis\nAmlodipine is a calcium channel blocker.\nIt lowers pressure.\n\n## Queries\n"
             "1. amlodipine indications\n- calcium channel blockers\nQuery 3: \"beta blockers uses\"\n4. fourth query")
    assert parse_queries(reply, 3) == ["amlodipine indications", "calcium channel blockers", "beta blockers uses"]
    assert parse_queries("## Analysis\n1. drug uses\n2. drug risks", 5) == ["drug uses", "drug risks"]
    assert parse_queries("Queries:\n\nnothing", 2) == []
    # A reply whose line breaks were lost still gives its numbered queries.
    assert parse_queries("## Analysis unclear ## Queries 1. amlodipine uses 2. calcium channel blockers 3. more", 2) == \
        ["amlodipine uses", "calcium channel blockers"]


def imedrag_script(conversation: Conversation) -> str:
    """Round replies ask queries that depend on the round; each follow-up query is answered by name;
    the final call answers A."""
    prompt = conversation[-1].content
    if prompt.startswith("Here are the relevant documents:"):
        query = prompt.split("Here is the question:\n")[1].split("\n")[0]
        return f"ANSWER TO {query}"
    if "## Queries" in prompt:
        asked = len(re.findall(r"^Query: ", prompt, re.MULTILINE))
        return f"## Analysis\nnot enough yet\n## Queries\n1. drug query {asked} a\n2. drug query {asked} b"
    return "<answer>A</answer>"


def test_irag_answers_each_follow_up_query_and_carries_the_pairs_forward(tools: KnowledgeTools):
    llm = ScriptedChatModel(imedrag_script)
    config = make_config("irag", {"rounds": 2, "queries_per_round": 2, "text_k": 2})
    (result,) = run_method("irag", [TREAT], tools, llm, config)
    # Per round: one call writes the queries, one batched call answers both; then the final answer.
    assert [len(call) for call in llm.calls] == [1, 2, 1, 2, 1]
    assert [s.action for s in result.steps] == ["follow_up", "query_answer", "query_answer"] * 2 + ["answer"]
    assert result.llm_calls == 2 * (1 + 2) + 1 and result.prediction == "A"

    # Each follow-up query is answered from its own snippets, without the original question.
    first_answers = llm.calls[1]
    assert [c[-1].content.split("Here is the question:\n")[1].split("\n")[0] for c in first_answers] == \
        ["drug query 0 a", "drug query 0 b"]
    assert all("Hypertension" not in c[-1].content.split("Here is the question:")[1] for c in first_answers)
    answer_step = result.steps[1]
    assert answer_step.arguments == {"query": "drug query 0 a"} and len(answer_step.retrieved_ids) == 2
    assert answer_step.retrieved_ids == [p.chunk_id for p in tools.passages(["drug query 0 a"], k=2)[0]]
    assert answer_step.output == "ANSWER TO drug query 0 a"

    # The pairs of round 1 are round 2's context; every pair is the final answer's context.
    round_2 = llm.calls[2][0][-1].content
    assert format_query_answers([("drug query 0 a", "ANSWER TO drug query 0 a"),
                                 ("drug query 0 b", "ANSWER TO drug query 0 b")]) in round_2
    assert result.steps[3].arguments == {"queries": ["drug query 2 a", "drug query 2 b"]}
    final = llm.calls[4][0][-1].content
    pairs = [(f"drug query {r} {x}", f"ANSWER TO drug query {r} {x}") for r in (0, 2) for x in "ab"]
    assert format_query_answers(pairs) in final and "<answer>" in final and "Here are the relevant" not in final
    # Evidence: what retrieval showed, the snippets the answers were written from; never the model's answers.
    assert not result.evidence.texts and not result.evidence.triples
    assert set(result.evidence.chunks) == {c for s in result.steps if s.action == "query_answer"
                                           for c in s.retrieved_ids}
    assert result.stats["follow_up_queries"] == 4 and result.stats["query_snippets"] >= 2


def test_irag_batches_every_question_s_queries_into_one_call(tools: KnowledgeTools):
    llm = ScriptedChatModel(imedrag_script)
    config = make_config("irag", {"rounds": 1, "queries_per_round": 2, "text_k": 1})
    treat, angina = run_method("irag", [TREAT, ANGINA], tools, llm, config, batch_size=2)
    assert [len(call) for call in llm.calls] == [2, 4, 2]
    # The wall time of the batched answer call counts once per question.
    first, second = treat.steps[1], treat.steps[2]
    assert first.latency_s > 0 and second.latency_s == 0.0
    assert (treat.prediction, angina.prediction) == ("A", "A") and not angina.correct


def test_irag_defaults_are_the_published_code_s_and_an_unreadable_round_searches_with_the_question(
        tools: KnowledgeTools):
    defaults = make_config("irag")
    assert (defaults.rounds, defaults.queries_per_round) == (4, 3)  # i_medrag_answer(n_rounds=4, n_queries=3)

    def reply(conversation: Conversation) -> str:
        prompt = conversation[-1].content
        if prompt.startswith("Here are the relevant documents:"):
            return "amlodipine may treat hypertension"
        return "<answer>A</answer>" if "<answer>" in prompt else "hmm"

    (result,) = run_method("irag", [TREAT], tools, ScriptedChatModel(reply), make_config("irag", {"rounds": 1}))
    assert result.steps[0].arguments == {"queries": [TREAT.question]} and "no query readable" in result.steps[0].notes
    # The model's answer names both gold concepts, but what it wrote is no evidence: only the snippets count,
    # whatever the model made of them.
    def unhelpful(conversation: Conversation) -> str:
        return "I do not know." if conversation[-1].content.startswith("Here are") else reply(conversation)

    (blind,) = run_method("irag", [TREAT], tools, ScriptedChatModel(unhelpful), make_config("irag", {"rounds": 1}))
    assert (result.gold_fact_seen, result.answer_seen) == (blind.gold_fact_seen, blind.answer_seen)
    assert set(result.evidence.chunks) == set(blind.evidence.chunks)
