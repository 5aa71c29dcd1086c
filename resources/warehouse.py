"""The warehouse (DuckDB + Parquet lake) and the UMLS release location."""


from pathlib import Path

import dagster as dg

from medgraph.settings import Settings, load_settings
from medgraph.storage import Lake, Warehouse
from medgraph.umls.filters import IngestFilters
from medgraph.umls.release import resolve_release_dir


class WarehouseResource(dg.ConfigurableResource):
    """`$MEDGRAPH_HOME/warehouse.duckdb` and the Parquet lake under `$MEDGRAPH_HOME/lake`."""

    home: str
    memory_limit: str = "2GB"
    threads: int | None = None

    def open(self) -> Warehouse:
        home = Path(self.home)
        return Warehouse(home / "warehouse.duckdb", Lake(home / "lake"), self.memory_limit, self.threads)


class UmlsReleaseResource(dg.ConfigurableResource):
    """Where the release is (MEDGRAPH_UMLS_DIR, else the generated sample) and which rows to keep."""

    home: str
    umls_dir: str | None = None
    profile: str = "demo"
    languages: list[str] | None = ["ENG"]
    excluded_suppress: list[str] = ["O", "E", "Y"]
    sabs: list[str] | None = None
    max_srl: int | None = None

    def path(self) -> Path:
        return resolve_release_dir(self.umls_dir, Path(self.home) / "sample_release" / self.profile, self.profile)

    def filters(self) -> IngestFilters:
        return IngestFilters(
            languages=tuple(self.languages) if self.languages is not None else None,
            excluded_suppress=tuple(self.excluded_suppress),
            sabs=tuple(self.sabs) if self.sabs is not None else None,
            max_srl=self.max_srl,
        )


def build_resources(settings: Settings | None = None) -> dict[str, dg.ConfigurableResource]:
    """The resources of the code location, configured from the environment (DESIGN.md "Settings")."""
    settings = settings or load_settings()
    home = str(settings.home)
    from dagster_dbt import DbtCliResource

    from platform_assets.dbt_project import DBT_EXECUTABLE, dbt_project
    from resources.encoder import EncoderResource
    from resources.llm import LlmResource
    from resources.mlflow import default_mlflow_resource

    return {
        "warehouse": WarehouseResource(home=home),
        "dbt": DbtCliResource(project_dir=dbt_project, dbt_executable=DBT_EXECUTABLE),
        "release": UmlsReleaseResource(home=home, umls_dir=settings.umls_dir, profile=settings.profile),
        "encoder": EncoderResource(spec=settings.encoder),
        "mlflow_tracking": default_mlflow_resource(settings.home, settings.mlflow_tracking_uri),
        "llm": LlmResource(spec=settings.llm, home=home),
    }
