"""The reader adapter's examples (RAFT-style, train split only), its leakage guard and its LoRA fit (issue 29)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from medgraph.kg.graph import KnowledgeGraph, Triple
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods.baselines import rag_kg_evidence
from medgraph.methods.common import parse_answer
from medgraph.methods.registry import run_method
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.item import QaItem
from medgraph.rl.reader import (
    DEFAULT_LAYOUTS,
    NOT_FOUND,
    NOT_FOUND_DOCUMENTS,
    ReaderConfig,
    ReaderExample,
    baits_a_second_hop,
    check_no_leak,
    held_out_pairs,
    layouts_text,
    parse_layouts,
    reader_examples,
    train_reader_adapter,
    with_gold_at_rank,
)
from medgraph.rl.sft import SftConfig, lr_factor
from medgraph.storage import Warehouse

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HYPERTENSION = "C0020538"
KG_FACTS = (("kg_facts", 1.0),)
# The layouts that need only the graph (rag_kg needs a retriever: its own test below).
GRAPH_ONLY = tuple((name, weight) for name, weight in DEFAULT_LAYOUTS if name != "rag_kg")


@pytest.fixture(scope="module")
def graph(kg_warehouse: Warehouse) -> KnowledgeGraph:
    return KnowledgeGraph(kg_warehouse)


def mc_item(graph: KnowledgeGraph, qid: str = "q1") -> tuple[QaItem, Triple, list[str]]:
    """A multiple-choice item whose gold fact is a real edge of the tiny KG; the wrong options are other
    neighbours of the question concept, so the evidence has distractors."""
    edges = graph.one_hop([HYPERTENSION])
    gold = edges[0]
    others = list(dict.fromkeys(t.dst_cui for t in edges if t.dst_cui != gold.dst_cui))[:3]
    assert len(others) == 3, "the tiny KG changed: Hypertension needs 4 distinct neighbours"
    options = dict(zip("ABCD", ["answer", "wrong 1", "wrong 2", "wrong 3"], strict=True))
    item = QaItem("kgqa_mc", qid, f"Which concept is linked to Hypertension by {gold.relation}?", options, "A",
                  extra={"gold_path": [gold.edge_id], "seed_cuis": [HYPERTENSION], "answer_cuis": [gold.dst_cui],
                         "option_cuis": [gold.dst_cui, *others], "gold_pairs": [sorted([gold.src_cui, gold.dst_cui])],
                         "gold_facts": [[f"{gold.src_cui}|{gold.relation}|{gold.dst_cui}"]]})
    return item, gold, others


def facts_shown(example: ReaderExample) -> str:
    return example.conversation[1].content.split("Question:")[0]


def test_examples_quote_the_gold_fact_among_distractors_or_withhold_it(graph: KnowledgeGraph):
    item, gold, _ = mc_item(graph)
    config = ReaderConfig(gold_share=1.0, layouts=KG_FACTS)
    (shown,), counts = reader_examples(graph, [item], config, frozenset())
    assert shown.gold_shown and counts["gold_shown"] == 1 and counts["layout_kg_facts"] == 1
    assert [m.role for m in shown.conversation] == ["system", "user", "assistant"]
    lines = facts_shown(shown).splitlines()
    assert any(line.endswith(gold.text) for line in lines)
    assert len(lines) > 2  # the heading, the gold fact and at least one distractor

    (withheld,), counts = reader_examples(graph, [item], ReaderConfig(gold_share=0.0, layouts=KG_FACTS), frozenset())
    assert not withheld.gold_shown and counts["gold_withheld"] == 1
    assert gold.text not in facts_shown(withheld) and withheld.conversation[2].content == NOT_FOUND
    assert "<answer>" not in withheld.conversation[2].content  # names no option: nothing to memorise


def test_the_a2rag_layout_asks_first_and_shows_the_same_fact(graph: KnowledgeGraph):
    """A2RAG's answering call puts the question before "Knowledge graph facts:" (`answer_conversation`)."""
    item, gold, _ = mc_item(graph)
    config = ReaderConfig(gold_share=1.0, layouts=(("a2rag", 1.0),))
    (example,), _ = reader_examples(graph, [item], config, frozenset())
    prompt = example.conversation[1].content
    assert example.layout == "a2rag" and prompt.index("Question:") < prompt.index("Knowledge graph facts:")
    assert any(line.endswith(gold.text) for line in prompt.split("Knowledge graph facts:")[1].splitlines())


