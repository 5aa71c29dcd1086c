"""Benchmark loaders: the embedded KG split, MIRAGE and PubMedQA (real files in ../shared/data), JSONL."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from medgraph.eval.evaluate import markdown_table, result_rows, summarize
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import KnowledgeTools, run_method
from medgraph.methods.common import format_question
from medgraph.qa.benchmarks import BenchmarkFormatError, load_benchmark, parse_benchmark_spec
from medgraph.qa.item import QaItem, gold_doc_ids
from medgraph.qa.mirage import load_mirage, write_mirage
from medgraph.retrieval import Retriever
from medgraph.storage import Warehouse
from medgraph.text.corpus import packaged_corpus

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")


@needs_shared
@pytest.mark.shared_data
def test_mirage_subset_and_pubmedqa_files_load_as_partitions(tmp_path: Path):
    spec = f"mirage:{SHARED / 'mirage/mirage_dev.json'}#medqa+bioasq,pubmedqa:{SHARED / 'pubmedqa/pqal_dev.json'}"
    benchmark = load_benchmark(spec, tmp_path)
    assert sorted(benchmark) == ["bioasq", "medqa", "pubmedqa"]
    assert len(benchmark["medqa"]) == 255 and len(benchmark["pubmedqa"]) == 500
    medqa = benchmark["medqa"][0]
    assert medqa.options and medqa.answer in medqa.options
    pubmed = benchmark["pubmedqa"][0]
    assert pubmed.options == {"A": "yes", "B": "no", "C": "maybe"} and pubmed.extra["contexts"]
    assert load_benchmark(spec, tmp_path, limit_per_dataset=5)["pubmedqa"] == benchmark["pubmedqa"][:5]


def test_the_embedded_split_is_the_default_and_missing_files_say_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="materialize qa/qa_items"):
        load_benchmark("kg", tmp_path)
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "qa_items.test.json").write_text(json.dumps(
        {"kgqa_mc": {"q1": {"question": "Which?", "options": {"A": "x", "B": "y"}, "answer": "B"}}}))
    assert [i.qid for i in load_benchmark("kg", tmp_path)["kgqa_mc"]] == ["q1"]
    with pytest.raises(ValueError, match="expected kg, mirage:PATH"):
        parse_benchmark_spec("medqa.json", tmp_path)


def test_jsonl_errors_name_the_file_and_line(tmp_path: Path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "Q?", "options": {"A": "a", "B": "b"}, "answer": "A", "id": "x1"}\n'
                    '{"question": "Q2?", "answer": "free text"}\n')
    items = load_benchmark(f"jsonl:{path}", tmp_path)["mine"]
    assert [(i.qid, i.answer, i.is_multiple_choice) for i in items] == [("x1", "A", True), ("2", "free text", False)]

    path.write_text('{"question": "Q?", "options": {"A": "a"}, "answer": "C"}\n{"question": \n')
    with pytest.raises(BenchmarkFormatError, match=r"mine.jsonl:1: answer 'C' is not one of \['A'\]"):
        load_benchmark(f"jsonl:{path}", tmp_path)
    path.write_text('{"question": "Q?", "answer": "A"}\n{"question": \n')
    with pytest.raises(BenchmarkFormatError, match=r"mine.jsonl:2: not valid JSON"):
        load_benchmark(f"jsonl:{path}#custom", tmp_path)


# --------------------------------------------------------------------------- PubMedQA, reasoning-required


def test_pubmedqa_items_name_their_own_abstract_and_keep_it_out_of_the_question(tmp_path: Path):
    path = tmp_path / "pqal.json"
    path.write_text(json.dumps({
        "10808977": {"QUESTION": "Can tailored interventions increase mammography use?",
                     "CONTEXTS": ["Telephone counseling and tailored print communications."],
                     "LONG_ANSWER": "Yes.", "final_decision": "yes"},
        "42": {"QUESTION": "Is it so?", "CONTEXTS": ["Sentence."], "final_decision": "maybe"}}))
    items = load_benchmark(f"pubmedqa:{path}", tmp_path)["pubmedqa"]
    assert [(i.qid, i.answer, gold_doc_ids(i)) for i in items] == [
        ("10808977", "A", ("pubmed:10808977",)), ("42", "C", ("pubmed:42",))]
    assert "Telephone" not in format_question(items[0])  # the abstract is retrieved, not given
    frozen = load_mirage(write_mirage(tmp_path / "frozen.json", items))  # the evaluation reads the frozen file
    assert [gold_doc_ids(i) for i in frozen] == [gold_doc_ids(i) for i in items]
    assert gold_doc_ids(QaItem("kg", "q", "Which?", {"A": "x"}, "A")) is None
    # The packaged corpus holds the abstracts of pqal_dev.json under the same ids.
    assert "pubmed:10808977" in {d.doc_id for d in packaged_corpus().documents}


@pytest.mark.usefixtures("one_torch_thread")
def test_gold_doc_recall_counts_a_shown_chunk_of_the_questions_own_abstract(retrieval_warehouse: Warehouse, encoder,
                                                                            caplog: pytest.LogCaptureFixture):
    documents = {d.doc_id: d for d in packaged_corpus().documents}
    own, other = documents["pubmed:10808977"], documents["pubmed:1571683"]
    options = {"A": "yes", "B": "no", "C": "maybe"}

    def asking(qid: str, text: str, gold: list[str]) -> QaItem:
        return QaItem("pubmedqa", qid, text[:300], options, "A", extra={"gold_doc_ids": gold})

    items = [asking("found", own.text, [own.doc_id]),  # its own abstract's words: rag shows that abstract
             asking("missed", own.text, [other.doc_id]),  # the same words, but another abstract is the gold one
             asking("absent", own.text, ["pubmed:1"]),  # a gold document the corpus does not hold
             QaItem("pubmedqa", "none", "Is it so?", options, "A")]  # names no document
    with Retriever(retrieval_warehouse, encoder) as retriever, caplog.at_level(logging.WARNING):
        results = run_method("rag", items, KnowledgeTools(retriever), ScriptedChatModel(["<answer>A</answer>"] * 4))
        doc_of = {c.chunk_id: c.doc_id for c in retriever.chunks(list(results[1].evidence.chunks)).values()}
    found, missed, absent, none = results
    assert len(found.evidence.chunks) == 5 and own.doc_id in doc_of.values() and other.doc_id not in doc_of.values()
    assert (found.gold_doc_recall, missed.gold_doc_recall, absent.gold_doc_recall, none.gold_doc_recall) == (
        1.0, 0.0, None, None)
    assert found.stats["gold_doc_in_corpus"] and not absent.stats["gold_doc_in_corpus"]
    assert "gold_doc_recall" not in none.stats
    assert "1 of 3 questions have no gold document in text.corpus_chunks (e.g. absent)" in caplog.text

    (summary,) = summarize(results)
    assert (summary.gold_doc_recall, summary.gold_doc_recall_se, summary.gold_doc_recall_n) == (
        0.5, pytest.approx(math.sqrt(0.5) / math.sqrt(2)), 2)
    assert summary.extra["gold_doc_in_corpus_share"] == pytest.approx(2 / 3)
    assert "| 0.500 ± 0.500 (n=2) |" in markdown_table([summary])
    assert [r["gold_doc_recall"] for r in result_rows(results)] == [1.0, 0.0, None, None]


def test_report_shows_gold_doc_recall_only_where_measured(tmp_path: Path):
    from medgraph.eval.report import ReportData, build_report

    def row(method: str, **recall: float) -> dict[str, object]:
        return {"asset": "eval_baselines", "method": method, "dataset": "pubmedqa", "questions": 8, "accuracy": 0.5,
                "accuracy_se": 0.1, "parse_failure_rate": 0.0, "mean_f1": 0.5, "prompt_tokens": 700.0,
                "completion_tokens": 5.0, "llm_calls": 1.0, "latency_p50_s": 1.0, "latency_p95_s": 2.0, "extra": {},
                **recall}

    measured = [row("rag", gold_doc_recall=0.875, gold_doc_recall_se=0.125, gold_doc_recall_n=8), row("cot")]
    markdown = build_report(ReportData(measured, {}, {}, [], [], []), tmp_path / "a")["markdown"].read_text()
    section = markdown.split("## Gold-document recall")[1].split("\n## ")[0]
    assert "| rag | pubmedqa | 8 | 0.875 | 0.125 |" in section and "| cot |" not in section
    unmeasured = build_report(ReportData([row("cot")], {}, {}, [], [], []), tmp_path / "b")["markdown"].read_text()
    assert "Gold-document recall" not in unmeasured
