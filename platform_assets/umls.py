"""UMLS release -> `umls.*` tables (Parquet in the lake, views in the warehouse)."""

from collections.abc import Iterator

import dagster as dg

from medgraph.umls import checks
from medgraph.umls.publish import publish_release, stage_release, table_data_version, table_warnings
from medgraph.umls.schema import INGESTED, MRCONSO, MRREL, RrfLayout
from platform_assets.automation import on_data_version_change
from resources import UmlsReleaseResource, WarehouseResource

GROUP = "umls"
# Bump when the ingestion logic changes what lands in the tables.
INGEST_CODE_VERSION = "1"


@dg.observable_source_asset(
    key="umls_release",
    group_name=GROUP,
    description="The UMLS release directory (MEDGRAPH_UMLS_DIR, else the generated sample). "
    "Its data version is a content fingerprint, so an unchanged release triggers nothing.",
)
def umls_release(context: dg.AssetExecutionContext, release: UmlsReleaseResource) -> dg.ObserveResult:
    fingerprint, path = release.fingerprint()
    context.log.info(f"UMLS release at {path}: fingerprint {fingerprint}")
    return dg.ObserveResult(
        data_version=dg.DataVersion(fingerprint),
        metadata={"path": dg.MetadataValue.path(path), "fingerprint": fingerprint, "profile": release.profile},
    )


class IngestConfig(dg.Config):
    quarantine_bad_rows: bool = False
    """Put malformed rows into `umls.<table>_rejects` and count them instead of failing."""
    check_mrfiles: bool = True
    """Fail when a file's rows or bytes differ from MRFILES.RRF (off only for an excerpt of a release)."""


UMLS_TABLE_KEYS = [dg.AssetKey([GROUP, layout.table]) for layout in INGESTED]
_LAYOUT_BY_KEY = dict(zip(UMLS_TABLE_KEYS, INGESTED))


def _blocking_check_specs(layout: RrfLayout) -> list[dg.AssetCheckSpec]:
    key = dg.AssetKey([GROUP, layout.table])
    return [
        dg.AssetCheckSpec("columns_match_layout", asset=key, blocking=True,
                          description=f"umls.{layout.table} has exactly the {len(layout.columns)} columns of "
                          f"{layout.filename}."),
        dg.AssetCheckSpec("identifiers_well_formed", asset=key, blocking=True,
                          description="CUIs, AUIs and TUIs match their UMLS formats."),
        dg.AssetCheckSpec("not_empty", asset=key, blocking=True, description="The table has rows."),
    ]


# Evaluated on the published table when a check runs without its table (re-run from the UI).
_PUBLISHED_CHECKS = {"columns_match_layout": checks.check_columns,
                     "identifiers_well_formed": checks.check_identifier_formats,
                     "not_empty": checks.check_not_empty}


@dg.multi_asset(
    name="umls_tables",
    specs=[
        dg.AssetSpec(
            key, deps=[umls_release], group_name=GROUP, kinds={"duckdb", "parquet"}, code_version=INGEST_CODE_VERSION,
            automation_condition=on_data_version_change(),
            description=f"{layout.description} ({layout.filename}) rows that pass the release filters, "
            f"as zstd Parquet in the lake and the view `umls.{layout.table}`.",
        )
        for key, layout in _LAYOUT_BY_KEY.items()
    ],
    check_specs=[spec for layout in INGESTED for spec in _blocking_check_specs(layout)],
    # Subsettable, so one table can be re-ingested (from the UI, or when automation re-ingests one
    # table): the selected tables are published together, and publish_release refuses a subset when an
    # unselected table was published from other RRF content than the release now holds (two releases).
    can_subset=True,
    pool="warehouse",
)
def umls_release_tables(
    context: dg.AssetExecutionContext, config: IngestConfig, release: UmlsReleaseResource,
    warehouse: WarehouseResource,
) -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
    """Stage every selected table (parse, filters, completeness, blocking checks on the staged rows), then
    publish them in one transaction: a failure anywhere leaves the whole previous release in place."""
    layouts = [layout for key, layout in _LAYOUT_BY_KEY.items() if key in context.selected_asset_keys]
    selected_checks = context.selected_asset_check_keys
    store = warehouse.get_warehouse()
    if layouts:
        release_dir, filters = release.path(), release.filters()
        staged = stage_release(release_dir, layouts, store, filters, quarantine=config.quarantine_bad_rows,
                               check_mrfiles=config.check_mrfiles)
        published = publish_release(store, staged, release_dir=release_dir)
        fingerprint = release.fingerprint()[0]  # lineage, even when the source was never observed
        for table, stats in zip(staged, published):
            key = dg.AssetKey([GROUP, table.layout.table])
            for warning in table_warnings(table, stats):
                context.log.warning(warning)
            metadata = {**stats.as_metadata(), "parquet_path": dg.MetadataValue.path(stats.parquet_path),
                        "dagster/row_count": stats.rows_out, "dagster/table_name": f"umls.{table.layout.table}",
                        "release_fingerprint": fingerprint}
            # The blocking checks ran on the staged rows (the gate); they are reported per table here.
            results = [_result(outcome, dg.AssetCheckSeverity.ERROR, key, name)
                       for name, outcome in table.checks.items() if dg.AssetCheckKey(key, name) in selected_checks]
            version = table_data_version(INGEST_CODE_VERSION, table, filters, config.quarantine_bad_rows)
            yield dg.MaterializeResult(asset_key=key, metadata=metadata, check_results=results,
                                       data_version=dg.DataVersion(version))
    for check_key in sorted(selected_checks, key=lambda k: k.to_user_string()):
        if check_key.asset_key in context.selected_asset_keys or check_key.asset_key not in _LAYOUT_BY_KEY:
            continue
        outcome = _PUBLISHED_CHECKS[check_key.name](store, _LAYOUT_BY_KEY[check_key.asset_key])
        yield _result(outcome, dg.AssetCheckSeverity.ERROR, check_key.asset_key, check_key.name)


def _result(outcome: checks.CheckOutcome, severity: dg.AssetCheckSeverity, asset_key: dg.AssetKey | None = None,
            check_name: str | None = None) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=outcome.passed, severity=severity, description=outcome.description,
                               metadata=outcome.metadata, asset_key=asset_key, check_name=check_name)


@dg.asset_check(asset=dg.AssetKey([GROUP, MRREL.table]), name="cuis_present_in_mrconso",
                additional_deps=[dg.AssetKey([GROUP, MRCONSO.table])],
                description="Every MRREL CUI has an atom in MRCONSO; language/source filters make some orphans, "
                "so this warns and reports the count.")
def cuis_present_in_mrconso(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    return _result(checks.check_relation_orphans(warehouse.get_warehouse()), dg.AssetCheckSeverity.WARN)


# Lists, as the rest of the code base composes them (`[*umls.umls_tables, *umls.umls_checks]`): the one
# multi-asset holds the five tables and their blocking checks.
umls_tables = [umls_release_tables]
umls_checks = [cuis_present_in_mrconso]

defs = dg.Definitions(assets=[umls_release, *umls_tables], asset_checks=umls_checks)