def test_the_documents_layout_shows_concept_texts(graph: KnowledgeGraph):
    """MedRAG's layout with the facts as `kg_node_text` writes them: the subject's document lists "<relation>
    <object>" and the other options' concepts are described without relations."""
    item, gold, others = mc_item(graph)
    config = ReaderConfig(gold_share=1.0, layouts=(("documents", 1.0),))
    (example,), counts = reader_examples(graph, [item], config, frozenset())
    prompt = example.conversation[1].content
    assert counts["layout_documents"] == 1 and prompt.startswith("Here are the relevant documents:\n[1] ")
    documents = prompt.split("Question:")[0].strip().splitlines()[1:]
    phrase = f"{gold.relation.replace('_', ' ')} {gold.dst_name}"
    (stating,) = [line for line in documents if phrase in line.split("Relations:", 1)[-1]]
    assert stating.startswith(f"[{stating[1]}] {gold.src_name}.")
    assert len(documents) >= 1 + len(others)  # each wrong option's concept has its own description
    assert example.pairs <= {frozenset((t.src_cui, t.dst_cui)) for t in graph.one_hop([HYPERTENSION])}
    (withheld,), _ = reader_examples(graph, [item], replace(config, gold_share=0.0), frozenset())
    assert phrase not in withheld.conversation[1].content.split("Question:")[0]
    assert withheld.conversation[2].content == NOT_FOUND_DOCUMENTS


def test_targets_quote_the_fact_and_name_no_number(graph: KnowledgeGraph):
    """RAFT's form: the target quotes the gold fact ("The evidence states that ...") in every layout."""
    item, gold, _ = mc_item(graph)
    for layout in ("kg_facts", "a2rag", "documents"):
        config = ReaderConfig(gold_share=1.0, layouts=((layout, 1.0),), answer_form="letter")
        (example,), _ = reader_examples(graph, [item], config, frozenset())
        assert example.conversation[2].content == (f"The evidence states that {gold.text}. "
                                                   "The answer is answer, option A. <answer>A</answer>")


def test_the_text_form_answers_with_the_option_text_that_every_parser_reads_as_its_letter(graph: KnowledgeGraph):
    item, gold, _ = mc_item(graph)
    item = replace(item, options={**item.options, "A": gold.dst_name})
    (example,), _ = reader_examples(graph, [item], ReaderConfig(gold_share=1.0, layouts=KG_FACTS), frozenset())
    target = example.conversation[2].content  # the default form
    assert target == f"The evidence states that {gold.text}. The answer is <answer>{gold.dst_name}</answer>."
    assert parse_answer(target, item) == "A"
    with pytest.raises(ValueError, match="answer_form"):
        ReaderConfig(answer_form="number")


def test_a_share_of_examples_is_shown_no_evidence_and_says_so(graph: KnowledgeGraph):
    items = [mc_item(graph, f"q{i}")[0] for i in range(20)]
    config = ReaderConfig(gold_share=1.0, layouts=KG_FACTS, no_evidence_share=0.5)
    examples, counts = reader_examples(graph, items, config, frozenset())
    empty = [e for e in examples if "knowledge graph facts" not in e.conversation[1].content]
    assert 0 < len(empty) == counts["no_evidence"] < len(examples)
    assert all(e.conversation[2].content == NOT_FOUND and not e.pairs and not e.gold_shown for e in empty)


