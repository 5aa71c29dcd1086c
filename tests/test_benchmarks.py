"""Benchmark loaders: the embedded KG split, MIRAGE and PubMedQA (real files in ../shared/data), JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medgraph.eval.benchmarks import (
    BenchmarkFormatError,
    load_benchmark,
    parse_benchmark_spec,
)

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
