"""Issue 17 faults, each reproduced: bad benchmarks, path traversal, credentials in URIs, malformed input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from conftest import REPO_ROOT

from medgraph.qa.benchmarks import (
    KG_DATASETS,
    MIRAGE_DATASETS,
    BenchmarkFormatError,
    check_dataset_name,
    load_benchmark,
    partition_names,
)
from platform_assets.evaluation import qa_benchmark
from resources import WarehouseResource

MC_ITEM = {"question": "Which?", "options": {"A": "x", "B": "y"}, "answer": "A"}


# Fault 4: one bad benchmark file broke every asset (dataset_names ran while the definitions loaded).

def test_definitions_load_when_the_benchmark_file_is_missing(tmp_path: Path):
    env = {**os.environ, "MEDGRAPH_HOME": str(tmp_path / "home"),
           "MEDGRAPH_BENCHMARK": f"mirage:{tmp_path / 'missing.json'}"}
    script = ("import json, dagster as dg, definitions\n"
              "graph = definitions.defs.resolve_asset_graph()\n"
              "node = graph.get(dg.AssetKey(['eval', 'qa_benchmark']))\n"
              "print(json.dumps({'mrsab': graph.has(dg.AssetKey(['umls', 'mrsab'])),\n"
              "                  'partitions': node.partitions_def.get_partition_keys()}))\n")
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"mrsab": True, "partitions": sorted(MIRAGE_DATASETS)}


def test_partition_names_come_from_the_spec_without_opening_a_file(tmp_path: Path):
    missing = tmp_path / "missing.json"
    assert partition_names(f"mirage:{missing}", tmp_path) == sorted(MIRAGE_DATASETS)
    assert partition_names(f"mirage:{missing}#medqa+bioasq,kg", tmp_path) == sorted(["medqa", "bioasq", *KG_DATASETS])
    assert partition_names("nonsense:spec", tmp_path) == list(KG_DATASETS)
    assert partition_names("", tmp_path) == list(KG_DATASETS)
    # A file that exists is not opened either: its own dataset ("custom") is no partition unless the spec names it.
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps({"custom": {"q1": MC_ITEM}}))
    assert partition_names(f"mirage:{custom}", tmp_path) == sorted(MIRAGE_DATASETS)
    assert partition_names(f"mirage:{custom}#custom", tmp_path) == ["custom"]


def test_a_missing_benchmark_file_fails_inside_qa_benchmark(tmp_path: Path):
    missing = tmp_path / "missing.json"
    result = dg.materialize([qa_benchmark], resources={"warehouse": WarehouseResource(home=str(tmp_path / "home"))},
                            partition_key=KG_DATASETS[0], raise_on_error=False,
                            run_config=dg.RunConfig(ops={"eval__qa_benchmark": {"config": {"spec": f"mirage:{missing}"}}}))
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert f"benchmark file {missing} does not exist" in failure.step_failure_data.error.to_string()


# Fault 5: a MIRAGE dataset key `../../x` made eval/qa_benchmark write outside $MEDGRAPH_HOME.

@pytest.mark.parametrize("name", ["../../../../somewhere/x", "a/b", "..", ".", "", "a\\b", "name with space"])
def test_unsafe_dataset_names_are_rejected(name: str):
    with pytest.raises(BenchmarkFormatError, match="is not allowed"):
        check_dataset_name(name, "somewhere")


def test_mirage_dataset_key_cannot_escape_the_home(tmp_path: Path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"../../../../escaped/x": {"q1": MC_ITEM}, KG_DATASETS[0]: {"q1": MC_ITEM}}))
    with pytest.raises(BenchmarkFormatError, match=r"dataset name '\.\./\.\./\.\./\.\./escaped/x' is not allowed"):
        load_benchmark(f"mirage:{bench}", tmp_path)
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps(MC_ITEM) + "\n")
    with pytest.raises(BenchmarkFormatError, match="is not allowed"):
        load_benchmark(f"jsonl:{lines}#../x", tmp_path)
    assert partition_names(f"mirage:{bench}", tmp_path) == sorted(MIRAGE_DATASETS)

    home = tmp_path / "a" / "b" / "home"
    result = dg.materialize([qa_benchmark], resources={"warehouse": WarehouseResource(home=str(home))},
                            partition_key=KG_DATASETS[0], raise_on_error=False,
                            run_config=dg.RunConfig(ops={"eval__qa_benchmark": {"config": {"spec": f"mirage:{bench}"}}}))
    assert not result.success
    assert not list(tmp_path.rglob("x.json"))
    assert not (home / "eval" / "benchmark" / f"{KG_DATASETS[0]}.json").exists()


# Fault 8: credentials in URIs were printed (`medgraph status`, which `make demo` runs at the end) and tagged.

@pytest.mark.parametrize(("uri", "shown"), [
    ("http://admin:pw@host:5000", "http://admin:***@host:5000"),
    ("https://TOKEN@example.org/v1", "https://***@example.org/v1"),
    ("postgresql://mlflow:p@ss:w@db:5432/mlflow?sslmode=require&password=pw2",
     "postgresql://mlflow:***@db:5432/mlflow?sslmode=require&password=***"),
    ("https://bucket.s3.amazonaws.com/k?X-Amz-Credential=AKIA&X-Amz-Signature=abc&x=1",
     "https://bucket.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"),
    ("openai:qwen@http://user:key@gpu:8000/v1", "openai:qwen@http://user:***@gpu:8000/v1"),
    ("sqlite:////home/me/mlflow.db", "sqlite:////home/me/mlflow.db"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("write to me@example.org", "write to me@example.org"),
])
def test_redact_uri(uri: str, shown: str):
    from medgraph.settings import redact_uri

    assert redact_uri(uri) == shown


def test_status_does_not_print_credentials(medgraph_home: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture):
    import duckdb

    from medgraph.cli import main

    medgraph_home.mkdir(parents=True)
    duckdb.connect(str(medgraph_home / "warehouse.duckdb")).close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://admin:s3cr3t-pw@mlflow.internal:5000")
    monkeypatch.setenv("MEDGRAPH_S3_ENDPOINT_URL", "http://minio:m1n10-key@minio.internal:9000")
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t-pw" not in out and "m1n10-key" not in out
    assert "MLflow             http://admin:***@mlflow.internal:5000" in out
    assert "S3 endpoint        http://minio:***@minio.internal:9000" in out


def test_mlflow_tags_do_not_hold_credentials(mlflow_db: Path, tmp_path: Path):
    from medgraph.tracking import Tracking

    tracking = Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))
    with tracking.start_run("asset", tags={"llm": "openai:m@http://u:hunter2@llm:8000/v1", "plain": "x"}) as run:
        run_id = run.info.run_id
    tags = tracking.client.get_run(run_id).data.tags
    assert tags["llm"] == "openai:m@http://u:***@llm:8000/v1" and tags["plain"] == "x"


# Fault 1: incomplete releases were ingested as success (truncated .gz, a missing split part, no MRFILES check).
# Fault 9 (encoding): non-UTF-8 bytes surfaced as "wrote N rows, validation pass kept N+1".

@pytest.fixture
def sample_copy(tiny_release: Path, tmp_path: Path) -> Path:
    """A writable copy of the embedded sample release, whose MRFILES.RRF lists every file's rows and bytes."""
    import shutil

    return Path(shutil.copytree(tiny_release, tmp_path / "release"))


