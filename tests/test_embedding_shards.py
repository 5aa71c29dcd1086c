"""Embedding past one machine (issue 27): a table embedded in shards, then merged, equals the table embedded whole."""

from __future__ import annotations

import hashlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import copy_warehouse

from medgraph.embed.encoder import Encoder, load_encoder
from medgraph.embed.tables import (
    EMBEDDING_SOURCES,
    Shard,
    ShardsNotCurrentError,
    embed_shard,
    embed_table,
    merge_shards,
    read_embeddings,
    shard_path,
)
from medgraph.settings import load_settings
from medgraph.storage import Warehouse
from platform_assets.embeddings import EmbeddingConfig, build_embedding_assets
from resources import EncoderResource, WarehouseResource

# The drug edges of the tiny KG: 191 triples, a few seconds to embed, about half in each of 2 shards.
RELATIONS = ["may_treat", "may_prevent", "has_contraindicated_drug"]
EDGE_SHARDS = dg.AssetKey(["embeddings", "edge_embeddings_shards"])
EDGES = dg.AssetKey(["embeddings", "edge_embeddings"])


def resources(home: Path | str) -> dict:
    return {"warehouse": WarehouseResource(home=str(home)), "encoder": EncoderResource(spec="minilm", max_length=32)}


def sharded_embeddings_job(home: str) -> dg.JobDefinition:
    """edge_embeddings' shard asset on 2 shards under the multiprocess executor: each step in its own process.

    Rebuilt by name in every step process (`build_reconstructable_job`), as a code location rebuilds its jobs."""
    defs = dg.Definitions(
        assets=build_embedding_assets(2),
        resources=resources(home),
        jobs=[dg.define_asset_job("edge_embedding_shards", selection=[EDGE_SHARDS],
                                  executor_def=dg.multiprocess_executor)],
    )
    return defs.resolve_job_def("edge_embedding_shards")


def run_shard(home: str, dagster_home: str, partition: str) -> str:
    """Run one partition of `sharded_embeddings_job` against the instance in `dagster_home`; its run id."""
    job = dg.build_reconstructable_job(__name__, "sharded_embeddings_job", reconstructable_args=(home,))
    config = {"ops": {"embeddings__edge_embeddings_shards": {"config": {"relations": RELATIONS}}}}
    with dg.DagsterInstance.from_config(dagster_home) as instance:
        return dg.execute_job(job, instance, run_config=config, tags={"dagster/partition": partition}).run_id


def table(warehouse: Warehouse, target: str) -> dict[str, tuple[str, str, np.ndarray]]:
    rows = pq.read_table(warehouse.lake.table_path("embeddings", target)).to_pylist()
    return {r["id"]: (r["content_hash"], r["encoder_id"], np.asarray(r["embedding"], np.float32)) for r in rows}


