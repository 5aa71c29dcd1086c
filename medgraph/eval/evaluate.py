"""Run methods on a benchmark, summarize them honestly, and store results and traces as tables.

Metrics follow docs/ARCHITECTURE.md "Evaluation protocol": accuracy with its binomial
standard error; an unparseable answer counts as wrong and is reported as the
parse-failure rate, and an answer reply cut at its token budget (asked once
more for the answer alone) as the truncation rate; the evidence metrics (the
share of a question's gold facts — the gold edge itself or a text stating it —
in what the answering call was shown, the same within its first ten units, and
whether an answer concept was named there) as means with their standard errors
over the questions that carry gold; gold-document recall (PubMedQA: whether a chunk of the
question's own abstract was among the passages shown, recall@k for rag) likewise;
cost as tokens per question and latency p50/p95; method
statistics (A2RAG routing shares and HIIM mode, SEMA-RAG rounds and early
stops, Graph-R1 steps, GSRM recall per iteration when gold paths are known).

Tables: `lake/eval/<table>/<dataset>.parquet` (one file per dataset partition,
replaced atomically) behind the views `eval.<table>`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from medgraph.methods.common import MethodResult, trace_rows
from medgraph.storage import Warehouse, list_tables, sql_literal

SCHEMA = "eval"


@dataclass(frozen=True)
class MethodSummary:
    """One method (or ablation) on one dataset."""

    method: str
    dataset: str
    questions: int
    accuracy: float
    accuracy_se: float  # binomial standard error sqrt(p (1 - p) / n)
    parse_failure_rate: float
    mean_f1: float
    prompt_tokens: float  # per question
    prompt_tokens_computed: float  # ... that the model ran (a prefix cache served the others)
    completion_tokens: float
    llm_calls: float
    latency_p50_s: float
    latency_p95_s: float
    extra: dict[str, float]  # method statistics (routing shares, rounds, steps, GSRM recall, ...)
    # The answer reply hit its token budget without a readable answer (then asked once more): apart from
    # parse failures, which are the questions left without a readable answer in the end.
    truncation_rate: float = 0.0
    # Questions whose answer reply held no readable answer (cut, or in no form the parser reads), so that the
    # model was asked once more for the answer alone (constrained to the option tags for multiple choice).
    answer_retry_rate: float = 0.0
    # Evidence metrics (`methods.common.evidence_metrics`): the share of the gold facts (the gold edge itself,
    # in either listing, or a text that states it) in the evidence shown to the answering call; the same within
    # its first ten units; whether an answer concept was named there. Each: mean, its standard error of the
    # mean, and the number of questions that carry gold (NaN, NaN, 0 when none does).
    gold_fact_seen: float = float("nan")
    gold_fact_seen_se: float = float("nan")
    gold_fact_seen_n: int = 0
    gold_fact_top10: float = float("nan")
    gold_fact_top10_se: float = float("nan")
    gold_fact_top10_n: int = 0
    answer_seen: float = float("nan")
    answer_seen_se: float = float("nan")
    answer_seen_n: int = 0
    # Share of questions for which a chunk of their own gold document (PubMedQA: the question's abstract) was
    # among the passages shown to the answering call, its standard error, and n (questions whose gold
    # document is in the corpus).
    gold_doc_recall: float = float("nan")
    gold_doc_recall_se: float = float("nan")
    gold_doc_recall_n: int = 0

    def as_row(self) -> dict[str, object]:
        row = {k: v for k, v in self.__dict__.items() if k != "extra"}
        row["extra"] = json.dumps(self.extra, sort_keys=True)
        return row


def binomial_se(correct: int, n: int) -> float:
    if n == 0:
        return float("nan")
    p = correct / n
    return math.sqrt(p * (1 - p) / n)


def mean_and_se(values: Sequence[float | None]) -> tuple[float, float, int]:
    """(mean, standard error of the mean, n) of the values that are not None; (NaN, NaN, 0) for none
    and a standard error of NaN for one."""
    known = np.array([v for v in values if v is not None], dtype=float)
    if len(known) == 0:
        return float("nan"), float("nan"), 0
    se = float(known.std(ddof=1) / math.sqrt(len(known))) if len(known) > 1 else float("nan")
    return float(known.mean()), se, len(known)


def _shares(values: Iterable[object], prefix: str) -> dict[str, float]:
    counts = Counter(str(v) for v in values)
    total = sum(counts.values())
    return {f"{prefix}{k}": c / total for k, c in sorted(counts.items())} if total else {}


def _schema_outcome(stats: Mapping[str, object]) -> str:
    """What SEMA-RAG's I-Agent schema became: read and about the question, read with a query about nothing the
    question names (the question stands in), or unreadable."""
    if not stats["schema_parsed"]:
        return "question as query"
    return "parsed" if stats.get("schema_grounded", True) else "parsed, query off the question"


def method_statistics(results: Sequence[MethodResult]) -> dict[str, float]:
    """Method-specific statistics, from each result's `stats` (whatever the method records)."""
    stats: dict[str, float] = {}
    routing = [r.stats["routing"] for r in results if "routing" in r.stats]
    stats.update(_shares(routing, "routing_share/"))
    stats.update(_shares([r.stats["hiim"] for r in results if "hiim" in r.stats], "hiim_share/"))
    rounds = [float(r.stats["rounds"]) for r in results if "rounds" in r.stats]
    if rounds:
        stats["rounds_mean"] = float(np.mean(rounds))
        stats.update({f"rounds_share/{k}": v for k, v in _shares([int(x) for x in rounds], "").items()})
    early = [bool(r.stats["early_stop"]) for r in results if "early_stop" in r.stats]
    if early:
        stats["early_stop_rate"] = float(np.mean(early))
    # The agents' decisions, as shares of questions (the report flags one taken for nearly every question).
    stats.update(_shares([r.stats["stop_reason"] for r in results if "stop_reason" in r.stats], "stop_share/"))
    stats.update(_shares([_schema_outcome(r.stats) for r in results if "schema_parsed" in r.stats], "schema_share/"))
    stats.update(_shares([r.stats["actions"][0] for r in results if r.stats.get("actions")], "first_action_share/"))
    if results and results[0].method.startswith("graph-r1"):
        stats["steps_mean"] = float(np.mean([len(r.steps) for r in results]))
        actions = [s.action for r in results for s in r.steps]
        stats.update(_shares(actions, "action_share/"))
        visited = [bool(r.stats["visited_named_concept"]) for r in results if "visited_named_concept" in r.stats]
        if visited:  # traversed or analyzed a concept the question names
            stats["visited_named_concept_rate"] = float(np.mean(visited))
    # How often a method's fallback acted: Graph-R1's environment refused an answer that named no option,
    # SEMA-RAG's evidence report was cut at its budget (then dropped unless it stated an answer).
    for key, name in (("refused_answers", "refused_answer_rate"), ("report_cut", "report_cut_rate")):
        flags = [bool(r.stats[key]) for r in results if key in r.stats]
        if flags:
            stats[name] = float(np.mean(flags))
    for key in ("gsrm_gold_recall", "gsrm_iterations", "gsrm_returned", "gold_fact_in_graph_tokens"):
        values = [float(r.stats[key]) for r in results if r.stats.get(key) is not None]
        if values:
            stats[f"{key}_mean"] = float(np.mean(values))
    in_corpus = [bool(r.stats["gold_doc_in_corpus"]) for r in results if "gold_doc_in_corpus" in r.stats]
    if in_corpus:  # < 1: some questions' own documents are not in the corpus (gold-doc recall unmeasured)
        stats["gold_doc_in_corpus_share"] = float(np.mean(in_corpus))
    # Recall@10 and Recall@N of GSRM's ranked triple list after each iteration k (0 = the 1-hop G_init).
    for cutoff in ("at10", "atN"):
        by_iteration = [r.stats[f"gsrm_recall_{cutoff}_by_iteration"] for r in results
                        if isinstance(r.stats.get(f"gsrm_recall_{cutoff}_by_iteration"), list)]
        for iteration in range(max((len(x) for x in by_iteration), default=0)):
            values = [x[iteration] for x in by_iteration if len(x) > iteration and x[iteration] is not None]
            if values:
                stats[f"gsrm_recall_{cutoff}/iter{iteration}"] = float(np.mean(values))
    return stats