def test_sample_release_is_verified_against_mrfiles(sample_copy: Path, warehouse):
    from medgraph.umls.ingest import ingest_rrf_file

    stats = ingest_rrf_file(sample_copy, "MRREL", warehouse)
    data = (sample_copy / "MRREL.RRF").read_bytes()
    rows = len(data.splitlines())
    assert stats.as_metadata()["release_completeness"] == f"verified against MRFILES.RRF: {rows} rows, {len(data)} bytes"


def test_release_without_mrfiles_says_completeness_was_not_verified(release_copy: Path, warehouse):
    from medgraph.umls.ingest import ingest_rrf_file

    assert not (release_copy / "MRFILES.RRF").exists()
    completeness = ingest_rrf_file(release_copy, "MRSAB", warehouse).as_metadata()["release_completeness"]
    assert completeness.startswith("not verified: no MRFILES.RRF entry for MRSAB.RRF was compared")


def test_truncated_gzip_fails_before_parsing(sample_copy: Path, warehouse):
    import gzip
    import zlib

    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    plain = sample_copy / "MRREL.RRF"
    lines = plain.read_bytes().splitlines(keepends=True)
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # a gzip stream cut at a line boundary, no trailer
    cut = compressor.compress(b"".join(lines[: len(lines) // 2])) + compressor.flush(zlib.Z_SYNC_FLUSH)
    (sample_copy / "MRREL.RRF.gz").write_bytes(cut)
    plain.unlink()
    with pytest.raises(EOFError):
        gzip.decompress(cut)
    with pytest.raises(ReleaseIncompleteError, match=r"MRREL\.RRF\.gz: corrupt or truncated gzip archive \(Compressed file ended"):
        ingest_rrf_file(sample_copy, "MRREL", warehouse)
    assert not (warehouse.path.parent / "lake" / "umls").exists()  # nothing staged or published


def test_missing_split_part_fails(sample_copy: Path, warehouse):
    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    plain = sample_copy / "MRREL.RRF"
    lines = plain.read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    for suffix, part in (("aa", lines[:third]), ("ab", lines[third: 2 * third]), ("ac", lines[2 * third:])):
        (sample_copy / f"MRREL.RRF.{suffix}").write_bytes(b"".join(part))
    plain.unlink()
    assert ingest_rrf_file(sample_copy, "MRREL", warehouse).rows_out == len(lines)  # complete parts read as one
    (sample_copy / "MRREL.RRF.ab").unlink()
    with pytest.raises(ReleaseIncompleteError,
                       match=r"MRREL\.RRF: split part MRREL\.RRF\.ab is missing \(found MRREL\.RRF\.aa, MRREL\.RRF\.ac\)"):
        ingest_rrf_file(sample_copy, "MRREL", warehouse)


def test_file_shorter_than_mrfiles_declares_fails_naming_both_numbers(sample_copy: Path, warehouse):
    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    plain = sample_copy / "MRDEF.RRF"
    data = plain.read_bytes()
    lines = data.splitlines(keepends=True)
    shorter = b"".join(lines[:-10])
    plain.write_bytes(shorter)
    expected = (f"MRDEF.RRF is incomplete: MRFILES.RRF declares {len(lines)} rows and {len(data)} bytes, "
                f"the release has {len(lines) - 10} rows and {len(shorter)} bytes")
    with pytest.raises(ReleaseIncompleteError, match=expected):
        ingest_rrf_file(sample_copy, "MRDEF", warehouse)


def test_non_utf8_bytes_name_the_file_and_line(release_copy: Path, warehouse):
    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    path = release_copy / "MRCONSO.RRF"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b"|", b"|caf\xe9 ", 1)  # Latin-1, not UTF-8
    path.write_bytes(b"".join(lines))
    with pytest.raises(ReleaseIncompleteError, match=r"MRCONSO\.RRF:5: not UTF-8 \(bytes e9"):
        ingest_rrf_file(release_copy, "MRCONSO", warehouse)


@pytest.mark.parametrize("where", ["inside a field", "at the end of the file"])
def test_a_stray_carriage_return_names_the_file_and_line(release_copy: Path, warehouse, where: str):
    """Issue 58 case 6. Before: DuckDB's "CSV Parser state machine reached an invalid state", no line, and a
    fix (strict_mode=false) that is not a setting of ours."""
    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    path = release_copy / "MRCONSO.RRF"
    lines = path.read_bytes().splitlines(keepends=True)
    if where == "inside a field":
        lines[4], line = lines[4].replace(b"|", b"|ab\rcd", 1), 5
    else:
        lines[-1], line = lines[-1].rstrip(b"\n") + b"\r", len(lines)
    path.write_bytes(b"".join(lines))
    with pytest.raises(ReleaseIncompleteError, match=rf"MRCONSO\.RRF:{line}: a carriage return \(\\r\) inside the row"):
        ingest_rrf_file(release_copy, "MRCONSO", warehouse)


# Fault 9 (MIRAGE): an item without options was accepted; options as a list or an item that is a string were a
# raw AttributeError; a truncated file's JSON error omitted the file name; non-UTF-8 bytes named no line.

@pytest.mark.parametrize(("questions", "message"), [
    ({"q7": {"question": "Which?", "answer": "A"}},
     "medqa/q7 lacks options (a MIRAGE item has question, options and answer; options may be {})"),
    ({"q7": {"question": "Which?", "options": ["x", "y"], "answer": "A"}},
     "medqa/q7: options must be an object of letter -> text, found list"),
    ({"q7": "Which one?"}, "medqa/q7: expected an object with question, options and answer, found str"),
    ({"q7": {"options": {"A": "x"}, "answer": "A"}},
     "medqa/q7 lacks question (a MIRAGE item has question, options and answer; options may be {})"),
    (["q7"], "dataset 'medqa': expected an object of question id -> item, found list"),
])
def test_malformed_mirage_items_name_the_file_and_question(tmp_path: Path, questions: object, message: str):
    from medgraph.qa.mirage import load_mirage

    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps({"medqa": questions}))
    with pytest.raises((TypeError, ValueError)) as error:
        load_mirage(path)
    assert str(error.value) == f"{path}: {message}"
    with pytest.raises(BenchmarkFormatError) as error:  # the same text through the benchmark loader
        load_benchmark(f"mirage:{path}", tmp_path)
    assert str(error.value) == f"{path}: {message}"


def test_truncated_and_non_utf8_mirage_files_name_the_file_and_line(tmp_path: Path):
    from medgraph.qa.mirage import load_mirage

    text = json.dumps({"medqa": {"q1": MC_ITEM, "q2": MC_ITEM}}, indent=1)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"^{truncated}:\d+: not valid JSON \(.*; the file is truncated\)$"):
        load_mirage(truncated)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(text.replace('"x"', '"caf\u00e9"').encode("latin-1"))
    line = text.splitlines().index(next(x for x in text.splitlines() if '"x"' in x)) + 1
    with pytest.raises(ValueError, match=rf"^{latin1}:{line}: not UTF-8 \(byte 0xe9\)"):
        load_mirage(latin1)
    with pytest.raises(BenchmarkFormatError, match=rf"^{latin1}:{line}: not UTF-8 \(byte 0xe9\)"):
        load_benchmark(f"mirage:{latin1}", tmp_path)


