"""Question-level retrieval on top of the shared Retriever: entity linking, triple scoring, evidence.

Every method uses these, so entity linking, triple similarity and passage
retrieval are the same wherever they appear (A2RAG's GSRM, SEMA-RAG's
evidence, the RAG baselines). All operations take a batch: one call serves
every question of an agent step.

Entities of a question are the concepts whose names occur in it (the
dictionary matcher that links corpus chunks to the KG, `text/mentions.py`)
and the concept each option names (an exact name or synonym, else the
concepts mentioned in the option). Triples are scored by the cosine between
the query vector and the triple's vector ("head relation tail"): from the
`edge_embeddings` table when it holds the triple under the same encoder,
otherwise encoded on the fly and kept in memory, since edges may be only
partly embedded (a demo embeds a subset of relations).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medgraph.embed.encoder import Encoder
from medgraph.embed.vector_cache import TextVectorCache, home_vector_cache
from medgraph.kg.graph import Triple
from medgraph.qa.item import QaItem
from medgraph.retrieval import Retriever, SearchMode
from medgraph.text.mentions import MENTIONS_TABLE, ConceptDictionary, TextChunk
from medgraph.text.mentions import SCHEMA as MENTIONS_SCHEMA

# Options that name no concept: yes/no questions and "none of the above" style answers.
_NON_CONCEPT_OPTIONS = frozenset({"yes", "no", "maybe", "none", "all of the above", "none of the above"})


def concept_options(item: QaItem) -> list[str]:
    """The texts of the item's options that name a concept (not yes / no / "none of the above")."""
    return [text for text in item.options.values() if text.strip().lower() not in _NON_CONCEPT_OPTIONS]


@dataclass(frozen=True)
class Passage:
    """A retrieved chunk as evidence."""

    chunk_id: str
    title: str
    text: str
    score: float


