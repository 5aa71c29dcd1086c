"""The `qa.qa_items` table: one row per generated question, with its split, gold path, pairs and facts.

Written by `medgraph.qa.generate` (a lake Parquet file and its view, atomically) and read back as QaItems
by everything that trains or evaluates on the KG questions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from medgraph.qa.item import QaItem
from medgraph.qa.mirage import load_mirage
from medgraph.storage import Warehouse

SCHEMA = "qa"
TABLE = "qa_items"

TABLE_SCHEMA = pa.schema([
    ("qid", pa.string()), ("dataset", pa.string()), ("split", pa.string()), ("question_type", pa.string()),
    ("question", pa.string()), ("options", pa.string()), ("option_cuis", pa.list_(pa.string())),
    ("answer", pa.string()), ("answer_cuis", pa.list_(pa.string())),
    ("acceptable_answers", pa.list_(pa.string())), ("gold_path", pa.list_(pa.string())),
    ("gold_pairs", pa.list_(pa.list_(pa.string()))), ("gold_facts", pa.list_(pa.list_(pa.string()))),
    ("gold_path_text", pa.string()), ("seed_cuis", pa.list_(pa.string())), ("relations", pa.list_(pa.string())),
    ("hops", pa.int32()),
])


def publish_qa_items(items: Sequence[object], warehouse: Warehouse) -> Path:
    """`lake/qa/qa_items.parquet` (options as JSON text) and the view `qa.qa_items`, atomically, from items
    with one attribute per column (`medgraph.qa.generate.KgQaItem`)."""
    columns: dict[str, list[object]] = {name: [] for name in TABLE_SCHEMA.names}
    for item in items:
        for name in TABLE_SCHEMA.names:
            value = getattr(item, name)
            columns[name].append(json.dumps(value, ensure_ascii=False) if name == "options" else
                                 [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple)
                                 else value)
    return warehouse.publish_arrow(SCHEMA, TABLE, pa.table(columns, schema=TABLE_SCHEMA))


def load_qa_items(warehouse: Warehouse, split: str, limit: int | None = None, seed: int = 0,
                  datasets: Sequence[str] | None = None) -> list[QaItem]:
    """`qa.qa_items` of one split (and of `datasets`, when given) as QaItems carrying gold path, seed, answer and
    option CUIs in `extra`; `limit` takes a seeded sample (in qid order)."""
    with warehouse.connect(read_only=True) as con:
        rows = con.execute(
            "SELECT dataset, qid, question, options, answer, acceptable_answers, gold_path, seed_cuis, answer_cuis, "
            f"option_cuis, question_type, relations, gold_pairs, gold_facts, hops FROM {SCHEMA}.{TABLE} WHERE split = ? "
            + ("AND list_contains(?, dataset) " if datasets is not None else "") + "ORDER BY qid",
            [split] + ([list(datasets)] if datasets is not None else [])).fetchall()
    if limit is not None and limit < len(rows):
        rows = sorted(random.Random(seed).sample(rows, limit), key=lambda row: row[1])
    return [QaItem(dataset=dataset, qid=qid, question=question, options=json.loads(options or "{}"), answer=answer,
                   acceptable_answers=tuple(acceptable or ()),
                   extra={"gold_path": list(gold), "seed_cuis": list(seeds), "answer_cuis": list(answers),
                          "option_cuis": list(option_cuis or ()), "question_type": question_type,
                          "relations": list(relations or ()), "gold_pairs": [list(p) for p in pairs or ()],
                          "gold_facts": [list(f) for f in facts or ()], "hops": hops})
            for dataset, qid, question, options, answer, acceptable, gold, seeds, answers, option_cuis,
            question_type, relations, pairs, facts, hops in rows]


def in_split_file_order(items: Sequence[QaItem], split_file: Path) -> list[QaItem]:
    """`items` in the order of their split's MIRAGE file (`qa/qa_items.<split>.json`): the evaluation takes the
    first N of each dataset in that order (`load_benchmark`), question types in generation order, so a gate
    that draws its first N the same way measures the same mix of shapes (the first 48 kgqa_mc validation
    questions by qid held 6 one-hop questions, the file's first 48 hold 24)."""
    position = {(item.dataset, item.qid): n for n, item in enumerate(load_mirage(split_file))}
    missing = [item.qid for item in items if (item.dataset, item.qid) not in position]
    if missing:
        raise ValueError(f"{split_file}: {len(missing)} questions of qa.qa_items are not in the file (e.g. "
                         f"{missing[0]}): the file is older than the table; materialize qa/qa_items again")
    return sorted(items, key=lambda item: position[(item.dataset, item.qid)])


def first_as_evaluated(items: Sequence[QaItem], split_file: Path, datasets: Sequence[str],
                       per_dataset: int) -> list[QaItem]:
    """The first `per_dataset` items of each of `datasets` in the split file's order: the questions an
    evaluation of that split asks with `limit_per_dataset` (`load_benchmark`), as `qa.qa_items` rows (gold
    facts and all), for a gate or a benchmark that must measure what the report measures."""
    ordered = in_split_file_order(items, split_file)
    return [item for dataset in datasets for item in [i for i in ordered if i.dataset == dataset][:per_dataset]]


def gold_pairs_in_two_splits(warehouse: Warehouse) -> list[tuple[str, str, list[str]]]:
    """(cui, cui, splits) of every unordered gold pair of `qa.qa_items` found in more than one split."""
    with warehouse.connect(read_only=True) as con:
        return [(a, b, list(splits)) for a, b, splits in con.execute(
            f"SELECT pair[1], pair[2], list(DISTINCT split ORDER BY split) FROM "
            f"(SELECT split, unnest(gold_pairs) AS pair FROM {SCHEMA}.{TABLE}) GROUP BY ALL "
            "HAVING count(DISTINCT split) > 1 ORDER BY 1, 2").fetchall()]
