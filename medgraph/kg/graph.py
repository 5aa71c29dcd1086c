"""Read access to the knowledge graph in the warehouse (`kg.*` tables built by dbt).

Every call takes many inputs at once: agents advance a batch of questions in
lockstep, so one SQL round trip serves the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import duckdb
import numpy as np

from medgraph.kg.csr import GraphIndex, build_graph_index
from medgraph.storage import Warehouse

# Same expression as the dbt macro `normalize_name` (dbt/macros/normalize_name.sql).
NORMALIZE_SQL = "trim(regexp_replace(lower(strip_accents({})), '[^a-z0-9]+', ' ', 'g'))"


@dataclass(frozen=True)
class Node:
    cui: str
    name: str
    semantic_types: tuple[str, ...] = ()
    definition: str | None = None


@dataclass(frozen=True)
class Triple:
    """One directed edge `src -relation-> dst` with readable names."""

    edge_id: str
    src_cui: str
    src_name: str
    relation: str
    dst_cui: str
    dst_name: str

    @property
    def text(self) -> str:
        """The triple as the text that is embedded and shown to a model."""
        return f"{self.src_name} {self.relation.replace('_', ' ')} {self.dst_name}"


_TRIPLE_SELECT = """
    SELECT e.edge_id, e.src_cui, s.preferred_name, e.relation, e.dst_cui, d.preferred_name
    FROM kg.kg_edges e
    JOIN kg.kg_nodes s ON s.cui = e.src_cui
    JOIN kg.kg_nodes d ON d.cui = e.dst_cui
"""


class KnowledgeGraph:
    """The `kg` schema of a warehouse, opened read-only for the lifetime of this object."""

    def __init__(self, warehouse: Warehouse):
        self.warehouse = warehouse
        self._con: duckdb.DuckDBPyConnection | None = None
        self._index: GraphIndex | None = None

    @property
    def index(self) -> GraphIndex:
        """The CSR topology (built or loaded on first use)."""
        if self._index is None:
            self._index = build_graph_index(self.warehouse)
        return self._index

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self._con = self.warehouse.open_connection(read_only=True)
        return self._con

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None

    def __enter__(self) -> KnowledgeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(self, names: Sequence[str]) -> list[list[str]]:
        """CUIs whose preferred name or synonym equals each name (after normalization).

        Preferred-name matches come first; a name nobody uses gives [].
        """
        if not names:
            return []
        rows = self.con.execute(
            f"""
            WITH q AS (SELECT i, {NORMALIZE_SQL.format('name')} AS normalized
                       FROM (SELECT unnest($names) AS name, generate_subscripts($names, 1) AS i))
            SELECT q.i, n.cui, max(n.is_preferred::INT) AS preferred
            FROM q JOIN kg.kg_node_names n ON n.normalized_name = q.normalized
            GROUP BY q.i, n.cui
            ORDER BY q.i, preferred DESC, n.cui
            """,
            {"names": list(names)},
        ).fetchall()
        found: list[list[str]] = [[] for _ in names]
        for i, cui, _ in rows:
            found[i - 1].append(cui)
        return found

    def names_containing(self, names: Sequence[str], candidates: Sequence[Sequence[str]]) -> list[set[str]]:
        """For each name, the CUIs among its `candidates` that have a preferred name or synonym holding
        the whole name as words, the last one possibly a word's start (after normalization): "Factor Xa"
        and "factor Xa inhibitor" -> "Factor Xa Inhibitors"."""
        pairs = [(i, cui) for i, row in enumerate(candidates, start=1) for cui in row]
        if not pairs:
            return [set() for _ in names]
        rows = self.con.execute(
            f"""
            WITH q AS (SELECT i, {NORMALIZE_SQL.format('name')} AS normalized
                       FROM (SELECT unnest($names) AS name, generate_subscripts($names, 1) AS i)),
                 c AS (SELECT unnest($rows) AS i, unnest($cuis) AS cui)
            SELECT DISTINCT c.i, c.cui
            FROM c JOIN q USING (i) JOIN kg.kg_node_names n ON n.cui = c.cui
            WHERE q.normalized <> '' AND contains(' ' || n.normalized_name, ' ' || q.normalized)
            """,
            {"names": list(names), "rows": [i for i, _ in pairs], "cuis": [cui for _, cui in pairs]},
        ).fetchall()
        found: list[set[str]] = [set() for _ in names]
        for i, cui in rows:
            found[i - 1].add(cui)
        return found

    def nodes(self, cuis: Iterable[str]) -> dict[str, Node]:
        wanted = sorted(set(cuis))
        if not wanted:
            return {}
        rows = self.con.execute(
            "SELECT cui, preferred_name, semantic_types, definition FROM kg.kg_nodes WHERE cui IN (SELECT unnest($c))",
            {"c": wanted},
        ).fetchall()
        return {cui: Node(cui, name, tuple(types or ()), definition) for cui, name, types, definition in rows}

    def node_texts(self, cuis: Iterable[str]) -> dict[str, str]:
        wanted = sorted(set(cuis))
        if not wanted:
            return {}
        rows = self.con.execute(
            "SELECT cui, text FROM kg.kg_node_text WHERE cui IN (SELECT unnest($c))", {"c": wanted}
        ).fetchall()
        return dict(rows)

    def one_hop(self, cuis: Iterable[str], relations: Iterable[str] | None = None,
                limit_per_node: int | None = None) -> list[Triple]:
        """All edges leaving any of `cuis` (optionally only some relations), each at most once,
        grouped by source (in CUI order) and relation.

        `limit_per_node` caps hub nodes (a phenotype with thousands of annotated
        diseases) so one hop cannot flood an agent's context.
        """
        index = self.index
        sources = index.positions(sorted(set(cuis)))
        edges = index.out_edges(sources[sources >= 0])
        if relations is not None:
            names = set(relations)
            wanted = {i for i, (_, _, name) in enumerate(index.relations) if name in names}
            edges = edges[np.isin(index.relation[edges], list(wanted))]
        src = index.sources(edges)
        if limit_per_node is not None and len(edges):
            # Rank of each edge within its source's run (edges are grouped by source).
            run_start = np.r_[0, np.flatnonzero(np.diff(src)) + 1]
            rank = np.arange(len(src)) - np.repeat(run_start, np.diff(np.r_[run_start, len(src)]))
            keep = rank < limit_per_node
            edges, src = edges[keep], src[keep]
        return [self._triple(index, int(s), int(e)) for s, e in zip(src, edges)]

    def _triple(self, index: GraphIndex, src: int, edge: int) -> Triple:
        dst = int(index.dst[edge])
        return Triple(
            edge_id=index.edge_id(src, edge),
            src_cui=index.cuis[src].decode(),
            src_name=index.names[src].as_py(),
            relation=index.relations[index.relation[edge]][2],
            dst_cui=index.cuis[dst].decode(),
            dst_name=index.names[dst].as_py(),
        )

    def neighbors(self, cui: str, relation: str | None = None) -> list[Triple]:
        """Edges leaving one concept, optionally of one relation."""
        return self.one_hop([cui], None if relation is None else [relation])

    def triples(self, edge_ids: Iterable[str]) -> list[Triple]:
        wanted = sorted(set(edge_ids))
        if not wanted:
            return []
        rows = self.con.execute(f"{_TRIPLE_SELECT} WHERE e.edge_id IN (SELECT unnest($e))", {"e": wanted}).fetchall()
        return [Triple(*row) for row in rows]
