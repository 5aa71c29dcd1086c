"""Relations extracted from corpus chunks by an LLM (text.chunk_hyperedges): batched, linked, resumable, opt-in.

A scripted chat model writes the facts, so which chunks were sent, in which
batches, and what was stored (and what was not, after a failure) is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from conftest import copy_warehouse

from medgraph.llm.base import Conversation
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.storage import Warehouse
from medgraph.text.corpus import build_corpus_chunks
from medgraph.text.extraction import extract_chunk_hyperedges, hyperedge_id, parse_facts

AMLODIPINE, HYPERTENSION = "C9001289", "C0020538"


@pytest.fixture(scope="module")
def corpus_warehouse(kg_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(kg_warehouse, tmp_path_factory.mktemp("extraction") / "home")
    build_corpus_chunks(warehouse)
    return warehouse


@pytest.fixture
def home(corpus_warehouse: Warehouse, tmp_path: Path) -> Warehouse:
    return copy_warehouse(corpus_warehouse, tmp_path / "home")


FACT = {"fact": "Amlodipine may treat hypertension in adults.", "entities": ["amlodipine", "Hypertension", "adults"]}


def facts_reply(conversation: Conversation) -> str:
    """Two facts per chunk; the first one over two KG concepts."""
    return json.dumps(FACT) + "\n" + json.dumps({"fact": "Something else holds.", "entities": ["something"]})


def chunk_ids(warehouse: Warehouse) -> list[str]:
    with warehouse.connect(read_only=True) as con:
        return [r[0] for r in con.execute("SELECT chunk_id FROM text.corpus_chunks").fetchall()]


def test_facts_are_stored_as_hyperedges_over_linked_concepts_in_batches(home: Warehouse):
    llm = ScriptedChatModel(facts_reply)
    stats = extract_chunk_hyperedges(home, llm, batch_chunks=2, max_chunks=3)
    assert [len(call) for call in llm.calls] == [2, 1]
    assert (stats.chunks_extracted, stats.hyperedges, stats.hyperedges_linked, stats.parse_failures) == (3, 6, 3, 0)
    assert stats.prompt_tokens > 0 and stats.completion_tokens == 3 * len(facts_reply([]).split())
    assert stats.chunks_total == len(chunk_ids(home)) and stats.skipped_reason is None
    with home.connect(read_only=True) as con:
        rows = con.execute("SELECT hyperedge_id, chunk_id, relation_text, entities, cuis, model "
                           "FROM text.chunk_hyperedges ORDER BY chunk_id, hyperedge_id").fetchall()
        runs = con.execute("SELECT count(*), sum(hyperedges) FROM text.chunk_hyperedge_runs").fetchone()
    linked = [r for r in rows if r[2] == FACT["fact"]]
    assert len(linked) == 3 and all(r[4] == [AMLODIPINE, HYPERTENSION] and r[3] == FACT["entities"] for r in linked)
    assert linked[0][0] == hyperedge_id(linked[0][1], "scripted", 0) and runs == (3, 6)
    # The prompt shows the chunk's text.
    sent = llm.calls[0][0][-1].content
    with home.connect(read_only=True) as con:
        text = con.execute("SELECT text FROM text.corpus_chunks WHERE chunk_id = $c", {"c": linked[0][1]}).fetchone()[0]
    assert any(text[:200] in call[-1].content for batch in llm.calls for call in batch) and "JSON" in sent
    # Published to the lake as well.
    lake_rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{home.lake.table_path('text', 'chunk_hyperedges')}')")
    assert lake_rows.fetchone()[0] == 6


def test_a_rerun_skips_done_chunks_and_a_failed_batch_leaves_nothing_behind(home: Warehouse):
    extract_chunk_hyperedges(home, ScriptedChatModel(facts_reply), batch_chunks=2, max_chunks=2)
    calls = {"n": 0}

    def fails_on_second_batch(conversation: Conversation) -> str:
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("endpoint went away")
        return "no facts here"  # unreadable: recorded as a parse failure, and done

    with pytest.raises(RuntimeError, match="went away"):
        extract_chunk_hyperedges(home, ScriptedChatModel(fails_on_second_batch), batch_chunks=2, max_chunks=4)
    with home.connect(read_only=True) as con:
        done = con.execute("SELECT chunk_id, parse_failed FROM text.chunk_hyperedge_runs ORDER BY extracted_at, "
                           "chunk_id").fetchall()
        edges = con.execute("SELECT count(*) FROM text.chunk_hyperedges").fetchone()[0]
    assert len(done) == 4 and [failed for _, failed in done] == [False, False, True, True] and edges == 4

    resumed = ScriptedChatModel(facts_reply)
    stats = extract_chunk_hyperedges(home, resumed, batch_chunks=8, max_chunks=2)
    assert stats.chunks_skipped_done == 4 and stats.chunks_extracted == 2
    sent = {c[-1].content for batch in resumed.calls for c in batch}
    with home.connect(read_only=True) as con:  # the chunks done before this run
        done_texts = {t for (t,) in con.execute(
            "SELECT c.text FROM text.corpus_chunks c JOIN text.chunk_hyperedge_runs r USING (chunk_id) WHERE "
            "r.parse_failed OR r.extracted_at < (SELECT max(extracted_at) FROM text.chunk_hyperedge_runs)").fetchall()}
    assert len(done_texts) == 4
    assert not any(text[:200] in prompt for text in done_texts for prompt in sent)


def test_the_tiny_default_llm_is_skipped_with_a_reason(home: Warehouse):
    tiny = ScriptedChatModel(facts_reply, name="smollm2-135m-instruct")
    stats = extract_chunk_hyperedges(home, tiny)
    assert not tiny.calls and "tiny default" in stats.skipped_reason and stats.chunks_extracted == 0

    from platform_assets.text_extraction import ChunkHyperedgesConfig, chunk_hyperedges
    from resources import LlmResource, WarehouseResource

    result = chunk_hyperedges(context=dg.build_asset_context(), config=ChunkHyperedgesConfig(),
                              warehouse=WarehouseResource(home=str(home.path.parent)),
                              llm=LlmResource(spec="smollm2-135m-instruct", home=str(home.path.parent)))
    assert result.metadata["skipped"] is True and "tiny default" in result.metadata["skipped_reason"]


def test_parse_facts_reads_json_lines_lists_and_skips_the_rest():
    reply = '1. {"fact": "A treats B.", "entities": ["A", "B", "A"]}\nnot json {\n{"fact": "", "entities": []}'
    assert parse_facts(reply) == [("A treats B.", ["A", "B"])]
    assert parse_facts('```json\n[{"fact": "C  causes D.", "entities": ["C", 4]}]\n```') == [("C causes D.", ["C"])]
    assert parse_facts("nothing") == []