def test_one_hop_questions_can_enter_the_examples_more_than_once_each_drawn_afresh(graph: KnowledgeGraph):
    one_hop = [replace(item, extra={**item.extra, "hops": 1}) for item in
               (mc_item(graph, f"q{i}")[0] for i in range(10))]
    two_hop = [replace(item, extra={**item.extra, "hops": 2}) for item in
               (mc_item(graph, f"r{i}")[0] for i in range(10))]
    once, _ = reader_examples(graph, one_hop + two_hop, ReaderConfig(layouts=GRAPH_ONLY, baited_copies=1),
                              frozenset())
    thrice, _ = reader_examples(graph, one_hop + two_hop,
                                ReaderConfig(layouts=GRAPH_ONLY, one_hop_copies=3, baited_copies=1), frozenset())
    assert len(once) == 20 and len(thrice) == 40
    copies = [e for e in thrice if e.qid == "q0"]
    assert len(copies) == 3 and len({(e.layout, e.conversation[1].content) for e in copies}) > 1
    assert sum(e.qid.startswith("r") for e in thrice) == 10  # 2-hop questions enter once
    with pytest.raises(ValueError, match="one_hop_copies"):
        ReaderConfig(one_hop_copies=0)


def test_a_one_hop_question_baits_a_second_hop_when_its_answer_links_to_a_wrong_option(graph: KnowledgeGraph):
    item, gold, _ = mc_item(graph)
    linked = [t.dst_cui for t in graph.one_hop([gold.dst_cui]) if t.dst_cui != HYPERTENSION]
    assert linked, "the tiny KG changed: Hypertension's first neighbour needs a neighbour of its own"
    unlinked = ["C9999991", "C9999992", "C9999993"]  # concepts the KG does not hold
    one_hop = {**item.extra, "hops": 1}
    baited = replace(item, extra={**one_hop, "option_cuis": [gold.dst_cui, linked[0], *unlinked[:2]]})
    clean = replace(item, extra={**one_hop, "option_cuis": [gold.dst_cui, *unlinked]})
    chain = replace(baited, extra={**baited.extra, "hops": 2})  # a chain is asked for: no bait
    assert baits_a_second_hop(graph, [baited, clean, chain]) == [True, False, False]
    # baited_copies puts the baited question among the examples more often (times one_hop_copies); the clean one not.
    items = [replace(baited, qid="baited"), replace(clean, qid="clean")]
    examples, _ = reader_examples(graph, items, ReaderConfig(layouts=GRAPH_ONLY, baited_copies=3, one_hop_copies=2),
                                  frozenset())
    assert [e.qid for e in examples].count("baited") == 6 and [e.qid for e in examples].count("clean") == 2
    with pytest.raises(ValueError, match="baited_copies"):
        ReaderConfig(baited_copies=0)


def test_layouts_are_drawn_apart_from_the_withholding(graph: KnowledgeGraph):
    """Changing the layouts changes no example's gold-shown draw: the layouts have their own random stream."""
    items = [mc_item(graph, f"q{i}")[0] for i in range(20)]
    mixed, counts = reader_examples(graph, items, ReaderConfig(layouts=GRAPH_ONLY, gold_share=0.5,
                                                               no_evidence_share=0.0), frozenset())
    alone, _ = reader_examples(graph, items, ReaderConfig(gold_share=0.5, no_evidence_share=0.0, layouts=KG_FACTS),
                               frozenset())
    assert [e.gold_shown for e in mixed] == [e.gold_shown for e in alone]
    assert {k for k in counts if k.startswith("layout_")} == {"layout_kg_facts", "layout_a2rag", "layout_documents"}
    with pytest.raises(ValueError, match="reader layouts"):
        ReaderConfig(layouts=(("passages", 1.0),))
    with pytest.raises(ValueError, match="no_evidence_share must be within"):
        ReaderConfig(no_evidence_share=1.5)
    with pytest.raises(ValueError, match="gold_share must be within"):
        ReaderConfig(gold_share=-0.1)


def test_a_yes_no_item_always_shows_its_fact(graph: KnowledgeGraph):
    item, _, _ = mc_item(graph)
    yes_no = replace(item, options={"A": "yes", "B": "no"}, extra={**item.extra, "option_cuis": []})
    (example,), _ = reader_examples(graph, [yes_no], ReaderConfig(layouts=GRAPH_ONLY, gold_share=0.0), frozenset())
    assert example.gold_shown and example.conversation[2].content.endswith("The answer is <answer>yes</answer>.")


