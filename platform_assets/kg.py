"""dbt-duckdb KG marts: staging views and `kg.*` tables, dbt tests as asset checks."""

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import dagster as dg
from dagster_dbt import DagsterDbtTranslator, DagsterDbtTranslatorSettings, DbtCliResource, dbt_assets

from medgraph.s3 import S3Lake, install_httpfs
from medgraph.storage import duckdb_default_memory_limit
from platform_assets.automation import on_data_version_change
from resources.dbt import dbt_project
from resources import WarehouseResource


class KgTranslator(DagsterDbtTranslator):
    """dbt sources `umls.<table>` keep their default keys `umls/<table>`, which are the
    ingestion assets, so lineage runs unbroken from the RRF files to the marts."""

    def get_group_name(self, dbt_resource_props: Mapping[str, Any]) -> str:
        return "kg" if "marts" in dbt_resource_props.get("fqn", []) else "kg_staging"

    def get_automation_condition(self, dbt_resource_props: Mapping[str, Any]) -> dg.AutomationCondition | None:
        return on_data_version_change()


@dbt_assets(
    manifest=dbt_project.manifest_path,
    project=dbt_project,
    dagster_dbt_translator=KgTranslator(settings=DagsterDbtTranslatorSettings(enable_asset_checks=True)),
    pool="warehouse",
)
def kg_dbt_models(context: dg.AssetExecutionContext, dbt: DbtCliResource, warehouse: WarehouseResource):
    """Staging views over `umls.*`, then `kg.kg_nodes`, `kg.kg_edges`, `kg.kg_node_text`, `kg.kg_relations`."""
    store = warehouse.get_warehouse()
    store.repoint_lake_views()  # dbt opens the file itself: the umls views must read this home's lake
    memory_limit = warehouse.dbt_memory_limit or duckdb_default_memory_limit()
    args = ["build", "--vars", json.dumps({"warehouse_path": str(store.path), "memory_limit": memory_limit})]
    lake_env: dict[str, str] = {}
    if isinstance(store.lake, S3Lake):
        install_httpfs(store.lake.extension_dir)
        args += ["--target", "s3"]
        lake_env = dbt_s3_environment(store.lake)
    # dagster-dbt copies os.environ into the dbt process when cli() is called: the lake's variables
    # (credentials among them) exist only for that call, never as arguments (arguments are logged).
    # A subset of the models runs only the tests it can (`indirect_selection` in dbt/dbt_project.yml).
    with _environment(lake_env):
        invocation = dbt.cli(args, context=context)
    yield from invocation.stream()


def dbt_s3_environment(lake: S3Lake) -> dict[str, str]:
    """The variables the `s3` target of dbt/profiles.yml reads: where the lake is and how to reach it."""
    options = lake.options
    endpoint = urlparse(options.endpoint_url) if options.endpoint_url else None
    env = {
        "MEDGRAPH_DUCKDB_EXTENSION_DIR": str(lake.extension_dir),
        "MEDGRAPH_S3_SCOPE": f"s3://{lake.bucket}",
        "MEDGRAPH_S3_REGION": options.region,
        "DBT_ENV_SECRET_MEDGRAPH_S3_KEY_ID": options.key_id or "",
        "DBT_ENV_SECRET_MEDGRAPH_S3_SECRET": options.secret or "",
        "DBT_ENV_SECRET_MEDGRAPH_S3_SESSION_TOKEN": options.session_token or "",
    }
    if endpoint:
        env.update(MEDGRAPH_S3_ENDPOINT=endpoint.netloc, MEDGRAPH_S3_URL_STYLE="path",
                   MEDGRAPH_S3_USE_SSL=str(endpoint.scheme == "https").lower())
    return env


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


defs = dg.Definitions(assets=[kg_dbt_models])
