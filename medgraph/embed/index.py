"""Nearest-neighbour search over an embedding table, as a versioned FAISS file beside it in the lake.

Vectors are unit length, so inner product is cosine similarity. Tables with at
least `ann_threshold` rows get an HNSW graph (`IndexHNSWFlat`); smaller ones
are searched exactly (`IndexFlatIP`), which is both faster to build and exact
at that size. DuckDB's own `vss` HNSW is not used: it built 10x slower than
FAISS here (docs/ARCHITECTURE.md, "Stack facts").

Files: `lake/embeddings/<target>.<version>.faiss` and `<target>.<version>.ids.parquet`
(the id of each FAISS label, in label order, with the build parameters in its
metadata). The version is a short hash of the table's set of
(id, content_hash, encoder_id), so an unchanged table finds its index again
and any change gets a new file; older versions are removed once the new one is
published.

On an S3 lake the objects are the source of truth: a build reads a private
download of the table and uploads both files (staging key, then copy, like
tables); a load reads them from a local cache keyed by ETag and size
(`S3Lake.fetch`), so a process loads an unchanged index without downloading it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import duckdb
import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from medgraph.embed.tables import SCHEMA
from medgraph.s3 import S3Lake
from medgraph.storage import Lake, reading_lake_file, sql_literal

log = logging.getLogger(__name__)

IndexKind = Literal["exact", "hnsw"]
_READ_ROWS = 65_536  # vectors read and added per step while building
_METADATA_KEY = b"medgraph.vector_index"


class IndexNotFoundError(FileNotFoundError):
    """No index file (or no embedding table) where one was expected."""


@dataclass(frozen=True)
class IndexParams:
    """How an index is built. efSearch is a search-time knob, so it is not part of a build's identity."""

    ann_threshold: int = 20_000
    # Measured on 2 cores (benchmarks/ann_index.py): M=16 builds ~15% faster but loses recall sooner
    # as tables grow; efConstruction 128 doubled build time for +0.005 recall@10 at 100k vectors.
    m: int = 32
    ef_construction: int = 64
    # Recall@10 0.996 on 20k real MiniLM triples (0.3 ms/query) and 0.96 on 1M clustered synthetic
    # vectors (0.8 ms/query), where 128 gave 0.94: a query costs far less than the LLM call it feeds.
    ef_search: int = 256

    def kind_for(self, rows: int) -> IndexKind:
        return "hnsw" if rows >= self.ann_threshold else "exact"

    def build_key(self, rows: int) -> dict[str, object]:
        """What must match for an existing index file to be reused."""
        kind = self.kind_for(rows)
        return {"kind": kind, "m": self.m, "ef_construction": self.ef_construction} if kind == "hnsw" else {"kind": kind}


def set_faiss_threads(threads: int | None = None) -> int:
    """FAISS's OpenMP threads (process-wide): the CPUs this process may use unless told otherwise."""
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    faiss.omp_set_num_threads(threads)
    return threads


def _new_index(kind: IndexKind, dim: int, params: IndexParams) -> faiss.Index:
    if kind == "exact":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, params.m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = params.ef_construction
    index.hnsw.efSearch = params.ef_search
    return index


def table_version(parquet: Path | str, lake: Lake | S3Lake | None = None) -> tuple[str, int]:
    """(short hash of the set of (id, content_hash, encoder_id), rows) of an embedding table file.

    Order-independent (xor of per-row md5) and reads three narrow columns only,
    so checking whether an index is current costs a fraction of a second (on S3
    too: DuckDB's httpfs fetches just those column chunks; `lake` gives it access).
    """
    with (lake.connect() if lake is not None else duckdb.connect()) as con:
        rows, digest = con.execute(
            "SELECT count(*), bit_xor(md5_number(CAST(id AS VARCHAR) || '|' || content_hash || '|' || encoder_id)) "
            f"FROM read_parquet({sql_literal(str(parquet))})"
        ).fetchone()
    return hashlib.sha256(f"{rows}:{digest}".encode()).hexdigest()[:12], rows


def _table_path(lake: Lake | S3Lake, target: str) -> Path | str:
    path = lake.table_path(SCHEMA, target)
    if not lake.exists(path):
        raise IndexNotFoundError(f"no embedding table at {path}: materialize {SCHEMA}.{target} first")
    return path


def _paths(lake: Lake | S3Lake, target: str, version: str) -> tuple[Path | str, Path | str]:
    return lake.file_path(SCHEMA, f"{target}.{version}.faiss"), lake.file_path(SCHEMA, f"{target}.{version}.ids.parquet")