def test_facts_of_held_out_questions_never_reach_the_examples(graph: KnowledgeGraph):
    item, gold, others = mc_item(graph)
    distractor = frozenset((HYPERTENSION, others[0]))
    (example,), counts = reader_examples(graph, [item], ReaderConfig(layouts=GRAPH_ONLY, gold_share=1.0),
                                         frozenset({distractor}))
    assert distractor not in example.pairs and counts["dropped_held_out_facts"] >= 1
    # A validation question about the same pair as this train question: the train question is skipped.
    held_out = held_out_pairs([replace(item, qid="valid-1")])
    assert held_out == {frozenset((gold.src_cui, gold.dst_cui))}
    examples, counts = reader_examples(graph, [item], ReaderConfig(layouts=GRAPH_ONLY), held_out)
    assert examples == [] and counts["skipped_held_out_question"] == 1
    check_no_leak([example], frozenset())
    with pytest.raises(ValueError, match=r"join concept pairs of validation or test questions, e.g. question q1"):
        check_no_leak([example], held_out_pairs([replace(item, qid="test-1")]) | {next(iter(example.pairs))})


def as_gold(item: QaItem, gold: Triple, graph: KnowledgeGraph) -> QaItem:
    """`item` (same question and options, so the same retrieval) about `gold` instead."""
    others = [t.dst_cui for t in graph.one_hop([gold.src_cui]) if t.dst_cui != gold.dst_cui][:3]
    return replace(item, extra={**item.extra, "gold_path": [gold.edge_id], "seed_cuis": [gold.src_cui],
                                "answer_cuis": [gold.dst_cui], "option_cuis": [gold.dst_cui, *others],
                                "gold_pairs": [sorted([gold.src_cui, gold.dst_cui])],
                                "gold_facts": [[f"{gold.src_cui}|{gold.relation}|{gold.dst_cui}"]]})


def test_the_rag_kg_layout_is_rag_kg_s_own_answering_call(tools: KnowledgeTools):
    """RAFT's recipe: the example shows what the method's retriever returned for the question, word for word the
    prompt `rag-kg` answers, the gold fact at the rank the retriever gave it."""
    graph = tools.retriever.graph
    item, _, _ = mc_item(graph)
    passages, ranked = rag_kg_evidence(tools, [item])[0]
    assert passages and len(ranked) > 3
    item = as_gold(item, ranked[2], graph)  # the retriever's third fact is the gold one
    config = ReaderConfig(gold_share=1.0, no_evidence_share=0.0, layouts=(("rag_kg", 1.0),))
    (example,), counts = reader_examples(graph, [item], config, frozenset(), tools=tools)
    recorder = ScriptedChatModel(["The answer is <answer>A</answer>."])
    run_method("rag-kg", [item], tools, recorder)
    assert counts["layout_rag_kg"] == 1 and example.layout == "rag_kg" and example.gold_shown
    assert example.conversation[:2] == recorder.calls[0][0]
    assert example.conversation[2].content.startswith(f"The evidence states that {ranked[2].text}.")

    (withheld,), _ = reader_examples(graph, [item], replace(config, gold_share=0.0), frozenset(), tools=tools)
    shown = withheld.conversation[1].content
    assert ranked[2].text not in shown and ranked[3].text in shown and "Here are the relevant documents:" in shown
    assert withheld.conversation[2].content == NOT_FOUND

    # A fact joining a held-out pair never shows, though the retriever ranked it.
    held_out = frozenset({frozenset((ranked[0].src_cui, ranked[0].dst_cui))})
    (guarded,), counts = reader_examples(graph, [item], config, held_out, tools=tools)
    assert ranked[0].text not in guarded.conversation[1].content and counts["dropped_held_out_facts"] >= 1
    with pytest.raises(ValueError, match="needs `tools`"):
        reader_examples(graph, [item], config, frozenset())


