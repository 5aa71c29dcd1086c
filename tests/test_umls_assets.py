"""The umls/* assets in Dagster: in-process materialization, checks, observation, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from conftest import REPO_ROOT, replace_line

from platform_assets import umls
from platform_assets.evaluation import _ingested_release_fingerprint
from resources import UmlsReleaseResource, WarehouseResource

SNAPSHOT = Path(__file__).parent / "snapshots" / "asset_specs.json"
UMLS_KEYS = [dg.AssetKey(["umls", t]) for t in ("mrconso", "mrrel", "mrsty", "mrdef", "mrsab")]


def resources_for(home: Path, release: Path) -> dict:
    return {
        "warehouse": WarehouseResource(home=str(home)),
        "release": UmlsReleaseResource(home=str(home), umls_dir=str(release), profile="tiny"),
    }


def materialization(result: dg.ExecuteInProcessResult, table: str) -> dg.AssetMaterialization:
    """The run's materialization of `umls/<table>` (all five come from the one `umls_tables` op)."""
    found = [m for m in result.asset_materializations_for_node("umls_tables") if m.asset_key.path[-1] == table]
    assert len(found) == 1, [m.asset_key for m in result.asset_materializations_for_node("umls_tables")]
    return found[0]


def spec_snapshot(defs: dg.Definitions) -> dict:
    graph = defs.resolve_asset_graph()
    snapshot = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        snapshot[key.to_user_string()] = {
            "group": node.group_name,
            "kinds": sorted(node.kinds),
            "pools": sorted(node.pools or []),
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "automation": node.automation_condition.get_label() if node.automation_condition else None,
            "checks": sorted(c.name for c in node.check_keys),
        }
    return snapshot


def test_asset_specs_match_snapshot():
    """Keys, groups, kinds, pools, lineage and checks change only on purpose (UPDATE_SNAPSHOTS=1)."""
    import definitions

    current = spec_snapshot(definitions.defs)
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not SNAPSHOT.exists():
        SNAPSHOT.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    assert current == json.loads(SNAPSHOT.read_text())


def test_materializing_umls_assets_fills_tables_and_passes_checks(medgraph_home: Path, release_copy: Path):
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([*umls.umls_tables, *umls.umls_checks],
                            resources=resources_for(medgraph_home, release_copy), instance=instance)
    mrrel = materialization(result, "mrrel").metadata
    assert mrrel["dagster/row_count"].value == mrrel["rows_out"].value > 0
    # Lineage without an observation of the source: the report finds the ingested release's fingerprint.
    fingerprint = resources_for(medgraph_home, release_copy)["release"].fingerprint()[0]
    assert mrrel["release_fingerprint"].value == fingerprint
    assert _ingested_release_fingerprint(instance) == fingerprint
    assert _ingested_release_fingerprint(dg.DagsterInstance.ephemeral()) == "unknown"
    assert mrrel["rows_kept_after_suppress"].value == mrrel["rows_out"].value
    checks = {(c.asset_key.path[-1], c.check_name): c for c in result.get_asset_check_evaluations()}
    assert len(checks) == 16
    orphans = checks.pop(("mrrel", "cuis_present_in_mrconso"))
    assert all(c.passed for c in checks.values()), [k for k, c in checks.items() if not c.passed]
    # The synthetic release has Spanish-only concepts; the English filter leaves their relations orphaned.
    warehouse = resources_for(medgraph_home, release_copy)["warehouse"].get_warehouse()
    with warehouse.connect(read_only=True) as con:
        expected_orphans = con.execute(
            "SELECT count(DISTINCT cui) FROM (SELECT CUI1 AS cui FROM umls.mrrel UNION ALL SELECT CUI2 FROM umls.mrrel) "
            "WHERE cui NOT IN (SELECT CUI FROM umls.mrconso)").fetchone()[0]
    assert expected_orphans > 0 and not orphans.passed
    assert orphans.severity == dg.AssetCheckSeverity.WARN
    assert orphans.metadata["orphan_cuis"].value == expected_orphans