@pytest.mark.parametrize(("text", "key", "line"), [
    ('{"medqa": {\n"q1": ITEM,\n"q2": ITEM,\n"q1": ITEM}}', "q1", 4),  # a question id twice: the last would win
    ('{"medqa": {"q1": ITEM},\n"pubmedqa": {"q2": ITEM},\n"medqa": {"q3": ITEM}}', "medqa", 3),  # a dataset twice
])
def test_a_mirage_file_with_a_repeated_key_is_refused_naming_file_line_and_key(tmp_path: Path, text: str, key: str,
                                                                              line: int):
    from medgraph.qa.mirage import load_mirage

    path = tmp_path / "dup.json"
    path.write_text(text.replace("ITEM", json.dumps(MC_ITEM)))
    message = rf"^{path}:{line}: the key '{key}' appears twice in one object"
    with pytest.raises(ValueError, match=message):
        load_mirage(path)
    with pytest.raises(BenchmarkFormatError, match=message):
        load_benchmark(f"mirage:{path}", tmp_path)


def test_non_utf8_and_non_object_jsonl_lines_name_the_file_and_line(tmp_path: Path):
    from medgraph.qa.benchmarks import load_jsonl

    good = json.dumps({"question": "Which drug?", "options": {"A": "x", "B": "y"}, "answer": "A"})
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes((good + "\n" + good.replace("Which", "Caf\u00e9") + "\n").encode("latin-1"))
    with pytest.raises(BenchmarkFormatError, match=rf"^{latin1}:2: not UTF-8 \(byte 0xe9 at column 18\)"):
        load_jsonl(latin1)  # was a raw UnicodeDecodeError without file or line
    listed = tmp_path / "listed.jsonl"
    listed.write_text(good + "\n" + json.dumps(["question", "answer"]) + "\n", encoding="utf-8")
    with pytest.raises(BenchmarkFormatError, match=rf"^{listed}:2: expected an object .* found list"):
        load_jsonl(listed)  # a list holding "question" and "answer" passed the field check before


