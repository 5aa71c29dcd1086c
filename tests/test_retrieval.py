"""The retriever every method shares: concept lookup, search over nodes, edges and text, RRF."""

from __future__ import annotations

import pytest

from medgraph.retrieval import Retriever, reciprocal_rank_fusion
from medgraph.storage import Warehouse


def test_reciprocal_rank_fusion_rewards_agreement():
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["b", "d", "a"]], k=60)
    assert [item for item, _ in fused] == ["b", "a", "d", "c"]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)
    assert reciprocal_rank_fusion([["x"], []], limit=1) == [("x", pytest.approx(1 / 61))]


@pytest.fixture(scope="module")
def retriever(retrieval_warehouse: Warehouse, encoder):
    with Retriever(retrieval_warehouse, encoder) as retriever:
        yield retriever


def test_search_nodes_finds_seizure_in_the_top_10(retriever: Retriever):
    (hits,) = retriever.search_nodes(["seizure"], k=10)
    assert "C0036572" in [cui for cui, _ in hits]
    assert all(a[1] >= b[1] for a, b in zip(hits, hits[1:]))


@pytest.mark.parametrize("mode", ["bm25", "dense", "hybrid"])
def test_search_text_finds_seizure_chunks_in_every_mode(retriever: Retriever, mode: str):
    hits, other = retriever.search_text(["seizure", "which drug may treat hypertension"], k=10, mode=mode)
    chunks = retriever.chunks([c for c, _ in hits + other])
    assert len(hits) == 10 and len({c for c, _ in hits}) == 10
    assert sum("seizure" in chunks[c].text.lower() for c, _ in hits) >= 8
    if mode != "bm25":  # BM25 favours short chunks that repeat the word; meaning finds the concept itself
        assert "C0036572" in {chunks[c].doc_id for c, _ in hits}
    assert any("hypertension" in chunks[c].text.lower() for c, _ in other)


def test_search_edges_returns_triples_about_the_query(retriever: Retriever):
    (hits,) = retriever.search_edges(["amlodipine may treat hypertension"], k=5)
    assert hits and any(t.src_name == "amlodipine" and "Hypertension" in t.dst_name for t, _ in hits)


def test_find_concepts_prefers_exact_names_then_fuses_bm25_and_dense(retriever: Retriever):
    exact, fuzzy, unknown = retriever.find_concepts(["Hypertension", "seizures of the brain", "zzqx"], k=5)
    assert exact[0] == "C0020538"
    assert "C0036572" in fuzzy
    assert len(unknown) <= 5  # dense search always proposes something; exact finds nothing
    assert retriever.find_concepts(["zzqx"], mode="exact") == [[]]


def test_find_concepts_lists_a_concept_whose_name_holds_the_query_before_looser_matches(retriever: Retriever):
    """Graph-R1's <search>: "Factor Xa" has no exact name; "Factor Xa Inhibitors" came third, behind growth
    factors that BM25 and dense search liked better."""
    queries = ["Factor Xa", "factor Xa inhibitor", "proton pump", "calcium channel"]
    factor_xa, singular, pump, channel = retriever.find_concepts(queries, k=4)
    (inhibitors,), (ppi,) = retriever.graph.lookup(["Factor Xa Inhibitors", "Proton Pump Inhibitors"])
    assert factor_xa[0] == inhibitors and singular[0] == inhibitors and pump[0] == ppi
    names = retriever.nodes(channel)
    assert "calcium channel" in names[channel[0]].name.lower()
    assert retriever.find_concepts(["Hypertension"], k=2)[0][0] == "C0020538"  # an exact name still comes first


def test_dense_search_without_an_encoder_is_a_clear_error(retrieval_warehouse: Warehouse):
    with Retriever(retrieval_warehouse) as retriever, pytest.raises(ValueError, match="needs an encoder"):
        retriever.search_nodes(["seizure"])
