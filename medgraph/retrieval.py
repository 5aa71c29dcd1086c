"""One retriever over one KG, one corpus and one encoder: what every method and baseline uses.

All calls take a batch of queries: an agent step of a batch of questions is
one call. Text search fuses BM25 and dense rankings by reciprocal rank fusion
(RRF, k=60, as in MedRAG), which needs no score calibration between the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from medgraph.embed.encoder import Encoder
from medgraph.embed.index import VectorIndex
from medgraph.kg.graph import KnowledgeGraph, Node, Triple
from medgraph.storage import Warehouse
from medgraph.text.bm25 import bm25_search

SearchMode = Literal["bm25", "dense", "hybrid"]
RRF_K = 60


@dataclass(frozen=True)
class Chunk:
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
        """CUIs for each name: exact name/synonym match first; then BM25 over the KG's node texts
        and/or dense node search, fused by RRF. `exact` alone returns only exact matches."""
        exact = self.graph.lookup(names)
        if mode == "exact":
            return [found[:k] for found in exact]
        rankings: list[list[list[str]]] = []
        if mode in ("bm25", "hybrid"):
            hits = bm25_search(self.graph.con, list(names), k=4 * k)
            docs = self._doc_ids({c for row in hits for c, _ in row})
            rankings.append([[docs[c][0] for c, _ in row if docs.get(c, ("", ""))[1] == "kg"] for row in hits])
        if mode in ("dense", "hybrid"):
            rankings.append([[cui for cui, _ in row] for row in self.search_nodes(names, k=4 * k)])
        found = []
        for i, by_name in enumerate(exact):
            fused = [cui for cui, _ in reciprocal_rank_fusion([r[i] for r in rankings])]
            found.append(list(dict.fromkeys(by_name + fused))[:k])
        return found

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

    def chunks(self, chunk_ids: Sequence[str]) -> dict[str, Chunk]:
        wanted = sorted(set(chunk_ids))
        if not wanted:
            return {}
        rows = self.graph.con.execute(
            "SELECT chunk_id, doc_id, source, title, text FROM text.corpus_chunks WHERE chunk_id IN (SELECT unnest($c))",
            {"c": wanted},
        ).fetchall()
        return {row[0]: Chunk(*row) for row in rows}

    def _doc_ids(self, chunk_ids: set[str]) -> dict[str, tuple[str, str]]:
        if not chunk_ids:
            return {}
        rows = self.graph.con.execute(
            "SELECT chunk_id, doc_id, source FROM text.corpus_chunks WHERE chunk_id IN (SELECT unnest($c))",
            {"c": sorted(chunk_ids)},
        ).fetchall()
        return {chunk: (doc, source) for chunk, doc, source in rows}
