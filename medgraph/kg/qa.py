"""Question-answer items generated from the knowledge graph, with verifiable answers and gold paths.

Why: Graph-R1's GRPO reward needs questions whose answers a program can check,
and A2RAG's threshold is tuned on a validation split; the KG provides both for
free. Every item is read off edges of `kg.kg_edges`, so the answer is true by
construction and the edges that make it true are stored as its gold path.

The questions must need retrieval: structure alone must not answer them
(`medgraph.kg.shortcuts` measures it; a blocking check keeps every no-LLM
shortcut within chance + 0.10 on test). So every wrong option, and the object
of every "no", is a neighbour of the question concept under ANOTHER relation
and of the answer's semantic type: "the option linked to the question concept"
and "the option of the right type" say nothing, only the relation does. Each
is verified not to be an answer (no edge of the asked relation, or one worded
alike, in either listing) and is neither an ancestor nor a descendant of a
correct answer. Short answers are asked only where a random concept near the
question concepts is rarely correct (`QaLimits.max_adjacency_chance`).

Question types (dataset names in the MIRAGE files in brackets):
    mc          [kgqa_mc]    "Which of the following may treat <disease>?": one correct
                             concept and three of the subject's other neighbours of its type
    mc_2hop     [kgqa_mc]    "Which of the following may treat a condition with <phenotype> as a
                             manifestation?": wrong options two edges away through other relations
    yesno       [kgqa_yesno] "Is <phenotype> a manifestation of <disease>?", in pairs from one
                             subject: yes (an edge) and no (a neighbour under another relation)
    short_1hop  [kgqa_short] "What is the mechanism of action of <drug>?"
    short_2hop  [kgqa_short] chains, "Which drug may treat a condition with <phenotype> as a
                             manifestation?", and intersections, "What has <phenotype> as a
                             manifestation and is associated with the gene <gene>?"
Short answers keep every correct concept's names and synonyms for F1/EM scoring.

Relation names are data: `medgraph.kg.relation_phrases` words the relations we
know (those of the sample release and a few common UMLS RELAs) and anything else
gets a generic phrasing from its name. Relations that a question words the same way
(disease_has_associated_gene and phenotype_has_associated_gene both read "Which
gene is associated with X?") share their answers, and a statement is asked once
whichever direction it was found in. Questions about hubs (many neighbours) and
short answers with more than a few correct concepts are skipped, because they
cannot be scored meaningfully.

Splits are by fact, never by a random draw. A question's facts are the
unordered concept pairs of its gold path (any relation, either direction: UMLS
lists most relations twice, so "Which drug treats X?" and "What does drug D
treat?" ask the same fact from two ends); a "no" question's fact is the pair it
asks about. Items that share a fact are joined, transitively, into connected
components of the fact graph, and each component lands whole in one split (a
hash of its smallest pair). Guarantee: no unordered gold pair (and no asked
pair of a "no") occurs in two splits, so no fact rewarded in train is measured
again in validation or test. Distractors may come from anywhere. The qid is a
hash of what a question asks (type, relations, question entities; the object
too for yes/no), so it is stable across seeds; a question's split is stable
whenever its component is (a seed changes which questions are sampled, and so
can merge components).

The items are published as `qa.qa_items` and as MIRAGE files of
`medgraph.eval.questions.QaItem` (`KgQaItem.as_question`), one per split.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from medgraph.eval.questions import QaItem, write_mirage
from medgraph.kg.graph import NORMALIZE_SQL
from medgraph.kg.relation_phrases import UNINFORMATIVE_RELATIONS, relation_phrases
from medgraph.kg.shortcuts import content_words
from medgraph.storage import Warehouse

log = logging.getLogger(__name__)

SCHEMA = "qa"
TABLE = "qa_items"
QUESTION_TYPES = ("mc", "mc_2hop", "yesno", "short_1hop", "short_2hop")
DATASET_OF_TYPE = {"mc": "kgqa_mc", "mc_2hop": "kgqa_mc", "yesno": "kgqa_yesno", "short_1hop": "kgqa_short",
                   "short_2hop": "kgqa_short"}
SPLIT_NAMES = ("train", "validation", "test")
OPTION_LETTERS = ("A", "B", "C", "D")
YES_NO_OPTIONS = {"A": "yes", "B": "no"}

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


# --------------------------------------------------------------------------- the graph, read in batches


_BATCH = 256  # question subjects whose neighbourhoods are read together
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
        ).fetch_arrow_table()
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


class _Graph:
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
        relation_rels = con.execute("SELECT relation, list(DISTINCT rel) FROM kg.kg_edges GROUP BY ALL").fetchall()
        self.relations = tuple(sorted(r for r, _ in relation_rels))
        self._arrays = _GraphArrays(con, self.relations)
        self.hierarchical = frozenset(r for r, rels in relation_rels if set(rels) <= {"PAR", "CHD", "RB", "RN"})
        # A relation's inverse is the relation most of its edges reappear under, reversed (a DuckDB join:
        # only one row per pair of relations comes back).
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
        self.inverse: dict[str, str] = {}
        for relation, reverse_relation, reversed_edges, edges in inverse_counts:
            if relation not in self.inverse and reversed_edges * 2 >= edges:
                self.inverse[relation] = reverse_relation

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
            pending = [c for c in self._pending if c not in self._adjacency][:_BATCH]
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


# --------------------------------------------------------------------------- drafting questions


@dataclass(frozen=True)
class _Draft:
    """A question before edge ids and splits are attached."""

    question_type: str
    fact: tuple[str, ...]  # what the question asks about; hashed into the qid
    question: str
    options: dict[str, str]
    option_cuis: tuple[str, ...]
    answer: str
    answer_cuis: tuple[str, ...]
    acceptable_answers: tuple[str, ...]
    path: tuple[Edge, ...]
    seed_cuis: tuple[str, ...]
    relations: tuple[str, ...]


_POOLS = itertools.count()


def _ranked_pages(graph: _Graph, sql: str, params: Mapping[str, object], per_page: int) -> Iterator[list[tuple]]:
    """The rows (a, b) of `sql` (a SELECT of columns a, b, rank), kept by DuckDB in a temp table and read
    back `per_page` rows at a time, in (rank, a, b) order."""
    table = f"qa_pool_{next(_POOLS)}"
    graph.con.execute(f"CREATE TEMP TABLE {table} AS SELECT *, row_number() OVER (ORDER BY rank, a, b) AS position "
                      f"FROM ({sql})", dict(params))
    (top,) = graph.con.execute(f"SELECT count(*) FROM {table}").fetchone()
    for start in range(0, top, per_page):
        yield [row[:-2] for row in graph.con.execute(
            f"SELECT * FROM {table} WHERE position > ? AND position <= ? ORDER BY position",
            [start, start + per_page]).fetchall()]


def _subjects(graph: _Graph, rng: random.Random, max_answers: int | None, *, adjacency_levels: int,
              concept_levels: int, expand_hubs: bool = False, pend_next: bool = False) -> Iterator[tuple[str, str]]:
    """(relation, subject) pairs for every usable relation and every question entity it can be asked about
    (a seed: nameable, no hub; at most `max_answers` objects), taking one from each relation in turn so that
    rare relations (a few drug edges) are asked about as well as abundant ones; each relation's subjects in
    a pseudo-random order drawn from `rng`. DuckDB chooses and orders them; the neighbourhoods of each batch
    of `_BATCH` are read together (`_Graph.prefetch`)."""
    salt = f"{rng.getrandbits(64):016x}"
    sql = """
        SELECT e.relation AS a, e.src_cui AS b,
               row_number() OVER (PARTITION BY e.relation ORDER BY md5($salt || e.src_cui), e.src_cui) AS rank
        FROM (SELECT src_cui, relation, count(DISTINCT dst_cui) AS objects FROM kg.kg_edges
              WHERE src_cui <> dst_cui GROUP BY ALL) e
        JOIN qa_concepts q ON q.cui = e.src_cui
        WHERE NOT q.ambiguous AND q.degree <= $max_degree AND e.objects <= $max_answers
          AND NOT list_contains($skip, e.relation)
    """
    params = {"salt": salt, "max_degree": graph.limits.max_degree, "skip": sorted(graph.limits.skip_relations),
              "max_answers": max_answers if max_answers is not None else 2**62}
    for page in _ranked_pages(graph, sql, params, _BATCH):
        graph.prefetch({subject for _, subject in page}, adjacency_levels, concept_levels, expand_hubs, pend_next)
        yield from page


def _pick(rng: random.Random, population: Sequence[str], accept: Callable[[str], bool], k: int,
          tries: int = 200) -> list[str]:
    """Up to k members of `population` that `accept` takes, drawn at random; a large
    population is sampled rather than shuffled."""
    if len(population) <= tries:
        order: Iterable[str] = rng.sample(list(population), len(population))
    else:
        order = (population[rng.randrange(len(population))] for _ in range(tries))
    picked: list[str] = []
    for cui in order:
        if cui not in picked and accept(cui):
            picked.append(cui)
            if len(picked) == k:
                break
    return picked


def _distractors(graph: _Graph, subject: str, relation: str, form: str, answer: str, k: int,
                 rng: random.Random) -> list[str]:
    """k concepts like `answer` that are verifiably not an answer of (subject, relation), nor of a
    relation the question (phrase `form`) words the same way.

    Rule "neighbours" (the default): the subject's own neighbours under other relations, of the answer's
    semantic type (an option of another type would give itself away); a neighbour linked to the subject by the asked
    relation (or a relation worded alike, in either listing) is a correct answer, never a distractor.
    Every option is then linked to the question concept, so adjacency says nothing: only the relation
    does. Rule "non_neighbours": the answer's siblings, then other objects of the relation of its type,
    then any concept of its type, none linked to the subject at all.
    Either way a candidate is refused when it is an ancestor or descendant of a correct answer, or shares
    a name with one (or with the subject).
    """
    correct = graph.objects_worded(subject, relation, form)
    alike = graph.worded_alike(relation, form)
    taken_names = set(graph.normalized_names[subject])
    for cui in correct:
        taken_names |= graph.normalized_names[cui]
    chosen: list[str] = []
    neighbours = graph.neighbours.get(subject, frozenset())
    by_neighbours = graph.limits.distractor_rule == "neighbours"

    def acceptable(cui: str) -> bool:
        if cui == subject or cui in correct or cui in chosen or not graph.can_be_named(cui):
            return False
        if by_neighbours:
            if graph.linked_by(subject, cui, alike):
                return False
        elif cui in neighbours:
            return False
        return (not any(graph.in_lineage(cui, c) for c in correct)
                and not (graph.normalized_names[cui] & taken_names))

    tui = graph.tuis[answer][0] if graph.tuis.get(answer) else None
    same_type = (lambda cui: True) if tui is None else (lambda cui: tui in graph.tuis.get(cui, ()))
    tiers: list[Sequence[str]] = []
    if by_neighbours:  # the answer's semantic type only: an option of another type gives itself away
        tiers.append([c for c in sorted(neighbours) if same_type(c)])
    else:
        if graph.limits.sibling_distractors:
            tiers.append([c for c in graph.siblings(answer) if same_type(c)])
        if tui is not None:
            tiers += [graph.range_by_tui.get((relation, tui), []), graph.by_tui.get(tui, [])]
    for population in tiers:
        for cui in _pick(rng, population, acceptable, k - len(chosen)):
            chosen.append(cui)
            taken_names |= graph.normalized_names[cui]
        if len(chosen) == k:
            break
    return chosen


def _adjacency_chance(graph: _Graph, seeds: Sequence[str], hops: int, answers: Iterable[str]) -> float:
    """How often a concept drawn at random near the question concepts is a correct answer: the candidates
    are the common neighbours of several question concepts, else what lies within `hops` of the one."""
    if len(seeds) > 1:
        candidates = frozenset.intersection(*(graph.neighbours.get(s, frozenset()) for s in seeds))
    else:
        candidates = graph.within(seeds[0], hops)
    return len(candidates & set(answers)) / len(candidates) if candidates else 1.0


def _structure_answers(graph: _Graph, seeds: Sequence[str], hops: int, answers: Iterable[str]) -> bool:
    """True when adjacency alone would often find a short answer (see `QaLimits.max_adjacency_chance`)."""
    return _adjacency_chance(graph, seeds, hops, answers) > graph.limits.max_adjacency_chance


def _by_name(graph: _Graph, cuis: Iterable[str]) -> list[str]:
    return sorted(cuis, key=lambda c: (graph.names[c].casefold(), c))


def _mc_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    for relation, subject in _subjects(graph, rng, None, adjacency_levels=2, concept_levels=2):
        candidates = [c for c in graph.objects(subject, relation) if graph.can_be_named(c)]
        if not candidates:
            continue
        correct = rng.choice(candidates)
        distractors = _distractors(graph, subject, relation, "mc", correct, len(OPTION_LETTERS) - 1, rng)
        if len(distractors) < len(OPTION_LETTERS) - 1:
            continue
        option_cuis = [correct, *distractors]
        rng.shuffle(option_cuis)
        letter = OPTION_LETTERS[option_cuis.index(correct)]
        yield _Draft(
            question_type="mc",
            fact=(subject, graph.canonical(relation, "mc")),  # the stem: other seeds vary only the options
            question=relation_phrases(relation).mc.format(subject=graph.names[subject]),
            options={letter_: graph.names[cui] for letter_, cui in zip(OPTION_LETTERS, option_cuis)},
            option_cuis=tuple(option_cuis),
            answer=letter,
            answer_cuis=(correct,),
            acceptable_answers=graph.answer_names([correct]),
            path=((subject, relation, correct),),
            seed_cuis=(subject,),
            relations=(relation,),
        )


def _yesno_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    """Pairs from one subject and relation: a true edge (yes) and a "no" about a neighbour of the subject
    under another relation, of the true object's semantic type and sharing a word with the subject exactly
    when the true object does. Adjacency, the relation, the object's type and word overlap then say
    nothing about the answer: only the relation between the two concepts does.

    A statement is asked once, in one orientation: "May lisinopril be used to
    treat Hypertension?" comes from both (lisinopril may_treat Hypertension) and
    (Hypertension may_be_treated_by lisinopril).
    """
    asked: set[Edge] = set()
    for relation, subject in _subjects(graph, rng, None, adjacency_levels=2, concept_levels=2):
        candidates = [c for c in graph.objects(subject, relation) if graph.can_be_named(c)]
        if not candidates:
            continue
        true_object = rng.choice(candidates)
        overlaps = bool(content_words(graph.names[subject]) & content_words(graph.names[true_object]))
        negatives = [c for c in _distractors(graph, subject, relation, "yesno", true_object, 20, rng)
                     if bool(content_words(graph.names[subject]) & content_words(graph.names[c])) == overlaps]
        if not negatives:
            continue
        pair = []
        for obj, answer in ((true_object, "A"), (negatives[0], "B")):
            oriented = graph.oriented(subject, relation, obj)
            fact = (oriented[0], graph.canonical(oriented[1], "yesno"), oriented[2])
            pair.append((oriented, fact, answer))
        if any(fact in asked for _, fact, _ in pair):
            continue
        for (s_, r_, o_), fact, answer in pair:
            asked.add(fact)
            yield _Draft(
                question_type="yesno",
                fact=fact,
                question=relation_phrases(r_).yesno.format(subject=graph.names[s_], object=graph.names[o_]),
                options=dict(YES_NO_OPTIONS),
                option_cuis=(),
                answer=answer,
                answer_cuis=(o_,) if answer == "A" else (),
                acceptable_answers=(YES_NO_OPTIONS[answer],),
                path=((s_, r_, o_),) if answer == "A" else (),
                seed_cuis=(s_, o_),
                relations=(r_,),
            )


def _short_1hop_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    limits = graph.limits
    for relation, subject in _subjects(graph, rng, limits.max_answers, adjacency_levels=1, concept_levels=2):
        answers = _by_name(graph, graph.objects_worded(subject, relation, "short"))
        if len(answers) > limits.max_answers or _structure_answers(graph, (subject,), 1, answers):
            continue
        step = graph.relation_between(subject, answers[0], graph.worded_alike(relation, "short"))
        yield _Draft(
            question_type="short_1hop",
            fact=(subject, graph.canonical(relation, "short")),
            question=relation_phrases(relation).short_about(graph.names[subject]),
            options={},
            option_cuis=(),
            answer=graph.names[answers[0]],
            answer_cuis=tuple(answers),
            acceptable_answers=graph.answer_names(answers),
            path=((subject, step, answers[0]),),
            seed_cuis=(subject,),
            relations=(step,),
        )


@dataclass(frozen=True)
class _Chain:
    """subject -first-> bridge -second-> answer, with every bridge and every answer the wording admits."""

    subject: str
    first: str
    bridges: tuple[str, ...]
    second: str  # canonical for the "described" wording
    answers: tuple[str, ...]  # by name

    def path_to(self, graph: _Graph, answer: str) -> tuple[Edge, Edge]:
        seconds = graph.worded_alike(self.second, "described")
        bridge, second_step = next((b, r) for b in self.bridges for r in seconds if answer in graph.objects(b, r))
        first_step = graph.relation_between(self.subject, bridge, graph.worded_alike(self.first, "via"))
        return (self.subject, first_step, bridge), (bridge, second_step, answer)

    def about(self, graph: _Graph) -> str:
        return relation_phrases(self.first).via.format(subject=graph.names[self.subject])


def _chains(graph: _Graph, rng: random.Random, max_answers: int) -> Iterator[_Chain]:
    """subject -r1-> bridge -r2-> answer, asked as "<r2 question> about <r1's objects>".

    Every bridge counts: the answers are all objects of r2 from any object of r1,
    so the question stays true when the subject has several r1 objects. r2 is
    never r1 itself (a transitive step) or r1's inverse (that walks back to the
    subject's own neighbourhood), and two hierarchy steps are not combined.
    """
    limits = graph.limits
    for first, subject in _subjects(graph, rng, limits.max_answers, adjacency_levels=2, concept_levels=3,
                                    expand_hubs=True, pend_next=True):
        firsts = graph.worded_alike(first, "via")
        bridges = sorted(graph.objects_worded(subject, first, "via"))
        if len(bridges) > limits.max_answers or any(graph.is_hub(bridge) for bridge in bridges):
            continue
        excluded = set(firsts) | {graph.inverse.get(r) for r in firsts}
        choices: dict[str, list[str]] = {}
        for second in sorted({r for bridge in bridges for r in graph.out.get(bridge, {})}):
            if not graph.usable_relation(second) or second in excluded or graph.both_hierarchical(first, second):
                continue
            answers = set().union(*(graph.objects_worded(b, second, "described") for b in bridges))
            answers -= {subject, *bridges}
            if 1 <= len(answers) <= max_answers:
                choices[graph.canonical(second, "described")] = _by_name(graph, answers)
        if not choices:
            continue
        second = rng.choice(sorted(choices))
        yield _Chain(subject, first, tuple(bridges), second, tuple(choices[second]))


def _chain_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    for chain in _chains(graph, rng, graph.limits.max_answers):
        answers = chain.answers
        if _structure_answers(graph, (chain.subject,), 2, answers):
            continue
        path = chain.path_to(graph, answers[0])
        yield _Draft(
            question_type="short_2hop",
            fact=("chain", chain.subject, graph.canonical(chain.first, "via"), chain.second),
            question=relation_phrases(chain.second).short_about(chain.about(graph), described=True),
            options={},
            option_cuis=(),
            answer=graph.names[answers[0]],
            answer_cuis=tuple(answers),
            acceptable_answers=graph.answer_names(answers),
            path=path,
            seed_cuis=(chain.subject,),
            relations=(path[0][1], path[1][1]),
        )


def _mc_2hop_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    """"Which of the following may treat a condition with <phenotype> as a manifestation?": a chain
    (see `_chains`) whose wrong options also lie two edges from the question concept, through other
    relations (of the answer's semantic type), and are verifiably not reached by the asked chain."""
    for chain in _chains(graph, rng, max_answers=len(OPTION_LETTERS)):
        named = [a for a in chain.answers if graph.can_be_named(a)]
        if not named:
            continue
        correct = rng.choice(named)
        distractors = _two_hop_distractors(graph, chain, correct, len(OPTION_LETTERS) - 1, rng)
        if len(distractors) < len(OPTION_LETTERS) - 1:
            continue
        option_cuis = [correct, *distractors]
        rng.shuffle(option_cuis)
        letter = OPTION_LETTERS[option_cuis.index(correct)]
        path = chain.path_to(graph, correct)
        yield _Draft(
            question_type="mc_2hop",
            fact=("chain", chain.subject, graph.canonical(chain.first, "via"), chain.second),
            question=relation_phrases(chain.second).mc.format(subject=chain.about(graph)),
            options={letter_: graph.names[cui] for letter_, cui in zip(OPTION_LETTERS, option_cuis)},
            option_cuis=tuple(option_cuis),
            answer=letter,
            answer_cuis=(correct,),
            acceptable_answers=graph.answer_names([correct]),
            path=path,
            seed_cuis=(chain.subject,),
            relations=(path[0][1], path[1][1]),
        )


def _two_hop_distractors(graph: _Graph, chain: _Chain, answer: str, k: int, rng: random.Random) -> list[str]:
    """Concepts within two edges of the chain's subject, of the answer's semantic type, that the asked
    chain does not reach: no bridge links them by the second relation (either listing)."""
    seconds = graph.worded_alike(chain.second, "described")
    taken_names = set(graph.normalized_names[chain.subject])
    for cui in chain.answers:
        taken_names |= graph.normalized_names[cui]
    chosen: list[str] = []

    def acceptable(cui: str) -> bool:
        return (cui not in chosen and cui not in chain.answers and cui != chain.subject and cui not in chain.bridges
                and graph.can_be_named(cui) and not any(graph.linked_by(b, cui, seconds) for b in chain.bridges)
                and not any(graph.in_lineage(cui, a) for a in chain.answers)
                and not (graph.normalized_names[cui] & taken_names))

    tui = graph.tuis[answer][0] if graph.tuis.get(answer) else None
    for cui in _pick(rng, [c for c in sorted(graph.within(chain.subject, 2)) if tui in graph.tuis.get(c, ())],
                     acceptable, k):
        chosen.append(cui)
        taken_names |= graph.normalized_names[cui]
    return chosen


def _intersection_drafts(graph: _Graph, rng: random.Random, attempts: int = 3) -> Iterator[_Draft]:
    """"What <clause about e1> and <clause about e2>?": concepts linked to two question
    entities, where each constraint alone allows more answers than both together.

    The gold path runs e1 -> answer -> e2 through the answer.
    """
    limits = graph.limits
    for answer in itertools.islice(_answers(graph, rng), limits.max_intersection_tries):
        constraints: dict[str, list[str]] = {}
        for relation, objects in sorted(graph.out[answer].items()):
            seeds = [o for o in objects if graph.is_seed(o)]
            if graph.usable_relation(relation) and seeds:
                constraints[relation] = seeds
        relations = sorted(constraints)
        for _ in range(attempts):
            if len(relations) >= 2:
                q1, q2 = rng.sample(relations, 2)
                e1, e2 = rng.choice(constraints[q1]), rng.choice(constraints[q2])
            elif relations and len(constraints[relations[0]]) >= 2:
                q1 = q2 = relations[0]
                e1, e2 = rng.sample(constraints[q1], 2)
            else:
                break
            (q1, e1), (q2, e2) = sorted([(graph.canonical(q1, "clause"), e1), (graph.canonical(q2, "clause"), e2)])
            if graph.both_hierarchical(q1, q2):
                continue
            first, second = graph.subjects_worded(e1, q1, "clause"), graph.subjects_worded(e2, q2, "clause")
            answers = first & second
            if not (1 <= len(answers) <= limits.max_answers) or answers in (first, second) \
                    or _structure_answers(graph, (e1, e2), 1, answers):
                continue
            ordered = _by_name(graph, answers)
            canonical = ordered[0]
            # e1 -> answer: preferably the inverse of the constraint, else any edge.
            inverses = [graph.inverse[r] for r in graph.worded_alike(q1, "clause") if r in graph.inverse]
            back = graph.relation_between(e1, canonical, [*inverses, *sorted(graph.out.get(e1, {}))])
            if back is None:
                continue
            asked = graph.relation_between(canonical, e1, graph.worded_alike(q1, "clause"))
            forward = graph.relation_between(canonical, e2, graph.worded_alike(q2, "clause"))
            first_clause = relation_phrases(q1).clause.format(object=graph.names[e1])
            second_clause = relation_phrases(q2).clause.format(object=graph.names[e2])
            yield _Draft(
                question_type="short_2hop",
                fact=("intersection", e1, q1, e2, q2),
                question=f"What {first_clause} and {second_clause}?",
                options={},
                option_cuis=(),
                answer=graph.names[canonical],
                answer_cuis=tuple(ordered),
                acceptable_answers=graph.answer_names(ordered),
                path=((e1, back, canonical), (canonical, forward, e2)),
                seed_cuis=(e1, e2),
                relations=(asked, forward),  # answer -> e1, answer -> e2
            )
            break


def _answers(graph: _Graph, rng: random.Random) -> Iterator[str]:
    """The concepts an intersection can be asked about, in a pseudo-random order drawn from `rng`: nameable,
    with seed objects (nameable, no hub) under two usable relations, or two under one; the neighbourhoods
    of each batch read together.

    The same as every nameable concept with an edge, less those `_intersection_drafts` would skip at once
    (without drawing from `rng`): DuckDB drops them in one pass. On a synthetic 10M-MRREL release most
    concepts are such, and reading their neighbourhoods was most of question generation's time.
    """
    sql = """
        SELECT e.cui AS a, NULL AS b, row_number() OVER (ORDER BY md5($salt || e.cui), e.cui) AS rank
        FROM (SELECT e.src_cui AS cui FROM kg.kg_edges e JOIN qa_concepts o ON o.cui = e.dst_cui
              WHERE e.src_cui <> e.dst_cui AND NOT o.ambiguous AND o.degree <= $max_degree
                AND NOT list_contains($skip, e.relation)
              GROUP BY e.src_cui HAVING count(DISTINCT e.relation) >= 2 OR count(DISTINCT e.dst_cui) >= 2) e
        JOIN qa_concepts q ON q.cui = e.cui WHERE NOT q.ambiguous
    """
    params = {"salt": f"{rng.getrandbits(64):016x}", "max_degree": graph.limits.max_degree,
              "skip": sorted(graph.limits.skip_relations)}
    for page in _ranked_pages(graph, sql, params, _BATCH):
        graph.prefetch({cui for cui, _ in page}, adjacency_levels=2, concept_levels=3, expand_hubs=False)
        yield from (cui for cui, _ in page)


def _short_2hop_drafts(graph: _Graph, rng: random.Random) -> Iterator[_Draft]:
    """Chains and intersections in turn."""
    streams = [_chain_drafts(graph, rng), _intersection_drafts(graph, rng)]
    while streams:
        for stream in list(streams):
            draft = next(stream, None)
            if draft is None:
                streams.remove(stream)
            else:
                yield draft


_DRAFTERS: dict[str, Callable[[_Graph, random.Random], Iterator[_Draft]]] = {
    "mc": _mc_drafts,
    "mc_2hop": _mc_2hop_drafts,
    "yesno": _yesno_drafts,
    "short_1hop": _short_1hop_drafts,
    "short_2hop": _short_2hop_drafts,
}


# --------------------------------------------------------------------------- items, ids and splits


@dataclass(frozen=True)
class KgQaItem:
    """One row of `qa.qa_items`."""

    qid: str
    dataset: str
    split: str
    question_type: str  # mc | yesno | short_1hop | short_2hop
    question: str
    options: dict[str, str]  # letter -> text; {} for short answers
    option_cuis: tuple[str, ...]  # concept of each MC option, in letter order
    answer: str  # option letter (mc, yesno) or the canonical answer name (short)
    answer_cuis: tuple[str, ...]
    acceptable_answers: tuple[str, ...]
    gold_path: tuple[str, ...]  # edge ids, in path order; () for a "no"
    gold_pairs: tuple[Pair, ...]  # the unordered concept pairs of the gold path (what the split rule counts)
    # Each gold edge as the keys "src|relation|dst" that state it: itself and its inverse listing (what
    # "gold fact seen" counts: a triple of another relation between the same concepts is not the fact).
    gold_facts: tuple[tuple[str, ...], ...]
    gold_path_text: str
    seed_cuis: tuple[str, ...]  # the question entities
    relations: tuple[str, ...]  # the relations asked about: path order; intersections answer -> each entity
    hops: int

    def as_question(self) -> QaItem:
        """This item as its MIRAGE entry carries it: acceptable answers for short answers only, and beyond
        MIRAGE's fields (its readers ignore them) what retrieval recall is measured against."""
        return QaItem(
            dataset=self.dataset,
            qid=self.qid,
            question=self.question,
            options=self.options,
            answer=self.answer,
            acceptable_answers=() if self.options else self.acceptable_answers,
            extra={"question_type": self.question_type, "hops": self.hops, "gold_path": list(self.gold_path),
                   "gold_pairs": [list(pair) for pair in self.gold_pairs],
                   "gold_facts": [list(keys) for keys in self.gold_facts], "answer_cuis": list(self.answer_cuis),
                   "option_cuis": list(self.option_cuis), "relations": list(self.relations),
                   "seed_cuis": list(self.seed_cuis)},
        )


def question_id(question_type: str, fact: Sequence[str]) -> str:
    """A qid that depends only on the fact asked about, so it is stable across seeds and runs."""
    digest = hashlib.sha1("|".join((question_type, *fact)).encode("utf-8")).hexdigest()[:16]
    return f"{DATASET_OF_TYPE[question_type]}-{digest}"


def split_of(key: str, fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> str:
    """train / validation / test from the sha1 of `key`: stable, never random."""
    position = int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:15], 16) / 16**15
    bound = 0.0
    for name, fraction in zip(SPLIT_NAMES, fractions):
        bound += fraction
        if position < bound:
            return name
    return SPLIT_NAMES[-1]


