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
In each dataset and split no answer concept answers more than a small share of the questions
(`QaLimits.max_answer_share`, per relation chain `max_answer_share_per_relation`): a hub that
answers most of them would make "always say the hub" beat chance; the excess is not asked.

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
`medgraph.qa.item.QaItem` (`KgQaItem.as_question`), one per split; the table is `medgraph.qa.table`.
Within a file each dataset's questions come in a seeded hash order, not type by type: an evaluation asks
the first N of each dataset (`load_benchmark`'s `limit_per_dataset`), so any prefix must be a uniform
draw of the split (written type by type, a prefix of `kgqa_mc` was every one-hop question first).
"""


from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from medgraph.qa.drafting import DATASET_OF_TYPE, QUESTION_TYPES, Draft
from medgraph.qa.item import QaItem
from medgraph.qa.kg_view import Edge, QaGraph, QaLimits
from medgraph.qa.kinds import mc, mc_2hop, short_1hop, short_2hop, yesno
from medgraph.qa.mirage import write_mirage
from medgraph.qa.splits import (
    SPLIT_NAMES,
    Pair,
    balance_answer_positions,
    bound_answer_shares,
    draft_facts,
    fact_components,
    fact_keys,
    gold_pairs_of,
    question_id,
    split_of,
)
from medgraph.qa.table import SCHEMA, TABLE, publish_qa_items
from medgraph.storage import Warehouse

log = logging.getLogger(__name__)

_DRAFTERS: dict[str, Callable[[QaGraph, random.Random], Iterator[Draft]]] = {
    "mc": mc.drafts,
    "mc_2hop": mc_2hop.drafts,
    "yesno": yesno.drafts,
    "short_1hop": short_1hop.drafts,
    "short_2hop": short_2hop.drafts,
}


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


def _path_text(graph: QaGraph, draft: Draft) -> str:
    if not draft.path:  # a "no": the edge the question asks about is absent
        subject, obj = draft.seed_cuis
        return f"NOT {graph.names[subject]} -{draft.relations[0]}-> {graph.names[obj]}"
    text = graph.names[draft.path[0][0]]
    for _, relation, dst in draft.path:
        text += f" -{relation}-> {graph.names[dst]}"
    return text


def _finish(drafts: list[Draft], graph: QaGraph, warehouse: Warehouse, splits: Sequence[float], seed: int,
            limits: QaLimits) -> tuple[list[KgQaItem], list[Pair], int]:
    """The items, split by fact, each one's fact component, and how many drafts the answer-share bound dropped."""
    components = fact_components([draft_facts(draft) for draft in drafts])
    split_per_draft = [split_of("|".join(component), splits) for component in components]
    draw_order = sorted(range(len(drafts)), key=lambda i: _draw_order(seed, question_id(drafts[i].question_type,
                                                                                        drafts[i].fact)))
    kept = sorted(bound_answer_shares(drafts, split_per_draft, draw_order, limits.max_answer_share,
                                      limits.max_answer_share_per_relation))
    dropped = len(drafts) - len(kept)
    drafts, components = [drafts[i] for i in kept], [components[i] for i in kept]
    split_per_draft = [split_per_draft[i] for i in kept]
    edge_ids = _edge_ids(warehouse, {edge for draft in drafts for edge in draft.path})
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
    return items, components, dropped


def _write_mirage_splits(items: Sequence[KgQaItem], out_dir: str | Path, seed: int) -> dict[str, Path]:
    """One MIRAGE file per split, `<out_dir>/qa_items.<split>.json`, datasets in name order, each dataset's
    questions in `_draw_order`: `{dataset: {qid: {question, options, answer[, acceptable_answers], question_type,
    hops, gold_path, ...}}}`."""
    ordered = sorted(items, key=lambda item: (item.dataset, _draw_order(seed, item.qid)))
    return {split: write_mirage(Path(out_dir) / f"qa_items.{split}.json",
                                [item.as_question() for item in ordered if item.split == split])
            for split in SPLIT_NAMES}


def _draw_order(seed: int, qid: str) -> str:
    """A question's place in its split's file: a hash of the seed and its qid, so that the first N of a dataset
    are a uniform draw of every type it holds, and a question keeps its place when others come or go."""
    return hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest()


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
    dropped_for_answer_share: int = 0  # drafts not asked: their answer concept had its share (QaLimits)

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
            "items_dropped_for_answer_share": self.dropped_for_answer_share,
        }
        metadata.update({f"items_{t}": n for t, n in self.per_type.items()})
        metadata.update({f"split_{s}": n for s, n in self.per_split.items()})
        metadata.update({f"relation_{r}": n for r, n in sorted(self.per_relation.items())})
        metadata.update({f"json_{s}": p for s, p in self.json_paths.items()})
        return metadata


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


def _take_unique(drafts: Iterator[Draft], count: int) -> list[Draft]:
    """The first `count` drafts, each fact and each question text once (a repeated text
    could otherwise land in two splits)."""
    taken: list[Draft] = []
    seen: set[tuple[str, ...] | str] = set()
    for draft in drafts:
        if len(taken) >= count:
            break
        if draft.fact not in seen and draft.question not in seen:
            seen.update((draft.fact, draft.question))
            taken.append(draft)
    return taken


def _draft(warehouse: Warehouse, seed: int, counts: Mapping[str, int], limits: QaLimits) -> tuple[list[Draft], QaGraph]:
    """Up to `counts[type]` drafts of each question type, and the graph view they were read from (with the names
    of every concept their gold paths and questions mention)."""
    with warehouse.connect(read_only=True) as con:
        graph = QaGraph(con, limits)
        drafts: list[Draft] = []
        for question_type in QUESTION_TYPES:
            rng = random.Random(f"{seed}:{question_type}")
            drafts += _take_unique(_DRAFTERS[question_type](graph, rng), counts[question_type])
        # Names for the gold path texts, read while the connection is open.
        graph._load_concepts({c for draft in drafts for edge in draft.path for c in edge[::2]}
                             | {c for draft in drafts for c in draft.seed_cuis})
    return drafts, graph


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
    drafts, graph = _draft(warehouse, seed, _per_type_counts(per_type), limits)
    items, components, dropped = _finish(drafts, graph, warehouse, splits, seed, limits)
    leaked = gold_pairs_in_several_splits(items)
    if leaked:  # cannot happen by construction; never publish a leaking benchmark if it ever does
        raise AssertionError(f"{len(leaked)} gold pairs in several splits, e.g. {next(iter(leaked.items()))}")
    component_sizes = Counter(components)
    parquet = publish_qa_items(items, warehouse)
    json_paths = _write_mirage_splits(items, out_dir, seed)

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
        graph_rows_read=graph.rows_read,
        dropped_for_answer_share=dropped,
    )
    log.info("qa items: %d (%s) in %.1fs", stats.items, stats.per_type, stats.seconds)
    return stats