def test_a_gold_fact_the_retriever_missed_goes_to_a_random_rank_and_the_last_other_makes_room():
    def fact(name: str) -> Triple:
        return Triple(f"e-{name}", "C1", name, "rel", "C2", name)

    ranked = [fact(f"r{i}") for i in range(5)]
    gold_found, gold_missed = fact("r1"), fact("g")
    fact_of = {"e-r1": 0, "e-g": 1}.get
    shown = with_gold_at_rank(ranked, [gold_found, gold_missed], lambda t: fact_of(t.edge_id), 5, random.Random(0))
    assert len(shown) == 5 and shown.index(gold_found) == 1 and gold_missed in shown
    assert ranked[4] not in shown and [t for t in shown if t is not gold_missed] == ranked[:4]
    places = {with_gold_at_rank(ranked, [gold_missed], lambda t: fact_of(t.edge_id), 5,
                                random.Random(seed)).index(gold_missed) for seed in range(40)}
    assert len(places) >= 4  # no fixed place for the reader to learn


def test_the_adapter_learns_the_targets_and_leaves_the_base_weights_alone(graph: KnowledgeGraph,
                                                                         tiny_llm_dir: Path):
    items = [mc_item(graph, f"q{i}")[0] for i in range(4)]
    config = ReaderConfig(layouts=GRAPH_ONLY, gold_share=0.5,
                          fit=SftConfig(steps=40, batch_size=4, micro_batch_size=4, lr=2e-2, lora_r=8, lora_alpha=16,
                                        device="cpu", bf16=False))
    examples, _ = reader_examples(graph, items, config, frozenset())
    with pytest.raises(ValueError, match="validation or test"):  # refused before any model is loaded
        train_reader_adapter(tiny_llm_dir, examples, config, frozenset(examples[0].pairs))
    result = train_reader_adapter(tiny_llm_dir, examples, config, frozenset())
    # A random 64-wide model whose embeddings and head stay frozen learns slowly under LoRA (10.80 -> 10.49 nats
    # here, the same four examples every step; 80 steps: 10.37); the pretrained reader memorises such targets
    # within 8 steps (5.2 -> 0.4).
    assert result.metrics["train_nll_last"] < result.metrics["train_nll_first"] - 0.2
    trained = {n: p for n, p in result.policy.model.named_parameters()}
    assert all("lora_" in n for n, p in trained.items() if p.requires_grad)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llm_dir)
    name, weight = next((n, p) for n, p in base.named_parameters() if n.endswith("q_proj.weight"))
    adapted_base = next(p for n, p in trained.items() if n.endswith(name.replace("q_proj.weight", "q_proj.base_layer.weight")))
    assert torch.equal(weight, adapted_base)


def test_each_step_trains_at_its_scheduled_rate(graph: KnowledgeGraph, tiny_llm_dir: Path):
    items = [mc_item(graph, f"q{i}")[0] for i in range(2)]
    fit = SftConfig(steps=4, batch_size=2, micro_batch_size=2, lr=1e-3, lr_schedule="cosine", warmup_share=0.25,
                    lora_r=4, lora_alpha=8, device="cpu", bf16=False)
    examples, _ = reader_examples(graph, items, ReaderConfig(layouts=GRAPH_ONLY, fit=fit), frozenset())
    result = train_reader_adapter(tiny_llm_dir, examples, ReaderConfig(layouts=GRAPH_ONLY, fit=fit), frozenset())
    assert [round(h["lr"], 9) for h in result.history] == [round(1e-3 * lr_factor(s, fit), 9) for s in range(1, 5)]
    assert result.history[0]["lr"] == pytest.approx(1e-3) and result.history[-1]["lr"] == pytest.approx(1e-4)