@pytest.mark.parametrize("field, value", [("languages", ()), ("sabs", ()), ("languages", ("",)), ("max_srl", 12)])
def test_ingest_filters_that_keep_nothing_are_refused(field: str, value: object):
    from medgraph.umls.filters import IngestFilters

    with pytest.raises(ValueError, match=rf"^ingest filter {field}="):  # `languages: []` was a raw ParserException
        IngestFilters(**{field: value})


# Fault 2 (per table): an empty MRREL.RRF replaced the good table before the blocking not_empty check ran.

def test_empty_file_does_not_replace_the_table(release_copy: Path, warehouse):
    from medgraph.umls.ingest import StagedCheckError, ingest_rrf_file

    rows = ingest_rrf_file(release_copy, "MRREL", warehouse).rows_out
    (release_copy / "MRREL.RRF").write_bytes(b"")
    with pytest.raises(StagedCheckError, match=r"^MRREL\.RRF: not published, the staged rows fail blocking checks "
                                               r"\(not_empty: 0 rows\); umls\.mrrel is unchanged$"):
        ingest_rrf_file(release_copy, "MRREL", warehouse)
    assert warehouse.count("umls.mrrel") == rows
    assert not [p for p in (warehouse.path.parent / "lake" / "umls").iterdir() if ".tmp" in p.name]  # no staging left


