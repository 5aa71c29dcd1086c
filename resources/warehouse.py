"""The warehouse (DuckDB + Parquet lake) and the UMLS release location."""


import os
from pathlib import Path
from typing import Any

import dagster as dg

from medgraph.home import HomeLayout
from medgraph.s3 import download_release, is_s3_uri, list_objects, listing_fingerprint, s3_client_and_options
from medgraph.settings import Settings, load_settings, redact_uri
from medgraph.storage import Warehouse, warehouse_at
from medgraph.tracking import Tracking
from medgraph.umls.filters import IngestFilters
from medgraph.umls.release import release_fingerprint, resolve_release_dir
from medgraph.umls.schema import INGESTED


class S3Access(dg.Config):
    """How to reach S3 (the lake, the release): an endpoint for S3-compatible servers, and where the keys
    come from. Plain config, not a nested resource, so the resources stay usable in build_*_context."""

    endpoint_url: str | None = None
    """MEDGRAPH_S3_ENDPOINT_URL; None: AWS (or boto3's AWS_ENDPOINT_URL_S3)."""
    credentials_secret_id: str | None = None
    """MEDGRAPH_AWS_SECRET_ID: a Secrets Manager secret with the keys; None: the AWS chain (env, profile, role)."""

    def client(self) -> Any:
        """A boto3 S3 client; region and keys from the AWS environment (or the secret)."""
        return s3_client_and_options(self.endpoint_url, self.credentials_secret_id)[0]


class WarehouseResource(dg.ConfigurableResource):
    """`$MEDGRAPH_HOME/warehouse.duckdb` and the Parquet lake: `$MEDGRAPH_HOME/lake`, or `lake`
    (MEDGRAPH_LAKE: another directory or `s3://bucket/prefix`, reached as `s3` says)."""

    home: str
    lake: str | None = None
    s3: S3Access = S3Access()
    memory_limit: str = "2GB"
    threads: int | None = None
    # The dbt process's DuckDB memory_limit; None: DuckDB's default, 80% of RAM (kg_edges does not fit in 2 GB
    # at 10M MRREL rows: it does not spill).
    dbt_memory_limit: str | None = None

    @property
    def layout(self) -> HomeLayout:
        return HomeLayout(self.home)

    def get_warehouse(self) -> Warehouse:
        return warehouse_at(Path(self.home), self.lake, s3_endpoint_url=self.s3.endpoint_url,
                            s3_secret_id=self.s3.credentials_secret_id, memory_limit=self.memory_limit,
                            threads=self.threads)


class UmlsReleaseResource(dg.ConfigurableResource):
    """Where the release is (MEDGRAPH_UMLS_DIR, else the generated sample) and which rows to keep."""

    home: str
    umls_dir: str | None = None
    profile: str = "demo"
    s3: S3Access = S3Access()
    languages: list[str] | None = ["ENG"]
    excluded_suppress: list[str] = ["O", "E", "Y"]
    sabs: list[str] | None = None
    max_srl: int | None = None

    @property
    def layout(self) -> HomeLayout:
        return HomeLayout(self.home)

    def path(self) -> Path:
        """A local META directory; a release on S3 is mirrored first into `$MEDGRAPH_HOME/umls_cache`
        (only files whose ETag or size changed are downloaded)."""
        if is_s3_uri(self.umls_dir):
            names = tuple(layout.filename for layout in INGESTED)
            return download_release(self.s3.client(), self.umls_dir, self.layout.umls_cache, names)
        return resolve_release_dir(self.umls_dir, self.layout.sample_release(self.profile), self.profile)

    def fingerprint(self) -> tuple[str, str]:
        """(content fingerprint, location). On S3 from names, sizes and ETags: a sensor tick downloads nothing."""
        if is_s3_uri(self.umls_dir):
            names = tuple(layout.filename for layout in INGESTED)
            objects = [o for o in list_objects(self.s3.client(), self.umls_dir)
                       if o.key.rsplit("/", 1)[-1].startswith(names)]
            if not objects:
                raise FileNotFoundError(f"no UMLS release files under {self.umls_dir}")
            return listing_fingerprint(objects), self.umls_dir
        path = self.path()
        return release_fingerprint(path), str(path)

    def filters(self) -> IngestFilters:
        return IngestFilters(
            languages=tuple(self.languages) if self.languages is not None else None,
            excluded_suppress=tuple(self.excluded_suppress),
            sabs=tuple(self.sabs) if self.sabs is not None else None,
            max_srl=self.max_srl,
        )


def by_name_if_secret(value: str | None, variable: str) -> Any:
    """`value` as resource config, or `dg.EnvVar(variable)` when it holds a credential (`user:password@` in a
    URL, `?password=`): Dagster keeps resource config in every run's snapshot and shows it on the UI's
    resource page, but of an EnvVar only the variable's name; the value is read when the run starts."""
    if value is None or redact_uri(value) == value:
        return value
    if os.environ.get(variable) != value:
        raise ValueError(f"{variable} ({redact_uri(value)}) holds a credential: give it to the code location in "
                         f"its environment, so that only the variable's name is stored with each run")
    return dg.EnvVar(variable)


def build_resources(settings: Settings | None = None) -> dict[str, dg.ConfigurableResource]:
    """The resources of the code location, configured from the environment (docs/ARCHITECTURE.md "Settings").
    URL settings that hold a credential are passed by variable name (`by_name_if_secret`)."""
    settings = settings or load_settings()
    home = str(settings.home)
    s3 = S3Access(endpoint_url=by_name_if_secret(settings.s3_endpoint_url, "MEDGRAPH_S3_ENDPOINT_URL"),
                  credentials_secret_id=settings.aws_secret_id)
    lake = by_name_if_secret(settings.lake or None, "MEDGRAPH_LAKE")
    umls_dir = by_name_if_secret(settings.umls_dir, "MEDGRAPH_UMLS_DIR")
    from dagster_dbt import DbtCliResource

    from resources.dbt import DBT_EXECUTABLE, dbt_project
    from resources.encoder import EncoderResource
    from resources.llm import LlmResource
    from resources.mlflow import MlflowResource
    from resources.training import TrainingResource

    tracking = Tracking.from_settings(settings)
    return {
        "warehouse": WarehouseResource(home=home, lake=lake, s3=s3,
                                       memory_limit=settings.duckdb_memory_limit or "2GB",
                                       dbt_memory_limit=settings.duckdb_memory_limit),
        "dbt": DbtCliResource(project_dir=dbt_project, dbt_executable=DBT_EXECUTABLE),
        "release": UmlsReleaseResource(home=home, umls_dir=umls_dir, profile=settings.profile, s3=s3),
        "encoder": EncoderResource(spec=settings.encoder),
        "mlflow_tracking": MlflowResource(
            tracking_uri=by_name_if_secret(tracking.tracking_uri, "MLFLOW_TRACKING_URI"),
            artifact_root=by_name_if_secret(tracking.artifact_root, "MEDGRAPH_MLFLOW_ARTIFACTS")),
        "llm": LlmResource(spec=by_name_if_secret(settings.llm, "MEDGRAPH_LLM"), home=home),
        "training": TrainingResource(profile=settings.profile),
    }
