"""Benchmarks as data: the embedded KG-derived test split, MIRAGE, PubMedQA and generic JSONL files.

A benchmark spec (config or `MEDGRAPH_BENCHMARK`) names one or more sources,
comma-separated:

    kg                               the embedded KG-derived test split ($MEDGRAPH_HOME/qa/qa_items.test.json)
    mirage:PATH[#medqa+pubmedqa]     a MIRAGE `benchmark.json` (any subset of its datasets)
    pubmedqa:PATH                    a PubMedQA `ori_pqal.json`-style file (yes/no/maybe), reasoning-required:
                                     each abstract is to be retrieved from the corpus, not given
    jsonl:PATH[#name]                one JSON object per line: question, options, answer (and optional id)

Every source yields QaItems grouped by dataset name; dataset names become the
evaluation assets' static partitions. Bad input names the file, the line or
question id, and what was expected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from medgraph.home import HomeLayout
from medgraph.qa.drafting import DATASET_OF_TYPE
from medgraph.qa.item import QaItem
from medgraph.qa.mirage import load_mirage

PUBMEDQA_OPTIONS = {"A": "yes", "B": "no", "C": "maybe"}
KINDS = ("kg", "mirage", "pubmedqa", "jsonl")
# Dataset names become file names (eval/benchmark/<dataset>.json, lake partitions): no separators, no `..`.
DATASET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MIRAGE_DATASETS = ("bioasq", "medmcqa", "medqa", "mmlu", "pubmedqa")  # MIRAGE's five, when a file cannot be read


class BenchmarkFormatError(ValueError):
    """A benchmark file that does not have the expected shape (the message says where and what)."""


@dataclass(frozen=True)
class BenchmarkSource:
    kind: str  # kg | mirage | pubmedqa | jsonl
    path: Path | None
    datasets: tuple[str, ...] = ()  # mirage: the subset to keep; jsonl: the dataset name (one)


def check_dataset_name(name: object, where: str) -> str:
    """`name` if it is safe as a file name (`[A-Za-z0-9_.-]+`, not `.` or `..`), else BenchmarkFormatError."""
    if not isinstance(name, str) or not DATASET_NAME.fullmatch(name) or name in (".", ".."):
        raise BenchmarkFormatError(f"{where}: dataset name {name!r} is not allowed (it becomes a file name): "
                                   f"use letters, digits, '_', '.' and '-' only, not '.' or '..'")
    return name


def parse_benchmark_spec(spec: str, home: Path) -> list[BenchmarkSource]:
    """`kg,mirage:/data/benchmark.json#medqa+bioasq` -> sources. Relative paths are from the cwd."""
    sources = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part == "kg":
            sources.append(BenchmarkSource("kg", HomeLayout(home).qa_split("test")))
            continue
        kind, sep, rest = part.partition(":")
        if not sep or kind not in KINDS:
            raise ValueError(f"benchmark spec {part!r}: expected kg, mirage:PATH[#datasets], pubmedqa:PATH "
                             f"or jsonl:PATH[#name]")
        path, _, selector = rest.partition("#")
        datasets = tuple(d for d in selector.split("+") if d)
        sources.append(BenchmarkSource(kind, Path(path).expanduser(), datasets))
    if not sources:
        raise ValueError("empty benchmark spec: name at least one source (e.g. `kg`)")
    return sources


def pubmed_doc_id(pmid: str | int) -> str:
    """The corpus document id of a PubMed abstract (the packaged PubMedQA corpus uses these)."""
    return f"pubmed:{pmid}"


def load_pubmedqa(path: Path, dataset: str = "pubmedqa") -> list[QaItem]:
    """PubMedQA `ori_pqal.json`: {pmid: {QUESTION, CONTEXTS, final_decision, ...}} as yes/no/maybe items.

    The reasoning-required setting: the abstract is not in the question or the prompt (it is kept
    in `extra["contexts"]` for reference, and no method reads it); methods must retrieve it from the
    corpus, whose default `pubmedqa` source holds the 500 PQA-L abstracts of `pqal_dev.json`.
    `extra["gold_doc_ids"]` names it (`pubmed:<PMID>`), so evaluation records whether each method
    showed its answering call a chunk of it (`gold_doc_recall`); for a file whose abstracts are not
    in the corpus that is left unmeasured, with a warning (add them as a corpus file).
    """
    data = _read_json(path)
    if not isinstance(data, dict):
        raise BenchmarkFormatError(f"{path}: expected an object of PubMed ids, found {type(data).__name__}")
    letter_of = {text: letter for letter, text in PUBMEDQA_OPTIONS.items()}
    items = []
    for pmid, entry in data.items():
        if not isinstance(entry, dict) or "QUESTION" not in entry or "final_decision" not in entry:
            raise BenchmarkFormatError(f"{path}: entry {pmid}: expected QUESTION and final_decision")
        decision = str(entry["final_decision"]).strip().lower()
        if decision not in letter_of:
            raise BenchmarkFormatError(f"{path}: entry {pmid}: final_decision {decision!r} is not yes, no or maybe")
        items.append(QaItem(dataset=dataset, qid=str(pmid), question=str(entry["QUESTION"]),
                            options=dict(PUBMEDQA_OPTIONS), answer=letter_of[decision], pmids=(str(pmid),),
                            extra={"gold_doc_ids": [pubmed_doc_id(pmid)],
                                   "contexts": list(entry.get("CONTEXTS") or []),
                                   "long_answer": entry.get("LONG_ANSWER", "")}))
    return items


def load_jsonl(path: Path, dataset: str | None = None) -> list[QaItem]:
    """One question per line: {"question", "options" (object, may be empty), "answer", optional "id"}."""
    dataset = dataset or path.stem
    items = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise BenchmarkFormatError(
                    f"{path}:{number}: not UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1}); "
                    f"benchmark files are UTF-8: convert the file (e.g. iconv -f latin1 -t utf-8)") from None
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise BenchmarkFormatError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(entry, Mapping):
                raise BenchmarkFormatError(f"{path}:{number}: expected an object with question, options, answer; "
                                           f"found {type(entry).__name__}")
            missing = [k for k in ("question", "answer") if k not in entry]
            if missing:
                raise BenchmarkFormatError(f"{path}:{number}: expected fields question, options, answer; "
                                           f"missing {missing}")
            options = entry.get("options") or {}
            if not isinstance(options, Mapping):
                raise BenchmarkFormatError(f"{path}:{number}: options must be an object of letter -> text")
            options = {str(k): str(v) for k, v in options.items()}
            answer = str(entry["answer"])
            if options and answer not in options:
                raise BenchmarkFormatError(f"{path}:{number}: answer {answer!r} is not one of {sorted(options)}")
            items.append(QaItem(dataset=dataset, qid=str(entry.get("id", number)), question=str(entry["question"]),
                                options=options, answer=answer,
                                acceptable_answers=tuple(str(a) for a in entry.get("acceptable_answers") or ())))
    return items


def load_source(source: BenchmarkSource) -> list[QaItem]:
    if source.path is None or not source.path.is_file():
        hint = " (materialize qa/qa_items first)" if source.kind == "kg" else ""
        raise FileNotFoundError(f"benchmark file {source.path} does not exist{hint}")
    if source.kind in ("kg", "mirage"):
        try:
            return load_mirage(source.path, source.datasets or None)
        except (TypeError, ValueError) as error:
            raise BenchmarkFormatError(str(error)) from None
    if source.kind == "pubmedqa":
        return load_pubmedqa(source.path)
    return load_jsonl(source.path, source.datasets[0] if source.datasets else None)


def load_benchmark(spec: str, home: Path, limit_per_dataset: int | None = None) -> dict[str, list[QaItem]]:
    """Items of every source by dataset name, in file order (optionally the first N of each)."""
    by_dataset: dict[str, list[QaItem]] = {}
    for source in parse_benchmark_spec(spec, home):
        for item in load_source(source):
            if item.dataset not in by_dataset:
                check_dataset_name(item.dataset, str(source.path))
            by_dataset.setdefault(item.dataset, []).append(item)
    if limit_per_dataset is not None:
        by_dataset = {name: items[:limit_per_dataset] for name, items in by_dataset.items()}
    duplicates = {name for name, items in by_dataset.items() if len({i.qid for i in items}) != len(items)}
    if duplicates:
        raise BenchmarkFormatError(f"datasets {sorted(duplicates)} repeat question ids (two sources share a name?)")
    return by_dataset


KG_DATASETS = tuple(sorted(set(DATASET_OF_TYPE.values())))  # the embedded split's datasets


def _declared_names(source: BenchmarkSource) -> list[str] | None:
    """The dataset names a source declares without opening a file; None for a MIRAGE file without selector."""
    if source.kind == "kg":
        return list(KG_DATASETS)
    if source.kind == "pubmedqa":
        return ["pubmedqa"]
    if source.kind == "jsonl":
        return [source.datasets[0] if source.datasets else source.path.stem]
    return list(source.datasets) or None


def partition_names(spec: str, home: Path) -> list[str]:
    """The evaluation partitions, from the spec alone: loading the definitions opens no benchmark file.

    A source's declared names (`_declared_names`); a MIRAGE file without a selector gets MIRAGE's five datasets
    (name a subset with `#medqa+bioasq`). Never raises, so one bad benchmark cannot stop the definitions from
    loading: a bad spec gives the embedded split's names, and `eval/qa_benchmark` fails with the real error
    (a missing file, a dataset the file does not hold) when it runs.
    """
    try:
        sources = parse_benchmark_spec(spec, home)
    except ValueError:
        return list(KG_DATASETS)
    declared = [name for source in sources for name in (_declared_names(source) or MIRAGE_DATASETS)]
    safe = sorted({name for name in declared if DATASET_NAME.fullmatch(name) and name not in (".", "..")})
    return safe or list(KG_DATASETS)


def _read_json(path: Path) -> object:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise BenchmarkFormatError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    except UnicodeDecodeError:
        raise BenchmarkFormatError(_not_utf8(path)) from None


def _not_utf8(path: Path) -> str:
    """`file:line: not UTF-8 (...)` for a file that failed to decode (the reader's offset is of its buffer)."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        return f"{path}:{line}: not UTF-8 (byte {raw[error.start]:#04x})"
    return f"{path}: not UTF-8"