# Fault 2 (across tables): a release publishes all-or-nothing (medgraph.umls.publish).

def test_publish_release_swaps_every_view_at_once_and_keeps_only_the_current_files(release_copy: Path, warehouse):
    from medgraph.umls.publish import publish_release, stage_release
    from medgraph.umls.schema import INGESTED

    lake = warehouse.lake.root / "umls"
    first = publish_release(warehouse, stage_release(release_copy, INGESTED, warehouse), release_copy)
    assert [s.table for s in first] == [layout.table for layout in INGESTED]
    # Versioned files of one publish, read by the views: `<table>.<version>.parquet`, one version for all five.
    names = sorted(p.name for p in lake.iterdir())
    assert names == sorted(Path(s.parquet_path).name for s in first)
    assert len({name.split(".", 1)[1] for name in names}) == 1
    assert warehouse.view_files("umls")["mrrel"] == [first[1].parquet_path]
    # What a publish killed before its commit leaves: a moved version no view reads, and a staging file.
    orphan = lake / "mrsab.20260101T000000-0123abcd.parquet"
    orphan.write_bytes(Path(first[4].parquet_path).read_bytes())
    staging = lake / ".mrsab.0123456789ab.tmp.parquet"
    staging.write_bytes(b"")

    second = publish_release(warehouse, stage_release(release_copy, INGESTED, warehouse), release_copy)
    assert sorted(p.name for p in lake.iterdir()) == sorted(Path(s.parquet_path).name for s in second)
    assert not orphan.exists() and not staging.exists()
    assert all(s.rows_out == warehouse.count(f"umls.{s.table}") > 0 for s in second)


def test_a_failure_while_publishing_leaves_every_view_as_it_was(release_copy: Path, warehouse):
    """A staged file lost before the swap (as when the disk fails under it): the tables moved before it are
    taken back, no view changes, nothing new is left in the lake."""
    from medgraph.umls.publish import ReleaseNotPublishedError, publish_release, stage_release
    from medgraph.umls.schema import INGESTED

    publish_release(warehouse, stage_release(release_copy, INGESTED, warehouse))
    lake = warehouse.lake.root / "umls"
    files, views = sorted(lake.iterdir()), warehouse.view_files("umls")
    counts = {layout.table: warehouse.count(f"umls.{layout.table}") for layout in INGESTED}
    (release_copy / "MRREL.RRF").write_text("".join((release_copy / "MRREL.RRF").read_text().splitlines(True)[:10]))
    staged = stage_release(release_copy, INGESTED, warehouse)
    Path(staged[3].staging).unlink()  # MRDEF's: MRCONSO, MRREL and MRSTY are moved into place before it fails
    with pytest.raises(ReleaseNotPublishedError, match=r"^publishing umls\.mrconso, umls\.mrrel, umls\.mrsty, "
                                                       r"umls\.mrdef, umls\.mrsab failed, every umls view is unchanged"):
        publish_release(warehouse, staged)
    assert sorted(lake.iterdir()) == files and warehouse.view_files("umls") == views
    assert {table: warehouse.count(f"umls.{table}") for table in counts} == counts


