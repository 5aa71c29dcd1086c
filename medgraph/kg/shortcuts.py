"""No-LLM shortcut baselines of the KG-derived questions, and the relation-aware oracle (their ceiling).

A question whose answer follows from the graph's shape alone measures nothing about retrieval or
reading. Each rule below answers every item of `qa.qa_items` with no model, from the question text, the
options and the graph; its score per item is the *expected* accuracy of the rule (ties are broken at
random, so a rule that narrows four options to two scores 0.5 where one of the two is right):

    random          chance: 1/options (multiple choice, yes/no); 1/|concepts| for a short answer
    majority        the most frequent answer of the train split (a letter, "yes"/"no", or an answer text)
    adjacency       the option linked to a question concept by any edge within the item's hops ("yes" iff
                    the two concepts are linked); for a short answer a random concept among the common
                    neighbours of the question concepts (of the one: within its hops)
    name_overlap    the option (or, short: the nearby concept) whose name shares most words with the question;
                    yes/no: "yes" iff the two names share a word
    semantic_type   multiple choice and yes/no: the option whose semantic type is the one the asked relation's
                    answers have most often in train ("yes" iff the object has it)
    relation_oracle the ceiling: the option reached from the question concept by the asked relation (path),
                    "yes" iff that edge exists, the concepts that path reaches

`shortcut_rows` gives one row per (dataset, split, rule) with the mean and n; `check_shortcuts` is the
blocking rule of `qa/qa_items`: on each test split no shortcut beats chance by more than `margin`.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from medgraph.storage import Warehouse, read_rows

SHORTCUTS = ("random", "majority", "adjacency", "name_overlap", "semantic_type")
ORACLE = "relation_oracle"
MARGIN = 0.10
TABLE = "qa_shortcuts"
_STOPWORDS = frozenset("""a an and are as at be by for from has have in is it of on or the to what which with
    following kind condition disease drug gene may other""".split())


@dataclass(frozen=True)
class _Item:
    qid: str
    dataset: str
    split: str
    question_type: str
    question: str
    options: dict[str, str]
    option_cuis: tuple[str, ...]
    answer: str
    answer_cuis: tuple[str, ...]
    acceptable: tuple[str, ...]
    seeds: tuple[str, ...]
    relations: tuple[str, ...]
    hops: int

    @property
    def short(self) -> bool:
        return not self.options

    @property
    def yesno(self) -> bool:
        return self.question_type == "yesno"


class _Graph:
    """The part of `kg.kg_edges` within two edges of the items' concepts (read in one or two queries)."""

    def __init__(self, warehouse: Warehouse, items: Sequence[_Item]):
        self.neighbours: dict[str, set[str]] = defaultdict(set)
        self.out: dict[tuple[str, str], set[str]] = defaultdict(set)  # (src, relation) -> dsts
        self.read: set[str] = set()
        self._words: dict[str, set[str]] = {}
        with warehouse.connect(read_only=True) as con:
            self.concepts = con.execute("SELECT count(*) FROM kg.kg_nodes").fetchone()[0]
            self._read(con, {c for item in items for c in (*item.seeds, *item.option_cuis)})
            self._read(con, {n for item in items if item.hops > 1 for s in item.seeds for n in self.neighbours[s]})
            # Names and types of the concepts read (every endpoint of the edges above), not of the whole graph.
            seen = sorted(set(self.neighbours) | {c for item in items for c in (*item.seeds, *item.option_cuis)})
            con.register("shortcut_concepts", pa.table({"cui": pa.array(seen, pa.string())}))
            rows = con.execute("SELECT n.cui, n.preferred_name, n.tuis[1], len(n.tuis) > 0 FROM kg.kg_nodes n "
                               "WHERE n.cui IN (SELECT cui FROM shortcut_concepts)").fetchall()
            self.names = {cui: name for cui, name, _, _ in rows}
            self.tui = {cui: tui for cui, _, tui, typed in rows if typed}

    def _read(self, con, cuis: set[str]) -> None:
        wanted = sorted(cuis - self.read)
        if not wanted:
            return
        rows = con.execute(
            "SELECT src_cui, relation, dst_cui FROM kg.kg_edges WHERE src_cui <> dst_cui AND "
            "(src_cui IN (SELECT unnest($ids)) OR dst_cui IN (SELECT unnest($ids)))", {"ids": wanted}).fetchall()
        for src, relation, dst in rows:
            self.neighbours[src].add(dst)
            self.neighbours[dst].add(src)
            self.out[(src, relation)].add(dst)
        self.read |= set(wanted)

    def words(self, cui: str) -> set[str]:
        """`content_words` of a concept's preferred name, once per concept (2-hop neighbourhoods through a hub
        hold tens of thousands of concepts, met again by many items)."""
        words = self._words.get(cui)
        if words is None:
            words = self._words[cui] = content_words(self.names.get(cui) or "")
        return words

    def within(self, cui: str, hops: int) -> set[str]:
        reached, frontier = set(), {cui}
        for _ in range(hops):
            frontier = {n for c in frontier for n in self.neighbours.get(c, ())} - reached - {cui}
            reached |= frontier
        return reached

    def near(self, seeds: Sequence[str], hops: int) -> set[str]:
        """Common neighbours of several question concepts; what lies within `hops` of one."""
        if len(seeds) > 1:
            return set.intersection(*(set(self.neighbours.get(s, ())) for s in seeds))
        return self.within(seeds[0], hops)

    def reached(self, start: str, relations: Sequence[str]) -> set[str]:
        """Concepts reached from `start` along the relation path (each step as listed)."""
        frontier = {start}
        for relation in relations:
            frontier = {d for c in frontier for d in self.out.get((c, relation), ())}
        return frontier


