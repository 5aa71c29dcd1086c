"""Encoder, incremental embedding tables and the vector index, on the real MiniLM model and small data."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import copy_warehouse

from medgraph.embed import encoder as encoder_module
from medgraph.embed.encoder import Encoder, EncoderNotFoundError, load_encoder
from medgraph.embed.index import IndexParams, VectorIndex
from medgraph.embed.tables import EMBEDDING_SOURCES, embed_source, embed_table, read_embeddings
from medgraph.storage import Warehouse

NODES = 40  # node texts kept in the test copies: enough for several batches, quick to embed


@pytest.fixture(scope="module")
def encoder() -> Iterator[Encoder]:
    # Tiny batches: one torch thread. Two spin-wait on each other on a busy 2-core machine (10x slower).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_encoder("minilm", max_length=32)
    torch.set_num_threads(previous)


class StandInEncoder:
    """The real encoder under another encoder_id (a "new model"), optionally failing on its n-th call."""

    def __init__(self, inner: Encoder, encoder_id: str, fail_on_call: int | None = None):
        self.inner, self.encoder_id, self.fail_on_call, self.calls = inner, encoder_id, fail_on_call, 0
        self.dim = inner.dim

    def encode(self, texts: list[str], kind: str = "document", **options: object) -> np.ndarray:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("encoder failed mid-way")
        return self.inner.encode(texts, kind, **options)


@pytest.fixture
def small_kg(kg_warehouse: Warehouse, tmp_path: Path) -> Warehouse:
    """A writable copy of the tiny KG with only NODES node texts and 30 edges."""
    warehouse = copy_warehouse(kg_warehouse, tmp_path / "home")
    with warehouse.connect() as con:
        con.execute(f"DELETE FROM kg.kg_node_text WHERE cui NOT IN "
                    f"(SELECT cui FROM kg.kg_node_text ORDER BY cui LIMIT {NODES})")
        con.execute("DELETE FROM kg.kg_edges WHERE edge_id NOT IN (SELECT edge_id FROM kg.kg_edges ORDER BY edge_id LIMIT 30)")
    return warehouse


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clustered_vectors(n: int, dim: int = 384, centers: int = 50, seed: int = 0) -> np.ndarray:
    """Unit vectors from a Gaussian mixture: uniform random vectors would make every neighbour a tie."""
    rng = np.random.default_rng(seed)
    middle = rng.standard_normal((centers, dim)).astype(np.float32)
    middle /= np.linalg.norm(middle, axis=1, keepdims=True)
    labels = rng.integers(0, centers, n)
    points = middle[labels] + rng.standard_normal((n, dim)).astype(np.float32) * (0.8 / np.sqrt(dim))
    return points / np.linalg.norm(points, axis=1, keepdims=True)


# --- encoder -----------------------------------------------------------------------------------------------


def test_encoder_returns_unit_vectors_in_input_order(encoder: Encoder):
    texts = ["Aspirin", "Epilepsy is a chronic neurological disorder with recurrent seizures.", "Fever", "A bone fracture"]
    batched = encoder.encode(texts, batch_size=3)
    one_by_one = np.vstack([encoder.encode([text]) for text in texts])
    assert batched.shape == (4, 384) and batched.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)  # length-sorted batches, padding and order undone


def test_seizure_query_is_closer_to_epilepsy_than_to_fracture(encoder: Encoder):
    query = encoder.encode(["what causes recurrent seizures?"], kind="query")[0]
    epilepsy, fracture = encoder.encode([
        "Epilepsy: a brain disorder with recurrent unprovoked seizures.",
        "Fracture of the femur: a break in the thigh bone.",
    ])
    assert query @ epilepsy > query @ fracture + 0.2


def test_encoder_id_names_weights_pooling_max_length_and_dtype(encoder: Encoder):
    assert encoder.encoder_id.startswith("minilm-") and encoder.pooling == "mean"
    assert load_encoder("minilm", max_length=32).encoder_id == encoder.encoder_id
    assert load_encoder("minilm", max_length=16).encoder_id != encoder.encoder_id
    assert load_encoder("minilm", max_length=32, pooling="cls").encoder_id != encoder.encoder_id
    bf16 = load_encoder("minilm", max_length=32, dtype="bfloat16")
    assert bf16.encoder_id != encoder.encoder_id
    texts = ["Epilepsy with recurrent seizures", "Fracture of femur"]
    assert (bf16.encode(texts) * encoder.encode(texts)).sum(axis=1).min() > 0.999


def test_missing_model_directory_names_the_path(tmp_path: Path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(EncoderNotFoundError, match=re.escape(str(missing))):
        load_encoder(str(missing))
    with pytest.raises(EncoderNotFoundError, match=re.escape(str(tmp_path)) + r".*config\.json"):
        Encoder(tmp_path)


def test_missing_builtin_package_names_the_package(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(encoder_module.BUILTIN_ENCODERS, "ghost", ("no_such_module_xyz", "ghost-encoder-pkg"))
    with pytest.raises(EncoderNotFoundError, match="pip install ghost-encoder-pkg"):
        load_encoder("ghost")


# --- incremental tables ------------------------------------------------------------------------------------


def test_node_embeddings_embed_only_new_and_changed_rows(small_kg: Warehouse, encoder: Encoder):
    first = embed_source(small_kg, "node_embeddings", encoder, batch_size=16)
    assert (first.embedded, first.reused, first.removed, first.rows, first.dim) == (NODES, 0, 0, NODES, 384)

    second = embed_source(small_kg, "node_embeddings", encoder, batch_size=16)
    assert (second.embedded, second.reused, second.removed) == (0, NODES, 0)

    ids, before = read_embeddings(small_kg.lake, "node_embeddings")
    changed = min(ids)
    with small_kg.connect() as con:
        con.execute("UPDATE kg.kg_node_text SET text = 'Recurrent seizures.' WHERE cui = ?", [changed])
    third = embed_source(small_kg, "node_embeddings", encoder, batch_size=16)
    assert (third.embedded, third.reused, third.removed) == (1, NODES - 1, 0)
    after_ids, after = read_embeddings(small_kg.lake, "node_embeddings")
    old = dict(zip(ids, before))
    new = dict(zip(after_ids, after))
    assert not np.allclose(old[changed], new[changed])
    assert all(np.array_equal(old[i], new[i]) for i in ids if i != changed)  # reused rows are the same bytes

    with small_kg.connect() as con:
        con.execute("DELETE FROM kg.kg_node_text WHERE cui IN (SELECT cui FROM kg.kg_node_text ORDER BY cui DESC LIMIT 5)")
    fourth = embed_source(small_kg, "node_embeddings", encoder, batch_size=16)
    assert (fourth.embedded, fourth.reused, fourth.removed, fourth.rows) == (0, NODES - 5, 5, NODES - 5)
    assert small_kg.count("embeddings.node_embeddings") == NODES - 5


def test_a_new_encoder_re_embeds_every_row(small_kg: Warehouse, encoder: Encoder):
    embed_source(small_kg, "node_embeddings", encoder, batch_size=32)
    stats = embed_source(small_kg, "node_embeddings", StandInEncoder(encoder, "other-model"), batch_size=32)
    assert (stats.embedded, stats.reused, stats.removed) == (NODES, 0, 0)
    with small_kg.connect(read_only=True) as con:
        assert con.execute("SELECT DISTINCT encoder_id FROM embeddings.node_embeddings").fetchall() == [("other-model",)]


def test_table_is_zstd_parquet_with_fixed_size_vectors_and_a_view(small_kg: Warehouse, encoder: Encoder):
    stats = embed_source(small_kg, "node_embeddings", encoder)
    path = small_kg.lake.table_path("embeddings", "node_embeddings")
    assert stats.parquet_path == str(path)
    schema = pq.read_schema(path)
    assert schema.names == ["id", "content_hash", "encoder_id", "embedding"]
    assert schema.field("embedding").type.list_size == 384
    assert pq.ParquetFile(path).metadata.row_group(0).column(3).compression == "ZSTD"
    with small_kg.connect(read_only=True) as con:
        assert con.execute("SELECT count(*), min(len(embedding)) FROM embeddings.node_embeddings").fetchone() == (NODES, 384)
    assert {"rows", "embedded", "reused", "removed", "encoder_id", "texts_per_second"} <= set(stats.as_metadata())


def test_failure_mid_way_keeps_previous_table_and_leaves_no_staging_files(small_kg: Warehouse, encoder: Encoder):
    embed_source(small_kg, "node_embeddings", encoder)
    path = small_kg.lake.table_path("embeddings", "node_embeddings")
    before = file_digest(path)
    failing = StandInEncoder(encoder, "other-model", fail_on_call=2)
    with pytest.raises(RuntimeError, match="mid-way"):
        embed_source(small_kg, "node_embeddings", failing, batch_size=16)
    assert failing.calls == 2
    assert file_digest(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["node_embeddings.parquet"]
    assert small_kg.count("embeddings.node_embeddings") == NODES


def test_duplicate_ids_in_the_source_are_an_error(small_kg: Warehouse, encoder: Encoder):
    sql = "SELECT cui, text FROM kg.kg_node_text UNION ALL SELECT cui, text FROM kg.kg_node_text"
    with pytest.raises(ValueError, match=f"cui must be unique.*{NODES} duplicate"):
        embed_table(small_kg, sql, "doubled", encoder, id_column="cui", text_column="text")
    assert not small_kg.lake.table_path("embeddings", "doubled").exists()


def test_edge_text_is_head_relation_tail_for_every_edge(kg_warehouse: Warehouse):
    with kg_warehouse.connect(read_only=True) as con:
        texts = dict(con.execute(EMBEDDING_SOURCES["edge_embeddings"].sql).fetchall())
        edges = con.execute(
            "SELECT e.edge_id, h.preferred_name, e.relation, t.preferred_name FROM kg.kg_edges e "
            "JOIN kg.kg_nodes h ON h.cui = e.src_cui JOIN kg.kg_nodes t ON t.cui = e.dst_cui"
        ).fetchall()
        total = con.execute("SELECT count(*) FROM kg.kg_edges").fetchone()[0]
    assert len(texts) == len(edges) == total
    for edge_id, head, relation, tail in edges:
        assert texts[edge_id] == f"{head} {relation.replace('_', ' ')} {tail}"


def test_edge_and_chunk_embeddings(small_kg: Warehouse, encoder: Encoder):
    assert embed_source(small_kg, "edge_embeddings", encoder).rows == 30
    with small_kg.connect() as con:
        con.execute("CREATE SCHEMA text")
        con.execute("CREATE TABLE text.corpus_chunks AS SELECT * FROM (VALUES "
                    "('c1', 'd1', 'user', 'Epilepsy', 'Seizures recur in epilepsy.'), "
                    "('c2', 'd1', 'user', 'Epilepsy', 'Valproate treats some epilepsies.'), "
                    "('c3', 'd2', 'kg', 'Fracture', 'A fracture is a broken bone.')) "
                    "AS t(chunk_id, doc_id, source, title, text)")
    stats = embed_source(small_kg, "chunk_embeddings", encoder)
    assert (stats.rows, stats.embedded) == (3, 3)
    ids, vectors = read_embeddings(small_kg.lake, "chunk_embeddings")
    query = encoder.encode(["seizure"], kind="query")[0]
    assert ids[np.argmax(vectors @ query)] in ("c1", "c2")


# --- vector index ------------------------------------------------------------------------------------------


def test_hnsw_agrees_with_exact_search_on_top_10():
    vectors = clustered_vectors(3_000 + 50)
    points, queries = vectors[:3_000], vectors[3_000:]
    ids = [f"v{i}" for i in range(len(points))]
    exact = VectorIndex.from_vectors(ids, points, kind="exact")
    hnsw = VectorIndex.from_vectors(ids, points, IndexParams(m=16, ef_construction=64, ef_search=64), kind="hnsw")
    truth, approximate = exact.search(queries, 10), hnsw.search(queries, 10)
    recall = np.mean([len({i for i, _ in a} & {i for i, _ in t}) / 10 for a, t in zip(approximate, truth)])
    assert recall >= 0.95
    assert [s for _, s in truth[0]] == sorted((s for _, s in truth[0]), reverse=True)


def test_index_is_versioned_reloaded_and_replaced(small_kg: Warehouse, encoder: Encoder,
                                                  monkeypatch: pytest.MonkeyPatch):
    embed_source(small_kg, "node_embeddings", encoder)
    params = IndexParams(ann_threshold=10)  # force HNSW on this small table
    built = VectorIndex.build_or_load(small_kg.lake, "node_embeddings", params)
    folder = small_kg.lake.root / "embeddings"
    assert built.kind == "hnsw" and len(built) == NODES
    assert (folder / f"node_embeddings.{built.version}.faiss").exists()
    assert (folder / f"node_embeddings.{built.version}.ids.parquet").exists()

    ids, vectors = read_embeddings(small_kg.lake, "node_embeddings")
    hits = built.search(vectors[:5], k=3)
    assert [h[0][0] for h in hits] == list(ids[:5]) and hits[0][0][1] == pytest.approx(1.0, abs=1e-4)

    monkeypatch.setattr(VectorIndex, "build", classmethod(lambda *a, **k: pytest.fail("rebuilt an unchanged table")))
    loaded = VectorIndex.build_or_load(small_kg.lake, "node_embeddings", params)
    assert loaded.version == built.version and loaded.search(vectors[:5], k=3) == hits
    monkeypatch.undo()

    with small_kg.connect() as con:
        con.execute("UPDATE kg.kg_node_text SET text = 'Recurrent seizures.' WHERE cui = ?", [ids[0]])
    embed_source(small_kg, "node_embeddings", encoder)
    rebuilt = VectorIndex.build_or_load(small_kg.lake, "node_embeddings", params)
    assert rebuilt.version != built.version
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "node_embeddings.parquet", f"node_embeddings.{rebuilt.version}.faiss",
        f"node_embeddings.{rebuilt.version}.ids.parquet"])
    assert VectorIndex.load(small_kg.lake, "node_embeddings").version == rebuilt.version


def test_small_tables_use_exact_search(small_kg: Warehouse, encoder: Encoder):
    embed_source(small_kg, "node_embeddings", encoder)
    index = VectorIndex.build_or_load(small_kg.lake, "node_embeddings")
    assert index.kind == "exact" and len(index) == NODES
    assert len(index.search(np.zeros((2, 384), np.float32), k=100)[0]) == NODES  # k larger than the table


def test_identical_texts_are_borrowed_from_another_embedding_table(small_kg: Warehouse, encoder: Encoder):
    """KG chunks are node texts: chunk_embeddings takes their vectors from node_embeddings."""
    embed_source(small_kg, "node_embeddings", encoder)
    with small_kg.connect() as con:
        con.execute("CREATE SCHEMA text")
        con.execute("CREATE TABLE text.corpus_chunks AS SELECT 'chunk-' || cui AS chunk_id, text FROM kg.kg_node_text "
                    "UNION ALL SELECT 'chunk-new', 'a text no node has'")
    counting = StandInEncoder(encoder, encoder.encoder_id)
    stats = embed_source(small_kg, "chunk_embeddings", counting, reuse_from=["node_embeddings"])
    assert (stats.embedded, stats.reused, stats.rows) == (1, NODES, NODES + 1)
    chunk_ids, chunk_vectors = read_embeddings(small_kg.lake, "chunk_embeddings")
    node_ids, node_vectors = read_embeddings(small_kg.lake, "node_embeddings")
    by_node = dict(zip(node_ids, node_vectors))
    for chunk_id, vector in zip(chunk_ids, chunk_vectors):
        if chunk_id != "chunk-new":
            np.testing.assert_array_equal(vector, by_node[chunk_id.removeprefix("chunk-")])


def test_changing_one_definition_in_the_release_re_embeds_only_that_node(tiny_release: Path, tmp_path: Path,
                                                                        encoder: Encoder):
    """Release -> ingest -> dbt -> embeddings, twice: an edited MRDEF row re-embeds exactly one node text."""
    import shutil

    from conftest import ingest_release, run_dbt

    from medgraph.storage import Lake
    from medgraph.umls.ingest import ingest_rrf_file

    release = Path(shutil.copytree(tiny_release, tmp_path / "release"))
    home = tmp_path / "home"
    warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
    ingest_release(release, warehouse)
    run_dbt(home, "build", "--select", "+kg_node_text", "--indirect-selection", "cautious")
    # A slice of nodes keeps the test fast; it includes Seizure, whose definition we edit.
    source = ("SELECT cui, text FROM kg.kg_node_text WHERE cui = 'C0036572' OR cui IN "
              "(SELECT cui FROM kg.kg_node_text ORDER BY cui LIMIT 30)")
    first = embed_table(warehouse, source, "node_embeddings", encoder, id_column="cui", text_column="text")
    assert first.embedded == first.rows == 31

    mrdef = release / "MRDEF.RRF"
    lines = mrdef.read_text(encoding="utf-8").splitlines(keepends=True)
    (index,) = [i for i, line in enumerate(lines) if line.startswith("C0036572|")][:1]
    fields = lines[index].split("|")
    fields[5] = "A sudden, abnormal electrical disturbance of the brain (edited)."
    lines[index] = "|".join(fields)
    mrdef.write_text("".join(lines), encoding="utf-8")
    # The edit changes MRDEF's size, which MRFILES.RRF declares: skip the completeness check for this file.
    ingest_rrf_file(release, "MRDEF", warehouse, check_mrfiles=False)
    run_dbt(home, "build", "--select", "+kg_node_text", "--indirect-selection", "cautious")

    second = embed_table(warehouse, source, "node_embeddings", encoder, id_column="cui", text_column="text")
    assert (second.embedded, second.reused, second.removed) == (1, 30, 0)