def summarize(results: Sequence[MethodResult]) -> list[MethodSummary]:
    """One summary per (method, dataset), in first-seen order."""
    groups: dict[tuple[str, str], list[MethodResult]] = {}
    for result in results:
        groups.setdefault((result.method, result.dataset), []).append(result)
    summaries = []
    for (method, dataset), group in groups.items():
        n = len(group)
        correct = sum(r.correct for r in group)
        latencies = np.array([r.latency_s for r in group])
        fact_seen = mean_and_se([r.gold_fact_seen for r in group])
        fact_top10 = mean_and_se([r.gold_fact_top10 for r in group])
        answer_seen = mean_and_se([r.answer_seen for r in group])
        doc_recall, doc_recall_se, doc_recall_n = mean_and_se([r.gold_doc_recall for r in group])
        summaries.append(MethodSummary(
            method=method, dataset=dataset, questions=n, accuracy=correct / n, accuracy_se=binomial_se(correct, n),
            parse_failure_rate=sum(r.parse_failed for r in group) / n, mean_f1=float(np.mean([r.f1 for r in group])),
            prompt_tokens=float(np.mean([r.prompt_tokens for r in group])),
            prompt_tokens_computed=float(np.mean([r.prompt_tokens_computed for r in group])),
            completion_tokens=float(np.mean([r.completion_tokens for r in group])),
            llm_calls=float(np.mean([r.llm_calls for r in group])),
            latency_p50_s=float(np.percentile(latencies, 50)), latency_p95_s=float(np.percentile(latencies, 95)),
            extra=method_statistics(group),
            truncation_rate=sum(r.truncated for r in group) / n,
            answer_retry_rate=sum(r.extra_answer_call for r in group) / n,
            gold_fact_seen=fact_seen[0], gold_fact_seen_se=fact_seen[1], gold_fact_seen_n=fact_seen[2],
            gold_fact_top10=fact_top10[0], gold_fact_top10_se=fact_top10[1], gold_fact_top10_n=fact_top10[2],
            answer_seen=answer_seen[0], answer_seen_se=answer_seen[1], answer_seen_n=answer_seen[2],
            gold_doc_recall=doc_recall, gold_doc_recall_se=doc_recall_se, gold_doc_recall_n=doc_recall_n,
        ))
    return summaries


