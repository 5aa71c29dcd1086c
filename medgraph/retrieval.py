"""One retriever over one KG, one corpus and one encoder: what every method and baseline uses.

All calls take a batch of queries: an agent step of a batch of questions is
one call. Text search fuses BM25 and dense rankings by reciprocal rank fusion
(RRF, k=60, as in MedRAG), which needs no score calibration between the two.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from medgraph.embed.encoder import Encoder
from medgraph.embed.index import VectorIndex
from medgraph.kg.graph import KnowledgeGraph, Node, Triple
from medgraph.storage import Warehouse, table_exists
from medgraph.text.bm25 import bm25_search
from medgraph.text.corpus import CONCEPT_SOURCES  # sources whose doc_id is a CUI

SearchMode = Literal["bm25", "dense", "hybrid"]
RRF_K = 60
# Mentions at or above this score count as the chunk naming the concept (the evidence-recall threshold).
MIN_MENTION_SCORE = 0.9


@dataclass(frozen=True)
class RetrievedChunk:
    """A corpus chunk fetched as evidence, with the document and source it came from."""

    chunk_id: str
    doc_id: str
    source: str
    title: str
    text: str


def reciprocal_rank_fusion(rankings: Sequence[Sequence[str]], k: int = RRF_K,
                           limit: int | None = None) -> list[tuple[str, float]]:
    """Fuse ranked id lists: score(d) = sum over lists of 1 / (k + rank of d), rank from 1."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    fused = sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
    return fused[:limit] if limit is not None else fused