def test_staging_a_release_stops_at_the_first_bad_file_and_keeps_nothing(release_copy: Path, warehouse):
    from medgraph.umls.publish import ReleaseNotPublishedError, stage_release
    from medgraph.umls.schema import INGESTED

    (release_copy / "MRSTY.RRF").write_bytes(b"")
    with pytest.raises(ReleaseNotPublishedError, match=r"^MRSTY\.RRF: not published, the staged rows fail blocking "
                                                       r"checks \(not_empty: 0 rows\); umls\.mrsty is unchanged\n"
                                                       r"The release was not published: umls\.mrconso, "):
        stage_release(release_copy, INGESTED, warehouse)
    assert not list((warehouse.lake.root / "umls").iterdir())  # MRCONSO's and MRREL's staged files discarded


# Issue 30, fault 2: credentials in URIs leaked through error paths (MLflow's "API request to http://user:pw@...",
# the LLM client's "POST http://alice:pw@... failed"), and an MLflow server that does not answer hung ~248 s.

PLANTED = "planted-Pw0rd-9"


@contextmanager
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers; yields the port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def medgraph_cli(*args: str, env: dict[str, str], timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "medgraph.cli", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc, time.monotonic() - started


def test_an_mlflow_server_that_refuses_fails_at_once_without_its_password(tmp_path: Path):
    """Before: `medgraph models list` retried for ~248 s, then printed a traceback holding user:password."""
    env = {**os.environ, "MEDGRAPH_HOME": str(tmp_path / "home"),
           "MLFLOW_TRACKING_URI": f"http://user:{PLANTED}@127.0.0.1:{closed_port()}"}
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        env.pop(name, None)
    for command in (["models", "list"], ["models", "show", "medgraph-gat"]):
        proc, elapsed = medgraph_cli(*command, env=env)
        assert proc.returncode == 1 and elapsed < 30, (elapsed, proc.stderr[-2000:])
        assert PLANTED not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"medgraph models: error: the MLflow tracking server at "
                                      f"http://user:***@127.0.0.1:{env['MLFLOW_TRACKING_URI'].rsplit(':', 1)[1]} "
                                      "did not answer ([Errno 111] Connection refused; 3 attempts of at most 10 s")


