"""The Dagster UI end to end: the real webserver on loopback, queried through its GraphQL API.

A second check renders the asset graph page in headless Chromium (Debian packages
`chromium`, `chromium-driver`, which .ci/run installs) and saves a screenshot; it skips where
Chromium is absent. A third launches a run the way the UI's "Materialize" button does (the
`launchRun` mutation with an asset selection) with `dagster-daemon run` beside the webserver,
and waits for SUCCESS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
import requests
from servers import free_port, stop, wait_until_ready

import definitions

ROOT = Path(__file__).resolve().parents[1]
QUERY = """
{
  repositoriesOrError {
    ... on RepositoryConnection {
      nodes {
        name
        assetNodes { assetKey { path } assetChecksOrError { ... on AssetChecks { checks { name } } } }
        sensors { name }
        schedules { name }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def ui_env(tmp_path_factory: pytest.TempPathFactory, tiny_release: Path) -> dict[str, str]:
    """The environment of `make ui` on a fresh home, ingesting the tiny sample release."""
    home = tmp_path_factory.mktemp("ui")
    (home / "dagster").mkdir()
    shutil.copy(ROOT / "deploy" / "local" / "dagster.yaml", home / "dagster" / "dagster.yaml")
    return {**os.environ, "MEDGRAPH_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"),
            "MEDGRAPH_UMLS_DIR": str(tiny_release), "MEDGRAPH_PROFILE": "tiny"}


@pytest.fixture(scope="module")
def webserver(ui_env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    executable = Path(sys.executable).parent / "dagster-webserver"
    process = subprocess.Popen([str(executable), "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1",
                                "-p", str(port)], cwd=ROOT, env=ui_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, lambda: requests.get(f"{url}/server_info", timeout=2).ok and _loaded(url),
                         "dagster-webserver", 240, interval_s=2,
                         # Its output is a pipe: read it only once the process has ended, or the read blocks.
                         output=lambda: process.stdout.read() if process.poll() is not None else "")
        yield url
    finally:
        stop(process, timeout_s=30)


@pytest.fixture(scope="module")
def daemon(ui_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`dagster-daemon run` on the same instance (it dequeues runs and frees pool slots); its log file."""
    log = tmp_path_factory.mktemp("daemon") / "daemon.log"
    executable = Path(sys.executable).parent / "dagster-daemon"
    with log.open("w") as output:
        process = subprocess.Popen([str(executable), "run", "-w", str(ROOT / "workspace.yaml")], cwd=ROOT,
                                   env=ui_env, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        stop(process, timeout_s=30)


def _loaded(url: str) -> bool:
    """The code location has loaded (the webserver answers before it has)."""
    reply = requests.post(f"{url}/graphql", json={"query": QUERY}, timeout=30).json()
    nodes = (reply.get("data") or {}).get("repositoriesOrError", {}).get("nodes")
    return bool(nodes)


@pytest.mark.slow
def test_every_asset_check_sensor_and_schedule_is_served(webserver: str):
    reply = requests.post(f"{webserver}/graphql", json={"query": QUERY}, timeout=60).json()
    (repository,) = reply["data"]["repositoriesOrError"]["nodes"]
    served_assets = {"/".join(n["assetKey"]["path"]) for n in repository["assetNodes"]}
    served_checks = {(("/".join(n["assetKey"]["path"])), c["name"]) for n in repository["assetNodes"]
                     for c in (n["assetChecksOrError"].get("checks") or [])}
    graph = definitions.defs.resolve_asset_graph()
    assert served_assets >= {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert served_checks >= {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert {s["name"] for s in repository["sensors"]} >= {"umls_release_sensor", "champion_sensor"}
    assert {s["name"] for s in repository["schedules"]} == {"weekly_retraining"}


@pytest.mark.slow
def test_the_asset_graph_page_renders_in_headless_chromium(webserver: str, tmp_path: Path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (Debian packages chromium, chromium-driver)")
    screenshot = tmp_path / "asset-graph.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                    "--virtual-time-budget=15000", f"--screenshot={screenshot}", f"{webserver}/asset-groups"],
                   check=True, capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one


LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
  }
}
"""
RUN_STATUS = """
query Status($runId: ID!) {
  runOrError(runId: $runId) {
    ... on Run { status }
    ... on RunNotFoundError { message }
  }
}
"""
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


def _graphql(url: str, query: str, variables: dict) -> dict:
    reply = requests.post(f"{url}/graphql", json={"query": query, "variables": variables}, timeout=60).json()
    assert "errors" not in reply, reply["errors"]
    return reply["data"]


@pytest.mark.slow
def test_a_run_launched_like_the_ui_does_succeeds(webserver: str, daemon: Path, ui_env: dict[str, str]):
    """The UI's "Materialize" on `umls/mrsab`: launchRun on the implicit asset job with an asset selection; the
    daemon dequeues it, the run ingests the tiny release's MRSAB.RRF and ends in SUCCESS."""
    params = {"selector": {"repositoryLocationName": "medgraph", "repositoryName": "__repository__",
                           "pipelineName": "__ASSET_JOB", "assetSelection": [{"path": ["umls", "mrsab"]}]},
              "mode": "default", "runConfigData": {}, "executionMetadata": {"tags": []}}
    launched = _graphql(webserver, LAUNCH, {"params": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    deadline = time.monotonic() + 240  # the run process imports the definitions on 2 busy cores
    status = None
    while time.monotonic() < deadline:
        status = _graphql(webserver, RUN_STATUS, {"runId": run_id})["runOrError"].get("status")
        if status in FINISHED:
            break
        time.sleep(2)
    assert status == "SUCCESS", f"run {run_id} is {status}; daemon log:\n{daemon.read_text()[-3000:]}"
    with duckdb.connect(str(Path(ui_env["MEDGRAPH_HOME"]) / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("select count(*) from umls.mrsab").fetchone()[0] > 0
