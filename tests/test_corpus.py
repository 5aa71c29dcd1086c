"""The default text corpus: the packaged PubMedQA abstracts (with their licence) and concept definitions."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest
from conftest import SHARED_DATA, copy_warehouse

from medgraph.storage import Warehouse
from medgraph.text.corpus import (
    DEFAULT_SOURCES,
    CorpusFormatError,
    build_corpus_chunks,
    documents_in_corpus,
    mention_coverage,
    packaged_corpus,
)
from medgraph.text.data import build_pubmedqa_corpus
from medgraph.text.mentions import link_chunk_mentions

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "medgraph" / "text" / "data"
PQAL_DEV = SHARED_DATA / "pubmedqa" / "pqal_dev.json"


@pytest.fixture
def kg_copy(kg_warehouse: Warehouse, tmp_path: Path) -> Warehouse:
    return copy_warehouse(kg_warehouse, tmp_path / "home")


def rows(warehouse: Warehouse, sql: str, params: list | None = None) -> list[tuple]:
    with warehouse.connect(read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


# -----------------------------------------------------------------------------
# The packaged file

def test_packaged_pubmedqa_corpus_loads_with_its_licence_and_attribution():
    corpus = packaged_corpus()
    assert corpus.source == "pubmedqa" and len(corpus.documents) == 500
    ids = [d.doc_id for d in corpus.documents]
    assert len(set(ids)) == 500 and all(re.fullmatch(r"pubmed:\d+", i) for i in ids)
    assert all(d.source == "pubmedqa" and d.title == f"PMID {d.doc_id.split(':')[1]}"
               and len(d.text) > 200 for d in corpus.documents)
    assert corpus.licence == "MIT"
    assert "Jin et al. 2019" in corpus.attribution and "https://github.com/pubmedqa/pubmedqa" in corpus.attribution
    assert "MIT License" in corpus.licence_text and "Permission is hereby granted" in corpus.licence_text
    assert "Copyright (c) 2019 pubmedqa" in corpus.licence_text
    assert corpus.licence_note.startswith("MIT; Jin et al. 2019")


def test_packaged_file_is_small_and_declared_as_package_data():
    data_file = DATA_DIR / "pubmedqa_pqal_abstracts.jsonl.gz"
    assert data_file.stat().st_size < 1_000_000
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["medgraph.text.data"]
    for name in ("pubmedqa_pqal_abstracts.jsonl.gz", "PUBMEDQA_LICENSE"):
        assert (DATA_DIR / name).is_file() and any(fnmatch.fnmatch(name, p) for p in patterns), name
    assert (DATA_DIR / "__init__.py").is_file()  # a package, so setuptools' find includes it


@pytest.mark.shared_data
def test_build_script_reproduces_the_packaged_file_without_questions_or_answers(tmp_path: Path):
    if not PQAL_DEV.is_file():
        pytest.skip(f"shared PubMedQA data not present at {PQAL_DEV}")
    out = tmp_path / "abstracts.jsonl.gz"
    build_pubmedqa_corpus.main([str(PQAL_DEV), "--out", str(out)])
    assert out.read_bytes() == (DATA_DIR / "pubmedqa_pqal_abstracts.jsonl.gz").read_bytes()
    pqal = json.loads(PQAL_DEV.read_text(encoding="utf-8"))
    texts = {d.doc_id: d.text for d in packaged_corpus().documents}
    assert set(texts) == {f"pubmed:{pmid}" for pmid in pqal}
    for pmid, entry in pqal.items():
        text = texts[f"pubmed:{pmid}"]
        assert text == " ".join(c.strip() for c in entry["CONTEXTS"])
        assert entry["LONG_ANSWER"].strip() not in text  # the conclusion (the answer) is not shipped


# -----------------------------------------------------------------------------
# The default corpus

def test_default_corpus_is_pubmedqa_abstracts_and_definitions_without_node_texts(kg_copy: Warehouse):
    stats = build_corpus_chunks(kg_copy)
    assert tuple(stats.per_source) == DEFAULT_SOURCES == ("pubmedqa", "definitions")
    assert stats.per_source["pubmedqa"].documents == 500
    sources = dict(rows(kg_copy, "SELECT source, count(*) FROM text.corpus_chunks GROUP BY source"))
    assert set(sources) == {"pubmedqa", "definitions"}

    defined = rows(kg_copy, "SELECT count(DISTINCT cui) FROM staging.stg_umls__definitions "
                            "WHERE cui IN (SELECT cui FROM kg.kg_nodes)")[0][0]
    assert defined > 0 and stats.per_source["definitions"].documents == defined
    # One document per concept: id the CUI, title its preferred name, text its definition (not the node text).
    cui, title, text, name, definition, node_text = rows(kg_copy, """
        SELECT c.doc_id, c.title, c.text, n.preferred_name, n.definition, t.text
        FROM text.corpus_chunks AS c JOIN kg.kg_nodes AS n ON n.cui = c.doc_id
        JOIN kg.kg_node_text AS t USING (cui)
        WHERE c.source = 'definitions' ORDER BY c.doc_id LIMIT 1""")[0]
    assert title == name and text.startswith(f"{name}: ") and definition in text
    assert text != node_text and "Relations:" not in text
    assert not rows(kg_copy, "SELECT 1 FROM text.corpus_chunks "
                             "WHERE source = 'definitions' AND text LIKE '%Relations:%'")

    metadata = stats.as_metadata()
    assert metadata["sources"] == "pubmedqa, definitions" and metadata["documents_pubmedqa"] == 500
    assert metadata["licence_pubmedqa"].startswith("MIT; Jin et al. 2019")
    with kg_copy.connect(read_only=True) as con:
        assert documents_in_corpus(con, ["pubmed:10808977", "pubmed:1", cui]) == {"pubmed:10808977", cui}


def test_node_texts_are_an_opt_in_source_and_names_are_checked(kg_copy: Warehouse, tmp_path: Path):
    stats = build_corpus_chunks(kg_copy, sources=["definitions", "kg_node_texts"])
    nodes = rows(kg_copy, "SELECT count(*) FROM kg.kg_node_text")[0][0]
    assert stats.per_source["kg_node_texts"].documents == nodes and "pubmedqa" not in stats.per_source
    assert "licence_pubmedqa" not in stats.as_metadata()
    with pytest.raises(ValueError, match="unknown corpus source.*'kg'"):
        build_corpus_chunks(kg_copy, sources=["kg"])
    clash = tmp_path / "pubmedqa.jsonl"
    clash.write_text('{"id": "1", "text": "x"}\n', encoding="utf-8")
    with pytest.raises(CorpusFormatError, match="reserved for a built-in source"):
        build_corpus_chunks(kg_copy, [clash], sources=())
    assert stats.chunks == rows(kg_copy, "SELECT count(*) FROM text.corpus_chunks")[0][0]  # the failure kept it


def test_mentions_over_the_default_corpus_report_coverage_per_source(kg_copy: Warehouse):
    build_corpus_chunks(kg_copy)
    stats = link_chunk_mentions(kg_copy)
    coverage = mention_coverage(kg_copy)
    assert set(coverage) == {"pubmedqa", "definitions"}
    assert sum(m for m, _ in coverage.values()) == stats.chunks_with_mentions
    assert sum(t for _, t in coverage.values()) == stats.chunks
    mentioning, total = coverage["definitions"]
    assert mentioning >= 0.98 * total  # each definition names its concept
    assert 0 < coverage["pubmedqa"][0] <= coverage["pubmedqa"][1] == 500


def test_text_assets_report_sources_licence_and_mention_coverage(kg_copy: Warehouse, tmp_path: Path):
    import dagster as dg

    from platform_assets import text
    from resources import WarehouseResource

    result = dg.materialize([text.corpus_chunks, text.chunk_concept_graph],
                            resources={"warehouse": WarehouseResource(home=str(tmp_path / "home"))})
    metadata = {e.step_materialization_data.materialization.asset_key.to_user_string():
                {k: v.value for k, v in e.step_materialization_data.materialization.metadata.items()}
                for e in result.get_asset_materialization_events()}
    corpus, mentions = metadata["text/corpus_chunks"], metadata["kg/kg_chunk_mentions"]
    assert corpus["sources"] == "pubmedqa, definitions" and corpus["documents_pubmedqa"] == 500
    assert corpus["licence_pubmedqa"].startswith("MIT; Jin et al. 2019")
    # The metadata against the tables the asset wrote, counted here.
    with kg_copy.connect(read_only=True) as con:
        chunks, mentioning, pubmed, pubmed_mentioning = con.execute(
            "SELECT count(*), count(*) FILTER (WHERE m), count(*) FILTER (WHERE source = 'pubmedqa'), "
            "count(*) FILTER (WHERE m AND source = 'pubmedqa') FROM (SELECT source, EXISTS (SELECT 1 FROM "
            "kg.kg_chunk_mentions k WHERE k.chunk_id = c.chunk_id) AS m FROM text.corpus_chunks c)").fetchone()
    assert 0 < pubmed_mentioning <= pubmed < chunks
    assert (mentions["chunks"], mentions["chunks_with_mentions"]) == (chunks, mentioning)
    assert mentions["chunks_with_mentions_share"] == pytest.approx(mentioning / chunks, abs=5e-5)
    assert mentions["chunks_with_mentions_pubmedqa"].startswith(f"{pubmed_mentioning} of {pubmed} (")
