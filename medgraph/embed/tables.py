"""Incremental embedding tables: `lake/embeddings/<target>.parquet` and the view `embeddings.<target>`.

A row is keyed by (id, content_hash, encoder_id), content_hash being the
sha256 of the text. A run snapshots the source query to a staging Parquet
file (so the warehouse is locked for seconds, not for the hours a large
embedding can take), finds in DuckDB which rows the current table already
holds, embeds only the new or changed texts in streamed batches, and writes
reused plus new rows to a staging file that is renamed over the table (on an
S3 lake: uploaded and copied over the table's key). A failure at any point
leaves the previous table as it was and removes the staging files. Snapshot,
new vectors and the new table are written on local disk in both cases: pyarrow
writes them, and only the finished table needs to cross the network.

Past one machine (a full UMLS: ~7M node texts, ~54M triples), a table is embedded
in shards: `embed_shard` embeds the rows whose id falls in one `Shard` (md5 of
the id, modulo the shard count: stable across processes, machines and DuckDB
versions) into its own lake file `<target>.shard-<k>-of-<n>.parquet`, published
the same way, and `merge_shards` checks that the shard files together hold
exactly the current source rows, each once, from the configured encoder, and
publishes their union as the table. Shards run anywhere at once; a failed or
refused merge leaves the previous table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from medgraph.embed.encoder import Encoder
from medgraph.s3 import S3Lake
from medgraph.storage import Lake, Warehouse, quote_ident, reading_lake_file, sql_literal

log = logging.getLogger(__name__)

SCHEMA = "embeddings"
_WRITE_ROWS = 65_536  # rows per row group of the published file


@dataclass(frozen=True)
class EmbeddingSource:
    """What to embed: a query over the warehouse with an id and a text column."""

    sql: str
    id_column: str
    text_column: str


# The three embedding tables of the platform, defined in one place.
EMBEDDING_SOURCES: dict[str, EmbeddingSource] = {
    # One readable text per KG node (name, synonyms, types, definition, relations): dense node search.
    "node_embeddings": EmbeddingSource("SELECT cui, text FROM kg.kg_node_text", "cui", "text"),
    # What a node is without its relations: the GAT's input features. Node texts list a node's
    # relations, so features made from them would spell out held-out edges to the model.
    "node_description_embeddings": EmbeddingSource("SELECT cui, description FROM kg.kg_node_text", "cui",
                                                   "description"),
    # A triple as a short sentence, "<head> <relation> <tail>": what GSRM scores against the question.
    "edge_embeddings": EmbeddingSource(
        """
        SELECT e.edge_id,
               concat_ws(' ', h.preferred_name, replace(e.relation, '_', ' '), t.preferred_name) AS text
        FROM kg.kg_edges AS e
        JOIN kg.kg_nodes AS h ON h.cui = e.src_cui
        JOIN kg.kg_nodes AS t ON t.cui = e.dst_cui
        """,
        "edge_id",
        "text",
    ),
    # Corpus chunks for dense text retrieval.
    "chunk_embeddings": EmbeddingSource("SELECT chunk_id, text FROM text.corpus_chunks", "chunk_id", "text"),
}


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`: the rows whose id's md5, read as a number, is `index` modulo `count`."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in 0..{self.count - 1}, got {self.index}")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """`"K/N"` -> Shard(K, N)."""
        index, slash, count = text.partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"a shard is written 'K/N' (shard K of N, 0 <= K < N), got {text!r}")
        return cls(int(index), int(count))

    @property
    def name(self) -> str:
        return f"{self.index}-of-{self.count}"

    def predicate(self, id_sql: str) -> str:
        """SQL true for the rows of this shard, `id_sql` being the id expression."""
        return f"{shard_number_sql(id_sql, self.count)} = {self.index}"


def shard_number_sql(id_sql: str, count: int) -> str:
    """SQL for the shard of an id: the first 15 hex digits of md5(id as text), modulo `count` (in Python:
    `int(hashlib.md5(str(id).encode()).hexdigest()[:15], 16) % count`)."""
    return f"(CAST(('0x' || left(md5(CAST({id_sql} AS VARCHAR)), 15)) AS BIGINT) % {int(count)})"


def embedding_source_sql(target: str, relations: Sequence[str] | None = None, sample: Shard | None = None) -> str:
    """The source query of one of EMBEDDING_SOURCES; for edges, optionally only some relations
    (a full release has ~50M edges, and a laptop demo embeds a subset); with `sample`, only the rows of that
    shard: a bounded, deterministic slice of any table (a trial run at UMLS size, benchmarks/scale_run.py)."""
    source = EMBEDDING_SOURCES[target]
    sql = source.sql
    if target == "edge_embeddings" and relations:
        sql += f" WHERE e.relation IN ({', '.join(sql_literal(r) for r in relations)})"
    if sample is not None:
        sql = f"SELECT * FROM ({sql}) AS unsampled WHERE {sample.predicate(quote_ident(source.id_column))}"
    return sql


def shard_path(lake: Lake | S3Lake, target: str, shard: Shard) -> Path | str:
    """The lake file of one shard of `embeddings.<target>`."""
    return lake.file_path(SCHEMA, f"{target}.shard-{shard.name}.parquet")


class ShardsNotCurrentError(RuntimeError):
    """The shard files do not add up to the current source (missing, stale or from another encoder)."""

    def __init__(self, message: str, shards: Sequence[int]):
        super().__init__(message)
        self.shards = sorted(shards)


@dataclass
class EmbedStats:
    """What one run of `embed_table` did; becomes Dagster metadata."""

    embedded: int
    reused: int
    removed: int
    rows: int
    dim: int
    seconds: float
    encode_seconds: float = 0.0
    table: str = ""
    encoder_id: str = ""
    parquet_path: str = ""

    def as_metadata(self) -> dict[str, object]:
        return {
            "table": self.table,
            "rows": self.rows,
            "embedded": self.embedded,
            "reused": self.reused,
            "removed": self.removed,
            "dim": self.dim,
            "encoder_id": self.encoder_id,
            "seconds": round(self.seconds, 3),
            "encode_seconds": round(self.encode_seconds, 3),
            "texts_per_second": round(self.embedded / self.encode_seconds) if self.encode_seconds > 0 else 0,
            "parquet_path": self.parquet_path,
        }


@dataclass
class MergeStats:
    """What one run of `merge_shards` did; becomes Dagster metadata."""

    rows: int
    shards: int
    dim: int
    encoder_id: str
    seconds: float
    table: str
    parquet_path: str

    def as_metadata(self) -> dict[str, object]:
        return {"table": self.table, "rows": self.rows, "shards": self.shards, "dim": self.dim,
                "encoder_id": self.encoder_id, "seconds": round(self.seconds, 3), "parquet_path": self.parquet_path}


def _snapshot_source(warehouse: Warehouse, source_sql: str, id_column: str, text_column: str, path: Path,
                     with_text: bool = True) -> None:
    """Copy (id, text, content_hash) of the source query to a Parquet file, then let go of the warehouse."""
    text = f"coalesce(CAST({quote_ident(text_column)} AS VARCHAR), '')"
    columns = f"{quote_ident(id_column)} AS id, " + (f"{text} AS text, " if with_text else "")
    with warehouse.connect(read_only=True) as con:
        con.execute(
            f"COPY (SELECT {columns}sha256({text}) AS content_hash "
            f"FROM ({source_sql}) AS source) TO {sql_literal(str(path))} (FORMAT parquet, COMPRESSION zstd)"
        )


def _embedding_type(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


def _embed_new_rows(con: duckdb.DuckDBPyConnection, todo_sql: str, total: int, encoder: Encoder,
                    out: Path, batch_size: int, progress: bool) -> float:
    """Stream the rows to embed, shortest texts together, into `out`; returns seconds spent encoding."""
    encode_seconds = 0.0
    reader = con.execute(todo_sql).to_arrow_reader(batch_size)
    writer = None
    try:
        with tqdm(total=total, disable=not progress, unit="text", desc="embed") as bar:
            for batch in reader:
                if batch.num_rows == 0:
                    continue
                started = time.perf_counter()
                vectors = np.ascontiguousarray(encoder.encode(batch.column("text").to_pylist()), dtype=np.float32)
                encode_seconds += time.perf_counter() - started
                if vectors.shape != (batch.num_rows, encoder.dim):
                    raise ValueError(f"encoder returned shape {vectors.shape} for {batch.num_rows} texts")
                embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), encoder.dim)
                table = pa.table({"id": batch.column("id"), "content_hash": batch.column("content_hash"),
                                  "embedding": embedding})
                if writer is None:
                    writer = pq.ParquetWriter(out, table.schema, compression="zstd", compression_level=1)
                writer.write_table(table)
                bar.update(batch.num_rows)
    finally:
        if writer is not None:
            writer.close()
    return encode_seconds


def _write_table(con: duckdb.DuckDBPyConnection, sql: str, dim: int, out: Path) -> int:
    """Stream a query into zstd Parquet with `embedding` as a fixed-size list of float32."""
    reader = con.execute(sql).to_arrow_reader(_WRITE_ROWS)
    fields = [pa.field(f.name, _embedding_type(dim)) if f.name == "embedding" else f for f in reader.schema]
    schema = pa.schema(fields)
    written = 0
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        for batch in reader:
            writer.write_batch(batch.cast(schema))
            written += batch.num_rows
    return written


def embed_table(
    warehouse: Warehouse,
    source_sql: str,
    target: str,
    encoder: Encoder,
    *,
    id_column: str,
    text_column: str,
    batch_size: int = 4096,
    progress: bool = False,
    reuse_from: Sequence[str] = (),
) -> EmbedStats:
    """Bring `embeddings.<target>` up to date with the rows of `source_sql`, embedding only what changed.

    `reuse_from` names other embedding tables whose vectors are taken for identical texts
    (same content hash and encoder): KG chunks are mostly node texts already embedded.

    `batch_size` is the number of rows fetched, embedded and written per step
    (memory stays bounded by it); the model's own batch size is the encoder's.
    """
    current = warehouse.lake.table_path(SCHEMA, target)
    stats = _embed_into(warehouse, source_sql, target, current, encoder, id_column=id_column,
                        text_column=text_column, batch_size=batch_size, progress=progress, reuse_from=reuse_from)
    warehouse.register_parquet_view(SCHEMA, target, stats.parquet_path)
    stats.table = f"{SCHEMA}.{target}"
    return stats


def embed_shard(
    warehouse: Warehouse,
    source_sql: str,
    target: str,
    encoder: Encoder,
    shard: Shard,
    *,
    id_column: str,
    text_column: str,
    batch_size: int = 4096,
    progress: bool = False,
) -> EmbedStats:
    """Bring the lake file of one shard of `embeddings.<target>` up to date with its rows of `source_sql`
    (`shard_path`; no view: `merge_shards` publishes the table).

    Incremental like `embed_table`: vectors are reused from the shard's previous file, or, on the first
    sharded run, from the rows of the current table that fall in this shard, so going from one shard to
    several re-embeds nothing that is unchanged.
    """
    lake = warehouse.lake
    out = shard_path(lake, target, shard)
    previous = out if lake.exists(out) else lake.table_path(SCHEMA, target)
    sharded_sql = (f"SELECT * FROM ({source_sql}) AS unsharded "
                   f"WHERE {shard.predicate(quote_ident(id_column))}")
    return _embed_into(warehouse, sharded_sql, f"{target}.shard-{shard.name}", out, encoder, id_column=id_column,
                       text_column=text_column, batch_size=batch_size, progress=progress, previous=previous,
                       previous_filter=shard.predicate("id"))


def _embed_into(warehouse: Warehouse, source_sql: str, name: str, out: Path | str, encoder: Encoder, *,
                id_column: str, text_column: str, batch_size: int, progress: bool, reuse_from: Sequence[str] = (),
                previous: Path | str | None = None, previous_filter: str = "") -> EmbedStats:
    """Write the embedding rows of `source_sql` to the lake file `out` (atomically), reusing the rows of
    `previous` (default: `out` itself; `previous_filter`: only its rows matching this SQL condition) whose id,
    text and encoder are unchanged. `name` names scratch files and log lines."""
    started = time.perf_counter()
    lake: Lake | S3Lake = warehouse.lake
    previous = out if previous is None else previous
    snapshot = lake.scratch_path(SCHEMA, f"{name}.source")
    new_vectors = lake.scratch_path(SCHEMA, f"{name}.new")
    staging = lake.scratch_path(SCHEMA, name)
    encoder_id = sql_literal(encoder.encoder_id)
    try:
        _snapshot_source(warehouse, source_sql, id_column, text_column, snapshot)
        with warehouse.scratch() as con:
            con.execute(f"CREATE VIEW src AS SELECT * FROM read_parquet({sql_literal(str(snapshot))})")
            rows, distinct, null_ids = con.execute(
                "SELECT count(*), count(DISTINCT id), count(*) FILTER (WHERE id IS NULL) FROM src").fetchone()
            if null_ids or distinct != rows:
                raise ValueError(f"{name}: {id_column} must be unique and not null in the source query "
                                 f"({rows - distinct} duplicate, {null_ids} null)")
            donors = [lake.table_path(SCHEMA, other) for other in reuse_from
                      if other != name and lake.exists(lake.table_path(SCHEMA, other))]
            _create_kept_view(con, previous if lake.exists(previous) else None, previous_filter, donors, encoder_id)
            reused = con.execute("SELECT count(*) FROM kept").fetchone()[0]
            removed = con.execute("SELECT count(*) FROM old ANTI JOIN src USING (id)").fetchone()[0]
            # Ties in length broken by id: which texts share a (padded, bf16) batch changes their vectors in
            # the last bits, so an arbitrary order made two runs of the same release embed slightly differently.
            todo = ("SELECT s.id, s.text, s.content_hash FROM src AS s ANTI JOIN kept AS r ON s.id = r.id "
                    "ORDER BY length(s.text), s.id")
            parts = ["SELECT id, content_hash, encoder_id, embedding FROM kept"]
            encode_seconds = 0.0
            if rows > reused:
                encode_seconds = _embed_new_rows(con, todo, rows - reused, encoder, new_vectors, batch_size, progress)
                parts.append(f"SELECT id, content_hash, {encoder_id}, embedding "
                             f"FROM read_parquet({sql_literal(str(new_vectors))})")
            columns = f"id, content_hash, encoder_id, CAST(embedding AS FLOAT[{encoder.dim}]) AS embedding"
            written = _write_table(con, f"SELECT {columns} FROM ({' UNION ALL '.join(parts)})", encoder.dim, staging)
        if written != rows:
            raise RuntimeError(f"{name}: wrote {written} rows, the source has {rows}")
        final = lake.install(staging, out)
    finally:
        for path in (snapshot, new_vectors, staging):
            lake.discard(path)
    stats = EmbedStats(
        embedded=rows - reused, reused=reused, removed=removed, rows=rows, dim=encoder.dim,
        seconds=time.perf_counter() - started, encode_seconds=encode_seconds,
        table=name, encoder_id=encoder.encoder_id, parquet_path=str(final),
    )
    log.info("%s: %d rows, %d embedded, %d reused, %d removed in %.1fs",
             name, rows, stats.embedded, reused, removed, stats.seconds)
    return stats


def _create_kept_view(con: duckdb.DuckDBPyConnection, previous: Path | str | None, previous_filter: str,
                      donors: Sequence[Path | str], encoder_id: str) -> None:
    """The views `old` (the previous table's rows, or none) and `kept`: the rows of `src` (the source) whose vector
    can be reused as it is. From the previous table, a row still exactly right (same id, text and encoder); from a
    donor table (`reuse_from`), a vector of the same text by the same encoder. `encoder_id` is an SQL literal."""
    if previous is not None:
        where = f" WHERE {previous_filter}" if previous_filter else ""
        con.execute(f"CREATE VIEW old AS SELECT * FROM read_parquet({sql_literal(str(previous))}){where}")
    else:
        con.execute("CREATE VIEW old AS SELECT id, content_hash, '' AS encoder_id, "
                    "[]::FLOAT[] AS embedding FROM src LIMIT 0")
    con.execute(f"CREATE VIEW reusable AS SELECT o.* FROM old AS o SEMI JOIN src AS s "
                f"ON o.id = s.id AND o.content_hash = s.content_hash WHERE o.encoder_id = {encoder_id}")
    if not donors:
        con.execute("CREATE VIEW kept AS SELECT * FROM reusable")
        return
    files = ", ".join(sql_literal(str(p)) for p in donors)
    con.execute(f"CREATE VIEW donors AS SELECT content_hash, any_value(embedding) AS embedding "
                f"FROM read_parquet([{files}]) WHERE encoder_id = {encoder_id} GROUP BY content_hash")
    con.execute(f"CREATE VIEW borrowed AS SELECT s.id, s.content_hash, {encoder_id} AS encoder_id, "
                "d.embedding FROM src AS s JOIN donors AS d USING (content_hash) "
                "WHERE s.id NOT IN (SELECT id FROM reusable)")
    con.execute("CREATE VIEW kept AS SELECT * FROM reusable UNION ALL SELECT * FROM borrowed")


def merge_shards(
    warehouse: Warehouse,
    source_sql: str,
    target: str,
    encoder_id: str,
    shards: int,
    *,
    id_column: str,
    text_column: str,
) -> MergeStats:
    """Publish the union of the `shards` shard files of `embeddings.<target>` as the table and its view.

    Refused (`ShardsNotCurrentError`, the previous table left as it was) unless the shard files hold
    exactly the rows of `source_sql` as it is now (same ids and texts, each once) embedded by `encoder_id`:
    a shard embedded before the source changed, or one left over from another shard count, never
    reaches the table. The error names the shards to embed again. After a merge, shard files of other
    shard counts are removed."""
    started = time.perf_counter()
    lake: Lake | S3Lake = warehouse.lake
    parts = [Shard(k, shards) for k in range(shards)]
    paths = {shard.index: shard_path(lake, target, shard) for shard in parts}
    missing = [k for k, path in paths.items() if not lake.exists(path)]
    if missing:
        raise ShardsNotCurrentError(f"{target}: shards {_names(missing, shards)} have no file yet", missing)
    snapshot = lake.scratch_path(SCHEMA, f"{target}.merge.source")
    staging = lake.scratch_path(SCHEMA, target)
    try:
        _snapshot_source(warehouse, source_sql, id_column, text_column, snapshot, with_text=False)
        with ExitStack() as stack:
            local = [stack.enter_context(lake.local_copy(paths[k], stable=True)) for k in sorted(paths)]
            con = stack.enter_context(warehouse.scratch())
            files = ", ".join(sql_literal(str(p)) for p in local)
            con.execute(f"CREATE VIEW src AS SELECT * FROM read_parquet({sql_literal(str(snapshot))})")
            con.execute(f"CREATE VIEW shards AS SELECT * FROM read_parquet([{files}])")
            rows = con.execute("SELECT count(*) FROM src").fetchone()[0]
            _refuse_shards_not_current(con, target, encoder_id, shards)
            with reading_lake_file(local[0]):
                dim = pq.read_schema(local[0]).field("embedding").type.list_size
            columns = f"id, content_hash, encoder_id, CAST(embedding AS FLOAT[{dim}]) AS embedding"
            written = _write_table(con, f"SELECT {columns} FROM shards", dim, staging)
        if written != rows:
            raise RuntimeError(f"{target}: merged {written} rows, the source has {rows}")
        final = lake.install(staging, lake.table_path(SCHEMA, target))
    finally:
        for path in (snapshot, staging):
            lake.discard(path)
    warehouse.register_parquet_view(SCHEMA, target, final)
    current = {str(p) for p in paths.values()}
    for stale in lake.glob(SCHEMA, f"{target}.shard-*-of-*.parquet"):
        if str(stale) not in current:
            lake.remove(stale)
    stats = MergeStats(rows=rows, shards=shards, dim=dim, encoder_id=encoder_id,
                       seconds=time.perf_counter() - started, table=f"{SCHEMA}.{target}", parquet_path=str(final))
    log.info("%s: merged %d shards, %d rows in %.1fs", stats.table, shards, rows, stats.seconds)
    return stats


def _refuse_shards_not_current(con: duckdb.DuckDBPyConnection, target: str, encoder_id: str, shards: int) -> None:
    """ShardsNotCurrentError naming each shard whose rows (view `shards`) are not the source's (view `src`)
    embedded by `encoder_id`. Per shard, on ids and hashes (not vectors): source rows absent or with another
    text, rows not in the source (a removed id, an old text) or there twice, rows of another encoder."""
    number = shard_number_sql("id", shards)
    bad = con.execute(f"""
        SELECT shard, sum(missing), sum(extra), sum(foreign_encoder) FROM (
            SELECT {number} AS shard, 1 AS missing, 0 AS extra, 0 AS foreign_encoder
            FROM src ANTI JOIN shards USING (id, content_hash)
            UNION ALL SELECT {number}, 0, 1, 0 FROM shards ANTI JOIN src USING (id, content_hash)
            UNION ALL SELECT {number}, 0, count(*) - 1, 0 FROM shards GROUP BY id HAVING count(*) > 1
            UNION ALL SELECT {number}, 0, 0, 1 FROM shards WHERE encoder_id <> {sql_literal(encoder_id)}
        ) GROUP BY shard ORDER BY shard
    """).fetchall()
    if bad:
        detail = "; ".join(f"shard {k}-of-{shards}: {m} source rows missing or changed, {x} rows not in "
                           f"the source or repeated, {f} from another encoder" for k, m, x, f in bad)
        raise ShardsNotCurrentError(
            f"{target}: the shard files are not the current source embedded by {encoder_id} ({detail}); "
            f"embed shards {_names([k for k, *_ in bad], shards)} again", [k for k, *_ in bad])


def _names(indexes: Sequence[int], count: int) -> str:
    return ", ".join(f"{k}-of-{count}" for k in indexes)


def embed_source(warehouse: Warehouse, target: str, encoder: Encoder, **options: object) -> EmbedStats:
    """`embed_table` for one of the platform's EMBEDDING_SOURCES (node, edge or chunk embeddings)."""
    source = EMBEDDING_SOURCES[target]
    return embed_table(warehouse, source.sql, target, encoder,
                       id_column=source.id_column, text_column=source.text_column, **options)


def read_embeddings(lake: Lake | S3Lake, target: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float32 vectors) of a whole embedding table: for small tables, GAT features and tests."""
    name = lake.table_path(SCHEMA, target)
    with lake.local_copy(name) as path, reading_lake_file(name):
        table = pq.read_table(path, columns=["id", "embedding"])
    embedding = table.column("embedding").combine_chunks()
    vectors = embedding.flatten().to_numpy(zero_copy_only=False).reshape(-1, embedding.type.list_size)
    return table.column("id").to_numpy(zero_copy_only=False), vectors