def test_a_long_two_hop_target_quotes_only_the_fact_that_names_the_answer():
    from medgraph.rl.reader import TARGET_TOKENS, _quoting_target, approx_tokens

    long_name = "Congenitally corrected transposition of the great arteries with ventricular septal defect"
    facts = [Triple("e1", "C1", long_name, "has_manifestation", "C2", "Abnormal atrioventricular valve morphology"),
             Triple("e2", "C9", "Ebstein anomaly of the tricuspid valve", "has_manifestation", "C2",
                    "Abnormal atrioventricular valve morphology"),
             Triple("e3", "C1", long_name, "isa", "C3", "Congenital malformation of the great arteries")]
    item = QaItem("kgqa_mc", "q", "Which disease shares a manifestation with ...?",
                  {"A": "x", "B": "Ebstein anomaly of the tricuspid valve", "C": "y", "D": "z"}, "B",
                  extra={"answer_cuis": ["C9"], "seed_cuis": ["C1"]})
    target = _quoting_target(item, facts[:2], "letter")
    full = f"The evidence states that {facts[0].text}; and that {facts[1].text}."
    assert approx_tokens(full) > TARGET_TOKENS and len(target) < len(full)
    assert target.startswith("The evidence states that Ebstein anomaly")
    assert target.endswith("option B. <answer>B</answer>")
    # The budget is the reader's tokens: a tokenizer that counts the pair as short keeps both facts.
    assert _quoting_target(item, facts[:2], "letter", count_tokens=lambda text: 10).startswith(full[:-1])
    short = [Triple("e1", "C1", "X", "r", "C2", "Y"), Triple("e2", "C9", "Z", "r", "C2", "Y")]
    assert _quoting_target(item, short, "letter").startswith("The evidence states that X r Y; and that Z r Y.")


def test_a_two_hop_target_quotes_its_facts_from_the_question_concept_to_the_answer():
    """The 2-hop adapters quoted the question concept's fact and answered its bridge; the targets, in the shuffled
    evidence order, put the answer's fact first as often as last (benchmarks/README.md, run 12)."""
    from medgraph.rl.reader import _quoting_target

    hop_to_answer = Triple("e2", "C2", "Subcutaneous hemorrhage", "manifestation_of", "C3", "Microscopic polyangiitis")
    hop_from_question = Triple("e1", "C1", "Purpura", "isa", "C2", "Subcutaneous hemorrhage")
    item = QaItem("kgqa_mc", "q", "a broader category of Purpura is a manifestation of which of the following?",
                  {"A": "Mononeuropathy", "B": "Microscopic polyangiitis", "C": "x", "D": "y"}, "B",
                  extra={"answer_cuis": ["C3"], "seed_cuis": ["C1"]})
    assert _quoting_target(item, [hop_to_answer, hop_from_question], "text") == (
        "The evidence states that Purpura isa Subcutaneous hemorrhage; and that Subcutaneous hemorrhage manifestation "
        "of Microscopic polyangiitis. The answer is <answer>Microscopic polyangiitis</answer>.")


def test_layouts_read_back_as_written_and_a_malformed_string_is_named():
    assert layouts_text(DEFAULT_LAYOUTS) == "kg_facts:0.3,a2rag:0.2,documents:0.2,rag_kg:0.3"
    assert parse_layouts(layouts_text(DEFAULT_LAYOUTS)) == DEFAULT_LAYOUTS
    assert ReaderConfig().as_dict()["layouts"] == layouts_text(DEFAULT_LAYOUTS)
    with pytest.raises(ValueError, match="name:weight.*'kg_facts0.3'"):
        parse_layouts("kg_facts0.3")


def test_the_adapted_reader_answers_only_the_layouts_it_was_trained_on():
    """i-MedRAG's query-answer pairs and SEMA-RAG's evidence report are layouts the adapter never saw (it
    answered no i-MedRAG question in form: asked again 1.00): those methods keep the base reader."""
    from medgraph.eval.readers import ADAPTED_LAYOUTS, base_reader_only
    from medgraph.rl.reader import LAYOUTS

    assert set(ADAPTED_LAYOUTS.values()) == {*LAYOUTS, "no evidence"}
    assert [base_reader_only(name) for name in ("rag", "rag-kg", "cot", "oracle-evidence", "a2rag-no-hiim")] == \
        [None] * 5
    for name in ("irag", "sema-rag", "sema-rag-no-early-stop"):
        assert "not trained on" in base_reader_only(name)