def test_an_mlflow_server_that_never_answers_fails_within_the_limit_it_states(tmp_path: Path):
    with silent_server() as port:
        env = {**os.environ, "MEDGRAPH_HOME": str(tmp_path / "home"),
               "MLFLOW_TRACKING_URI": f"http://user:{PLANTED}@127.0.0.1:{port}",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
        proc, elapsed = medgraph_cli("models", "list", env=env)
    assert proc.returncode == 1 and PLANTED not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "did not answer (timed out; 2 attempts of at most 1 s, about 4 s in all" in proc.stderr
    assert elapsed < 4 + 8  # Python and MLflow start-up included


def test_registry_errors_in_process_hold_no_password_and_unreachable_is_not_no_champion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`champion_version` took an unreachable server for "no champion" (graph-r1 then ran the base LLM)."""
    from mlflow.exceptions import MlflowException

    from medgraph.tracking import RegistryUnavailableError, Tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracking = Tracking(f"http://user:{PLANTED}@127.0.0.1:{closed_port()}", str(tmp_path / "artifacts"))
    with pytest.raises(RegistryUnavailableError) as unreachable:
        tracking.champion_version("medgraph-gat")
    with pytest.raises(RegistryUnavailableError) as listing:
        tracking.client.search_registered_models()
    for error in (unreachable.value, listing.value):
        assert PLANTED not in str(error) and error.__cause__ is None and error.__suppress_context__
        assert "http://user:***@127.0.0.1" in str(error)
    with pytest.raises(MlflowException) as bad:  # any other MLflow error: the same type and code, redacted
        Tracking(f"sqlite:///{tmp_path / 'mlflow.db'}", "").client.get_run(f"http://u:{PLANTED}@x")
    assert PLANTED not in str(bad.value)


def test_llm_server_errors_hold_no_password(tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch):
    """Before: "POST http://alice:secret@.../v1/chat/completions failed after 5 attempts"."""
    import duckdb

    from medgraph.cli import main
    from medgraph.llm import user
    from medgraph.llm.openai_http import LlmRequestError, OpenAIChatModel

    refused = f"http://alice:{PLANTED}@127.0.0.1:{closed_port()}/v1"
    model = OpenAIChatModel("m", refused, max_retries=1, backoff_s=0.01)
    with pytest.raises(LlmRequestError) as error:
        model.generate([[user("x")]])
    assert "POST http://alice:***@127.0.0.1" in str(error.value) and "failed after 2 attempts" in str(error.value)
    assert PLANTED not in str(error.value) + error.value.url + repr(model)

    home = tmp_path / "home"
    home.mkdir()
    duckdb.connect(str(home / "warehouse.duckdb")).close()
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    with llm_server_that_refuses_the_key() as url:
        spec = f"openai:m@{url.replace('http://', f'http://alice:{PLANTED}@')}"
        assert main(["ask", "Which drug?", "--method", "cot", "--llm", spec]) == 1
    captured = capsys.readouterr()
    assert "failed with HTTP 401" in captured.err and "http://alice:***@127.0.0.1" in captured.err
    assert PLANTED not in captured.out + captured.err
    assert main(["ask", "x", "--method", "cot", "--llm", f"openai:m@ftp://alice:{PLANTED}@host/v1"]) == 1
    assert PLANTED not in capsys.readouterr().err


@contextmanager
def llm_server_that_refuses_the_key() -> Iterator[str]:
    """An OpenAI-compatible server on loopback that answers every request with HTTP 401; yields its base URL."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": "invalid API key"}}).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_log_records_of_any_logger_are_redacted(caplog: pytest.LogCaptureFixture):
    import logging

    from medgraph.settings import install_log_redaction

    install_log_redaction()
    with caplog.at_level(logging.INFO):
        logging.getLogger("mlflow.somewhere").warning("API request to %s failed", f"http://u:{PLANTED}@h/api")
        try:
            raise ValueError(f"cannot reach s3 endpoint http://minio:{PLANTED}@minio:9000")
        except ValueError:
            logging.getLogger("botocore.x").exception("upload failed")
    assert PLANTED not in caplog.text and "http://u:***@h/api" in caplog.text and "http://minio:***@minio" in caplog.text


def test_credentials_in_the_s3_endpoint_url_are_dropped_before_boto3_and_duckdb_see_them(
        aws_env, caplog: pytest.LogCaptureFixture):
    import botocore.exceptions

    from medgraph.s3 import s3_client_and_options

    port = closed_port()
    client, options = s3_client_and_options(f"http://minio:{PLANTED}@127.0.0.1:{port}", max_attempts=1)
    assert client.meta.endpoint_url == f"http://127.0.0.1:{port}" == options.endpoint_url
    assert "http://minio:***@127.0.0.1" in caplog.text and "MEDGRAPH_AWS_SECRET_ID" in caplog.text
    with pytest.raises(botocore.exceptions.EndpointConnectionError) as error:
        client.list_objects_v2(Bucket="lake")
    assert PLANTED not in str(error.value) + caplog.text + options.secret_sql("s", "s3://lake")


# Issue 30, fault 6: without MRFILES, a release whose last split part was missing was published smaller with a
# warning that said "split parts checked".