def _mean_cell(mean: float, se: float, n: int) -> str:
    """"0.750 ± 0.120 (n=8)"; "-" when no question has a value."""
    if n == 0:
        return "-"
    return f"{mean:.3f} ± {se:.3f} (n={n})" if not math.isnan(se) else f"{mean:.3f} (n={n})"


def markdown_table(summaries: Sequence[MethodSummary]) -> str:
    columns = ("method", "dataset", "n", "accuracy", "parse failures", "truncated", "asked again", "gold fact seen",
               "gold fact in top 10 shown", "answer concept seen", "gold doc recall", "tokens/q",
               "latency p50 / p95 (s)")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in summaries:
        lines.append(f"| {s.method} | {s.dataset} | {s.questions} | {s.accuracy:.3f} ± {s.accuracy_se:.3f} "
                     f"| {s.parse_failure_rate:.1%} | {s.truncation_rate:.1%} | {s.answer_retry_rate:.1%} "
                     f"| {_mean_cell(s.gold_fact_seen, s.gold_fact_seen_se, s.gold_fact_seen_n)} "
                     f"| {_mean_cell(s.gold_fact_top10, s.gold_fact_top10_se, s.gold_fact_top10_n)} "
                     f"| {_mean_cell(s.answer_seen, s.answer_seen_se, s.answer_seen_n)} "
                     f"| {_mean_cell(s.gold_doc_recall, s.gold_doc_recall_se, s.gold_doc_recall_n)} "
                     f"| {s.prompt_tokens + s.completion_tokens:.0f} "
                     f"| {s.latency_p50_s:.2f} / {s.latency_p95_s:.2f} |")
    return "\n".join(lines)


# --- tables -------------------------------------------------------------------------------------------------


