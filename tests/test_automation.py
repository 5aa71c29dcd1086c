"""Automation follows data versions (issue 17, fault 12): the real definitions, a real instance, several ticks of
`dg.evaluate_automation_conditions`.

The root of the lineage runs for real: `umls_release_sensor` observes the tiny release and the `umls/*` tables are
ingested from it. Everything below is recorded the way Dagster's executor records a materialization without a
data version of its own (the logical version: a hash of the code version and the inputs' data versions; the
first test checks that rule against the real ingestion), because training models and running LLM evaluations
here would take minutes and the conditions only read those events.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import (
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    compute_logical_data_version,
    extract_data_version_from_entry,
)

import definitions
from platform_assets import umls
from resources import UmlsReleaseResource, WarehouseResource
from sensors.release import umls_release_sensor

RELEASE = dg.AssetKey("umls_release")
MRDEF = dg.AssetKey(["umls", "mrdef"])
UMLS_TABLES = list(umls.UMLS_TABLE_KEYS)
EVALUATIONS = [dg.AssetKey(["eval", name]) for name in ("eval_a2rag", "eval_graph_r1", "eval_sema_rag",
                                                         "eval_baselines")]
GPU_MODELS = [dg.AssetKey(["models", name]) for name in ("gat_model", "hiim_projector", "gsrm_params",
                                                          "graph_r1_sft", "graph_r1_policy")]


@pytest.fixture
def setting(medgraph_home: Path, tiny_release: Path, tmp_path: Path):
    """(instance, resources, asset graph, release copy, release sensor cursor, automation cursor): every asset
    materialized once from the tiny release and the first automation tick evaluated."""
    release_dir = Path(shutil.copytree(tiny_release, tmp_path / "META"))
    resources = {"warehouse": WarehouseResource(home=str(medgraph_home)),
                 "release": UmlsReleaseResource(home=str(medgraph_home), umls_dir=str(release_dir), profile="tiny")}
    instance = dg.DagsterInstance.ephemeral()
    graph = definitions.defs.resolve_asset_graph()
    cursor = sensor_tick(instance, resources, None)
    ingest(instance, resources, UMLS_TABLES)
    record_materializations(instance, graph, [(key, partition) for key in graph.toposorted_asset_keys
                                              if graph.get(key).is_materializable and key not in UMLS_TABLES
                                              for partition in partitions(graph, key)])
    first = dg.evaluate_automation_conditions(defs=definitions.defs, instance=instance)
    assert first.total_requested == 0  # everything exists: nothing to do
    return instance, resources, graph, release_dir, cursor, first.cursor


def sensor_tick(instance: dg.DagsterInstance, resources: dict, cursor: str | None) -> str | None:
    """Evaluate the release sensor and store its asset events as the sensor daemon does; the new cursor, or
    None when it requested nothing."""
    result = umls_release_sensor(dg.build_sensor_context(instance=instance, cursor=cursor,
                                                         resources={"release": resources["release"]}))
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    assert len(result.run_requests) == (1 if result.asset_events else 0)
    return result.cursor if result.run_requests else None


def ingest(instance: dg.DagsterInstance, resources: dict, keys: list[dg.AssetKey]) -> None:
    dg.materialize(umls.umls_tables, resources=resources, instance=instance, selection=keys)


def partitions(graph, key: dg.AssetKey) -> list[str | None]:
    partitions_def = graph.get(key).partitions_def
    return partitions_def.get_partition_keys() if partitions_def else [None]


def data_version(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None = None) -> str | None:
    records_filter = dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None)
    fetch = instance.fetch_observations if key == RELEASE else instance.fetch_materializations
    records = fetch(records_filter, limit=1).records
    version = extract_data_version_from_entry(records[0].event_log_entry) if records else None
    return version.value if version else None


def logical_version(instance: dg.DagsterInstance, graph, key: dg.AssetKey, partition: str | None) -> str:
    """The data version Dagster's executor gives a materialization that brings none of its own."""
    inputs = {}
    for parent in graph.get(key).parent_keys:
        same_partition = partition if graph.get(parent).partitions_def is not None else None
        inputs[parent] = dg.DataVersion(data_version(instance, parent, same_partition) or "INITIAL")
    return compute_logical_data_version(graph.get(key).code_version, inputs).value


def record_materializations(instance: dg.DagsterInstance, graph, targets: list[tuple[dg.AssetKey, str | None]]):
    for key, partition in targets:  # in topological order, as a run materializes them
        version = logical_version(instance, graph, key, partition)
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key, partition=partition,
                                                                    tags={DATA_VERSION_TAG: version}))


def descendants(graph, roots: list[dg.AssetKey]) -> set[dg.AssetKey]:
    found: set[dg.AssetKey] = set()
    frontier = list(roots)
    while frontier:
        for child in graph.get(frontier.pop()).child_keys:
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def requested(result) -> list[tuple[dg.AssetKey, str | None]]:
    return [(key, partition) for key in definitions.defs.resolve_asset_graph().toposorted_asset_keys
            for partition in sorted(result.get_requested_partitions(key), key=str)]


def test_ingestion_versions_each_table_by_its_own_files(setting):
    """A table's data version is its own RRF content (plus filters and code), not Dagster's logical version,
    so a re-ingestion without a fresh observation of the release still tells real changes from touches."""
    instance, _resources, _graph, *_ = setting
    records = {table: instance.fetch_materializations(table, limit=1).records[0] for table in UMLS_TABLES}
    assert all(r.asset_materialization.tags.get(DATA_VERSION_IS_USER_PROVIDED_TAG) for r in records.values())
    assert len({data_version(instance, table) for table in UMLS_TABLES}) == len(UMLS_TABLES)
    assert data_version(instance, RELEASE)  # the sensor's observation carries the fingerprint


