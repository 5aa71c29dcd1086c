"""BM25 over `text.corpus_chunks` with DuckDB's full-text-search extension.

The index is DuckDB's own (`PRAGMA create_fts_index`: porter stemmer, English
stop words, title + text), so it lives in the warehouse beside the table and
is replaced with it in one transaction. The extension is loaded from the
`duckdb-extension-fts` package's file: `INSTALL fts` by name would go to the
internet, which deployments here do not have.

Search scores many queries in one pass instead of calling the index's
`match_bm25` macro once per query: the macro scans the whole posting table
(`terms`, one row per token of the corpus) for every call. Here the queries'
terms are looked up first, then one statement reads only the postings of
those terms, which is cheap because the index build rewrites the posting
table in term order (DuckDB's zone maps then skip every row group holding
other terms). The statement uses the index's own tokenizer and stemmer and the
macro's formula and defaults (k1 = 1.2, b = 0.75), so the scores are the same.
"""

from __future__ import annotations

import importlib.util
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from medgraph.storage import Warehouse, transaction

TABLE = "text.corpus_chunks"
FTS_SCHEMA = "fts_text_corpus_chunks"  # DuckDB names an index's schema fts_<schema>_<table>
K1 = 1.2
B = 0.75
_HAS_WORD = re.compile(r"[^\W\d_]", re.UNICODE)  # the index tokenizer keeps letters only


class Bm25IndexMissing(RuntimeError):
    """The warehouse has no BM25 index over `text.corpus_chunks`."""


@dataclass
class Bm25IndexStats:
    chunks: int
    terms: int
    seconds: float

    def as_metadata(self) -> dict[str, object]:
        return {"index": FTS_SCHEMA, "chunks": self.chunks, "terms": self.terms,
                "seconds": round(self.seconds, 3)}


def fts_extension_path() -> Path:
    """The fts extension file shipped in the `duckdb-extension-fts` package for this DuckDB version."""
    spec = importlib.util.find_spec("duckdb_extension_fts")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("BM25 needs the package 'duckdb-extension-fts' (same version as duckdb)")
    root = Path(next(iter(spec.submodule_search_locations))) / "extensions"
    path = root / f"v{duckdb.__version__}" / "fts.duckdb_extension"
    if not path.is_file():
        found = sorted(p.parent.name for p in root.glob("*/fts.duckdb_extension"))
        raise FileNotFoundError(f"no fts extension for duckdb {duckdb.__version__} in {root} "
                                f"(found: {found}); "
                                f"install duckdb-extension-fts=={duckdb.__version__}")
    return path


def load_fts(con: duckdb.DuckDBPyConnection) -> None:
    """Load the fts extension into `con` from the package file (no network, nothing written to ~/.duckdb)."""
    con.execute(f"LOAD '{fts_extension_path()}'")


def create_bm25_index(con: duckdb.DuckDBPyConnection) -> None:
    """(Re)create the index over title + text; runs inside the caller's transaction, if any."""
    load_fts(con)
    con.execute(
        f"PRAGMA create_fts_index('{TABLE}', 'chunk_id', 'title', 'text', "
        "stemmer = 'porter', stopwords = 'english', strip_accents = 1, lower = 1, overwrite = 1)"
    )
    # Postings in term order, so a search reads only its terms' row groups (the warehouse
    # connection does not preserve insertion order unless told to for this statement).
    preserve = con.execute("SELECT current_setting('preserve_insertion_order')").fetchone()[0]
    con.execute("SET preserve_insertion_order = true")
    try:
        con.execute(f"CREATE OR REPLACE TABLE {FTS_SCHEMA}.terms AS "
                    f"SELECT * FROM {FTS_SCHEMA}.terms ORDER BY termid, docid")
    finally:
        con.execute(f"SET preserve_insertion_order = {'true' if preserve else 'false'}")


def build_bm25_index(warehouse: Warehouse) -> Bm25IndexStats:
    """Rebuild the index from the current table, in one transaction (a failure keeps the old index)."""
    started = time.perf_counter()
    with warehouse.connect() as con:
        with transaction(con):
            create_bm25_index(con)
        chunks, terms = con.execute(
            f"SELECT (SELECT num_docs FROM {FTS_SCHEMA}.stats), (SELECT count(*) FROM {FTS_SCHEMA}.dict)"
        ).fetchone()
    return Bm25IndexStats(chunks=chunks, terms=terms, seconds=time.perf_counter() - started)


