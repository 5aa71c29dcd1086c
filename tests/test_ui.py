"""The Dagster UI end to end: the real webserver on loopback, queried through its GraphQL API.

A second check renders the asset graph page in headless Chromium (Debian packages
`chromium`, `chromium-driver`) and saves a screenshot; it skips where Chromium is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
def webserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}
    (home / "dagster").mkdir()
    shutil.copy(ROOT / "deploy" / "local" / "dagster.yaml", home / "dagster" / "dagster.yaml")
    port = free_port()
    executable = Path(sys.executable).parent / "dagster-webserver"
    process = subprocess.Popen([str(executable), "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1",
                                "-p", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
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
