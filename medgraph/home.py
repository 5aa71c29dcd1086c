"""The layout of a MedGraph home (MEDGRAPH_HOME): every named path under it, spelled out here only.

docs/ARCHITECTURE.md section 2 says what each holds. Code asks a `HomeLayout` for a path by name
(`HomeLayout(home).reports`) instead of joining strings, so the layout can change in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HomeLayout:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    # storage and tracking
    @property
    def warehouse(self) -> Path:
        return self.root / "warehouse.duckdb"

    @property
    def lake(self) -> Path:
        return self.root / "lake"

    @property
    def lake_local(self) -> Path:
        """An S3 lake's local side: the httpfs extension, scratch and cache."""
        return self.root / "lake_local"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    # inputs
    def sample_release(self, profile: str) -> Path:
        return self.root / "sample_release" / profile

    @property
    def umls_cache(self) -> Path:
        """Release files mirrored from S3."""
        return self.root / "umls_cache"

    # what the assets write beside the warehouse
    @property
    def qa(self) -> Path:
        """The generated questions as MIRAGE files, one per split."""
        return self.root / "qa"

    def qa_split(self, split: str) -> Path:
        return self.qa / f"qa_items.{split}.json"

    def benchmark(self, dataset: str) -> Path:
        """The frozen evaluation questions of one dataset (partition)."""
        return self.root / "eval" / "benchmark" / f"{dataset}.json"

    @property
    def models(self) -> Path:
        """Converted LLMs and `gsrm_params.json`."""
        return self.root / "models"

    @property
    def gsrm_params(self) -> Path:
        return self.models / "gsrm_params.json"

    def checkpoints(self, asset: str) -> Path:
        """Training checkpoints of one model asset (`gat_model`, `graph_r1_policy`, ...)."""
        return self.root / "checkpoints" / asset

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def text_vectors(self) -> Path:
        """Triple texts GSRM encoded on the fly, per encoder (safe to delete)."""
        return self.root / "cache" / "text_vectors"
