"""The MIRAGE file format, `{dataset: {qid: {question, options, answer, ...}}}`, read and written as QaItems.

`write_mirage` and `load_mirage` are inverses: every field survives (`extra` included, so a KG item's gold
path is what GSRM recall is measured against).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from medgraph.files import write_json_atomically
from medgraph.qa.item import QaItem


def write_mirage(path: str | Path, items: Sequence[QaItem]) -> Path:
    """Write QaItems as a MIRAGE-format file (atomically), the inverse of `load_mirage`: every field survives,
    `extra` included (KG items' `gold_path` is what GSRM recall is measured against)."""
    payload: dict[str, dict[str, object]] = {}
    for item in items:
        entry: dict[str, object] = {"question": item.question, "options": item.options, "answer": item.answer}
        if item.acceptable_answers:
            entry["acceptable_answers"] = list(item.acceptable_answers)
        if item.pmids:
            entry["PMID"] = list(item.pmids)
        entry.update({key: value for key, value in item.extra.items() if key not in entry})
        payload.setdefault(item.dataset, {})[item.qid] = entry
    return write_json_atomically(path, payload)


def _read_json_file(path: Path) -> object:
    """JSON from `path`; bytes that are not UTF-8 and syntax errors (a truncated file) name the file and line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte {raw[error.start]:#04x}); a MIRAGE file is UTF-8 JSON") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno}"
                         f"{'; the file is truncated' if error.pos >= len(text.rstrip()) else ''})") from None
    except _DuplicateKey as duplicate:
        # json keeps the last of two equal keys, so one question (or a whole dataset) would silently replace another.
        written = [m.start() for m in re.finditer(re.escape(json.dumps(duplicate.key)) + r"\s*:", text)]
        where = f"{path}:{text.count(chr(10), 0, written[1]) + 1}" if len(written) == 2 else str(path)
        raise ValueError(f"{where}: the key {duplicate.key!r} appears twice in one object (a repeated question "
                         "id or dataset would replace the first); give each its own key") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def load_mirage(path: str | Path, datasets: Iterable[str] | None = None) -> list[QaItem]:
    """Read `{dataset: {qid: {question, options, answer, ...}}}` into QaItems, in file order.

    `datasets` selects some of the file's datasets; naming one it lacks is an error.
    """
    path = Path(path)
    data = _read_json_file(path)
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected an object of datasets, found {type(data).__name__}")
    wanted = list(data) if datasets is None else list(datasets)
    missing = [d for d in wanted if d not in data]
    if missing:
        raise ValueError(f"{path}: no dataset(s) {missing}; the file has {sorted(data)}")
    items = []
    for dataset in wanted:
        if not isinstance(data[dataset], dict):
            raise TypeError(f"{path}: dataset {dataset!r}: expected an object of question id -> item, "
                             f"found {type(data[dataset]).__name__}")
        for qid, entry in data[dataset].items():
            # Every malformed shape names the file and the question (MIRAGE items: question, options, answer).
            if not isinstance(entry, dict):
                raise TypeError(f"{path}: {dataset}/{qid}: expected an object with question, options and answer, "
                                 f"found {type(entry).__name__}")
            lacking = [key for key in ("question", "options", "answer") if key not in entry]
            if lacking:
                raise ValueError(f"{path}: {dataset}/{qid} lacks {', '.join(lacking)} "
                                 f"(a MIRAGE item has question, options and answer; options may be {{}})")
            if not isinstance(entry["options"], dict):
                raise TypeError(f"{path}: {dataset}/{qid}: options must be an object of letter -> text, "
                                 f"found {type(entry['options']).__name__}")
            options = {str(k): str(v) for k, v in entry["options"].items()}
            answer = str(entry["answer"])
            if options and answer not in options:
                raise ValueError(f"{path}: {dataset}/{qid} answer {answer!r} is not one of {sorted(options)}")
            extra = {k: v for k, v in entry.items()
                     if k not in ("question", "options", "answer", "acceptable_answers", "PMID")}
            items.append(QaItem(
                dataset=dataset,
                qid=str(qid),
                question=str(entry["question"]),
                options=options,
                answer=answer,
                acceptable_answers=tuple(str(a) for a in entry.get("acceptable_answers") or ()),
                pmids=tuple(str(p) for p in entry.get("PMID") or ()),
                extra=extra,
            ))
    return items