Pair = tuple[str, str]  # an unordered concept pair, stored sorted


def concept_pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


def gold_pairs_of(path: Iterable[Edge]) -> tuple[Pair, ...]:
    """The unordered concept pairs of a gold path, each once, in path order."""
    return tuple(dict.fromkeys(concept_pair(src, dst) for src, _, dst in path))


def fact_key(src: str, relation: str, dst: str) -> str:
    return f"{src}|{relation}|{dst}"


def fact_keys(edge: Edge, inverse: Mapping[str, str]) -> tuple[str, ...]:
    """The keys that state one edge: itself, and the reverse listing under its inverse relation (UMLS lists
    most relations twice); the edge's own key first."""
    src, relation, dst = edge
    reverse = {inverse[relation]} if relation in inverse else set()
    reverse |= {r for r, inv in inverse.items() if inv == relation}
    return (fact_key(src, relation, dst), *sorted(fact_key(dst, r, src) for r in reverse))


def _facts(draft: _Draft) -> set[Pair]:
    """What a question asks or rewards, as unordered pairs: its gold path; for a 1-hop question every
    (question entity, correct answer) too (each is scored correct); for a "no", the pair it asks about."""
    facts = set(gold_pairs_of(draft.path))
    if draft.question_type in ("mc", "short_1hop"):
        facts |= {concept_pair(draft.seed_cuis[0], answer) for answer in draft.answer_cuis}
    if not draft.path:
        facts.add(concept_pair(*draft.seed_cuis[:2]))
    return facts


