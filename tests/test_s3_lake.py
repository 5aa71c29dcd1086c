"""The lake on S3 (a real S3-compatible server on loopback): same assets, same tables, atomic publishing,
the release read from S3, MLflow artifacts on S3."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import boto3
import dagster as dg
import pytest
from conftest import replace_line

from medgraph.s3 import LakeNotLocalError, S3Lake, S3UriError, download_release, parse_s3_uri
from medgraph.settings import load_settings
from medgraph.storage import Warehouse
from medgraph.umls.filters import IngestFilters
from medgraph.umls.ingest import RrfFormatError

TABLES = ["umls.mrconso", "umls.mrrel", "umls.mrsty", "umls.mrdef", "umls.mrsab",
          "kg.kg_nodes", "kg.kg_edges", "kg.kg_node_text", "kg.kg_relations", "kg.kg_node_names"]


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


def materialize_kg(env: dict[str, str]) -> Warehouse:
    from platform_assets import kg, umls
    from resources import build_resources

    resources = build_resources(load_settings(env))
    result = dg.materialize([umls.umls_release, *umls.umls_tables, *umls.umls_checks, kg.kg_dbt_models],
                            resources=resources, raise_on_error=False)
    failures = [e.message for e in result.all_events if e.is_failure]
    assert result.success, failures
    dbt_checks = [c for c in result.get_asset_check_evaluations() if c.asset_key.path[0] == "kg"]
    assert dbt_checks and all(c.passed for c in dbt_checks)
    return resources["warehouse"].open()


def table_fingerprints(warehouse: Warehouse) -> dict[str, tuple[int, str]]:
    """Row count and an order-independent content hash (md5 of the sorted md5s of the rows) per table."""
    with warehouse.connect(read_only=True) as con:
        return {t: con.execute(f"SELECT count(*), md5(coalesce(string_agg(h, ',' ORDER BY h), '')) "
                               f"FROM (SELECT md5(CAST(r AS VARCHAR)) AS h FROM {t} r)").fetchone()
                for t in TABLES}


@pytest.mark.slow
def test_same_assets_give_identical_tables_with_a_local_and_an_s3_lake(
        tiny_release: Path, tmp_path: Path, s3, bucket: str, s3_server: str):
    local = materialize_kg({"MEDGRAPH_HOME": str(tmp_path / "local"), "MEDGRAPH_UMLS_DIR": str(tiny_release),
                            "MEDGRAPH_PROFILE": "tiny"})
    release_uri = upload_release(s3, bucket, tiny_release, "releases/2025AB/META")
    remote = materialize_kg({"MEDGRAPH_HOME": str(tmp_path / "s3"), "MEDGRAPH_UMLS_DIR": release_uri,
                             "MEDGRAPH_PROFILE": "tiny", "MEDGRAPH_LAKE": f"s3://{bucket}/lake",
                             "MEDGRAPH_S3_ENDPOINT_URL": s3_server})

    expected = table_fingerprints(local)
    assert all(rows > 0 for rows, _ in expected.values())
    assert table_fingerprints(remote) == expected
    # The S3 run really used S3: its views read s3:// files, the files exist there and not on local disk.
    with remote.connect(read_only=True) as con:
        view = con.execute("SELECT sql FROM duckdb_views() WHERE schema_name = 'umls' AND view_name = 'mrrel'"
                           ).fetchone()[0]
    assert f"s3://{bucket}/lake/umls/mrrel.parquet" in view
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="lake/")["Contents"]}
    assert {f"lake/umls/{t}.parquet" for t in ("mrconso", "mrrel", "mrsty", "mrdef", "mrsab")} <= keys
    assert not [k for k in keys if "/.staging/" in k], "staging objects must be deleted after publishing"
    assert not (tmp_path / "s3" / "lake").exists()


def test_failed_write_keeps_the_previous_s3_object_and_leaves_no_staging(
        synthetic_release: Path, tmp_path: Path, s3, bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch):
    from medgraph.umls.ingest import ingest_rrf_file
    from resources.warehouse import S3Access, WarehouseResource

    warehouse = WarehouseResource(home=str(tmp_path / "home"), lake=f"s3://{bucket}/lake",
                                  s3=S3Access(endpoint_url=s3_server)).open()
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
        WarehouseResource(home=str(tmp_path), lake="s3://x").open()


def test_steps_that_need_a_local_lake_directory_say_so(tmp_path: Path, s3_server: str, aws_env):
    from medgraph.kg.csr import build_graph_index
    from resources.warehouse import S3Access, WarehouseResource

    warehouse = WarehouseResource(home=str(tmp_path), lake="s3://medgraph-lake/x",
                                  s3=S3Access(endpoint_url=s3_server)).open()
    with pytest.raises(LakeNotLocalError, match="the lake is s3://medgraph-lake/x: on S3 the UMLS tables"):
        build_graph_index(warehouse)


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