def split_into_parts(release: Path, filename: str, parts: int) -> list[Path]:
    """Replace `filename` by `parts` split parts `.aa`, `.ab`, ... at line boundaries (as `split -n l/N` does)."""
    plain = release / filename
    lines = plain.read_bytes().splitlines(keepends=True)
    size = -(-len(lines) // parts)
    paths = []
    for index in range(parts):
        path = release / f"{filename}.a{chr(ord('a') + index)}"
        path.write_bytes(b"".join(lines[index * size: (index + 1) * size]))
        paths.append(path)
    plain.unlink()
    return paths


def test_without_mrfiles_a_missing_last_split_part_is_said_to_be_undetectable(release_copy: Path, warehouse):
    from medgraph.umls.ingest import ingest_rrf_file

    assert not (release_copy / "MRFILES.RRF").exists()
    *kept, last = split_into_parts(release_copy, "MRREL.RRF", 3)
    last.unlink()
    completeness = ingest_rrf_file(release_copy, "MRREL", warehouse).as_metadata()["release_completeness"]
    assert "split parts checked" not in completeness
    assert completeness.startswith("not verified: no MRFILES.RRF entry for MRREL.RRF was compared")
    assert ("read from 2 split parts (MRREL.RRF.aa to MRREL.RRF.ab) with no gap between them; a missing last part "
            "cannot be detected without MRFILES.RRF") in completeness


def test_split_parts_that_mrfiles_lists_must_all_be_there(sample_copy: Path, warehouse):
    """MRFILES.RRF has "one row for each physical segment of each logical file": when it lists the parts, their
    count, rows and bytes are checked, and a missing last part is refused."""
    from medgraph.umls.completeness import ReleaseIncompleteError
    from medgraph.umls.ingest import ingest_rrf_file

    parts = split_into_parts(sample_copy, "MRREL.RRF", 3)
    mrfiles = sample_copy / "MRFILES.RRF"
    rows = [row for row in mrfiles.read_text().splitlines() if not row.startswith("MRREL.RRF|")]
    template = next(row for row in mrfiles.read_text().splitlines() if row.startswith("MRREL.RRF|")).split("|")
    for part in parts:
        data = part.read_bytes()
        rows.append("|".join([part.name, *template[1:4], str(len(data.splitlines())), str(len(data)), ""]))
    mrfiles.write_text("\n".join(rows) + "\n")
    total = sum(len(p.read_bytes().splitlines()) for p in parts)
    stats = ingest_rrf_file(sample_copy, "MRREL", warehouse)
    assert stats.rows_out == total
    assert stats.as_metadata()["release_completeness"].startswith(
        "verified against MRFILES.RRF: 3 split parts (MRREL.RRF.aa to MRREL.RRF.ac)")
    parts[-1].unlink()
    with pytest.raises(ReleaseIncompleteError, match=r"^MRREL\.RRF: MRFILES\.RRF declares 3 split parts "
                                                     r"\(MRREL\.RRF\.aa to MRREL\.RRF\.ac\), the release has 2: "
                                                     r"MRREL\.RRF\.ac is missing"):
        ingest_rrf_file(sample_copy, "MRREL", warehouse)


def test_a_truncated_lake_file_read_downstream_is_named_with_what_to_do(tmp_path: Path):
    """Issue 58 case 6. Before: `ArrowInvalid: Parquet magic bytes not found in footer`, no path."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from medgraph.embed.index import VectorIndex
    from medgraph.embed.tables import read_embeddings
    from medgraph.storage import DamagedLakeFileError, Lake
    from medgraph.text.mentions import read_chunks

    lake = Lake(tmp_path / "lake")
    embeddings = lake.table_path("embeddings", "node_embeddings")
    embeddings.parent.mkdir(parents=True)
    vectors = pa.array(list(np.eye(4, dtype=np.float32)), type=pa.list_(pa.float32(), 4))
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "content_hash": ["h"] * 4, "encoder_id": ["e"] * 4,
                             "embedding": vectors}), embeddings)
    assert read_embeddings(lake, "node_embeddings")[1].shape == (4, 4)  # intact, it reads
    embeddings.write_bytes(embeddings.read_bytes()[:-100])
    chunks = lake.table_path("text", "corpus_chunks")
    chunks.parent.mkdir(parents=True)
    chunks.write_bytes(b"PAR1 not a whole file")
    reads = [(lambda: read_embeddings(lake, "node_embeddings"), embeddings),
             (lambda: VectorIndex.build(lake, "node_embeddings"), embeddings), (lambda: next(read_chunks(lake)), chunks)]
    for read, damaged in reads:
        with pytest.raises(DamagedLakeFileError) as raised:
            read()
        assert str(raised.value).startswith(f"{damaged}: not a readable Parquet file (")
        assert "materialize the asset that writes it again" in str(raised.value)