def fact_components(facts_per_item: Sequence[set[Pair]]) -> list[Pair]:
    """For each item, its component of the fact graph, named by the component's smallest pair.

    Items that share a fact (an unordered pair) are joined, transitively (union-find over pairs).
    """
    parent: dict[Pair, Pair] = {}

    def root(pair: Pair) -> Pair:
        parent.setdefault(pair, pair)
        while parent[pair] != pair:
            parent[pair] = parent[parent[pair]]  # path halving
            pair = parent[pair]
        return pair

    for facts in facts_per_item:
        if not facts:
            raise ValueError("a question without facts cannot be split by fact")
        ordered = sorted(facts)
        for other in ordered[1:]:
            a, b = root(ordered[0]), root(other)
            if a != b:
                parent[max(a, b)] = min(a, b)  # a root stays its component's smallest pair
    return [root(min(facts)) for facts in facts_per_item]


def fact_splits(facts_per_item: Sequence[set[Pair]], fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> list[str]:
    """The split of each item such that no fact occurs in two splits: a whole component per split, from
    the hash of its smallest pair (an item alone with its facts keeps its split whatever else is generated)."""
    return [split_of("|".join(component), fractions) for component in fact_components(facts_per_item)]


def _edge_ids(warehouse: Warehouse, edges: set[Edge]) -> dict[Edge, str]:
    """Edge ids for (src, relation, dst) triples; the smallest when sources disagree on `rel`."""
    if not edges:
        return {}
    wanted = pa.table({name: [e[i] for e in sorted(edges)] for i, name in enumerate(("src", "relation", "dst"))})
    with warehouse.connect(read_only=True) as con:
        con.register("wanted_edges", wanted)
        rows = con.execute(
            "SELECT w.src, w.relation, w.dst, min(e.edge_id) FROM wanted_edges w JOIN kg.kg_edges e "
            "ON e.src_cui = w.src AND e.relation = w.relation AND e.dst_cui = w.dst GROUP BY ALL"
        ).fetchall()
    return {(src, relation, dst): edge_id for src, relation, dst, edge_id in rows}


def _path_text(graph: _Graph, draft: _Draft) -> str:
    if not draft.path:  # a "no": the edge the question asks about is absent
        subject, obj = draft.seed_cuis
        return f"NOT {graph.names[subject]} -{draft.relations[0]}-> {graph.names[obj]}"
    text = graph.names[draft.path[0][0]]
    for _, relation, dst in draft.path:
        text += f" -{relation}-> {graph.names[dst]}"
    return text


def balance_answer_positions(drafts: Sequence[_Draft], split_per_draft: Sequence[str]) -> list[_Draft]:
    """Multiple choice: the correct option's letter rotates A, B, C, D over each (question type, split) in
    qid order, so every letter is right in a quarter of each split (to within one item).

    A per-item shuffle is fair only in expectation: with seed 0 on the demo KG, D was right for 38 of 100
    validation and 31 of 72 test 2-hop items (train: 203 of 800), so a reader that leans to D looked like it
    reads, and no shortcut rule fitted on train can see it. The correct option swaps places with the option at
    its letter; the distractors keep their shuffled order otherwise."""
    rank: dict[tuple[str, str], list[int]] = {}
    for index, (draft, split) in enumerate(zip(drafts, split_per_draft, strict=True)):
        if len(draft.options) == len(OPTION_LETTERS) and draft.answer in OPTION_LETTERS:
            rank.setdefault((draft.question_type, split), []).append(index)
    balanced = list(drafts)
    for indices in rank.values():
        indices.sort(key=lambda i: question_id(drafts[i].question_type, drafts[i].fact))
        for position, index in enumerate(indices):
            draft = drafts[index]
            option_cuis = list(draft.option_cuis)
            names = [draft.options[letter] for letter in OPTION_LETTERS]
            here, there = OPTION_LETTERS.index(draft.answer), position % len(OPTION_LETTERS)
            option_cuis[here], option_cuis[there] = option_cuis[there], option_cuis[here]
            names[here], names[there] = names[there], names[here]
            balanced[index] = replace(draft, option_cuis=tuple(option_cuis), answer=OPTION_LETTERS[there],
                                      options=dict(zip(OPTION_LETTERS, names, strict=True)))
    return balanced


def _finish(drafts: list[_Draft], graph: _Graph, warehouse: Warehouse,
            splits: Sequence[float]) -> tuple[list[KgQaItem], list[Pair]]:
    """The items, split by fact, and each one's fact component."""
    edge_ids = _edge_ids(warehouse, {edge for draft in drafts for edge in draft.path})
    components = fact_components([_facts(draft) for draft in drafts])
    split_per_draft = [split_of("|".join(component), splits) for component in components]
    drafts = balance_answer_positions(drafts, split_per_draft)
    items = []
    for draft, split in zip(drafts, split_per_draft, strict=True):
        qid = question_id(draft.question_type, draft.fact)
        items.append(KgQaItem(
            qid=qid,
            dataset=DATASET_OF_TYPE[draft.question_type],
            split=split,
            question_type=draft.question_type,
            question=draft.question,
            options=draft.options,
            option_cuis=draft.option_cuis,
            answer=draft.answer,
            answer_cuis=draft.answer_cuis,
            acceptable_answers=draft.acceptable_answers,
            gold_path=tuple(edge_ids[edge] for edge in draft.path),
            gold_pairs=gold_pairs_of(draft.path),
            gold_facts=tuple(fact_keys(edge, graph.inverse) for edge in draft.path),
            gold_path_text=_path_text(graph, draft),
            seed_cuis=draft.seed_cuis,
            relations=draft.relations,
            hops=len(draft.relations),
        ))
    return items, components


# --------------------------------------------------------------------------- outputs


_TABLE_SCHEMA = pa.schema([
    ("qid", pa.string()), ("dataset", pa.string()), ("split", pa.string()), ("question_type", pa.string()),
    ("question", pa.string()), ("options", pa.string()), ("option_cuis", pa.list_(pa.string())),
    ("answer", pa.string()), ("answer_cuis", pa.list_(pa.string())),
    ("acceptable_answers", pa.list_(pa.string())), ("gold_path", pa.list_(pa.string())),
    ("gold_pairs", pa.list_(pa.list_(pa.string()))), ("gold_facts", pa.list_(pa.list_(pa.string()))),
    ("gold_path_text", pa.string()), ("seed_cuis", pa.list_(pa.string())), ("relations", pa.list_(pa.string())),
    ("hops", pa.int32()),
])


def _publish_table(items: list[KgQaItem], warehouse: Warehouse) -> Path:
    """`lake/qa/qa_items.parquet` (options as JSON text) and the view `qa.qa_items`, atomically."""
    columns: dict[str, list[object]] = {name: [] for name in _TABLE_SCHEMA.names}
    for item in items:
        for name in _TABLE_SCHEMA.names:
            value = getattr(item, name)
            columns[name].append(json.dumps(value, ensure_ascii=False) if name == "options" else
                                 [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple)
                                 else value)
    return warehouse.publish_arrow(SCHEMA, TABLE, pa.table(columns, schema=_TABLE_SCHEMA))


def _write_mirage_splits(items: Sequence[KgQaItem], out_dir: str | Path) -> dict[str, Path]:
    """One MIRAGE file per split, `<out_dir>/qa_items.<split>.json`, datasets in name order:
    `{dataset: {qid: {question, options, answer[, acceptable_answers], question_type, hops, gold_path, ...}}}`."""
    by_dataset = sorted(items, key=lambda item: item.dataset)  # stable: each dataset keeps the items' order
    return {split: write_mirage(Path(out_dir) / f"qa_items.{split}.json",
                                [item.as_question() for item in by_dataset if item.split == split])
            for split in SPLIT_NAMES}


@dataclass
class QaStats:
    """What one generation produced; becomes Dagster metadata."""

    items: int
    per_type: dict[str, int]
    per_split: dict[str, int]
    per_type_split: dict[str, dict[str, int]]
    per_relation: dict[str, int]  # first relation of each question
    yes: int
    no: int
    seed: int
    seconds: float
    parquet_path: str
    fact_components: int  # connected components of the fact graph (each lands whole in one split)
    largest_component: int  # items in the largest one
    pairs_in_two_splits: int  # unordered gold pairs found in more than one split: 0 by construction
    json_paths: dict[str, str]
    graph_rows_read: int = 0  # adjacency and concept rows of kg.* read into Python (the rest stays in DuckDB)

    def as_metadata(self) -> dict[str, object]:
        metadata: dict[str, object] = {
            "table": f"{SCHEMA}.{TABLE}",
            "items": self.items,
            "seed": self.seed,
            "yesno_yes": self.yes,
            "yesno_no": self.no,
            "seconds": round(self.seconds, 3),
            "parquet_path": self.parquet_path,
            "fact_components": self.fact_components,
            "largest_fact_component_items": self.largest_component,
            "gold_pairs_in_two_splits": self.pairs_in_two_splits,
            "items_dropped_straddling_splits": 0,  # components keep every item whole: none is dropped
            "graph_rows_read": self.graph_rows_read,
        }
        metadata.update({f"items_{t}": n for t, n in self.per_type.items()})
        metadata.update({f"split_{s}": n for s, n in self.per_split.items()})
        metadata.update({f"relation_{r}": n for r, n in sorted(self.per_relation.items())})
        metadata.update({f"json_{s}": p for s, p in self.json_paths.items()})
        return metadata


def gold_pairs_in_two_splits(warehouse: Warehouse) -> list[tuple[str, str, list[str]]]:
    """(cui, cui, splits) of every unordered gold pair of `qa.qa_items` found in more than one split."""
    with warehouse.connect(read_only=True) as con:
        return [(a, b, list(splits)) for a, b, splits in con.execute(
            f"SELECT pair[1], pair[2], list(DISTINCT split ORDER BY split) FROM "
            f"(SELECT split, unnest(gold_pairs) AS pair FROM {SCHEMA}.{TABLE}) GROUP BY ALL "
            "HAVING count(DISTINCT split) > 1 ORDER BY 1, 2").fetchall()]


def gold_pairs_in_several_splits(items: Iterable[KgQaItem]) -> dict[Pair, set[str]]:
    """Every unordered gold pair that occurs in more than one split, with those splits (empty when leak-free)."""
    splits_of: dict[Pair, set[str]] = defaultdict(set)
    for item in items:
        for pair in item.gold_pairs:
            splits_of[pair].add(item.split)
    return {pair: splits for pair, splits in splits_of.items() if len(splits) > 1}


def _per_type_counts(per_type: int | Mapping[str, int]) -> dict[str, int]:
    if isinstance(per_type, int):
        return {t: per_type for t in QUESTION_TYPES}
    unknown = set(per_type) - set(QUESTION_TYPES)
    if unknown:
        raise ValueError(f"unknown question types {sorted(unknown)}; known: {', '.join(QUESTION_TYPES)}")
    return {t: int(per_type.get(t, 0)) for t in QUESTION_TYPES}


def _take_unique(drafts: Iterator[_Draft], count: int) -> list[_Draft]:
    """The first `count` drafts, each fact and each question text once (a repeated text
    could otherwise land in two splits)."""
    taken: list[_Draft] = []
    seen: set[tuple[str, ...] | str] = set()
    for draft in drafts:
        if len(taken) >= count:
            break
        if draft.fact not in seen and draft.question not in seen:
            seen.update((draft.fact, draft.question))
            taken.append(draft)
    return taken


def generate_qa_items(
    warehouse: Warehouse,
    out_dir: str | Path,
    *,
    seed: int = 0,
    per_type: int | Mapping[str, int] = 1000,
    splits: Sequence[float] = (0.8, 0.1, 0.1),
    limits: QaLimits = QaLimits(),
) -> QaStats:
    """Generate up to `per_type` questions of each type from `kg.kg_nodes`/`kg.kg_edges`,
    publish them as `qa.qa_items` and write MIRAGE files `qa_items.<split>.json` under `out_dir`.

    Deterministic for a given graph, seed and settings. `splits` are the
    train/validation/test fractions of the question-entity hash.
    """
    started = time.perf_counter()
    if len(splits) != len(SPLIT_NAMES) or min(splits) < 0 or abs(sum(splits) - 1.0) > 1e-9:
        raise ValueError(f"splits must be three non-negative fractions summing to 1, got {tuple(splits)}")
    counts = _per_type_counts(per_type)
    with warehouse.connect(read_only=True) as con:
        graph = _Graph(con, limits)
        drafts: list[_Draft] = []
        for question_type in QUESTION_TYPES:
            rng = random.Random(f"{seed}:{question_type}")
            drafts += _take_unique(_DRAFTERS[question_type](graph, rng), counts[question_type])
        # Names for the gold path texts, read while the connection is open.
        graph._load_concepts({c for draft in drafts for edge in draft.path for c in edge[::2]}
                             | {c for draft in drafts for c in draft.seed_cuis})
        rows_read = graph.rows_read
    items, components = _finish(drafts, graph, warehouse, splits)
    leaked = gold_pairs_in_several_splits(items)
    if leaked:  # cannot happen by construction; never publish a leaking benchmark if it ever does
        raise AssertionError(f"{len(leaked)} gold pairs in several splits, e.g. {next(iter(leaked.items()))}")
    component_sizes = Counter(components)
    parquet = _publish_table(items, warehouse)
    json_paths = _write_mirage_splits(items, out_dir)

    per_type_split: dict[str, dict[str, int]] = {t: dict.fromkeys(SPLIT_NAMES, 0) for t in QUESTION_TYPES}
    for item in items:
        per_type_split[item.question_type][item.split] += 1
    yesno = Counter(item.answer for item in items if item.question_type == "yesno")
    stats = QaStats(
        items=len(items),
        per_type={t: sum(per_type_split[t].values()) for t in QUESTION_TYPES},
        per_split={s: sum(per_type_split[t][s] for t in QUESTION_TYPES) for s in SPLIT_NAMES},
        per_type_split=per_type_split,
        per_relation=dict(Counter(item.relations[0] for item in items)),
        yes=yesno["A"],
        no=yesno["B"],
        seed=seed,
        seconds=time.perf_counter() - started,
        parquet_path=str(parquet),
        json_paths={s: str(p) for s, p in json_paths.items()},
        fact_components=len(component_sizes),
        largest_component=max(component_sizes.values(), default=0),
        pairs_in_two_splits=len(leaked),
        graph_rows_read=rows_read,
    )
    log.info("qa items: %d (%s) in %.1fs", stats.items, stats.per_type, stats.seconds)
    return stats