def bm25_search(warehouse_or_connection: Warehouse | duckdb.DuckDBPyConnection,
                queries: Sequence[str], k: int = 10) -> list[list[tuple[str, float]]]:
    """The top-k chunks (chunk_id, score), best first, for each query, in one statement.

    Any string is a valid query: punctuation and quotes are separators, and a
    query with no indexed word (empty, only punctuation or stop words) gets [].
    Scores are rounded to 9 decimals and ties broken by chunk_id, so results are deterministic.
    """
    if isinstance(warehouse_or_connection, Warehouse):
        with warehouse_or_connection.connect(read_only=True) as con:
            return bm25_search(con, queries, k)
    con = warehouse_or_connection
    results: list[list[tuple[str, float]]] = [[] for _ in queries]
    wanted = [(i, q) for i, q in enumerate(queries) if isinstance(q, str) and _HAS_WORD.search(q)]
    if not wanted or k < 1:
        return results
    load_fts(con)
    try:
        rows = _search_batch(con, [q for _, q in wanted], [i for i, _ in wanted], k)
    except duckdb.CatalogException as error:
        if FTS_SCHEMA not in str(error):
            raise
        raise Bm25IndexMissing(f"no BM25 index over {TABLE} in this warehouse: build the corpus "
                               "(medgraph.text.corpus.build_corpus_chunks) or run build_bm25_index") from None
    for qid, chunk, score in rows:
        results[qid].append((chunk, float(score)))
    return results


def _search_batch(con: duckdb.DuckDBPyConnection, texts: list[str], qids: list[int], k: int) -> list[tuple]:
    """Rows (qid, chunk_id, score), best first per query."""
    query_terms = con.execute(
        f"""
        WITH queries AS (
            SELECT unnest($qids::INTEGER[]) AS qid, unnest($texts::VARCHAR[]) AS query
        ),
        tokens AS (
            SELECT DISTINCT qid, stem(unnest({FTS_SCHEMA}.tokenize(query)), 'porter') AS term FROM queries
        )
        SELECT t.qid, d.termid, d.df FROM tokens AS t JOIN {FTS_SCHEMA}.dict AS d USING (term)
        """,
        {"qids": qids, "texts": texts},
    ).fetchall()
    if not query_terms:
        return []
    term_ids = sorted({termid for _, termid, _ in query_terms})
    # The ids are written into the statement (they are integers from the index): a literal
    # IN list is what lets DuckDB skip row groups of the term-ordered posting table.
    return con.execute(
        f"""
        WITH query_terms AS (
            SELECT unnest($q::INTEGER[]) AS qid, unnest($t::BIGINT[]) AS termid, unnest($df::BIGINT[]) AS df
        ),
        postings AS (
            SELECT docid, termid, count(*) AS tf
            FROM {FTS_SCHEMA}.terms
            WHERE termid IN ({", ".join(str(int(t)) for t in term_ids)})
            GROUP BY docid, termid
        ),
        scores AS (
            -- Rounded, so that the order in which threads add up the terms cannot reorder ties.
            SELECT q.qid, p.docid,
                   round(sum(log(((s.num_docs - q.df + 0.5) / (q.df + 0.5)) + 1)
                       * (p.tf * ($k1 + 1) / (p.tf + $k1 * (1 - $b + $b * (d.len / s.avgdl))))), 9) AS score
            FROM query_terms AS q
            JOIN postings AS p USING (termid)
            JOIN {FTS_SCHEMA}.docs AS d USING (docid)
            CROSS JOIN {FTS_SCHEMA}.stats AS s
            GROUP BY q.qid, p.docid
        )
        SELECT s.qid, d.name AS chunk_id, s.score
        FROM scores AS s JOIN {FTS_SCHEMA}.docs AS d USING (docid)
        QUALIFY row_number() OVER (PARTITION BY s.qid ORDER BY s.score DESC, d.name) <= $k
        ORDER BY s.qid, s.score DESC, d.name
        """,
        {"q": [q for q, _, _ in query_terms], "t": [t for _, t, _ in query_terms],
         "df": [df for _, _, df in query_terms], "k1": K1, "b": B, "k": k},
    ).fetchall()


def measure_latency(warehouse_or_connection: Warehouse | duckdb.DuckDBPyConnection,
                    queries: Sequence[str], k: int = 10) -> dict[str, float]:
    """Median and p95 seconds of one-query calls, plus the per-query time of one batched call."""
    if isinstance(warehouse_or_connection, Warehouse):
        with warehouse_or_connection.connect(read_only=True) as con:
            return measure_latency(con, queries, k)
    con = warehouse_or_connection
    bm25_search(con, queries[:1], k)  # warm up: extension load, catalog
    single = []
    for query in queries:
        started = time.perf_counter()
        bm25_search(con, [query], k)
        single.append(time.perf_counter() - started)
    started = time.perf_counter()
    bm25_search(con, queries, k)
    batched = (time.perf_counter() - started) / max(len(queries), 1)
    single.sort()
    return {
        "p50_seconds": statistics.median(single),
        "p95_seconds": single[min(len(single) - 1, int(0.95 * len(single)))],
        "batched_seconds_per_query": batched,
    }