class Retriever:
    """Concept lookup, graph hops, and search over nodes, edges and text chunks."""

    def __init__(self, warehouse: Warehouse, encoder: Encoder | None = None):
        self.warehouse = warehouse
        self.encoder = encoder
        self.graph = KnowledgeGraph(warehouse)
        self._indexes: dict[str, VectorIndex] = {}
        self._tables: dict[str, bool] = {}

    def close(self) -> None:
        self.graph.close()

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- graph -----------------------------------------------------------------------------------
    def one_hop(self, cuis: Sequence[str], relations: Sequence[str] | None = None,
                limit_per_node: int | None = None) -> list[Triple]:
        return self.graph.one_hop(cuis, relations, limit_per_node)

    def neighbors(self, cui: str, relation: str | None = None) -> list[Triple]:
        return self.graph.neighbors(cui, relation)

    def nodes(self, cuis: Sequence[str]) -> dict[str, Node]:
        return self.graph.nodes(cuis)

    def node_texts(self, cuis: Sequence[str]) -> dict[str, str]:
        return self.graph.node_texts(cuis)

    # -- dense search ----------------------------------------------------------------------------
    def _index(self, table: str) -> VectorIndex:
        if table not in self._indexes:
            self._indexes[table] = VectorIndex.build_or_load(self.warehouse.lake, table)
        return self._indexes[table]

    def _dense(self, table: str, queries: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
        if self.encoder is None:
            raise ValueError("dense search needs an encoder: Retriever(warehouse, encoder=load_encoder(...))")
        if not queries:
            return []
        return self._index(table).search(self.encoder.encode(list(queries), kind="query"), k)

    def search_nodes(self, queries: Sequence[str], k: int = 10) -> list[list[tuple[str, float]]]:
        """Concepts whose node text is closest to each query: (cui, cosine), best first."""
        return self._dense("node_embeddings", queries, k)

    def search_edges(self, queries: Sequence[str], k: int = 10) -> list[list[tuple[Triple, float]]]:
        """Triples whose text ("head relation tail") is closest to each query, best first."""
        hits = self._dense("edge_embeddings", queries, k)
        triples = {t.edge_id: t for t in self.graph.triples({edge for row in hits for edge, _ in row})}
        return [[(triples[edge], score) for edge, score in row if edge in triples] for row in hits]

    # -- concepts by name --------------------------------------------------------------------------
    def find_concepts(self, names: Sequence[str], k: int = 5,
                      mode: Literal["exact", "bm25", "dense", "hybrid"] = "hybrid") -> list[list[str]]:
        """CUIs for each name: exact name/synonym match first; then BM25 over the corpus's concept
        documents (definitions; node texts where opted in) and/or dense node search, fused by RRF, where
        the candidates with a name that holds the whole query as words come first ("Factor Xa" ->
        "Factor Xa Inhibitors" before "insulin-like growth factor 2"). `exact` alone returns only exact
        matches."""
        exact = self.graph.lookup(names)
        if mode == "exact":
            return [found[:k] for found in exact]
        rankings: list[list[list[str]]] = []
        if mode in ("bm25", "hybrid"):
            hits = bm25_search(self.graph.con, list(names), k=4 * k)
            docs = self._doc_ids({c for row in hits for c, _ in row})
            rankings.append([[docs[c][0] for c, _ in row if docs.get(c, ("", ""))[1] in CONCEPT_SOURCES]
                             for row in hits])
        if mode in ("dense", "hybrid"):
            rankings.append([[cui for cui, _ in row] for row in self.search_nodes(names, k=4 * k)])
        fused = [[cui for cui, _ in reciprocal_rank_fusion([r[i] for r in rankings])] for i in range(len(names))]
        named = self.graph.names_containing(names, fused)
        return [list(dict.fromkeys(by_name + [c for c in row if c in holds] + row))[:k]
                for by_name, row, holds in zip(exact, fused, named, strict=True)]

    # -- text ------------------------------------------------------------------------------------
    def search_text(self, queries: Sequence[str], k: int = 10,
                    mode: SearchMode = "hybrid") -> list[list[tuple[str, float]]]:
        """Chunk ids for each query, best first: BM25, dense, or both fused by RRF (scores are
        BM25 scores, cosines or RRF scores respectively)."""
        if mode not in ("bm25", "dense", "hybrid"):
            raise ValueError(f"mode must be bm25, dense or hybrid, got {mode!r}")
        if mode == "bm25":
            return bm25_search(self.graph.con, list(queries), k=k)
        if mode == "dense":
            return self._dense("chunk_embeddings", queries, k)
        # Each ranker proposes more than k so that fusion can promote items ranked lower by one.
        lexical = bm25_search(self.graph.con, list(queries), k=2 * k)
        dense = self._dense("chunk_embeddings", queries, 2 * k)
        return [reciprocal_rank_fusion([[c for c, _ in a], [c for c, _ in b]], limit=k)
                for a, b in zip(lexical, dense)]

    def chunks(self, chunk_ids: Sequence[str]) -> dict[str, RetrievedChunk]:
        wanted = sorted(set(chunk_ids))
        if not wanted:
            return {}
        rows = self.graph.con.execute(
            "SELECT chunk_id, doc_id, source, title, text FROM text.corpus_chunks WHERE chunk_id IN (SELECT unnest($c))",
            {"c": wanted},
        ).fetchall()
        return {row[0]: RetrievedChunk(*row) for row in rows}

    def _doc_ids(self, chunk_ids: set[str]) -> dict[str, tuple[str, str]]:
        if not chunk_ids:
            return {}
        rows = self.graph.con.execute(
            "SELECT chunk_id, doc_id, source FROM text.corpus_chunks WHERE chunk_id IN (SELECT unnest($c))",
            {"c": sorted(chunk_ids)},
        ).fetchall()
        return {chunk: (doc, source) for chunk, doc, source in rows}

    # -- the chunk-entity hypergraph (kg.kg_chunk_mentions, kg.kg_chunk_links) ------------------------
    def has_table(self, schema: str, table: str) -> bool:
        """Whether the warehouse holds `schema.table` (looked up once per retriever)."""
        key = f"{schema}.{table}"
        if key not in self._tables:
            self._tables[key] = table_exists(self.graph.con, schema, table)
        return self._tables[key]

    def chunks_mentioning(self, cuis: Sequence[str], limit: int, related: Mapping[str, Collection[str]] | None = None,
                          min_score: float = MIN_MENTION_SCORE) -> dict[str, list[str]]:
        """Up to `limit` chunk ids mentioning each concept: chunks that also mention more of
        `related[cui]` (e.g. its KG neighbours, so a chunk that states a relation comes first), then
        chunks that name it earlier, then by id. {} without `kg.kg_chunk_mentions`."""
        wanted = sorted(set(cuis))
        if not wanted or limit <= 0 or not self.has_table("kg", "kg_chunk_mentions"):
            return {}
        pairs = sorted({(cui, other) for cui in wanted for other in (related or {}).get(cui, ()) if other != cui})
        rows = self.graph.con.execute(
            """
            WITH hits AS (
                SELECT cui, chunk_id, min(start_char) AS first FROM kg.kg_chunk_mentions
                WHERE cui IN (SELECT unnest($cuis)) AND score >= $min_score GROUP BY cui, chunk_id
            ),
            related AS (SELECT unnest($src) AS cui, unnest($dst) AS other),
            linked AS (
                SELECT h.cui, h.chunk_id, count(DISTINCT m.cui) AS n
                FROM hits AS h
                JOIN kg.kg_chunk_mentions AS m ON m.chunk_id = h.chunk_id AND m.score >= $min_score
                JOIN related AS r ON r.cui = h.cui AND r.other = m.cui
                GROUP BY h.cui, h.chunk_id
            ),
            ranked AS (
                SELECT h.cui, h.chunk_id, row_number() OVER (
                    PARTITION BY h.cui ORDER BY coalesce(l.n, 0) DESC, h.first, h.chunk_id) AS rank
                FROM hits AS h LEFT JOIN linked AS l USING (cui, chunk_id)
            )
            SELECT cui, chunk_id FROM ranked WHERE rank <= $limit ORDER BY cui, rank
            """,
            {"cuis": wanted, "min_score": min_score, "src": [a for a, _ in pairs], "dst": [b for _, b in pairs],
             "limit": limit},
        ).fetchall()
        found: dict[str, list[str]] = {}
        for cui, chunk_id in rows:
            found.setdefault(cui, []).append(chunk_id)
        return found

    def chunk_concepts(self, chunk_ids: Sequence[str], min_score: float = MIN_MENTION_SCORE) -> dict[str, list[str]]:
        """The KG concepts each chunk mentions, in order of first mention. {} without the mentions table."""
        wanted = sorted(set(chunk_ids))
        if not wanted or not self.has_table("kg", "kg_chunk_mentions"):
            return {}
        rows = self.graph.con.execute(
            "SELECT chunk_id, cui FROM kg.kg_chunk_mentions WHERE chunk_id IN (SELECT unnest($ids)) "
            "AND score >= $min_score GROUP BY chunk_id, cui ORDER BY chunk_id, min(start_char), cui",
            {"ids": wanted, "min_score": min_score},
        ).fetchall()
        found: dict[str, list[str]] = {}
        for chunk_id, cui in rows:
            found.setdefault(chunk_id, []).append(cui)
        return found

    def linked_chunks(self, chunk_ids: Sequence[str], limit: int) -> dict[str, list[tuple[str, list[str]]]]:
        """Up to `limit` chunks linked to each chunk in `kg.kg_chunk_links` (they share a concept that is
        not a hub), strongest link first: (chunk id, the shared CUIs). {} without the links table."""
        wanted = sorted(set(chunk_ids))
        if not wanted or limit <= 0 or not self.has_table("kg", "kg_chunk_links"):
            return {}
        rows = self.graph.con.execute(
            """
            WITH both_ways AS (
                SELECT chunk_a AS chunk_id, chunk_b AS other, shared_concepts, weight FROM kg.kg_chunk_links
                WHERE chunk_a IN (SELECT unnest($ids))
                UNION ALL
                SELECT chunk_b, chunk_a, shared_concepts, weight FROM kg.kg_chunk_links
                WHERE chunk_b IN (SELECT unnest($ids))
            )
            SELECT chunk_id, other, shared_concepts FROM (
                SELECT *, row_number() OVER (PARTITION BY chunk_id ORDER BY weight DESC, other) AS rank FROM both_ways)
            WHERE rank <= $limit ORDER BY chunk_id, rank
            """,
            {"ids": wanted, "limit": limit},
        ).fetchall()
        found: dict[str, list[tuple[str, list[str]]]] = {}
        for chunk_id, other, shared in rows:
            found.setdefault(chunk_id, []).append((other, list(shared or ())))
        return found

    def chunks_mentioning_all(self, concept_sets: Sequence[Collection[str]],
                              min_score: float = MIN_MENTION_SCORE) -> list[dict[str, int]]:
        """For each set of concepts, the chunks that mention every one of them, each with the character
        offset by which all have been named (the largest first-mention end): a reader of the chunk's
        first that many characters has seen them together. Text evidence for a gold pair."""
        sets = [sorted(set(s)) for s in concept_sets]
        found: list[dict[str, int]] = [{} for _ in sets]
        if not any(sets) or not self.has_table("kg", "kg_chunk_mentions"):
            return found
        rows = self.graph.con.execute(
            """
            WITH wanted AS (
                SELECT i, unnest(cuis) AS cui, len(cuis) AS size
                FROM (SELECT unnest($sets) AS cuis, generate_subscripts($sets, 1) AS i)
            ),
            firsts AS (
                SELECT w.i, w.size, m.chunk_id, m.cui, min(m.end_char) AS seen_by
                FROM wanted AS w JOIN kg.kg_chunk_mentions AS m ON m.cui = w.cui AND m.score >= $min_score
                GROUP BY w.i, w.size, m.chunk_id, m.cui
            )
            SELECT i, chunk_id, max(seen_by) FROM firsts GROUP BY i, size, chunk_id
            HAVING count(*) = size ORDER BY i, chunk_id
            """,
            {"sets": sets, "min_score": min_score},
        ).fetchall()
        for i, chunk_id, seen_by in rows:
            found[i - 1][chunk_id] = int(seen_by)
        return found
