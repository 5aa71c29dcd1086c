"""The on-disk cache of triple vectors encoded on the fly: what it keeps, what it never mixes, and
that a second run of GSRM's scoring reads instead of encoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from medgraph.embed import vector_cache
from medgraph.embed.vector_cache import TextVectorCache
from medgraph.methods.tools import KnowledgeTools
from medgraph.retrieval import Retriever


def unit(*values: float) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_vectors_come_back_in_a_new_process_and_the_first_one_stays(tmp_path: Path):
    first = TextVectorCache(tmp_path, "enc-a")
    first.put("document", ["aspirin may treat pain", "x"], np.stack([unit(1, 0), unit(0, 1)]))
    later = TextVectorCache(tmp_path, "enc-a")  # a new process: reads the shards from disk
    later.put("document", ["aspirin may treat pain"], np.stack([unit(1, 1)]))  # recomputed: not stored again
    again = TextVectorCache(tmp_path, "enc-a")
    found = again.get("document", ["aspirin may treat pain", "x", "not cached"])
    np.testing.assert_array_equal(found[0], unit(1, 0))
    np.testing.assert_array_equal(found[1], unit(0, 1))
    assert found[2] is None and (again.hits, again.misses) == (2, 1)
    assert len(list((tmp_path / "enc-a").glob("*.npz"))) == 1


def test_encoder_kind_and_text_each_separate_vectors(tmp_path: Path):
    TextVectorCache(tmp_path, "enc-a").put("document", ["pain"], np.stack([unit(1, 0)]))
    assert TextVectorCache(tmp_path, "enc-b").get("document", ["pain"]) == [None]  # another encoder
    assert TextVectorCache(tmp_path, "enc-a").get("query", ["pain"]) == [None]  # another kind (prefixes differ)
    assert TextVectorCache(tmp_path, "enc-a").get("document", ["Pain"]) == [None]  # another text


def test_a_half_written_shard_is_ignored_and_many_shards_are_merged(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(vector_cache, "SHARDS_BEFORE_MERGE", 3)
    writer = TextVectorCache(tmp_path, "enc")
    for i in range(5):  # one shard per call
        writer.put("document", [f"text {i}"], np.stack([unit(1, i)]))
    (tmp_path / "enc" / ".dead.npz.0123456789ab.tmp").write_bytes(b"\x00" * 10)  # a writer killed before its rename
    merged = TextVectorCache(tmp_path, "enc")
    assert all(v is not None for v in merged.get("document", [f"text {i}" for i in range(5)]))
    assert len(list((tmp_path / "enc").glob("*.npz"))) == 1  # five shards became one
    np.testing.assert_array_equal(TextVectorCache(tmp_path, "enc").get("document", ["text 3"])[0], unit(1, 3))


def test_past_its_size_bound_the_oldest_shards_go(tmp_path: Path):
    cache = TextVectorCache(tmp_path, "enc")
    for i in range(4):
        cache.put("document", [f"text {i}"], np.stack([unit(1, i)]))
    shard_bytes = max(p.stat().st_size for p in (tmp_path / "enc").glob("*.npz"))
    bounded = TextVectorCache(tmp_path, "enc", max_bytes=2 * shard_bytes)
    found = bounded.get("document", [f"text {i}" for i in range(4)])
    assert sum(v is not None for v in found) == 2 and len(list((tmp_path / "enc").glob("*.npz"))) == 2


def test_a_second_run_reads_the_triple_vectors_the_first_one_encoded(retriever: Retriever, tmp_path: Path):
    (entities,) = retriever.find_concepts(["Hypertension"], k=1, mode="exact")
    (triples,) = KnowledgeTools(retriever).one_hop([entities])
    assert triples
    first = KnowledgeTools.with_home_cache(retriever, tmp_path)
    vectors = first.triple_vectors(triples)
    stored = len(first._stored_edge_vectors([t.edge_id for t in triples]))
    assert first.triples_encoded == len({t.edge_id for t in triples}) - stored > 0
    second = KnowledgeTools.with_home_cache(retriever, tmp_path)
    np.testing.assert_array_equal(second.triple_vectors(triples), vectors)
    assert second.triples_encoded == 0 and second.vector_cache.hits == first.triples_encoded
    uncached = KnowledgeTools(retriever)
    np.testing.assert_allclose(uncached.triple_vectors(triples), vectors, atol=2e-2)  # the same texts, encoded
    with pytest.raises(ValueError, match="2 texts but 1 vectors"):
        first.vector_cache.put("document", ["a", "b"], np.stack([unit(1, 0)]))
