"""Issue 17, fault 10: any subset of the dbt assets materializes on a fresh MEDGRAPH_HOME (a click on
one asset in the UI)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from conftest import copy_warehouse

from medgraph.settings import load_settings
from medgraph.storage import Warehouse
from platform_assets import kg, umls
from platform_assets.embeddings import INPUTS as EMBEDDING_INPUTS
from platform_assets.qa import KG_INPUTS as QA_INPUTS
from resources import build_resources

pytestmark = pytest.mark.slow  # a real dbt process per subset (~10-25 s each)

KG_ASSETS = [*umls.umls_tables, *umls.umls_checks, kg.kg_dbt_models]
KG_NODE_NAMES = dg.AssetKey(["kg", "kg_node_names"])


@pytest.fixture(autouse=True)
def _project_test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """What dbt/dbt_project.yml says, not a DBT_INDIRECT_SELECTION of the shell running the tests."""
    monkeypatch.delenv("DBT_INDIRECT_SELECTION", raising=False)


def fresh_home_resources(release: Path, home: Path) -> dict:
    settings = load_settings({"MEDGRAPH_HOME": str(home), "MEDGRAPH_UMLS_DIR": str(release),
                              "MEDGRAPH_PROFILE": "tiny"})
    return build_resources(settings)


def relations_in(warehouse: Warehouse, schema: str) -> set[str]:
    with warehouse.connect(read_only=True) as con:
        return {row[0] for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = ?", [schema]).fetchall()}


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {f"{check.asset_key.to_user_string()}:{check.check_name}": check.passed
            for check in result.get_asset_check_evaluations()}


def test_kg_node_names_and_its_upstream_on_a_fresh_home(tiny_release: Path, tmp_path: Path):
    """Before the fix: `Catalog Error: Table with name kg_edges does not exist!` from the relationship tests
    of kg_edges, which dbt's eager indirect selection ran because they read the selected kg_nodes."""
    resources = fresh_home_resources(tiny_release, tmp_path / "home")
    result = dg.materialize(KG_ASSETS, resources=resources, selection="*kg/kg_node_names",
                            raise_on_error=False)

    assert result.success
    warehouse = resources["warehouse"].get_warehouse()
    assert relations_in(warehouse, "kg") == {"kg_nodes", "kg_node_names"}
    assert warehouse.count("kg.kg_node_names") > warehouse.count("kg.kg_nodes") > 0
    checks = check_results(result)
    assert checks["kg/kg_node_names:relationships_kg_node_names_cui__cui__ref_kg_nodes_"] is True
    assert checks["kg/kg_nodes:unique_kg_nodes_cui"] is True
    assert all(checks.values()) and not [name for name in checks if name.startswith("kg/kg_edges")]


def test_assets_behind_node_embeddings_and_qa_items_on_a_fresh_home(tiny_release: Path, tmp_path: Path):
    """The dbt assets that `embeddings/node_embeddings` and `qa/qa_items` read, with their upstream (before
    the fix: `Catalog Error: Table with name kg_node_names does not exist!`, from the relationship test
    kg_node_names -> kg_nodes)."""
    resources = fresh_home_resources(tiny_release, tmp_path / "home")
    behind = dg.AssetSelection.assets(*EMBEDDING_INPUTS["node_embeddings"], *QA_INPUTS).upstream()
    result = dg.materialize(KG_ASSETS, resources=resources, selection=behind, raise_on_error=False)

    assert result.success
    warehouse = resources["warehouse"].get_warehouse()
    assert relations_in(warehouse, "kg") == {"kg_nodes", "kg_edges", "kg_node_text", "umls_rel_labels"}
    checks = check_results(result)
    assert checks["kg/kg_edges:relationships_kg_edges_src_cui__cui__ref_kg_nodes_"] is True
    assert all(checks.values()) and not [name for name in checks if name.startswith("kg/kg_node_names")]


def test_one_dbt_asset_alone_runs_its_relationship_test(kg_warehouse: Warehouse, tiny_release: Path,
                                                         tmp_path: Path):
    """`kg/kg_node_names` alone, as one click in the UI materializes it: its relationship test reads kg_nodes,
    upstream and already built, so it runs (dbt's `cautious` selection would skip it, leaving the check
    unanswered). The home is a copy, so this also runs dbt over views re-pointed at the copy's lake."""
    home = tmp_path / "home"
    copy_warehouse(kg_warehouse, home)
    resources = fresh_home_resources(tiny_release, home)
    result = dg.materialize(KG_ASSETS, resources=resources, selection=[KG_NODE_NAMES], raise_on_error=False)

    assert result.success
    assert {event.asset_key for event in result.get_asset_materialization_events()} == {KG_NODE_NAMES}
    assert check_results(result) == {
        "kg/kg_node_names:not_null_kg_node_names_cui": True,
        "kg/kg_node_names:not_null_kg_node_names_normalized_name": True,
        "kg/kg_node_names:relationships_kg_node_names_cui__cui__ref_kg_nodes_": True,
    }


def test_dbt_runs_under_the_warehouse_memory_limit(tiny_release: Path, tmp_path: Path):
    """MEDGRAPH_DUCKDB_MEMORY_LIMIT reaches the dbt process (DuckDB spills past it; before, the dbt profile set
    no limit and kg_edges' peak grew with the data): a limit too small for any model fails the build."""
    settings = load_settings({"MEDGRAPH_HOME": str(tmp_path / "home"), "MEDGRAPH_UMLS_DIR": str(tiny_release),
                              "MEDGRAPH_PROFILE": "tiny", "MEDGRAPH_DUCKDB_MEMORY_LIMIT": "1MB"})
    resources = build_resources(settings)
    assert resources["warehouse"].memory_limit == "1MB"
    dg.materialize([*umls.umls_tables], resources=build_resources(load_settings(
        {"MEDGRAPH_HOME": str(tmp_path / "home"), "MEDGRAPH_UMLS_DIR": str(tiny_release), "MEDGRAPH_PROFILE": "tiny"})))
    # The staging views and kg_nodes only (the umls tables are in place): the dbt step is what fails.
    result = dg.materialize([kg.kg_dbt_models], resources=resources, selection="*kg/kg_nodes", raise_on_error=False)
    assert not result.success
    failed = result.get_step_failure_events()
    assert [event.step_key for event in failed] == ["kg_dbt_models"]
    failures = " ".join(str(event.step_failure_data.error) for event in failed)
    assert "Out of Memory Error" in failures, failures[-2000:]
    with pytest.raises(ValueError, match="MEDGRAPH_DUCKDB_MEMORY_LIMIT must be a size such as 2GB"):
        load_settings({"MEDGRAPH_DUCKDB_MEMORY_LIMIT": "two gigs"})