def result_rows(results: Iterable[MethodResult]) -> list[dict[str, object]]:
    return [{"method": r.method, "dataset": r.dataset, "qid": r.qid, "answer": r.answer, "prediction": r.prediction,
             "parse_failed": r.parse_failed, "correct": r.correct, "f1": r.f1, "steps": len(r.steps),
             "prompt_tokens": r.prompt_tokens, "prompt_tokens_computed": r.prompt_tokens_computed,
             "completion_tokens": r.completion_tokens, "latency_s": r.latency_s,
             "truncated": r.truncated, "extra_answer_call": r.extra_answer_call,
             "gold_fact_seen": r.gold_fact_seen, "gold_fact_top10": r.gold_fact_top10, "answer_seen": r.answer_seen,
             "gold_doc_recall": r.gold_doc_recall,
             "stats": json.dumps(r.stats, sort_keys=True, default=str)} for r in results]


# Columns that can be null in every row of a partition (evidence recall on items without gold) keep their type.
_NULLABLE_COLUMNS = {"gold_fact_seen": pa.float64(), "gold_fact_top10": pa.float64(), "answer_seen": pa.float64(),
                     "gold_doc_recall": pa.float64()}


def _arrow_table(rows: Sequence[Mapping[str, object]]) -> pa.Table:
    table = pa.Table.from_pylist(list(rows))
    for i, column in enumerate(table.schema):
        if pa.types.is_null(column.type) and column.name in _NULLABLE_COLUMNS:
            table = table.set_column(i, column.name, table.column(i).cast(_NULLABLE_COLUMNS[column.name]))
    return table


def write_partition(warehouse: Warehouse, table: str, partition: str,
                    rows: Sequence[Mapping[str, object]]) -> Path | str:
    """Replace one dataset's file of `eval.<table>` atomically and (re)point the view at all files."""
    lake = warehouse.lake
    if lake.is_local:
        folder = lake.root / SCHEMA / table
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"{_safe(partition)}.parquet"
        staging = folder / f".{final.name}.tmp"
        try:
            pq.write_table(_arrow_table(rows), staging, compression="zstd")
            staging.replace(final)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        glob = sql_literal(str(folder / "*.parquet"))
    else:  # S3: DuckDB writes the staging object, the lake copies it over the partition's key
        name = f"{table}/{_safe(partition)}"
        staging = lake.staging_path(SCHEMA, name)
        try:
            with warehouse.scratch() as con:
                con.register("partition_rows", _arrow_table(rows))
                con.execute(f"COPY partition_rows TO {sql_literal(staging)} (FORMAT parquet, COMPRESSION zstd)")
            final = lake.publish(staging, SCHEMA, name)
        except BaseException:
            lake.discard(staging)
            raise
        glob = sql_literal(final.rsplit("/", 1)[0] + "/*.parquet")
    with warehouse.connect() as con:
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        con.execute(f"CREATE OR REPLACE VIEW {SCHEMA}.{table} AS SELECT * FROM read_parquet({glob}, union_by_name = true)")
    return final


def write_run(warehouse: Warehouse, asset: str, dataset: str, results: Sequence[MethodResult],
              summaries: Sequence[MethodSummary]) -> dict[str, Path | str]:
    """The results, traces and summary tables of one evaluation asset's dataset partition."""
    return {
        "results": write_partition(warehouse, f"{asset}_results", dataset, result_rows(results)),
        "traces": write_partition(warehouse, f"{asset}_traces", dataset, trace_rows(results)),
        "summary": write_partition(warehouse, f"{asset}_summary", dataset, [s.as_row() for s in summaries]),
    }


def read_eval_views(warehouse: Warehouse, suffix: str) -> list[dict[str, object]]:
    """Every row of every `eval.*<suffix>` view (e.g. `_results`), each with the asset it came from."""
    with warehouse.connect(read_only=True) as con:
        views = [name for _, name in list_tables(con, "eval", like=f"%{suffix}")]
        rows = []
        for view in views:
            cursor = con.execute(f"SELECT * FROM eval.{view}")
            columns = [c[0] for c in cursor.description]
            rows += [{**dict(zip(columns, values, strict=True)), "asset": view.removesuffix(suffix)}
                     for values in cursor.fetchall()]
    return rows


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