@pytest.mark.slow
def test_edge_embeddings_on_two_shards_equal_the_unsharded_table(kg_warehouse: Warehouse, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """Both shards of edge_embeddings run at once, each in its own run and step process (multiprocess executor),
    as the production launcher runs a backfill's partitions; the merge publishes a table equal to the unsharded
    asset's: same ids, texts and encoder, vectors within float32 tolerance."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the step processes' torch: two threads each would fight on 2 cores
    whole = copy_warehouse(kg_warehouse, tmp_path / "whole")
    sharded = copy_warehouse(kg_warehouse, tmp_path / "sharded")
    config = dg.RunConfig(ops={"embeddings__edge_embeddings": EmbeddingConfig(relations=RELATIONS)})

    unsharded_assets = build_embedding_assets(1)
    dg.materialize(unsharded_assets, selection=[EDGES], resources=resources(whole.path.parent), run_config=config)

    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        # Two processes, as two ECS tasks would be: Dagster's run set-up (logging.config) deadlocks in threads.
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            run_ids = list(pool.map(run_shard, [str(sharded.path.parent)] * 2, [str(tmp_path / "dagster")] * 2,
                                    ["0", "1"]))
        runs = [instance.get_run_by_id(run_id) for run_id in run_ids]
        assert [run.status for run in runs] == [dg.DagsterRunStatus.SUCCESS] * 2
        for run, key in zip(runs, ["0", "1"]):
            (materialization,) = [e.asset_materialization for e in instance.all_logs(
                run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)]
            assert (materialization.asset_key, materialization.partition) == (EDGE_SHARDS, key)
            steps = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_WORKER_STARTED)
            assert len(steps) == 1  # the multiprocess executor started a process for the step

        merged = dg.materialize(build_embedding_assets(2), selection=[EDGES], resources=resources(sharded.path.parent),
                                instance=instance, run_config=config)
        assert merged.asset_materializations_for_node("embeddings__edge_embeddings")[0].metadata["shards"].value == 2

    shard_ids = [set(pq.read_table(shard_path(sharded.lake, "edge_embeddings", Shard(k, 2))).column("id").to_pylist())
                 for k in range(2)]
    assert all(shard_ids) and not shard_ids[0] & shard_ids[1]  # two real, disjoint slices
    for k, ids in enumerate(shard_ids):  # the slice is md5(id) mod 2, as documented
        assert {int(hashlib.md5(i.encode()).hexdigest()[:15], 16) % 2 for i in ids} == {k}

    expected, actual = table(whole, "edge_embeddings"), table(sharded, "edge_embeddings")
    assert len(expected) == 191 and actual.keys() == expected.keys() == shard_ids[0] | shard_ids[1]
    for edge_id, (content_hash, encoder_id, vector) in expected.items():
        assert actual[edge_id][:2] == (content_hash, encoder_id)
        np.testing.assert_allclose(actual[edge_id][2], vector, atol=1e-5, rtol=0)
    with sharded.connect(read_only=True) as con:  # the view every reader uses points at the merged table
        assert con.execute("SELECT count(*) FROM embeddings.edge_embeddings").fetchone()[0] == 191


# --- merge: atomic, and only of current shards ----------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder(one_torch_thread: None) -> Encoder:
    return load_encoder("minilm", max_length=32)


@pytest.fixture
def small_kg(kg_warehouse: Warehouse, tmp_path: Path) -> Warehouse:
    """A writable copy of the tiny KG with 40 node texts."""
    warehouse = copy_warehouse(kg_warehouse, tmp_path / "home")
    with warehouse.connect() as con:
        con.execute("DELETE FROM kg.kg_node_text WHERE cui NOT IN (SELECT cui FROM kg.kg_node_text ORDER BY cui LIMIT 40)")
    return warehouse


def embed_shards(warehouse: Warehouse, encoder: Encoder, shards: int, only: tuple[int, ...] | None = None) -> list:
    source = EMBEDDING_SOURCES["node_embeddings"]
    return [embed_shard(warehouse, source.sql, "node_embeddings", encoder, Shard(k, shards),
                        id_column=source.id_column, text_column=source.text_column)
            for k in (only if only is not None else range(shards))]


def merge(warehouse: Warehouse, encoder_id: str, shards: int):
    source = EMBEDDING_SOURCES["node_embeddings"]
    return merge_shards(warehouse, source.sql, "node_embeddings", encoder_id, shards,
                        id_column=source.id_column, text_column=source.text_column)


def test_a_merge_of_stale_shards_is_refused_and_keeps_the_previous_table(small_kg: Warehouse, encoder: Encoder):
    embed_shards(small_kg, encoder, 2)
    assert merge(small_kg, encoder.encoder_id, 2).rows == 40
    published = small_kg.lake.table_path("embeddings", "node_embeddings")
    before = published.read_bytes()
    ids, _ = read_embeddings(small_kg.lake, "node_embeddings")
    changed = str(ids[0])
    stale = int(hashlib.md5(changed.encode()).hexdigest()[:15], 16) % 2
    with small_kg.connect() as con:
        con.execute("UPDATE kg.kg_node_text SET text = 'Recurrent seizures.' WHERE cui = ?", [changed])

    with pytest.raises(ShardsNotCurrentError, match=rf"shard {stale}-of-2: 1 source rows missing or changed") as error:
        merge(small_kg, encoder.encoder_id, 2)
    assert error.value.shards == [stale]
    with pytest.raises(ShardsNotCurrentError, match="from another encoder"):
        merge(small_kg, "another-encoder", 2)
    with pytest.raises(ShardsNotCurrentError, match="shards 0-of-3, 1-of-3, 2-of-3 have no file yet"):
        merge(small_kg, encoder.encoder_id, 3)
    assert published.read_bytes() == before  # every refusal left the table as it was, and no staging file
    assert not [p.name for p in published.parent.iterdir() if p.name.startswith(".")]

    (again,) = embed_shards(small_kg, encoder, 2, only=(stale,))
    assert again.embedded == 1  # the shard re-embeds its one changed text, reusing the rest
    merge(small_kg, encoder.encoder_id, 2)
    with small_kg.connect(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM embeddings.node_embeddings").fetchone()[0] == 40


def test_a_merge_failing_while_it_publishes_keeps_the_previous_table(small_kg: Warehouse, encoder: Encoder,
                                                                     monkeypatch: pytest.MonkeyPatch):
    from medgraph.storage import Lake

    embed_shards(small_kg, encoder, 2)
    merge(small_kg, encoder.encoder_id, 2)
    published = small_kg.lake.table_path("embeddings", "node_embeddings")
    before = published.read_bytes()
    with small_kg.connect() as con:
        con.execute("DELETE FROM kg.kg_node_text WHERE cui = (SELECT min(cui) FROM kg.kg_node_text)")
    embed_shards(small_kg, encoder, 2)

    def failing_install(self, local: Path, path: Path) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(Lake, "install", failing_install)
    with pytest.raises(OSError, match="disk full"):
        merge(small_kg, encoder.encoder_id, 2)
    monkeypatch.undo()
    assert published.read_bytes() == before and small_kg.count("embeddings.node_embeddings") == 40
    assert not [p.name for p in published.parent.iterdir() if p.name.startswith(".")]
    assert merge(small_kg, encoder.encoder_id, 2).rows == small_kg.count("embeddings.node_embeddings") == 39


def test_resharding_reuses_the_merged_table_and_removes_the_old_shard_files(small_kg: Warehouse, encoder: Encoder):
    embed_shards(small_kg, encoder, 2)
    merge(small_kg, encoder.encoder_id, 2)
    assert sum(stats.embedded for stats in embed_shards(small_kg, encoder, 3)) == 0  # vectors from the table
    assert merge(small_kg, encoder.encoder_id, 3).rows == 40
    folder = small_kg.lake.root / "embeddings"
    assert sorted(p.name for p in folder.glob("node_embeddings.shard-*")) == [
        f"node_embeddings.shard-{k}-of-3.parquet" for k in range(3)]


def test_shard_count_is_a_setting_and_one_shard_is_the_unsharded_graph():
    assert load_settings({}).embedding_shards == 1
    assert load_settings({"MEDGRAPH_EMBEDDING_SHARDS": "4"}).embedding_shards == 4
    with pytest.raises(ValueError, match="MEDGRAPH_EMBEDDING_SHARDS must be a whole number >= 1"):
        load_settings({"MEDGRAPH_EMBEDDING_SHARDS": "0"})
    one = {a.key for a in build_embedding_assets(1)}
    assert one == {dg.AssetKey(["embeddings", t]) for t in EMBEDDING_SOURCES}
    two = {a.key: a for a in build_embedding_assets(2)}
    assert set(two) == one | {dg.AssetKey(["embeddings", f"{t}_shards"])
                              for t in ("node_embeddings", "node_description_embeddings", "edge_embeddings")}
    assert two[EDGE_SHARDS].partitions_def.get_partition_keys() == ["0", "1"]
    assert set(two[EDGES].asset_deps[EDGES]) == {EDGE_SHARDS}


def test_shards_and_merge_on_an_s3_lake(tmp_path: Path, s3_server: str, aws_env, encoder: Encoder):
    """The same on an S3 lake (moto over HTTP): shard objects beside the table, the merge equal to one whole run."""
    import boto3

    from resources.warehouse import S3Access

    bucket = "medgraph-shards"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    warehouse = WarehouseResource(home=str(tmp_path), lake=f"s3://{bucket}/lake",
                                  s3=S3Access(endpoint_url=s3_server)).get_warehouse()
    with warehouse.connect() as con:
        con.execute("CREATE SCHEMA kg")
        con.execute("CREATE TABLE kg.kg_node_text AS SELECT 'C' || lpad(i::VARCHAR, 7, '0') AS cui, "
                    "'concept ' || i || repeat(' word', i % 7) AS text FROM range(30) AS r(i)")
    source = EMBEDDING_SOURCES["node_embeddings"]
    whole = embed_table(warehouse, source.sql, "whole", encoder, id_column="cui", text_column="text")
    embed_shards(warehouse, encoder, 2)
    stats = merge(warehouse, encoder.encoder_id, 2)
    assert stats.parquet_path == f"s3://{bucket}/lake/embeddings/node_embeddings.parquet" and stats.rows == 30
    assert warehouse.lake.glob("embeddings", "node_embeddings.shard-*") == [
        f"s3://{bucket}/lake/embeddings/node_embeddings.shard-{k}-of-2.parquet" for k in range(2)]
    expected = dict(zip(*read_embeddings(warehouse.lake, "whole")))
    actual = dict(zip(*read_embeddings(warehouse.lake, "node_embeddings")))
    assert actual.keys() == expected.keys() and whole.rows == 30
    for cui, vector in expected.items():
        np.testing.assert_allclose(actual[cui], vector, atol=1e-5, rtol=0)
    assert warehouse.count("embeddings.node_embeddings") == 30


# --- a sample: one shard's rows as the table, for a trial run at size -------------------------------------------


def test_a_sampled_table_holds_exactly_one_shards_rows_with_the_vectors_of_the_whole_table(small_kg: Warehouse,
                                                                                           tmp_path: Path):
    """`EmbeddingConfig.sample` ("K/N") publishes the rows of shard K of N (md5 of the id, as the shards split
    them) and nothing else; their vectors are the ones the whole table gets."""
    nodes = dg.AssetKey(["embeddings", "node_embeddings"])
    whole = copy_warehouse(small_kg, tmp_path / "whole")
    dg.materialize(build_embedding_assets(1), selection=[nodes], resources=resources(whole.path.parent))
    sample = dg.RunConfig(ops={"embeddings__node_embeddings": EmbeddingConfig(sample="1/3")})
    dg.materialize(build_embedding_assets(1), selection=[nodes], resources=resources(small_kg.path.parent),
                   run_config=sample)

    expected, actual = table(whole, "node_embeddings"), table(small_kg, "node_embeddings")
    assert len(expected) == 40
    in_shard = {cui for cui in expected if int(hashlib.md5(cui.encode()).hexdigest()[:15], 16) % 3 == 1}
    assert 0 < len(in_shard) < 40 and actual.keys() == in_shard
    for cui in in_shard:
        assert actual[cui][:2] == expected[cui][:2]
        np.testing.assert_allclose(actual[cui][2], expected[cui][2], atol=1e-5, rtol=0)
    assert small_kg.count("embeddings.node_embeddings") == len(in_shard)


@pytest.mark.parametrize("text", ["3", "3/3", "a/2", "1/0", "-1/2"])
def test_a_sample_not_written_k_of_n_is_refused_with_the_expected_form(text: str):
    with pytest.raises(ValueError, match="K/N|shard index must be in"):
        Shard.parse(text)