def test_rematerializing_from_an_unchanged_release_requests_nothing(setting):
    """Fault 12: with eager() this requested 17 assets, the GPU retraining among them."""
    instance, resources, _graph, release_dir, sensor_cursor, cursor = setting
    before = data_version(instance, MRDEF)
    (release_dir / "MRDEF.RRF").touch()  # touched, not changed
    assert sensor_tick(instance, resources, sensor_cursor) is None
    ingest(instance, resources, [MRDEF])
    assert data_version(instance, MRDEF) == before
    for _tick in range(3):
        result = dg.evaluate_automation_conditions(defs=definitions.defs, instance=instance, cursor=cursor)
        assert requested(result) == []
        cursor = result.cursor


def test_a_revised_definition_reevaluates_every_method_but_retrains_nothing(setting):
    instance, resources, graph, release_dir, sensor_cursor, cursor = setting
    before = {table: data_version(instance, table) for table in UMLS_TABLES}
    mrdef = release_dir / "MRDEF.RRF"
    lines = mrdef.read_text(encoding="utf-8").splitlines(keepends=True)
    fields = lines[0].split("|")
    # A revised definition of the same length, so MRFILES.RRF's byte count still holds.
    fields[5] = fields[5][:-1] + ("." if fields[5][-1] != "." else ";")
    mrdef.write_text("".join(["|".join(fields), *lines[1:]]), encoding="utf-8")

    # What the release sensor's run does: observe the release, ingest every table.
    assert sensor_tick(instance, resources, sensor_cursor) not in (None, sensor_cursor)
    ingest(instance, resources, UMLS_TABLES)
    changed_tables = [table for table in UMLS_TABLES if data_version(instance, table) != before[table]]
    assert MRDEF in changed_tables

    seen: list[tuple[dg.AssetKey, str | None]] = []
    for _tick in range(6):
        result = dg.evaluate_automation_conditions(defs=definitions.defs, instance=instance, cursor=cursor)
        cursor = result.cursor
        batch = requested(result)
        record_materializations(instance, graph, batch)  # the requested runs succeed before the next tick
        seen += batch
    keys = {key for key, _ in seen}

    assert len(seen) == len(set(seen)), "an asset was requested twice for one change"
    assert not keys & set(GPU_MODELS), "GPU retraining follows the weekly_retraining schedule"
    assert not keys & set(UMLS_TABLES), "the sensor's run already ingested the release"
    # Every automated asset below the changed tables: the KG, the corpus, the embeddings, the questions, the evaluations.
    below_change = descendants(graph, changed_tables)
    assert keys == {key for key in below_change if graph.get(key).automation_condition is not None}
    named = [["kg", "kg_nodes"], ["kg", "kg_edges"], ["kg", "kg_node_text"], ["text", "corpus_chunks"],
             ["embeddings", "node_embeddings"], ["embeddings", "chunk_embeddings"], ["qa", "qa_items"],
             ["eval", "evaluation_report"]]
    assert keys >= {*(dg.AssetKey(path) for path in named), *EVALUATIONS}
    # The report once, after the evaluations it summarizes.
    assert seen.index((dg.AssetKey(["eval", "evaluation_report"]), None)) == len(seen) - 1
    for evaluation in [*EVALUATIONS, dg.AssetKey(["eval", "qa_benchmark"])]:
        assert {p for key, p in seen if key == evaluation} == set(partitions(graph, evaluation))


def test_gpu_models_are_retrained_by_the_schedule_alone():
    graph = definitions.defs.resolve_asset_graph()
    assert all(graph.get(key).automation_condition is None for key in GPU_MODELS)
    schedule = definitions.defs.get_schedule_def("weekly_retraining")
    job = definitions.defs.resolve_job_def(schedule.job_name)
    assert set(GPU_MODELS) <= set(job.asset_layer.executable_asset_keys)


@pytest.mark.parametrize("target", ["demo", "reproduce"])
def test_make_target_runs_everything_in_one_launch_whose_config_is_valid(target):
    """`make demo`'s and `make reproduce`'s single run (data, models, the first dataset's evaluations, GSRM recall,
    the report) as the Makefile writes it: its selection holds every asset but the optional text extraction, one
    partitions definition, and the target's merged run config validates against that job (no config for an asset
    that is not there, no field an asset does not have)."""
    import re

    from dagster_shared.yaml_utils import load_yaml_from_glob_list

    from platform_assets.partitions import DATASETS

    root = Path(definitions.__file__).parent
    makefile = (root / "Makefile").read_text()
    selection = re.search(r"dg launch -m definitions --assets '([^']+)' --partition \$\(firstword", makefile)
    assert selection, "the first `dg launch` line of the materialize recipe changed shape"
    selection = selection.group(1)
    configs = re.search(rf"^{target}: .*\n\t\$\(call materialize,([^,]+),([^)]+)\)", makefile, re.MULTILINE)
    assert configs, f"make {target} no longer calls the materialize recipe with a run and an eval config"
    job = dg.define_asset_job("launch", selection=selection, partitions_def=DATASETS)
    defs = dg.Definitions.merge(definitions.defs, dg.Definitions(jobs=[job]))
    graph = defs.resolve_asset_graph()
    selected = dg.AssetSelection.from_string(selection).resolve(graph)
    assert {*EVALUATIONS, *GPU_MODELS, dg.AssetKey(["eval", "evaluation_report"]),
            dg.AssetKey(["eval", "gsrm_recall"])} <= selected
    assert not any(graph.get(key).group_name == "text_extraction" for key in selected)
    run_config = load_yaml_from_glob_list([str(root / path) for path in configs.groups()])  # as `dg launch -c A -c B`
    assert dg.validate_run_config(defs.resolve_job_def("launch"), run_config)