def content_words(text: str) -> set[str]:
    """The words the name-overlap rule compares: lowercase, longer than two letters, not a stopword."""
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2 and w not in _STOPWORDS}


def _normalized(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _pick(candidates: Iterable[str], correct: Iterable[str]) -> float:
    """Expected accuracy of a uniform pick among `candidates`."""
    pool = set(candidates)
    return len(pool & set(correct)) / len(pool) if pool else 0.0


def _best(scores: Mapping[str, float]) -> set[str]:
    top = max(scores.values(), default=0.0)
    return {key for key, value in scores.items() if value == top}


def _choice_scores(item: _Item, graph: _Graph, majority: str | None, typical_tui: str | None) -> dict[str, float]:
    """Multiple choice: expected accuracy of each rule on one item."""
    letters = list(item.options)
    cui_of = dict(zip(letters, item.option_cuis))
    near = set().union(*(graph.within(s, item.hops) for s in item.seeds))
    linked = [k for k in letters if cui_of.get(k) in near]
    overlap = {k: float(len(content_words(item.options[k]) & content_words(item.question))) for k in letters}
    typed = [k for k in letters if typical_tui is not None and graph.tui.get(cui_of.get(k, "")) == typical_tui]
    reached = graph.reached(item.seeds[0], item.relations)
    by_relation = [k for k in letters if cui_of.get(k) in reached]
    chance = 1 / len(letters)
    return {
        "random": chance,
        "majority": float(majority == item.answer),
        "adjacency": _pick(linked, [item.answer]) if linked else chance,
        "name_overlap": _pick(_best(overlap), [item.answer]),
        "semantic_type": _pick(typed, [item.answer]) if typed else chance,
        ORACLE: _pick(by_relation, [item.answer]) if by_relation else chance,
    }


def _yesno_scores(item: _Item, graph: _Graph, majority: str | None, typical_tui: str | None) -> dict[str, float]:
    """Yes/no (A = yes): expected accuracy of each rule on one item."""
    subject, obj = item.seeds[0], item.seeds[-1]
    yes = item.answer == "A"
    shared = content_words(graph.names.get(subject, "")) & content_words(graph.names.get(obj, ""))
    edge = obj in graph.reached(subject, item.relations)
    return {
        "random": 0.5,
        "majority": float(majority == item.answer),
        "adjacency": float((obj in graph.neighbours.get(subject, ())) == yes),
        "name_overlap": float(bool(shared) == yes),
        "semantic_type": float((typical_tui is not None and graph.tui.get(obj) == typical_tui) == yes),
        ORACLE: float(edge == yes),
    }


def _short_scores(item: _Item, graph: _Graph, majority: str | None) -> dict[str, float]:
    """Short answer: expected exact-match accuracy of each rule on one item."""
    near = graph.near(item.seeds, item.hops)
    question = content_words(item.question)
    overlap = {c: float(len(graph.words(c) & question)) for c in near}
    if len(item.seeds) > 1:  # an intersection: the answer -> each entity by its relation
        reached = set.intersection(*(
            {c for c in graph.neighbours.get(seed, ()) if seed in graph.out.get((c, relation), ())}
            for seed, relation in zip(item.seeds, item.relations)))
    else:
        reached = graph.reached(item.seeds[0], item.relations)
    acceptable = {_normalized(a) for a in item.acceptable} | {_normalized(item.answer)}
    return {
        "random": 1 / max(graph.concepts, 1),
        "majority": float(majority is not None and _normalized(majority) in acceptable),
        "adjacency": _pick(near, item.answer_cuis),
        "name_overlap": _pick(_best(overlap), item.answer_cuis) if overlap else 0.0,
        ORACLE: _pick(reached, item.answer_cuis),
    }


def item_scores(warehouse: Warehouse, items: Sequence[_Item] | None = None) -> list[tuple[_Item, dict[str, float]]]:
    """Each item of `qa.qa_items` with the expected accuracy of every rule on it."""
    items = list(items) if items is not None else read_items(warehouse)
    graph = _Graph(warehouse, items)
    train = [item for item in items if item.split == "train"]
    majority = {dataset: Counter(i.answer for i in train if i.dataset == dataset).most_common(1)[0][0]
                for dataset in {i.dataset for i in train}}
    # The semantic type the answers of a relation (the last of a path) have most often in train.
    types: dict[str, Counter[str]] = defaultdict(Counter)
    for item in train:
        objects = item.answer_cuis if not item.yesno else ((item.seeds[-1],) if item.answer == "A" else ())
        for cui in objects:
            if cui in graph.tui:
                types[item.relations[-1]][graph.tui[cui]] += 1
    typical = {relation: counts.most_common(1)[0][0] for relation, counts in types.items()}
    scored = []
    for item in items:
        tui = typical.get(item.relations[-1])
        if item.short:
            scores = _short_scores(item, graph, majority.get(item.dataset))
        elif item.yesno:
            scores = _yesno_scores(item, graph, majority.get(item.dataset), tui)
        else:
            scores = _choice_scores(item, graph, majority.get(item.dataset), tui)
        scored.append((item, scores))
    return scored


def shortcut_rows(scored: Sequence[tuple[_Item, Mapping[str, float]]]) -> list[dict[str, object]]:
    """(dataset, split, rule) -> mean expected accuracy over the items, with n and the dataset's chance."""
    groups: dict[tuple[str, str], list[Mapping[str, float]]] = defaultdict(list)
    for item, scores in scored:
        groups[(item.dataset, item.split)].append(scores)
    rows = []
    for (dataset, split), values in sorted(groups.items()):
        chance = sum(v["random"] for v in values) / len(values)
        for rule in (*SHORTCUTS, ORACLE):
            known = [v[rule] for v in values if rule in v]
            if known:
                rows.append({"dataset": dataset, "split": split, "rule": rule, "accuracy": sum(known) / len(known),
                             "n": len(known), "chance": chance, "shortcut": rule != ORACLE})
    return rows


def check_shortcuts(rows: Iterable[Mapping[str, object]], margin: float = MARGIN,
                    split: str = "test") -> list[str]:
    """Every shortcut that beats chance by more than `margin` on `split`, as a sentence (empty: none)."""
    return [f"{r['dataset']} {r['split']}: {r['rule']} {float(r['accuracy']):.3f} > chance {float(r['chance']):.3f} "
            f"+ {margin:.2f} (n={r['n']})"
            for r in rows if r["split"] == split and r["shortcut"]
            and float(r["accuracy"]) > float(r["chance"]) + margin]


def read_items(warehouse: Warehouse) -> list[_Item]:
    with warehouse.connect(read_only=True) as con:
        rows = con.execute(
            "SELECT qid, dataset, split, question_type, question, options, option_cuis, answer, answer_cuis, "
            "acceptable_answers, seed_cuis, relations, hops FROM qa.qa_items ORDER BY qid").fetchall()
    return [_Item(qid, dataset, split, qtype, question, json.loads(options or "{}"), tuple(option_cuis or ()),
                  answer, tuple(answer_cuis or ()), tuple(acceptable or ()), tuple(seeds), tuple(relations),
                  int(hops))
            for qid, dataset, split, qtype, question, options, option_cuis, answer, answer_cuis, acceptable, seeds,
            relations, hops in rows]


def publish_shortcuts(warehouse: Warehouse, rows: Sequence[Mapping[str, object]]) -> None:
    """`qa.qa_shortcuts` (one lake file, replaced atomically, and its view)."""
    table = pa.Table.from_pylist([dict(r) for r in rows], schema=pa.schema([
        ("dataset", pa.string()), ("split", pa.string()), ("rule", pa.string()), ("accuracy", pa.float64()),
        ("n", pa.int64()), ("chance", pa.float64()), ("shortcut", pa.bool_())]))
    warehouse.publish_arrow("qa", TABLE, table)


def measure_shortcuts(warehouse: Warehouse) -> list[dict[str, object]]:
    """Every rule on every item of `qa.qa_items`, published as `qa.qa_shortcuts`; the rows."""
    rows = shortcut_rows(item_scores(warehouse))
    publish_shortcuts(warehouse, rows)
    return rows


def read_shortcuts(warehouse: Warehouse) -> list[dict[str, object]]:
    """The rows of `qa.qa_shortcuts`; [] before `qa/qa_items` has measured them."""
    return read_rows(warehouse, "qa", TABLE, order_by="dataset, split, rule")


def shortcuts_markdown(rows: Sequence[Mapping[str, object]], split: str = "test") -> str:
    """One line per dataset: each rule's accuracy on `split` (n), chance first, the oracle last."""
    by_dataset: dict[str, dict[str, Mapping[str, object]]] = defaultdict(dict)
    for row in rows:
        if row["split"] == split:
            by_dataset[str(row["dataset"])][str(row["rule"])] = row
    rules = (*SHORTCUTS, ORACLE)
    lines = ["| dataset | n | " + " | ".join(rules) + " |", "|---|---|" + "---|" * len(rules)]
    for dataset, by_rule in sorted(by_dataset.items()):
        n = max(int(r["n"]) for r in by_rule.values())
        cells = [f"{float(by_rule[r]['accuracy']):.3f}" if r in by_rule else "-" for r in rules]
        lines.append(f"| {dataset} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