class KnowledgeTools:
    """Entity linking, triple vectors and evidence retrieval over one Retriever (batched)."""

    def __init__(self, retriever: Retriever, min_fuzzy_score: float = 0.9, max_entities: int = 12,
                 fallback_concepts: int = 3, vector_cache: TextVectorCache | None = None):
        self.retriever = retriever
        self.vector_cache = vector_cache  # triple vectors encoded by earlier runs (see vector_cache.py)
        self.min_fuzzy_score = min_fuzzy_score
        self.max_entities = max_entities
        self.fallback_concepts = fallback_concepts  # dense node hits when a question names no concept
        self._dictionary: ConceptDictionary | None = None
        self._triple_vectors: dict[str, np.ndarray] = {}
        self.triples_encoded = 0  # triples embedded on the fly (not found in edge_embeddings)

    @classmethod
    def with_home_cache(cls, retriever: Retriever, home: str | Path) -> KnowledgeTools:
        """Tools whose triple vectors persist in MEDGRAPH_HOME's vector cache, shared by the assets that
        grow GSRM subgraphs (tuning, projector, evaluation, recall report)."""
        return cls(retriever, vector_cache=home_vector_cache(home, retriever.encoder.encoder_id)
                   if retriever.encoder is not None else None)

    @property
    def encoder(self) -> Encoder:
        if self.retriever.encoder is None:
            raise ValueError("triple scoring needs a Retriever with an encoder: Retriever(warehouse, encoder)")
        return self.retriever.encoder

    # -- entity linking ------------------------------------------------------------------------------
    @property
    def dictionary(self) -> ConceptDictionary:
        """Every KG name, indexed for mention matching (built on first use)."""
        if self._dictionary is None:
            self._dictionary = ConceptDictionary.from_warehouse(self.retriever.warehouse)
        return self._dictionary

    def mentioned_concepts(self, texts: Sequence[str]) -> list[list[str]]:
        """CUIs whose names occur in each text, in order of first mention."""
        found = []
        for i, text in enumerate(texts):
            mentions = self.dictionary.find(TextChunk(str(i), "", text))
            cuis = [m.cui for m in mentions if m.score >= self.min_fuzzy_score]
            found.append(list(dict.fromkeys(cuis)))
        return found

    def named_concepts(self, names: Sequence[str]) -> list[list[str]]:
        """For each name: its exact-name concepts, else the concepts mentioned in it."""
        exact = self.retriever.find_concepts(list(names), k=3, mode="exact") if names else []
        mentioned = self.mentioned_concepts(names)
        return [by_name or in_text for by_name, in_text in zip(exact, mentioned)]

    def question_entities(self, items: Sequence[QaItem]) -> list[list[str]]:
        """E_q: concepts mentioned in each question plus the concept each option names; when none is
        found, the question's nearest concepts by dense search (so no question starts from nothing)."""
        in_questions = self.mentioned_concepts([item.question for item in items])
        option_names = [(i, text) for i, item in enumerate(items) for text in concept_options(item)]
        in_options: list[list[str]] = [[] for _ in items]
        for (i, _), cuis in zip(option_names, self.named_concepts([t for _, t in option_names])):
            in_options[i] += cuis[:1]
        entities = [list(dict.fromkeys(q + o))[: self.max_entities] for q, o in zip(in_questions, in_options)]
        empty = [i for i, found in enumerate(entities) if not found]
        if empty and self.fallback_concepts > 0:
            hits = self.retriever.search_nodes([items[i].question for i in empty], k=self.fallback_concepts)
            for i, row in zip(empty, hits):
                entities[i] = [cui for cui, _ in row]
        return entities

    # -- triples ---------------------------------------------------------------------------------------
    def one_hop(self, entity_sets: Sequence[Sequence[str]],
                per_relation_limit: int | None = None) -> list[list[Triple]]:
        """The 1-hop triples leaving each set of entities: one graph query for the whole batch.

        `per_relation_limit` keeps at most that many edges of each (entity, relation), so a hub
        (a phenotype of hundreds of diseases) cannot flood a subgraph while every kind of fact
        about it stays represented.
        """
        triples = self.retriever.one_hop(sorted({c for cuis in entity_sets for c in cuis}))
        by_source: dict[str, list[Triple]] = {}
        kept: Counter[tuple[str, str]] = Counter()
        for triple in triples:
            key = (triple.src_cui, triple.relation)
            if per_relation_limit is None or kept[key] < per_relation_limit:
                kept[key] += 1
                by_source.setdefault(triple.src_cui, []).append(triple)
        return [[t for cui in dict.fromkeys(cuis) for t in by_source.get(cui, [])] for cuis in entity_sets]

    def query_vectors(self, queries: Sequence[str]) -> np.ndarray:
        return self.encoder.encode(list(queries), kind="query") if queries else np.zeros((0, self.encoder.dim))

    def triple_vectors(self, triples: Sequence[Triple]) -> np.ndarray:
        """Unit vectors (len(triples), dim): stored edge embeddings, else encoded now (and cached)."""
        missing = list({t.edge_id: t for t in triples if t.edge_id not in self._triple_vectors}.values())
        if missing:
            self._triple_vectors.update(self._stored_edge_vectors([t.edge_id for t in missing]))
            still = [t for t in missing if t.edge_id not in self._triple_vectors]
            if still and self.vector_cache is not None:
                cached = self.vector_cache.get("document", [t.text for t in still])
                self._triple_vectors.update({t.edge_id: v for t, v in zip(still, cached) if v is not None})
                still = [t for t, v in zip(still, cached) if v is None]
            if still:
                vectors = self.encoder.encode([t.text for t in still], kind="document")
                self._triple_vectors.update({t.edge_id: v for t, v in zip(still, vectors)})
                self.triples_encoded += len(still)
                if self.vector_cache is not None:
                    self.vector_cache.put("document", [t.text for t in still], vectors)
        if not triples:
            return np.zeros((0, self.encoder.dim), dtype=np.float32)
        return np.stack([self._triple_vectors[t.edge_id] for t in triples])

    def _stored_edge_vectors(self, edge_ids: list[str]) -> dict[str, np.ndarray]:
        """Vectors of `embeddings.edge_embeddings` made by this encoder, for the ids it holds."""
        lake = self.retriever.warehouse.lake
        path = lake.table_path("embeddings", "edge_embeddings")
        if not lake.exists(path):  # the graph's connection reads it in place (a local file or s3:// via httpfs)
            return {}
        rows = self.retriever.graph.con.execute(
            "SELECT id, embedding FROM read_parquet($path) "
            "WHERE encoder_id = $encoder AND id IN (SELECT unnest($ids))",
            {"path": str(path), "encoder": self.encoder.encoder_id, "ids": edge_ids},
        ).fetchall()
        return {edge_id: np.asarray(vector, dtype=np.float32) for edge_id, vector in rows}

    def score_triples(self, triples: Sequence[Triple], query_vector: np.ndarray) -> np.ndarray:
        """cosine(emb(h r t), emb(q)) for each triple."""
        return self.triple_vectors(triples) @ query_vector if triples else np.zeros(0, dtype=np.float32)

    def ranked_triples(self, entity_sets: Sequence[Sequence[str]], queries: Sequence[str], top: int,
                       per_relation_limit: int | None = None) -> list[list[tuple[Triple, float]]]:
        """The `top` 1-hop triples of each entity set, by similarity to its query, best first."""
        hops = self.one_hop(entity_sets, per_relation_limit)
        vectors = self.query_vectors(queries)
        ranked = []
        for triples, vector in zip(hops, vectors):
            scores = self.score_triples(triples, vector)
            order = sorted(range(len(triples)), key=lambda j: (-scores[j], triples[j].edge_id))[:top]
            ranked.append([(triples[j], float(scores[j])) for j in order])
        return ranked

    # -- text ----------------------------------------------------------------------------------------
    def passages(self, queries: Sequence[str], k: int, mode: SearchMode = "hybrid") -> list[list[Passage]]:
        """The top-k corpus chunks for each query (BM25 + dense fused by RRF by default)."""
        if not queries:
            return []
        hits = self.retriever.search_text(list(queries), k=k, mode=mode)
        chunks = self.retriever.chunks([chunk_id for row in hits for chunk_id, _ in row])
        return [[Passage(c, chunks[c].title, chunks[c].text, score) for c, score in row if c in chunks]
                for row in hits]

    # -- what shown evidence mentions (evidence recall) ---------------------------------------------------
    def chunk_mentions(self, chunk_ids: Sequence[str]) -> dict[str, list[tuple[str, int, int]]]:
        """(CUI, start character, end character) of each concept mention in each chunk, scoring >=
        min_fuzzy_score: one query of `kg.kg_chunk_mentions`, or, where that table is not built, the same
        dictionary matcher run over the chunks now."""
        wanted = sorted(set(chunk_ids))
        if not wanted:
            return {}
        con = self.retriever.graph.con
        found: dict[str, list[tuple[str, int, int]]] = {c: [] for c in wanted}
        if self.retriever.has_table(MENTIONS_SCHEMA, MENTIONS_TABLE):
            rows = con.execute(
                f"SELECT chunk_id, cui, start_char, end_char FROM {MENTIONS_SCHEMA}.{MENTIONS_TABLE} "
                "WHERE chunk_id IN (SELECT unnest($ids)) AND score >= $min_score ORDER BY chunk_id, start_char",
                {"ids": wanted, "min_score": self.min_fuzzy_score},
            ).fetchall()
            for chunk_id, cui, start_char, end_char in rows:
                found[chunk_id].append((cui, int(start_char), int(end_char)))
            return found
        for chunk_id, chunk in self.retriever.chunks(wanted).items():
            found[chunk_id] = [(m.cui, m.start_char, m.end_char)
                               for m in self.dictionary.find(TextChunk(chunk_id, "", chunk.text))
                               if m.score >= self.min_fuzzy_score]
        return found