def test_malformed_cui_is_refused_before_publishing(medgraph_home: Path, release_copy: Path):
    """The blocking identifier check runs on the staged rows: X123 never becomes part of umls.mrsty."""
    resources = resources_for(medgraph_home, release_copy)
    selection = [dg.AssetKey(["umls", "mrsty"])]
    dg.materialize([*umls.umls_tables, *umls.umls_checks], resources=resources, selection=selection)
    warehouse = resources["warehouse"].get_warehouse()
    before = warehouse.count("umls.mrsty")
    path = release_copy / "MRSTY.RRF"
    fields = path.read_text().splitlines()[0].split("|")
    fields[0] = "X123"
    replace_line(path, 1, "|".join(fields))
    result = dg.materialize([*umls.umls_tables, *umls.umls_checks], resources=resources,
                            selection=selection, raise_on_error=False)
    assert not result.success
    assert ("MRSTY.RRF: not published, the staged rows fail blocking checks (identifiers_well_formed: "
            "1 malformed identifiers, example_bad_CUI 'X123'); umls.mrsty is unchanged") in str(result.all_events)
    assert warehouse.count("umls.mrsty") == before
    with warehouse.connect(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM umls.mrsty WHERE CUI = 'X123'").fetchone()[0] == 0


def test_failed_materialization_leaves_previous_table(medgraph_home: Path, release_copy: Path):
    resources = resources_for(medgraph_home, release_copy)
    dg.materialize(umls.umls_tables, resources=resources, selection=[UMLS_KEYS[3]])
    warehouse = resources["warehouse"].get_warehouse()
    before = warehouse.count("umls.mrdef")
    replace_line(release_copy / "MRDEF.RRF", 4, "C0000004|A0000004|")
    result = dg.materialize(umls.umls_tables, resources=resources, selection=[UMLS_KEYS[3]], raise_on_error=False)
    assert not result.success
    assert "MRDEF.RRF:4: expected 8 fields, found 2" in str(result.all_events)
    assert warehouse.count("umls.mrdef") == before

    quarantined = dg.materialize(
        umls.umls_tables, resources=resources, selection=[UMLS_KEYS[3]],
        run_config={"ops": {"umls_tables": {"config": {"quarantine_bad_rows": True}}}},
    )
    assert materialization(quarantined, "mrdef").metadata["rows_rejected"].value == 1
    assert warehouse.count("umls.mrdef_rejects") == 1


def test_release_observation_data_version_is_the_content_fingerprint(medgraph_home: Path, release_copy: Path,
                                                                    tmp_path: Path):
    def observe(release: Path) -> str:
        release_resource = resources_for(medgraph_home, release)["release"]
        with dg.build_asset_context() as context:
            return umls.umls_release.observe_fn(context, release=release_resource).data_version.value

    first = observe(release_copy)
    assert observe(release_copy) == first
    replace_line(release_copy / "MRSAB.RRF", 1, (release_copy / "MRSAB.RRF").read_text().splitlines()[0].replace("2025", "2026"))
    assert observe(release_copy) != first


@pytest.mark.slow
def test_cli_materializes_umls_assets_from_any_release(tmp_path: Path, synthetic_release: Path):
    """Acceptance: `dg launch -m definitions --assets group:umls` (what make demo runs) with MEDGRAPH_UMLS_DIR set."""
    home = tmp_path / "home"
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "MEDGRAPH_UMLS_DIR": str(synthetic_release),
           "DAGSTER_HOME": str(tmp_path / "dagster"), "MEDGRAPH_PROFILE": "tiny"}
    (tmp_path / "dagster").mkdir()
    dg = Path(sys.executable).parent / "dg"
    proc = subprocess.run([str(dg), "launch", "-m", "definitions", "--assets", "group:umls"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import duckdb

    with duckdb.connect(str(home / "warehouse.duckdb"), read_only=True) as con:
        counts = dict(con.execute(
            "SELECT table_name, 1 FROM information_schema.tables WHERE table_schema = 'umls'").fetchall())
        assert set(counts) == {"mrconso", "mrrel", "mrsty", "mrdef", "mrsab"}
        english = con.execute("SELECT count(*) FROM umls.mrconso WHERE LAT <> 'ENG'").fetchone()[0]
    assert english == 0


# Issue 17, fault 2 across tables: a bad MRREL used to leave the other four tables of the new release published.

TABLES = [key.path[-1] for key in UMLS_KEYS]
# A free-text column of each file other than MRREL: revising it changes the table, not its validity.
TEXT_COLUMN = {"MRCONSO": 14, "MRSTY": 3, "MRDEF": 5, "MRSAB": 4}


def revise(release: Path, name: str, marker: str = " (revised)") -> None:
    path = release / f"{name}.RRF"
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("|")
        fields[TEXT_COLUMN[name]] += marker
        lines.append("|".join(fields))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def contents(warehouse) -> dict[str, list[tuple]]:
    with warehouse.connect(read_only=True) as con:
        return {table: con.execute(f"SELECT * FROM umls.{table} ORDER BY ALL").fetchall() for table in TABLES}


def lake_files(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "lake" / "umls").iterdir())


def test_a_bad_mrrel_leaves_the_whole_previous_release(medgraph_home: Path, release_copy: Path):
    """Before: the other four tables of the new release were published one by one before MRREL failed, so the
    warehouse held two releases at once. Now all five are staged and checked, then swapped in one step."""
    resources = resources_for(medgraph_home, release_copy)
    dg.materialize([*umls.umls_tables, *umls.umls_checks], resources=resources)
    warehouse = resources["warehouse"].get_warehouse()
    before, files_before = contents(warehouse), lake_files(medgraph_home)
    assert all(before.values())

    mrrel = (release_copy / "MRREL.RRF").read_bytes()
    for name in TEXT_COLUMN:
        revise(release_copy, name)
    (release_copy / "MRREL.RRF").write_bytes(b"")
    result = dg.materialize([*umls.umls_tables, *umls.umls_checks], resources=resources, raise_on_error=False)
    assert not result.success
    events = str(result.all_events)
    assert "MRREL.RRF: not published, the staged rows fail blocking checks (not_empty: 0 rows)" in events
    assert ("The release was not published: umls.mrconso, umls.mrrel, umls.mrsty, umls.mrdef, umls.mrsab keep the "
            "previous release") in events
    assert not result.asset_materializations_for_node("umls_tables")
    assert contents(warehouse) == before  # row counts and contents of the previous release, all five
    assert lake_files(medgraph_home) == files_before  # no staged or versioned file left behind

    # A good release replaces all five, and only the new files remain.
    lines = mrrel.decode().splitlines(keepends=True)
    (release_copy / "MRREL.RRF").write_text("".join(lines[:-100]), encoding="utf-8")
    result = dg.materialize([*umls.umls_tables, *umls.umls_checks], resources=resources)
    after = contents(warehouse)
    assert all(after[table] != before[table] for table in TABLES)
    assert any("(revised)" in str(row) for row in after["mrconso"])
    assert len(after["mrrel"]) < len(before["mrrel"])
    paths = {table: materialization(result, table).metadata["parquet_path"].value for table in TABLES}
    assert lake_files(medgraph_home) == sorted(Path(path).name for path in paths.values())
    assert all(Path(path).name.startswith(f"{table}.") for table, path in paths.items())


def test_one_table_alone_is_refused_when_the_release_changed_under_the_others(medgraph_home: Path,
                                                                            release_copy: Path):
    """A subset run publishes its tables together; it must not publish a table of a new release beside
    tables of the old one (the mixed state fault 2 is about)."""
    resources = resources_for(medgraph_home, release_copy)
    dg.materialize(umls.umls_tables, resources=resources)
    warehouse = resources["warehouse"].get_warehouse()
    before = contents(warehouse)
    revise(release_copy, "MRDEF")
    revise(release_copy, "MRSTY")
    result = dg.materialize(umls.umls_tables, resources=resources, selection=[UMLS_KEYS[3]], raise_on_error=False)
    assert not result.success
    assert (f"publishing only umls.mrdef would mix two releases: MRSTY.RRF changed in {release_copy} since "
            f"umls.mrsty was published, and this run does not republish it. Nothing was published") \
        in str(result.all_events)
    assert contents(warehouse) == before
    # Both changed tables together: the release is consistent again.
    dg.materialize(umls.umls_tables, resources=resources, selection=[UMLS_KEYS[2], UMLS_KEYS[3]])
    after = contents(warehouse)
    assert [t for t in TABLES if after[t] != before[t]] == ["mrsty", "mrdef"]
