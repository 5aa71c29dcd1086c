"""UMLS release -> `umls.*` tables (Parquet in the lake, views in the warehouse)."""

import hashlib

import dagster as dg

from medgraph.umls import checks
from medgraph.umls.ingest import ingest_rrf_file
from medgraph.umls.release import release_fingerprint
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


def _table_asset(layout: RrfLayout) -> dg.AssetsDefinition:
    @dg.asset(
        key_prefix=[GROUP],
        name=layout.table,
        deps=[umls_release],
        group_name=GROUP,
        kinds={"duckdb", "parquet"},
        pool="warehouse",
        code_version=INGEST_CODE_VERSION,
        automation_condition=on_data_version_change(),
        description=f"{layout.description} ({layout.filename}) rows that pass the release filters, "
        f"as zstd Parquet in the lake and the view `umls.{layout.table}`.",
    )
    def _ingest(
        context: dg.AssetExecutionContext, config: IngestConfig, release: UmlsReleaseResource,
        warehouse: WarehouseResource,
    ) -> dg.MaterializeResult:
        release_dir, filters = release.path(), release.filters()
        stats = ingest_rrf_file(release_dir, layout, warehouse.open(), filters,
                                quarantine=config.quarantine_bad_rows, check_mrfiles=config.check_mrfiles)
        if not stats.completeness.startswith("verified"):
            context.log.warning(f"{layout.filename}: completeness {stats.completeness}")
        if stats.rejected:
            context.log.warning(f"{stats.rejected} malformed rows quarantined in umls.{layout.table}_rejects")
        metadata = stats.as_metadata()
        metadata["parquet_path"] = dg.MetadataValue.path(stats.parquet_path)
        metadata["dagster/row_count"] = stats.rows_out
        metadata["dagster/table_name"] = f"umls.{layout.table}"
        # Lineage: which release these rows came from, even when the source was never observed.
        metadata["release_fingerprint"] = release.fingerprint()[0]
        # The data version is this table's content: its own RRF files, the filters and the ingestion code, so
        # re-ingesting unchanged files (from the UI, without observing the release) changes nothing downstream
        # and a revised file changes only this table's descendants.
        content = f"{INGEST_CODE_VERSION}|{release_fingerprint(release_dir, (layout,))}|{filters}|{config.quarantine_bad_rows}"
        return dg.MaterializeResult(metadata=metadata,
                                    data_version=dg.DataVersion(hashlib.sha256(content.encode()).hexdigest()[:16]))

    return _ingest


def _result(outcome: checks.CheckOutcome, severity: dg.AssetCheckSeverity) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=outcome.passed, severity=severity, description=outcome.description,
                               metadata=outcome.metadata)


def _table_checks(layout: RrfLayout) -> list[dg.AssetChecksDefinition]:
    key = dg.AssetKey([GROUP, layout.table])

    @dg.asset_check(asset=key, name="columns_match_layout", blocking=True,
                    description=f"umls.{layout.table} has exactly the {len(layout.columns)} columns of {layout.filename}.")
    def columns_match_layout(warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _result(checks.check_columns(warehouse.open(), layout), dg.AssetCheckSeverity.ERROR)

    @dg.asset_check(asset=key, name="identifiers_well_formed", blocking=True,
                    description="CUIs, AUIs and TUIs match their UMLS formats.")
    def identifiers_well_formed(warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _result(checks.check_identifier_formats(warehouse.open(), layout), dg.AssetCheckSeverity.ERROR)

    @dg.asset_check(asset=key, name="not_empty", blocking=True, description="The table has rows.")
    def not_empty(warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _result(checks.check_not_empty(warehouse.open(), layout), dg.AssetCheckSeverity.ERROR)

    return [columns_match_layout, identifiers_well_formed, not_empty]


@dg.asset_check(asset=dg.AssetKey([GROUP, MRREL.table]), name="cuis_present_in_mrconso",
                additional_deps=[dg.AssetKey([GROUP, MRCONSO.table])],
                description="Every MRREL CUI has an atom in MRCONSO; language/source filters make some orphans, "
                "so this warns and reports the count.")
def cuis_present_in_mrconso(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    return _result(checks.check_relation_orphans(warehouse.open()), dg.AssetCheckSeverity.WARN)


umls_tables = [_table_asset(layout) for layout in INGESTED]
umls_checks = [check for layout in INGESTED for check in _table_checks(layout)] + [cuis_present_in_mrconso]

defs = dg.Definitions(assets=[umls_release, *umls_tables], asset_checks=umls_checks)
