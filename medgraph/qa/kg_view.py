"""The parts of `kg.*` question generation walks: CSR arrays in both directions, per-concept Arrow columns,
and caches filled in batches around the sampled question concepts (memory bounded by the batch, not the graph).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from medgraph.kg.graph import NORMALIZE_SQL
from medgraph.kg.relation_phrases import UNINFORMATIVE_RELATIONS, relation_phrases

Edge = tuple[str, str, str]  # (src_cui, relation, dst_cui)


@dataclass(frozen=True)
class QaLimits:
    """What makes a question worth asking."""

    max_answers: int = 3  # a short answer (and a 2-hop bridge set) has at most this many correct concepts
    max_degree: int = 50  # a question entity or bridge with more distinct neighbours is a hub: skipped
    skip_relations: frozenset[str] = UNINFORMATIVE_RELATIONS
    # Siblings of the answer make the most plausible distractors, and the riskiest: the KG may
    # simply not list a sibling that is also true (heparin treats more thromboses than it names).
    # Only used by the "non_neighbours" rule.
    sibling_distractors: bool = True
    # Where wrong options (and the object of a "no") come from. "neighbours": the question concept's own
    # neighbours under other relations (same semantic type, else group, as the answer), so that "the
    # option linked to the question concept" is no shortcut. "non_neighbours": concepts NOT linked to the
    # question concept at all (the rule before issue 25: adjacency alone then gives every answer; kept
    # to show the shortcut check firing).
    distractor_rule: str = "neighbours"
    # A short answer is asked only where picking a random concept near the question concepts (within the
    # item's hops) finds a correct one with probability at most this: structure alone must not answer it.
    max_adjacency_chance: float = 0.1
    # Intersections are rare on some graphs (a synthetic release: about one per few hundred concepts tried);
    # trying every concept made generation time grow with the graph. Past this many tries the 2-hop short
    # answers come from chains alone. The demo KG (7k concepts) never reaches it.
    max_intersection_tries: int = 50_000
    # In each dataset and split, one answer concept answers at most this share of the questions (of those asking
    # by one relation chain: the second share); the excess is not asked (`medgraph.qa.splits.bound_answer_shares`).
    # 1.0 switches the bound off.
    max_answer_share: float = 0.05
    max_answer_share_per_relation: float = 0.2


SUBJECT_BATCH = 256  # question subjects whose neighbourhoods are read together
_CACHE_BUDGET = 2_000_000  # concepts and adjacency entries held in Python before the caches are emptied


@dataclass(frozen=True)
class _Concept:
    name: str
    synonyms: tuple[str, ...]
    normalized_names: frozenset[str]  # every name, normalized
    tuis: tuple[str, ...]
    ambiguous: bool  # the preferred name is also a name of another concept
    degree: int  # distinct neighbours, both directions, any relation


@dataclass(frozen=True)
class _Adjacency:
    out: dict[str, tuple[str, ...]]  # relation -> objects (sorted)
    into: dict[str, tuple[str, ...]]  # relation -> subjects (sorted)
    neighbours: frozenset[str]
    parents: tuple[str, ...]  # CHD edges: this concept is a child of each


_NO_ADJACENCY = _Adjacency({}, {}, frozenset(), ())


class _View:
    """A read-only mapping over one field of the graph's per-concept caches, loaded on a miss."""

    def __init__(self, get: Callable[[str], object | None]):
        self._get = get

    def get(self, key: str, default: object = None) -> object:
        value = self._get(key)
        return default if value is None else value

    def __getitem__(self, key: str) -> object:
        value = self._get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self._get(key) is not None  # type: ignore[arg-type]