class VectorIndex:
    """A FAISS index plus the id of each of its labels; `search` answers many queries per call."""

    def __init__(self, index: faiss.Index, ids: Sequence[object], kind: IndexKind,
                 version: str = "", params: IndexParams = IndexParams()):
        if index.ntotal != len(ids):
            raise ValueError(f"index holds {index.ntotal} vectors but {len(ids)} ids were given")
        self.index, self.ids, self.kind, self.version, self.params = index, list(ids), kind, version, params

    def __repr__(self) -> str:
        return f"VectorIndex({self.kind}, {len(self)} x {self.dim}, version={self.version!r})"

    def __len__(self) -> int:
        return self.index.ntotal

    @property
    def dim(self) -> int:
        return self.index.d

    @classmethod
    def from_vectors(cls, ids: Sequence[object], vectors: np.ndarray, params: IndexParams = IndexParams(),
                     kind: IndexKind | None = None) -> VectorIndex:
        """An in-memory index over unit vectors (no files): HNSW or exact by size unless `kind` says."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        kind = kind or params.kind_for(len(vectors))
        index = _new_index(kind, vectors.shape[1], params)
        index.add(vectors)
        return cls(index, ids, kind, params=params)

    @classmethod
    def build(cls, lake: Lake | S3Lake, target: str, params: IndexParams = IndexParams(),
              threads: int | None = None) -> VectorIndex:
        """Build the index of `embeddings.<target>`, publish it as a new version and drop older ones."""
        set_faiss_threads(threads)
        started = time.perf_counter()
        # A stable copy: a concurrent publish of the table must not change the rows under the build.
        name = _table_path(lake, target)
        with lake.local_copy(name, stable=True) as snapshot, reading_lake_file(name):
            version, rows = table_version(snapshot)
            source = pq.ParquetFile(snapshot)
            dim = source.schema_arrow.field("embedding").type.list_size
            kind = params.kind_for(rows)
            index = _new_index(kind, dim, params)
            ids: list[pa.Array] = []
            for batch in source.iter_batches(batch_size=_READ_ROWS, columns=["id", "embedding"]):
                vectors = batch.column("embedding").flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
                index.add(np.ascontiguousarray(vectors, dtype=np.float32))
                ids.append(batch.column("id"))
        id_column = pa.concat_arrays(ids) if ids else pa.array([], source.schema_arrow.field("id").type)
        built = cls(index, id_column.to_pylist(), kind, version, params)
        try:
            built._publish(lake, target, id_column)
        except OSError as error:  # e.g. a read-only copy of a home: the index still serves from memory
            log.warning("%s.%s: the index was built but could not be published (%s); it is used from memory and "
                        "built again next time", SCHEMA, target, error)
        log.info("%s.%s: %s index over %d vectors built in %.1fs (version %s)",
                 SCHEMA, target, kind, rows, time.perf_counter() - started, version)
        return built

    def _publish(self, lake: Lake | S3Lake, target: str, id_column: pa.Array) -> None:
        """Write ids then the FAISS file (its presence marks a complete version), then remove old versions."""
        index_path, ids_path = _paths(lake, target, self.version)
        metadata = {"version": self.version, "rows": len(self), "dim": self.dim,
                    **self.params.build_key(len(self)), "ef_search": self.params.ef_search}
        staged_ids = lake.scratch_path(SCHEMA, f"{target}.{self.version}.ids")
        staged_index = lake.scratch_path(SCHEMA, f"{target}.{self.version}", suffix=".faiss")
        try:
            table = pa.table({"id": id_column}).replace_schema_metadata({_METADATA_KEY: json.dumps(metadata)})
            pq.write_table(table, staged_ids, compression="zstd")
            faiss.write_index(self.index, str(staged_index))
            lake.install(staged_ids, ids_path)
            lake.install(staged_index, index_path)
        finally:
            lake.discard(staged_ids)
            lake.discard(staged_index)
        for old in [*lake.glob(SCHEMA, f"{target}.*.faiss"), *lake.glob(SCHEMA, f"{target}.*.ids.parquet")]:
            if old not in (index_path, ids_path):
                lake.remove(old)

    @classmethod
    def load(cls, lake: Lake | S3Lake, target: str, version: str | None = None, *,
             ef_search: int | None = None, threads: int | None = None) -> VectorIndex:
        """The published index of `embeddings.<target>`: the version matching the table unless `version` says."""
        set_faiss_threads(threads)
        if version is None:
            version, _ = table_version(_table_path(lake, target), lake)
        index_path, ids_path = _paths(lake, target, version)
        if not lake.exists(index_path) or not lake.exists(ids_path):
            raise IndexNotFoundError(f"no index version {version} of {SCHEMA}.{target} at {index_path}")
        with reading_lake_file(ids_path):
            ids_table = pq.read_table(lake.fetch(ids_path))
        stored = json.loads(ids_table.schema.metadata[_METADATA_KEY])
        index = faiss.read_index(str(lake.fetch(index_path)))
        params = IndexParams(m=stored.get("m", IndexParams.m), ef_construction=stored.get("ef_construction",
                             IndexParams.ef_construction), ef_search=ef_search or stored["ef_search"])
        if stored["kind"] == "hnsw":
            index.hnsw.efSearch = params.ef_search
        return cls(index, ids_table.column("id").to_pylist(), stored["kind"], version, params)

    @classmethod
    def build_or_load(cls, lake: Lake | S3Lake, target: str, params: IndexParams = IndexParams(),
                      threads: int | None = None) -> VectorIndex:
        """The current index if one was built from this exact table with these parameters, else a new build."""
        version, rows = table_version(_table_path(lake, target), lake)
        index_path, ids_path = _paths(lake, target, version)
        if lake.exists(index_path) and lake.exists(ids_path):
            with reading_lake_file(ids_path):
                stored = json.loads(pq.read_schema(lake.fetch(ids_path)).metadata[_METADATA_KEY])
            if all(stored.get(key) == value for key, value in params.build_key(rows).items()):
                return cls.load(lake, target, version, ef_search=params.ef_search, threads=threads)
        return cls.build(lake, target, params, threads)

    def search(self, query_vectors: np.ndarray, k: int) -> list[list[tuple[object, float]]]:
        """The k best (id, cosine) per query row, best first."""
        queries = np.ascontiguousarray(np.atleast_2d(query_vectors), dtype=np.float32)
        if queries.shape[1] != self.dim:
            raise ValueError(f"queries have dimension {queries.shape[1]}, the index {self.dim}")
        k = min(k, len(self))
        if k <= 0:
            return [[] for _ in range(len(queries))]
        scores, labels = self.index.search(queries, k)
        return [
            [(self.ids[label], float(score)) for label, score in zip(row_labels, row_scores) if label >= 0]
            for row_labels, row_scores in zip(labels.tolist(), scores.tolist())
        ]
