"""Rules every question type shares: the draft, sampling question subjects, picking distractors (neighbours of
the question concept under another relation, of the answer's type), the adjacency-chance guard, and 2-hop chains.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.qa.kg_view import SUBJECT_BATCH, Edge, QaGraph

QUESTION_TYPES = ("mc", "mc_2hop", "yesno", "short_1hop", "short_2hop")
DATASET_OF_TYPE = {"mc": "kgqa_mc", "mc_2hop": "kgqa_mc", "yesno": "kgqa_yesno", "short_1hop": "kgqa_short",
                   "short_2hop": "kgqa_short"}
OPTION_LETTERS = ("A", "B", "C", "D")
YES_NO_OPTIONS = {"A": "yes", "B": "no"}


@dataclass(frozen=True)
class Draft:
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


def ranked_pages(graph: QaGraph, sql: str, params: Mapping[str, object], per_page: int) -> Iterator[list[tuple]]:
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


def question_subjects(graph: QaGraph, rng: random.Random, max_answers: int | None, *, adjacency_levels: int,
              concept_levels: int, expand_hubs: bool = False, pend_next: bool = False) -> Iterator[tuple[str, str]]:
    """(relation, subject) pairs for every usable relation and every question entity it can be asked about
    (a seed: nameable, no hub; at most `max_answers` objects), taking one from each relation in turn so that
    rare relations (a few drug edges) are asked about as well as abundant ones; each relation's subjects in
    a pseudo-random order drawn from `rng`. DuckDB chooses and orders them; the neighbourhoods of each batch
    of `SUBJECT_BATCH` are read together (`QaGraph.prefetch`)."""
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
    for page in ranked_pages(graph, sql, params, SUBJECT_BATCH):
        graph.prefetch({subject for _, subject in page}, adjacency_levels, concept_levels, expand_hubs, pend_next)
        yield from page


def pick(rng: random.Random, population: Sequence[str], accept: Callable[[str], bool], k: int,
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


def pick_distractors(graph: QaGraph, subject: str, relation: str, form: str, answer: str, k: int,
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
        for cui in pick(rng, population, acceptable, k - len(chosen)):
            chosen.append(cui)
            taken_names |= graph.normalized_names[cui]
        if len(chosen) == k:
            break
    return chosen


def adjacency_chance(graph: QaGraph, seeds: Sequence[str], hops: int, answers: Iterable[str]) -> float:
    """How often a concept drawn at random near the question concepts is a correct answer: the candidates
    are the common neighbours of several question concepts, else what lies within `hops` of the one."""
    if len(seeds) > 1:
        candidates = frozenset.intersection(*(graph.neighbours.get(s, frozenset()) for s in seeds))
    else:
        candidates = graph.within(seeds[0], hops)
    return len(candidates & set(answers)) / len(candidates) if candidates else 1.0


def structure_answers(graph: QaGraph, seeds: Sequence[str], hops: int, answers: Iterable[str]) -> bool:
    """True when adjacency alone would often find a short answer (see `QaLimits.max_adjacency_chance`)."""
    return adjacency_chance(graph, seeds, hops, answers) > graph.limits.max_adjacency_chance


def by_name(graph: QaGraph, cuis: Iterable[str]) -> list[str]:
    return sorted(cuis, key=lambda c: (graph.names[c].casefold(), c))


@dataclass(frozen=True)
class Chain:
    """subject -first-> bridge -second-> answer, with every bridge and every answer the wording admits."""

    subject: str
    first: str
    bridges: tuple[str, ...]
    second: str  # canonical for the "described" wording
    answers: tuple[str, ...]  # by name

    def path_to(self, graph: QaGraph, answer: str) -> tuple[Edge, Edge]:
        seconds = graph.worded_alike(self.second, "described")
        bridge, second_step = next((b, r) for b in self.bridges for r in seconds if answer in graph.objects(b, r))
        first_step = graph.relation_between(self.subject, bridge, graph.worded_alike(self.first, "via"))
        return (self.subject, first_step, bridge), (bridge, second_step, answer)

    def about(self, graph: QaGraph) -> str:
        return relation_phrases(self.first).via.format(subject=graph.names[self.subject])

    def inherited_answers(self, graph: QaGraph) -> frozenset[str]:
        """Correct answers that no edge from a bridge gives, when the first hop goes up the hierarchy.

        "A broader category of Shortened QT interval is a manifestation of which?" asks about Abnormal QT
        interval; a disease with Shortened QT interval as a manifestation has an abnormal QT interval too (an
        annotation holds for every ancestor of its term: HPO's true-path rule), so it is a correct answer
        although no edge links it to the bridge. Read from the concepts under the bridges within the subject's
        reach (the subject, its children, the bridges' other children); deeper descendants are not walked.
        Empty when no bridge is above the subject.
        """
        above = [b for b in self.bridges if b in graph.ancestors(self.subject)]
        if not above:
            return frozenset()
        inheritors = {self.subject, *graph.children.get(self.subject, ()),
                      *(c for b in above for c in graph.children.get(b, ()))}
        seconds = graph.worded_alike(self.second, "described")
        reached = {o for z in inheritors for r in seconds
                   for o in (*graph.objects(z, r), *graph.subjects(z, graph.inverse.get(r, "")))}
        return frozenset(reached - {*self.answers, self.subject, *self.bridges})


def two_hop_chains(graph: QaGraph, rng: random.Random, max_answers: int) -> Iterator[Chain]:
    """subject -r1-> bridge -r2-> answer, asked as "<r2 question> about <r1's objects>".

    Every bridge counts: the answers are all objects of r2 from any object of r1,
    so the question stays true when the subject has several r1 objects. r2 is
    never r1 itself (a transitive step) or r1's inverse (that walks back to the
    subject's own neighbourhood), and two hierarchy steps are not combined.
    """
    limits = graph.limits
    for first, subject in question_subjects(graph, rng, limits.max_answers, adjacency_levels=2, concept_levels=3,
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
                choices[graph.canonical(second, "described")] = by_name(graph, answers)
        if not choices:
            continue
        second = rng.choice(sorted(choices))
        yield Chain(subject, first, tuple(bridges), second, tuple(choices[second]))
