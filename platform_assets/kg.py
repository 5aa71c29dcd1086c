"""dbt-duckdb KG marts: staging views and `kg.*` tables, dbt tests as asset checks."""

import json
from collections.abc import Mapping
from typing import Any

import dagster as dg
from dagster_dbt import DagsterDbtTranslator, DagsterDbtTranslatorSettings, DbtCliResource, dbt_assets

from platform_assets.dbt_project import dbt_project
from resources import WarehouseResource


class KgTranslator(DagsterDbtTranslator):
    """dbt sources `umls.<table>` keep their default keys `umls/<table>`, which are the
    ingestion assets, so lineage runs unbroken from the RRF files to the marts."""

    def get_group_name(self, dbt_resource_props: Mapping[str, Any]) -> str:
        return "kg" if "marts" in dbt_resource_props.get("fqn", []) else "kg_staging"

    def get_automation_condition(self, dbt_resource_props: Mapping[str, Any]) -> dg.AutomationCondition | None:
        return dg.AutomationCondition.eager()


@dbt_assets(
    manifest=dbt_project.manifest_path,
    project=dbt_project,
    dagster_dbt_translator=KgTranslator(settings=DagsterDbtTranslatorSettings(enable_asset_checks=True)),
    pool="warehouse",
)
def kg_dbt_models(context: dg.AssetExecutionContext, dbt: DbtCliResource, warehouse: WarehouseResource):
    """Staging views over `umls.*`, then `kg.kg_nodes`, `kg.kg_edges`, `kg.kg_node_text`, `kg.kg_relations`."""
    dbt_vars = json.dumps({"warehouse_path": str(warehouse.open().path)})
    yield from dbt.cli(["build", "--vars", dbt_vars], context=context).stream()


defs = dg.Definitions(assets=[kg_dbt_models])