class _GraphArrays:
    """The graph as integer arrays, both directions (compressed sparse rows), and the per-concept columns
    as Arrow: about 14 bytes per edge, and no Python object per concept or edge until one is asked for.

    Built by DuckDB in two sorted scans. Every later read is an O(degree) slice: before, each batch and
    each miss ran a query that scanned `kg.kg_edges`, so time grew with batches x edges (issue 27).
    Positions are ranks of CUIs among kg_nodes and every edge endpoint (an endpoint without a node has
    null columns, read as "no concept").
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, relations: Sequence[str]):
        con.execute("""
            CREATE OR REPLACE TEMP TABLE qa_positions AS
            SELECT cui, (row_number() OVER (ORDER BY cui) - 1)::INTEGER AS pos
            FROM (SELECT cui FROM kg.kg_nodes UNION SELECT src_cui FROM kg.kg_edges
                  UNION SELECT dst_cui FROM kg.kg_edges)
        """)
        self.concepts = con.execute(
            f"""
            SELECT p.cui, n.cui IS NOT NULL AS has_node, n.preferred_name, coalesce(n.synonyms, []) AS synonyms,
                   coalesce(n.tuis, []) AS tuis,
                   list_transform(list_prepend(n.preferred_name, coalesce(n.synonyms, [])),
                                  x -> {NORMALIZE_SQL.format('x')}) AS forms,
                   coalesce(q.ambiguous, true) AS ambiguous, coalesce(q.degree, 0) AS degree
            FROM qa_positions p LEFT JOIN kg.kg_nodes n ON n.cui = p.cui LEFT JOIN qa_concepts q ON q.cui = p.cui
            ORDER BY p.pos
            """
        ).to_arrow_table()
        cuis = self.concepts.column("cui").to_pylist()
        self.cuis = np.asarray(cuis, dtype=f"U{max((len(c) for c in cuis), default=1)}")
        del cuis
        self.relations = tuple(relations)
        con.register("qa_relation_codes", pa.table({"relation": list(self.relations),
                                                     "code": pa.array(range(len(self.relations)), pa.int16())}))
        edges = """
            SELECT DISTINCT s.pos AS src, c.code, d.pos AS dst, e.rel = 'CHD' AS chd
            FROM kg.kg_edges e JOIN qa_positions s ON s.cui = e.src_cui JOIN qa_positions d ON d.cui = e.dst_cui
            JOIN qa_relation_codes c ON c.relation = e.relation
            WHERE e.src_cui <> e.dst_cui
        """
        self.out = self._rows(con.execute(f"SELECT src AS key, code, dst AS other, chd FROM ({edges}) "
                                          "ORDER BY key, code, other").fetchnumpy())
        self.into = self._rows(con.execute(f"SELECT dst AS key, code, src AS other, chd FROM ({edges}) "
                                           "ORDER BY key, code, other").fetchnumpy())
        con.unregister("qa_relation_codes")

    def _rows(self, columns: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(indptr, code, other, chd): the edges of position i are indptr[i]:indptr[i+1]."""
        indptr = np.zeros(len(self.cuis) + 1, dtype=np.int64)
        np.cumsum(np.bincount(columns["key"], minlength=len(self.cuis)), out=indptr[1:])
        return (indptr, columns["code"].astype(np.int16), columns["other"].astype(np.int32),
                columns["chd"].astype(bool))

    def positions(self, cuis: Sequence[str]) -> np.ndarray:
        """Positions of `cuis`; -1 for a CUI the graph does not hold."""
        if not len(cuis):
            return np.empty(0, dtype=np.int64)
        keys = np.asarray(cuis)  # its own width: a longer CUI must not be cut to match a shorter one
        found = np.minimum(np.searchsorted(self.cuis, keys), len(self.cuis) - 1)
        return np.where(self.cuis[found] == keys, found, -1)

    def edges(self, direction: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(key, code, other, chd) of every edge of `positions` (>= 0) in one direction ("out" or "into")."""
        indptr, code, other, chd = self.out if direction == "out" else self.into
        starts, counts = indptr[positions], indptr[positions + 1] - indptr[positions]
        rows = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        return np.repeat(positions, counts), code[rows], other[rows], chd[rows]


class QaGraph:
    """The parts of `kg.*` the generator walks, read from DuckDB around the sampled question concepts.

    Whole-graph facts that are small (the relations, their inverses, which are hierarchical) and the
    per-concept flags (degree, ambiguous preferred name: a DuckDB temp table, `qa_concepts`) are computed
    by DuckDB once; names, types and adjacency are read in batches (`prefetch`) for the neighbourhoods of
    the subjects being drafted, and on a miss together with the pending rest of the neighbourhood. The
    caches are emptied when they exceed `_CACHE_BUDGET`, so memory is bounded by the batch, not the graph;
    every answer is a function of the graph alone, so what is cached never changes a question.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, limits: QaLimits):
        self.con = con
        self.limits = limits
        self._concepts: dict[str, _Concept | None] = {}
        self._adjacency: dict[str, _Adjacency] = {}
        self._children: dict[str, tuple[str, ...]] = {}
        self._parents_only: dict[str, tuple[str, ...]] = {}  # read for hierarchy walks
        self._ancestors: dict[str, frozenset[str]] = {}
        self._alike: dict[tuple[str, str], tuple[str, ...]] = {}
        self._typed: dict[tuple[str, ...], list[str]] = {}
        self._pending: dict[str, None] = {}  # concepts a prefetch expects to need; loaded with the next miss
        self._walked: set[str] = set()  # concepts whose parents, and theirs, are read
        self._held = 0
        self.rows_read = 0  # adjacency and concept rows fetched into Python (tests bound it)
        self.names = _View(lambda c: (x := self._concept(c)) and x.name)
        self.synonyms = _View(lambda c: (x := self._concept(c)) and x.synonyms or None)
        self.normalized_names = _View(lambda c: (x := self._concept(c)) and x.normalized_names)
        self.tuis = _View(lambda c: (x := self._concept(c)) and x.tuis)
        self.out = _View(lambda c: self._adjacent(c).out)
        self.into = _View(lambda c: self._adjacent(c).into)
        self.neighbours = _View(lambda c: self._adjacent(c).neighbours)
        self.parents = _View(self._parents_of)
        self.children = _View(self._children_of)
        self.by_tui = _View(lambda tui: self._typed_sample(None, tui))
        self.range_by_tui = _View(lambda key: self._typed_sample(*key))
        _create_concept_flags(con)
        relation_rels = con.execute("SELECT relation, list(DISTINCT rel) FROM kg.kg_edges GROUP BY ALL").fetchall()
        self.relations = tuple(sorted(r for r, _ in relation_rels))
        self._arrays = _GraphArrays(con, self.relations)
        self.hierarchical = frozenset(r for r, rels in relation_rels if set(rels) <= {"PAR", "CHD", "RB", "RN"})
        self.inverse = _inverse_relations(con)

    # ----------------------------------------------------------------- reading

    def _load_concepts(self, cuis: Iterable[str]) -> None:
        wanted = sorted({c for c in cuis if c not in self._concepts})
        if not wanted:
            return
        positions = self._arrays.positions(wanted)
        found = positions >= 0
        rows = self._arrays.concepts.take(pa.array(positions[found])).to_pylist()
        self.rows_read += len(rows)
        for cui, row in zip(np.asarray(wanted)[found].tolist(), rows):
            self._concepts[cui] = _Concept(
                row["preferred_name"], tuple(row["synonyms"]), frozenset(f for f in row["forms"] if f),
                tuple(row["tuis"]), bool(row["ambiguous"]), int(row["degree"])) if row["has_node"] else None
        for cui in np.asarray(wanted)[~found].tolist():
            self._concepts[cui] = None  # not in the graph at all
        self._held += len(wanted)

    def _edges(self, direction: str, cuis: Sequence[str], chd_only: bool = False) -> Iterator[tuple[str, str, str]]:
        """(cui, relation, other) for every edge of `cuis` in `direction`, CUIs and relations as strings."""
        positions = self._arrays.positions(cuis)
        key, code, other, chd = self._arrays.edges(direction, positions[positions >= 0])
        if chd_only:
            key, code, other = key[chd], code[chd], other[chd]
        self.rows_read += len(key)
        names = self._arrays.cuis
        relations = self.relations
        return zip(names[key].tolist(), (relations[c] for c in code.tolist()), names[other].tolist())

    def _load_adjacency(self, cuis: Iterable[str]) -> None:
        wanted = sorted({c for c in cuis if c not in self._adjacency})
        if not wanted:
            return
        out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        into: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        parents: dict[str, set[str]] = defaultdict(set)
        for cui, relation, dst in self._edges("out", wanted):  # sorted by (cui, relation, other) already
            out[cui][relation].append(dst)
        for cui, _, dst in self._edges("out", wanted, chd_only=True):
            parents[cui].add(dst)
        for cui, relation, src in self._edges("into", wanted):
            into[cui][relation].append(src)
        held = 0
        for cui in wanted:
            outs = {r: tuple(dict.fromkeys(d)) for r, d in out[cui].items()} if cui in out else {}
            ins = {r: tuple(dict.fromkeys(s)) for r, s in into[cui].items()} if cui in into else {}
            neighbours = frozenset(n for targets in (*outs.values(), *ins.values()) for n in targets)
            held += len(neighbours)
            self._adjacency[cui] = _Adjacency(outs, ins, neighbours, tuple(sorted(parents.get(cui, ())))) \
                if outs or ins else _NO_ADJACENCY
            self._pending.pop(cui, None)
        self._held += len(wanted) + held

    def _concept(self, cui: str) -> _Concept | None:
        if cui not in self._concepts:
            self._load_concepts([cui])
        return self._concepts[cui]

    def _adjacent(self, cui: str) -> _Adjacency:
        adjacency = self._adjacency.get(cui)
        if adjacency is None:  # a miss: read it with the rest of what the batch expects to need
            pending = [c for c in self._pending if c not in self._adjacency][:SUBJECT_BATCH]
            self._load_adjacency([cui, *pending])
            adjacency = self._adjacency[cui]
        return adjacency

    def _parents_of(self, cui: str) -> tuple[str, ...]:
        if cui in self._adjacency:
            return self._adjacency[cui].parents
        if cui not in self._parents_only:
            self._load_parents({cui})
        return self._parents_only[cui]

    def _children_of(self, cui: str) -> tuple[str, ...]:
        if cui not in self._children:
            self._children[cui] = tuple(sorted({src for _, _, src in self._edges("into", [cui], chd_only=True)}))
        return self._children[cui]

    def _typed_sample(self, relation: str | None, tui: str, size: int = 1000) -> list[str]:
        """Concepts of a semantic type (objects of `relation` if given): a fixed pseudo-random sample of
        `size`, sorted (used by the "non_neighbours" rule only, which draws from them at random)."""
        key = (relation or "", tui)
        if key not in self._typed:
            source = ("(SELECT DISTINCT dst_cui AS cui FROM kg.kg_edges WHERE relation = $relation)"
                      if relation else "kg.kg_nodes")
            self._typed[key] = [c for (c,) in self.con.execute(
                f"SELECT s.cui FROM {source} s JOIN kg.kg_nodes n ON n.cui = s.cui "
                f"WHERE list_contains(n.tuis, $tui) ORDER BY md5(s.cui), s.cui LIMIT {size}",
                {"tui": tui, **({"relation": relation} if relation else {})}).fetchall()]
            self._typed[key].sort()
        return self._typed[key]

    def prefetch(self, cuis: Iterable[str], adjacency_levels: int, concept_levels: int, expand_hubs: bool,
                 pend_next: bool = False) -> None:
        """Read, in a few queries, the adjacency of the first `adjacency_levels` levels around `cuis` (level 0:
        `cuis`, level 1: their neighbours, ...) and the names and types of the first `concept_levels`
        (at most one more); past level 0 a hub's neighbourhood is read only if `expand_hubs`. With
        `pend_next`, the adjacency of the last level is read with the first miss among it."""
        if self._held > _CACHE_BUDGET:
            self.clear()
        level, seen = set(cuis), set(cuis)
        for hop in range(concept_levels):
            self._load_concepts(level)
            if hop >= adjacency_levels:
                break
            expand = level if expand_hubs or hop == 0 else {c for c in level if not self.is_hub(c)}
            self._load_adjacency(expand)
            level = {n for c in expand for n in self._adjacency[c].neighbours} - seen
            seen |= level
        if pend_next:
            self._pending.update(dict.fromkeys(sorted(level - self._adjacency.keys())))
        # The hierarchy above every concept read (candidates and answers are checked for lineage), one query
        # per level for the whole batch.
        # A concept whose hierarchy an earlier batch walked is not walked again (hubs and general concepts
        # are in most neighbourhoods: walking them per batch was most of the time at 3M MRREL rows).
        frontier = {c for c in seen - self._walked if self._concepts.get(c) is not None}
        while frontier:
            self._walked |= frontier
            self._load_parents(frontier)
            frontier = {p for c in frontier for p in self._parents_of(c)} - self._walked

    def clear(self) -> None:
        for cache in (self._concepts, self._adjacency, self._children, self._parents_only, self._ancestors,
                      self._pending, self._walked):
            cache.clear()
        self._held = 0

    # ----------------------------------------------------------------- what the drafters ask

    def objects(self, subject: str, relation: str) -> tuple[str, ...]:
        return self.out.get(subject, {}).get(relation, ())

    def subjects(self, obj: str, relation: str) -> tuple[str, ...]:
        return self.into.get(obj, {}).get(relation, ())

    def worded_alike(self, relation: str, form: str) -> tuple[str, ...]:
        """The relations whose `form` phrase reads exactly like `relation`'s (itself included).

        A question worded that way is answered by all of them: "Which gene is
        associated with Asthma?" asks about disease_has_associated_gene and
        phenotype_has_associated_gene alike when Asthma is both.
        """
        key = (relation, form)
        if key not in self._alike:
            text = relation_phrases(relation).form(form)
            self._alike[key] = tuple(r for r in self.relations if relation_phrases(r).form(form) == text) or (
                relation,)
        return self._alike[key]

    def canonical(self, relation: str, form: str) -> str:
        """One name for the relations worded alike, so that a fact has one qid."""
        return min(self.worded_alike(relation, form))

    def relation_between(self, src: str, dst: str, candidates: Iterable[str]) -> str | None:
        """The first of `candidates` that has the edge src -> dst."""
        return next((r for r in candidates if dst in self.objects(src, r)), None)

    def objects_worded(self, subject: str, relation: str, form: str) -> set[str]:
        """Objects of `subject` under every relation worded like `relation` in `form`."""
        return {o for r in self.worded_alike(relation, form) for o in self.objects(subject, r)}

    def subjects_worded(self, obj: str, relation: str, form: str) -> set[str]:
        return {s for r in self.worded_alike(relation, form) for s in self.subjects(obj, r)}

    def usable_relation(self, relation: str) -> bool:
        return relation not in self.limits.skip_relations

    def oriented(self, subject: str, relation: str, obj: str) -> Edge:
        """One orientation per statement: the reverse edge when the relation's inverse sorts
        first and the reverse is an edge (or neither is, for a statement that is false)."""
        inverse = self.inverse.get(relation)
        if inverse is not None and inverse < relation and (
                subject in self.objects(obj, inverse) or obj not in self.objects(subject, relation)):
            return obj, inverse, subject
        return subject, relation, obj

    def both_hierarchical(self, first: str, second: str) -> bool:
        """Two hierarchy steps make a transitive or sibling question, not a 2-hop one worth asking."""
        return first in self.hierarchical and second in self.hierarchical

    def is_hub(self, cui: str) -> bool:
        concept = self._concept(cui)
        degree = concept.degree if concept is not None else len(self.neighbours.get(cui, ()))
        return degree > self.limits.max_degree

    def can_be_named(self, cui: str) -> bool:
        """A concept a question can mention (or offer as an option) by its preferred name alone."""
        concept = self._concept(cui)
        return concept is not None and not concept.ambiguous

    def is_seed(self, cui: str) -> bool:
        return self.can_be_named(cui) and not self.is_hub(cui)

    def ancestors(self, cui: str) -> frozenset[str]:
        cached = self._ancestors.get(cui)
        if cached is None:
            seen: set[str] = set()
            frontier = set(self.parents.get(cui, ()))
            while frontier:  # one query per level of the hierarchy for what is not read yet
                seen |= frontier
                self._load_parents(frontier)
                frontier = {p for c in frontier for p in self.parents.get(c, ())} - seen
            cached = self._ancestors[cui] = frozenset(seen)
            self._held += len(cached)
        return cached

    def _load_parents(self, cuis: set[str]) -> None:
        """Parents only (CHD edges), for concepts whose adjacency is not read: the walk up a hierarchy
        need not read the (large) neighbourhoods of general concepts."""
        wanted = {c for c in cuis if c not in self._adjacency and c not in self._parents_only}
        if not wanted:
            return
        found: dict[str, set[str]] = defaultdict(set)
        for cui, _, dst in self._edges("out", sorted(wanted), chd_only=True):
            found[cui].add(dst)
        for cui in wanted:
            self._parents_only[cui] = tuple(sorted(found.get(cui, ())))
        self._held += len(wanted)

    def in_lineage(self, a: str, b: str) -> bool:
        """True when one concept is an ancestor of the other."""
        return a in self.ancestors(b) or b in self.ancestors(a)

    def within(self, cui: str, hops: int) -> frozenset[str]:
        """Concepts at most `hops` edges from `cui` (any relation, either direction), `cui` itself excluded."""
        reached, frontier = set(), {cui}
        for _ in range(hops):
            frontier = {n for c in frontier for n in self.neighbours.get(c, ())} - reached - {cui}
            reached |= frontier
        return frozenset(reached)

    def linked_by(self, a: str, b: str, relations: Iterable[str]) -> bool:
        """An edge a -r-> b for some r of `relations`, or its inverse listed as b -inverse(r)-> a."""
        return any(b in self.objects(a, r) or a in self.objects(b, self.inverse.get(r, "")) for r in relations)

    def siblings(self, cui: str) -> list[str]:
        return sorted({c for p in self.parents.get(cui, ()) for c in self.children.get(p, ()) if c != cui})

    def answer_names(self, cuis: Iterable[str]) -> tuple[str, ...]:
        """Preferred names, then synonyms, of each concept; each string once."""
        names: dict[str, None] = {}
        for cui in cuis:
            names.setdefault(self.names[cui], None)
            for synonym in self.synonyms.get(cui, ()):
                names.setdefault(synonym, None)
        return tuple(names)


