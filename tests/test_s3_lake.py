"""The lake on S3 (a real S3-compatible server on loopback): same assets, same tables, atomic publishing,
the release read from S3, MLflow artifacts on S3."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import dagster as dg
import numpy as np
import pytest
from conftest import replace_line

from medgraph.s3 import LakeNotLocalError, S3Lake, S3UriError, download_release, parse_s3_uri
from medgraph.settings import load_settings
from medgraph.storage import Warehouse
from medgraph.umls.filters import IngestFilters
from medgraph.umls.ingest import RrfFormatError

TABLES = ["umls.mrconso", "umls.mrrel", "umls.mrsty", "umls.mrdef", "umls.mrsab",
          "kg.kg_nodes", "kg.kg_edges", "kg.kg_node_text", "kg.kg_relations", "kg.kg_node_names",
          "text.corpus_chunks", "kg.kg_chunk_mentions", "kg.kg_chunk_links", "qa.qa_items"]
EMBEDDING_TABLES = ["embeddings.node_embeddings", "embeddings.chunk_embeddings"]
# Short texts in bfloat16 keep the two runs' encoding to seconds; the lake is what is under test, not the model.
LAKE_ENCODER = {"max_length": 16, "batch_size": 128, "dtype": "bfloat16"}


@pytest.fixture
def s3(s3_server: str, aws_env):
    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture
def bucket(s3) -> str:
    name = f"medgraph-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=name)
    return name


def upload_release(s3, bucket: str, release: Path, prefix: str) -> str:
    for path in sorted(release.iterdir()):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def materialize_graph(env: dict[str, str]) -> Warehouse:
    """The data graph up to the models' inputs: UMLS tables, dbt KG marts, corpus chunks with BM25 and
    mentions, node and chunk embeddings with their FAISS indexes, and the QA items."""
    from platform_assets import embeddings, kg, qa, text, umls
    from resources import build_resources
    from resources.encoder import EncoderResource

    resources = build_resources(load_settings(env))
    resources["encoder"] = EncoderResource(spec="minilm", **LAKE_ENCODER)
    embedding_assets = [a for a in embeddings.embedding_assets
                        if a.key.path[-1] in ("node_embeddings", "chunk_embeddings")]
    result = dg.materialize([umls.umls_release, *umls.umls_tables, *umls.umls_checks, kg.kg_dbt_models,
                             text.corpus_chunks, text.chunk_concept_graph, *embedding_assets, qa.qa_items],
                            resources=resources, raise_on_error=False)
    failures = [e.message for e in result.all_events if e.is_failure]
    assert result.success, failures
    dbt_checks = [c for c in result.get_asset_check_evaluations() if c.asset_key.path[0] == "kg"]
    assert dbt_checks and all(c.passed for c in dbt_checks)
    return resources["warehouse"].get_warehouse()


def table_fingerprints(warehouse: Warehouse, tables: list[str]) -> dict[str, tuple[int, str]]:
    """Row count and an order-independent content hash (md5 of the sorted md5s of the rows) per table."""
    with warehouse.connect(read_only=True) as con:
        return {t: con.execute(f"SELECT count(*), md5(coalesce(string_agg(h, ',' ORDER BY h), '')) "
                               f"FROM (SELECT md5(CAST(r AS VARCHAR)) AS h FROM {t} r)").fetchone()
                for t in tables}


@dataclass
class BothLakes:
    local: Warehouse
    remote: Warehouse
    s3: object
    bucket: str
    home: Path


@pytest.fixture(scope="module")
def both_lakes(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory, s3_server: str,
               one_torch_thread) -> BothLakes:
    """The same assets materialized once with a local lake and once with an S3 lake (module scope:
    the tests below compare and exercise the two)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        home = tmp_path_factory.mktemp("both_lakes")
        for name, value in {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials")}.items():
            monkeypatch.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(name, raising=False)
        s3 = boto3.client("s3", endpoint_url=s3_server)
        bucket = f"medgraph-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(Bucket=bucket)
        local = materialize_graph({"MEDGRAPH_HOME": str(home / "local"), "MEDGRAPH_UMLS_DIR": str(tiny_release),
                                   "MEDGRAPH_PROFILE": "tiny"})
        release_uri = upload_release(s3, bucket, tiny_release, "releases/2025AB/META")
        remote = materialize_graph({"MEDGRAPH_HOME": str(home / "s3"), "MEDGRAPH_UMLS_DIR": release_uri,
                                    "MEDGRAPH_PROFILE": "tiny", "MEDGRAPH_LAKE": f"s3://{bucket}/lake",
                                    "MEDGRAPH_S3_ENDPOINT_URL": s3_server})
        yield BothLakes(local, remote, s3, bucket, home / "s3")


def lake_keys(lakes: BothLakes, prefix: str = "lake/") -> set[str]:
    return {o["Key"] for page in lakes.s3.get_paginator("list_objects_v2").paginate(Bucket=lakes.bucket, Prefix=prefix)
            for o in page.get("Contents", [])}


@pytest.mark.slow
def test_same_assets_give_identical_tables_with_a_local_and_an_s3_lake(both_lakes: BothLakes):
    local, remote = both_lakes.local, both_lakes.remote
    expected = table_fingerprints(local, TABLES)
    assert all(rows > 0 for rows, _ in expected.values()), expected
    assert table_fingerprints(remote, TABLES) == expected

    # Embedding tables: the same rows (id, text hash, encoder) and the same vectors. Vectors are compared to
    # 1e-6, not by hash: the encoder's float sums may depend on how rows were batched (ties in text length).
    for table in EMBEDDING_TABLES:
        query = f"SELECT id, content_hash, encoder_id, embedding FROM {table} ORDER BY id"
        with local.connect(read_only=True) as a, remote.connect(read_only=True) as b:
            left, right = a.execute(query).fetchall(), b.execute(query).fetchall()
        assert len(left) > 0 and [r[:3] for r in left] == [r[:3] for r in right], table
        assert np.allclose(np.array([r[3] for r in left]), np.array([r[3] for r in right]), atol=1e-6), table

    # BM25 lives in the warehouse file (DuckDB fts) on either lake, built from the same chunks.
    from medgraph.text.bm25 import bm25_search

    queries = ["myocardial infarction treatment", "seizure", "insulin resistance"]
    assert bm25_search(remote, queries) == bm25_search(local, queries) != [[], [], []]

    # The S3 run really used S3: its views read s3:// files, the files exist there and not on local disk.
    with remote.connect(read_only=True) as con:
        views = dict(con.execute("SELECT schema_name || '.' || view_name, sql FROM duckdb_views() "
                                 "WHERE NOT internal").fetchall())
    bucket = both_lakes.bucket
    assert f"s3://{bucket}/lake/umls/mrrel." in views["umls.mrrel"]  # a release's versioned file (medgraph.umls.publish)
    assert f"s3://{bucket}/lake/embeddings/node_embeddings.parquet" in views["embeddings.node_embeddings"]
    assert f"s3://{bucket}/lake/qa/qa_items.parquet" in views["qa.qa_items"]
    keys = lake_keys(both_lakes)
    # One object per table, the one its view reads: older versions are deleted after the swap.
    umls_keys = sorted(k for k in keys if k.startswith("lake/umls/"))
    assert [k.split("/")[2].split(".")[0] for k in umls_keys] == sorted(("mrconso", "mrrel", "mrsty", "mrdef", "mrsab"))
    assert all(views[f"umls.{k.split('/')[2].split('.')[0]}"].count(k) == 1 for k in umls_keys)
    assert {"lake/text/corpus_chunks.parquet", "lake/kg/kg_chunk_mentions.parquet", "lake/kg/kg_chunk_links.parquet",
            "lake/embeddings/chunk_embeddings.parquet", "lake/qa/qa_items.parquet"} <= keys
    assert len([k for k in keys if k.startswith("lake/embeddings/node_embeddings.") and k.endswith(".faiss")]) == 1
    assert not [k for k in keys if "/.staging/" in k], "staging objects must be deleted after publishing"
    assert not (both_lakes.home / "lake").exists()
    scratch = both_lakes.home / "lake_local" / "scratch"
    assert not [p for p in scratch.rglob("*") if p.is_file()], "local scratch files must be removed"


@pytest.mark.slow
def test_faiss_index_round_trips_through_s3_and_searches_like_the_local_one(both_lakes: BothLakes):
    from medgraph.embed.index import VectorIndex
    from medgraph.embed.tables import read_embeddings

    local = VectorIndex.load(both_lakes.local.lake, "node_embeddings")
    remote = VectorIndex.load(both_lakes.remote.lake, "node_embeddings")
    assert remote.version == local.version and len(remote) == len(local) > 0 and remote.kind == local.kind
    _, vectors = read_embeddings(both_lakes.remote.lake, "node_embeddings")
    queries = vectors[:: max(1, len(vectors) // 8)]
    found_local, found_remote = local.search(queries, 5), remote.search(queries, 5)
    assert [[i for i, _ in row] for row in found_remote] == [[i for i, _ in row] for row in found_local]
    assert np.allclose([[s for _, s in row] for row in found_remote], [[s for _, s in row] for row in found_local],
                       atol=1e-5)
    # Loaded from the ETag-keyed local cache: a second load downloads nothing new.
    cache = both_lakes.home / "lake_local" / "cache"
    cached = sorted(cache.rglob("node_embeddings.*.faiss.*"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = VectorIndex.build_or_load(both_lakes.remote.lake, "node_embeddings")
    assert again.version == local.version and cached[0].stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_graph_index_cache_lives_in_the_s3_lake(both_lakes: BothLakes):
    from medgraph.kg.csr import build_graph_index

    expected = build_graph_index(both_lakes.local)
    first = build_graph_index(both_lakes.remote)
    key = f"lake/kg/graph_index.{first.version}.npz"
    assert key in lake_keys(both_lakes, "lake/kg/")
    again = build_graph_index(both_lakes.remote)  # from the cache object, through the local copy
    for index in (first, again):
        assert index.version == expected.version
        assert np.array_equal(index.cuis, expected.cuis) and np.array_equal(index.indptr, expected.indptr)
        assert np.array_equal(index.dst, expected.dst) and np.array_equal(index.relation, expected.relation)
        assert index.relations == expected.relations


@pytest.mark.slow
def test_failed_embedding_write_on_s3_keeps_the_previous_table(both_lakes: BothLakes,
                                                               monkeypatch: pytest.MonkeyPatch):
    from medgraph.embed.encoder import load_encoder
    from medgraph.embed.tables import embed_source

    remote, s3, bucket = both_lakes.remote, both_lakes.s3, both_lakes.bucket
    key = "lake/embeddings/node_embeddings.parquet"
    before = s3.head_object(Bucket=bucket, Key=key)["ETag"]
    rows = remote.count("embeddings.node_embeddings")

    class FailingEncoder:
        """A new encoder id (so every row is re-embedded) that fails on its second batch."""

        def __init__(self) -> None:
            self.inner, self.calls = load_encoder("minilm", max_length=8, batch_size=128), 0
            self.dim, self.encoder_id = self.inner.dim, "failing-encoder"

        def encode(self, texts: list[str], kind: str = "document", **options: object) -> np.ndarray:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("encoder failed mid-way")
            return self.inner.encode(texts, kind, **options)

    with pytest.raises(RuntimeError, match="mid-way"):
        embed_source(remote, "node_embeddings", FailingEncoder(), batch_size=256)

    # A failure in the upload or the publishing copy, after the new file is complete.
    def failing_upload(self, local: Path, path: str) -> str:
        assert Path(local).stat().st_size > 0
        raise ConnectionError("network gone during the upload")

    monkeypatch.setattr(S3Lake, "install", failing_upload)
    with pytest.raises(ConnectionError):  # the asset's encoder: every vector is reused, the new file written
        embed_source(remote, "node_embeddings", load_encoder("minilm", **LAKE_ENCODER))

    assert s3.head_object(Bucket=bucket, Key=key)["ETag"] == before
    assert remote.count("embeddings.node_embeddings") == rows
    assert s3.list_objects_v2(Bucket=bucket, Prefix="lake/.staging/")["KeyCount"] == 0
    scratch = both_lakes.home / "lake_local" / "scratch"
    assert not [p for p in scratch.rglob("*") if p.is_file()], "local scratch files must be removed"


def test_install_failing_in_the_copy_discards_the_staging_object(tmp_path: Path, s3, bucket: str,
                                                                  s3_server: str, monkeypatch: pytest.MonkeyPatch):
    from resources.warehouse import S3Access, WarehouseResource

    lake = WarehouseResource(home=str(tmp_path), lake=f"s3://{bucket}/lake", s3=S3Access(endpoint_url=s3_server)
                             ).get_warehouse().lake
    target = lake.file_path("embeddings", "x.1.faiss")
    first = lake.scratch_path("embeddings", "x", suffix=".faiss")
    first.write_bytes(b"version one")
    assert lake.install(first, target) == target and not first.exists()
    assert lake.fetch(target).read_bytes() == b"version one"

    second = lake.scratch_path("embeddings", "x", suffix=".faiss")
    second.write_bytes(b"version two")
    def failing_copy(self, staging: str, final: str) -> str:
        raise ConnectionError("CopyObject failed")

    monkeypatch.setattr(S3Lake, "_promote", failing_copy)
    with pytest.raises(ConnectionError):
        lake.install(second, target)
    monkeypatch.undo()
    assert s3.get_object(Bucket=bucket, Key="lake/embeddings/x.1.faiss")["Body"].read() == b"version one"
    assert s3.list_objects_v2(Bucket=bucket, Prefix="lake/.staging/")["KeyCount"] == 0
    assert lake.glob("embeddings", "x.*.faiss") == [target]
    lake.remove(target)
    assert lake.glob("embeddings", "x.*.faiss") == [] and not list((tmp_path / "lake_local" / "cache").rglob("x.1*"))


def test_failed_write_keeps_the_previous_s3_object_and_leaves_no_staging(
        synthetic_release: Path, tmp_path: Path, s3, bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch):
    from medgraph.umls.ingest import ingest_rrf_file
    from resources.warehouse import S3Access, WarehouseResource

    warehouse = WarehouseResource(home=str(tmp_path / "home"), lake=f"s3://{bucket}/lake",
                                  s3=S3Access(endpoint_url=s3_server)).get_warehouse()
    stats = ingest_rrf_file(synthetic_release, "MRREL", warehouse)
    assert stats.parquet_path == f"s3://{bucket}/lake/umls/mrrel.parquet"
    assert stats.parquet_bytes == s3.head_object(Bucket=bucket, Key="lake/umls/mrrel.parquet")["ContentLength"]
    before = s3.head_object(Bucket=bucket, Key="lake/umls/mrrel.parquet")["ETag"]
    rows = warehouse.count("umls.mrrel")

    broken = Path(shutil.copytree(synthetic_release, tmp_path / "broken"))
    line7 = (broken / "MRREL.RRF").read_text().splitlines()[6]
    replace_line(broken / "MRREL.RRF", 7, line7.rsplit("|", 2)[0] + "|")  # drop one field
    with pytest.raises(RrfFormatError, match=r"MRREL\.RRF:7: expected 16 fields, found 15"):
        ingest_rrf_file(broken, "MRREL", warehouse)

    # A failure after the new file is completely written (here: the publishing copy) must discard the staging
    # object and keep the table's object as it was.
    def failing_copy(self, staging: str, schema: str, table: str) -> str:
        assert s3.head_object(Bucket=bucket, Key=staging.split(f"s3://{bucket}/", 1)[1])["ContentLength"] > 0
        raise ConnectionError("network gone during CopyObject")

    monkeypatch.setattr(S3Lake, "publish", failing_copy)
    with pytest.raises(ConnectionError):
        ingest_rrf_file(synthetic_release, "MRREL", warehouse, IngestFilters(sabs=("MSH",)))
    assert s3.head_object(Bucket=bucket, Key="lake/umls/mrrel.parquet")["ETag"] == before
    assert warehouse.count("umls.mrrel") == rows
    assert s3.list_objects_v2(Bucket=bucket, Prefix="lake/.staging/")["KeyCount"] == 0


def test_release_mirror_downloads_only_changed_files(synthetic_release: Path, tmp_path: Path, s3, bucket: str):
    uri = upload_release(s3, bucket, synthetic_release, "META")
    names = ("MRCONSO.RRF", "MRREL.RRF", "MRSTY.RRF")
    local = download_release(s3, uri, tmp_path / "cache", names)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in synthetic_release.iterdir() if p.name.startswith(names))
    assert (local / "MRREL.RRF").read_bytes() == (synthetic_release / "MRREL.RRF").read_bytes()
    stamp = (local / "MRSTY.RRF").stat().st_mtime_ns

    s3.put_object(Bucket=bucket, Key="META/MRREL.RRF", Body=b"C1|A1|AUI|RO|C2|A2|AUI||R1|MTH||N|N|||\n")
    download_release(s3, uri, tmp_path / "cache", names)
    assert (local / "MRREL.RRF").read_bytes() == b"C1|A1|AUI|RO|C2|A2|AUI||R1|MTH||N|N|||\n"
    assert (local / "MRSTY.RRF").stat().st_mtime_ns == stamp, "an unchanged file is not downloaded again"

    s3.delete_object(Bucket=bucket, Key="META/MRSTY.RRF")
    download_release(s3, uri, tmp_path / "cache", names)
    assert not (local / "MRSTY.RRF").exists(), "a file removed from the release leaves the mirror"


def test_release_fingerprint_on_s3_follows_content_without_download(
        synthetic_release: Path, tmp_path: Path, s3, bucket: str, s3_server: str):
    from resources.warehouse import S3Access, UmlsReleaseResource

    uri = upload_release(s3, bucket, synthetic_release, "META")
    release = UmlsReleaseResource(home=str(tmp_path), umls_dir=uri, s3=S3Access(endpoint_url=s3_server))
    first, location = release.fingerprint()
    assert location == uri and not (tmp_path / "umls_cache").exists()
    assert release.fingerprint()[0] == first
    s3.put_object(Bucket=bucket, Key="META/MRSTY.RRF", Body=b"C0000001|T047|B2.2.1.2.1|Disease or Syndrome|AT1||\n")
    assert release.fingerprint()[0] != first


def test_bad_s3_locations_are_clear_errors(tmp_path: Path):
    from resources.warehouse import WarehouseResource

    with pytest.raises(S3UriError, match="expected s3://bucket"):
        parse_s3_uri("s3://Bad_Bucket/x")
    with pytest.raises(S3UriError, match="not an S3 location"):
        WarehouseResource(home=str(tmp_path), lake="s3://x").get_warehouse()


def test_code_treating_an_s3_lake_as_a_directory_gets_a_clear_error(tmp_path: Path, s3_server: str, aws_env):
    from resources.warehouse import S3Access, WarehouseResource

    lake = WarehouseResource(home=str(tmp_path), lake="s3://medgraph-lake/x",
                             s3=S3Access(endpoint_url=s3_server)).get_warehouse().lake
    with pytest.raises(LakeNotLocalError, match="the lake is s3://medgraph-lake/x, not a directory"):
        _ = lake.root


def test_open_warehouse_from_settings_opens_the_configured_s3_lake(tmp_path: Path, s3, bucket: str,
                                                                     s3_server: str):
    from medgraph.storage import open_warehouse
    from resources.warehouse import S3Access, WarehouseResource

    env = {"MEDGRAPH_HOME": str(tmp_path), "MEDGRAPH_LAKE": f"s3://{bucket}/lake",
           "MEDGRAPH_S3_ENDPOINT_URL": s3_server}
    warehouse = open_warehouse(load_settings(env))
    resource = WarehouseResource(home=str(tmp_path), lake=f"s3://{bucket}/lake",
                                 s3=S3Access(endpoint_url=s3_server)).get_warehouse()
    assert isinstance(warehouse.lake, S3Lake) and warehouse.lake == resource.lake
    assert warehouse.path == resource.path
    s3.put_object(Bucket=bucket, Key="lake/t/x.parquet", Body=b"")
    assert warehouse.lake.exists(warehouse.lake.table_path("t", "x"))
    # A local MEDGRAPH_LAKE other than the default is honoured too (the CLI used to ignore it).
    assert open_warehouse(load_settings({"MEDGRAPH_HOME": str(tmp_path), "MEDGRAPH_LAKE": str(tmp_path / "elsewhere")})
                          ).lake.root == tmp_path / "elsewhere"


def test_mlflow_artifacts_go_to_s3(tmp_path: Path, s3, bucket: str, s3_server: str,
                                   monkeypatch: pytest.MonkeyPatch, mlflow_db: Path):
    from medgraph.tracking import Tracking

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server)  # how MLflow's S3 artifact store finds the server
    tracking = Tracking(f"sqlite:///{mlflow_db}", f"s3://{bucket}/mlflow")
    note = tmp_path / "note.txt"
    note.write_text("graph attention")
    with tracking.start_run("s3_check") as run:
        import mlflow

        mlflow.log_artifact(str(note))
        mlflow.log_dict({"auc": 0.9}, "summary.json")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="mlflow/")["Contents"]}
    prefix = f"mlflow/s3_check/{run.info.run_id}/artifacts"
    assert {f"{prefix}/note.txt", f"{prefix}/summary.json"} <= keys
    assert s3.get_object(Bucket=bucket, Key=f"{prefix}/note.txt")["Body"].read() == b"graph attention"