def _create_concept_flags(con: duckdb.DuckDBPyConnection) -> None:
    """The temp table `qa_concepts`: each concept's degree, and whether its preferred name is ambiguous (empty,
    or a name or synonym of another concept too)."""
    normalize = NORMALIZE_SQL
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE qa_concepts AS
        WITH names AS (
            SELECT cui, {normalize.format('preferred_name')} AS preferred,
                   list_transform(list_prepend(preferred_name, coalesce(synonyms, [])),
                                  x -> {normalize.format('x')}) AS forms
            FROM kg.kg_nodes),
        owners AS (
            SELECT form, count(DISTINCT cui) AS owners
            FROM (SELECT cui, unnest(forms) AS form FROM names) WHERE form <> '' GROUP BY form),
        links AS (
            SELECT src_cui AS cui, dst_cui AS other FROM kg.kg_edges WHERE src_cui <> dst_cui
            UNION ALL SELECT dst_cui, src_cui FROM kg.kg_edges WHERE src_cui <> dst_cui),
        degrees AS (SELECT cui, count(DISTINCT other) AS degree FROM links GROUP BY cui)
        SELECT n.cui, n.preferred IS NULL OR n.preferred = '' OR coalesce(o.owners, 0) > 1 AS ambiguous,
               coalesce(d.degree, 0) AS degree
        FROM names n LEFT JOIN owners o ON o.form = n.preferred LEFT JOIN degrees d ON d.cui = n.cui
    """)


def _inverse_relations(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """relation -> its inverse: the relation most of its edges reappear under, reversed (a DuckDB join: only
    one row per pair of relations comes back)."""
    inverse_counts = con.execute(
        """
        WITH totals AS (SELECT relation, count(*) AS edges FROM kg.kg_edges GROUP BY ALL)
        SELECT a.relation, b.relation, count(*) AS reversed, any_value(t.edges)
        FROM kg.kg_edges a
        JOIN kg.kg_edges b ON b.src_cui = a.dst_cui AND b.dst_cui = a.src_cui
        JOIN totals t ON t.relation = a.relation
        GROUP BY ALL ORDER BY a.relation, reversed DESC, b.relation
        """
    ).fetchall()
    inverse: dict[str, str] = {}
    for relation, reverse_relation, reversed_edges, edges in inverse_counts:
        if relation not in inverse and reversed_edges * 2 >= edges:
            inverse[relation] = reverse_relation
    return inverse
