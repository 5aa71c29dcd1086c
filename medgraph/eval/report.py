"""The evaluation report: one Markdown file and one self-contained HTML page (plots inlined).

Built from the `eval.*_summary` tables every evaluation asset writes, plus
the champion runs in MLflow (the GRPO reward curve) and the lineage the caller
passes (release fingerprint, encoder, model versions, LLM). A person looks at
the plots; the tables hold the exact numbers.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medgraph.eval.claims import DEGENERATE_SHARE, Claim, seed_claims
from medgraph.eval.evaluate import read_eval_views, write_partition
from medgraph.eval.paired import Comparison, paired_comparisons, read_results
from medgraph.eval.readers import reader_label, split_reader
from medgraph.files import write_atomically
from medgraph.kg.shortcuts import MARGIN, ORACLE, SHORTCUTS, read_shortcuts
from medgraph.methods.registry import ABLATIONS
from medgraph.stats import SEPARABLE_CI_WIDTH
from medgraph.storage import Warehouse, read_rows

SUMMARY_SUFFIX = "_summary"
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
         "th{background:#f3f3f3}img{max-width:100%}")


@dataclass
class ReportData:
    summaries: list[dict[str, object]]  # one row per (asset, method, dataset); "extra" decoded
    lineage: dict[str, str]
    reward_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)
    comparisons: list[Comparison] = field(default_factory=list)  # paired: methods vs reference, ablations
    gsrm_recall: list[dict[str, object]] = field(default_factory=list)  # rows of eval.gsrm_recall
    claims: list[Claim] = field(default_factory=list)  # the seed papers' claims vs our measurements
    reference: str = "rag"
    shortcuts: list[dict[str, object]] = field(default_factory=list)  # rows of qa.qa_shortcuts
    reading: list[dict[str, object]] = field(default_factory=list)  # the reading check (`reading_check`)
    gsrm_params: dict[str, object] = field(default_factory=dict)  # models/gsrm_params.json


def read_summaries(warehouse: Warehouse) -> list[dict[str, object]]:
    rows = read_eval_views(warehouse, SUMMARY_SUFFIX)
    for row in rows:
        row["extra"] = json.loads(row.get("extra") or "{}")
    return rows


# --- plots ------------------------------------------------------------------------------------------------


def _figure_png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_plot(summaries: Sequence[Mapping[str, object]]) -> str:
    """Grouped bars: accuracy per method and dataset with binomial standard-error bars."""
    plt = _plt()
    methods = list(dict.fromkeys(str(s["method"]) for s in summaries))
    datasets = list(dict.fromkeys(str(s["dataset"]) for s in summaries))
    by_key = {(s["method"], s["dataset"]): s for s in summaries}
    width = 0.8 / max(len(methods), 1)
    fig, axis = plt.subplots(figsize=(max(6, 1.6 * len(datasets) + 2), 3.8))
    for m, method in enumerate(methods):
        xs, ys, errors = [], [], []
        for d, dataset in enumerate(datasets):
            if (method, dataset) in by_key:
                row = by_key[(method, dataset)]
                xs.append(d + (m - (len(methods) - 1) / 2) * width)
                ys.append(float(row["accuracy"]))
                errors.append(float(row["accuracy_se"]))
        axis.bar(xs, ys, width, yerr=errors, capsize=3, label=method)
    axis.set_xticks(range(len(datasets)), datasets)
    axis.set_ylim(0, 1)
    axis.set_ylabel("accuracy (± 1 s.e.)")
    axis.legend(fontsize=8, ncol=min(len(methods), 4), loc="upper right")
    axis.set_title("Accuracy per method and dataset")
    return _figure_png(fig)


def cost_plot(summaries: Sequence[Mapping[str, object]]) -> str:
    """Latency p50 (bars) and tokens per question (points) per method, over all datasets."""
    plt = _plt()
    methods = list(dict.fromkeys(str(s["method"]) for s in summaries))
    latency = [max(float(s["latency_p50_s"]) for s in summaries if s["method"] == m) for m in methods]
    tokens = [max(float(s["prompt_tokens"]) + float(s["completion_tokens"]) for s in summaries if s["method"] == m)
              for m in methods]
    fig, axis = plt.subplots(figsize=(max(6, 0.9 * len(methods) + 2), 3.5))
    axis.bar(methods, latency, color="tab:blue")
    axis.set_ylabel("latency p50 per question (s)", color="tab:blue")
    twin = axis.twinx()
    twin.plot(methods, tokens, "o", color="tab:red")
    twin.set_ylabel("tokens per question", color="tab:red")
    axis.tick_params(axis="x", rotation=30)
    axis.set_title("Cost per method")
    return _figure_png(fig)


def shares_plot(summaries: Sequence[Mapping[str, object]], prefix: str, title: str) -> str | None:
    rows = [(f"{s['method']}/{s['dataset']}", {k.removeprefix(prefix): v for k, v in s["extra"].items()
                                               if k.startswith(prefix)}) for s in summaries]
    rows = [(label, shares) for label, shares in rows if shares]
    if not rows:
        return None
    plt = _plt()
    categories = sorted({k for _, shares in rows for k in shares})
    fig, axis = plt.subplots(figsize=(6.5, 0.45 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for category in categories:
        values = [shares.get(category, 0.0) for _, shares in rows]
        axis.barh([label for label, _ in rows], values, left=left, label=category)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axis.set_xlim(0, 1)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title(title)
    return _figure_png(fig)


def curve_plot(curves: Mapping[str, Sequence[tuple[int, float]]], title: str) -> str | None:
    if not curves:
        return None
    plt = _plt()
    fig, axis = plt.subplots(figsize=(6, 3.5))
    for name, points in curves.items():
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    axis.set_xlabel("step")
    axis.legend(fontsize=8)
    axis.set_title(title)
    return _figure_png(fig)


def evidence_plot(summaries: Sequence[Mapping[str, object]]) -> str | None:
    """Bars: share of gold facts (pairs) and of answers present in what the answering LLM saw, ± 1 s.e."""
    rows = [s for s in summaries if _number(s.get("gold_fact_seen_n")) > 0]
    if not rows:
        return None
    plt = _plt()
    labels = [f"{s['method']}\n{s['dataset']}" for s in rows]
    xs = range(len(rows))
    fig, axis = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 3.8))
    for offset, key, label in ((-0.27, "gold_fact_seen", "gold fact seen"),
                               (0.0, "gold_fact_top10", "gold fact in top 10 shown"),
                               (0.27, "answer_seen", "answer concept seen")):
        axis.bar([x + offset for x in xs], [_number(s.get(key)) for s in rows], 0.27,
                 yerr=[_number(s.get(f"{key}_se")) for s in rows], capsize=3, label=label)
    axis.set_xticks(list(xs), labels, fontsize=7, rotation=30)
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("share of questions (± 1 s.e.)")
    axis.legend(fontsize=8)
    axis.set_title("Evidence recall: what the answering LLM was shown")
    return _figure_png(fig)


def forest_plot(comparisons: Sequence[Comparison]) -> str | None:
    """Each paired difference as a point with its 95% bootstrap CI; the dashed line is "no difference"."""
    if not comparisons:
        return None
    plt = _plt()
    fig, axis = plt.subplots(figsize=(7.5, 0.32 * len(comparisons) + 1.4))
    for y, c in enumerate(reversed(comparisons)):
        colour = "tab:green" if c.ci_low > 0 else "tab:red" if c.ci_high < 0 else "tab:gray"
        axis.errorbar(c.difference, y, xerr=[[c.difference - c.ci_low], [c.ci_high - c.difference]], fmt="o",
                      color=colour, capsize=3)
    axis.axvline(0, color="black", linestyle="--", linewidth=1)
    axis.set_yticks(range(len(comparisons)), [f"{c.method} - {c.reference} ({c.metric}, {c.dataset}, n={c.n})"
                                              for c in reversed(comparisons)], fontsize=7)
    axis.set_xlabel("difference (95% paired bootstrap CI)")
    axis.set_title("Paired differences")
    return _figure_png(fig)


def gsrm_recall_plot(rows: Sequence[Mapping[str, object]]) -> str | None:
    """Recall@10 of GSRM's ranked triples after each refinement iteration, per dataset and hop count."""
    rows = [r for r in rows if int(r["cutoff"]) == 10]
    if not rows:
        return None
    plt = _plt()
    fig, axis = plt.subplots(figsize=(6, 3.6))
    groups = sorted({(str(r["dataset"]), _hops(r)) for r in rows})
    for dataset, hops in groups:
        group = [r for r in rows if (r["dataset"], _hops(r)) == (dataset, hops)]
        points = sorted((int(r["iteration"]), float(r["recall"]), _number(r.get("recall_se"))) for r in group)
        n = max(int(r["n"]) for r in group)
        label = "1- and 2-hop" if hops == 0 else f"{hops}-hop"
        axis.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                      capsize=3, label=f"{dataset}, {label} (n={n})")
    axis.set_xlabel("refinement iteration k")
    axis.set_ylabel("Recall@10 (± 1 s.e.)")
    axis.set_ylim(0, 1.05)
    axis.set_xticks(sorted({int(r["iteration"]) for r in rows}))
    axis.legend(fontsize=8)
    axis.set_title("GSRM: Recall@10 of the ranked triple list (test split, no LLM)")
    return _figure_png(fig)


def _hops(row: Mapping[str, object]) -> int:
    """A GSRM recall row's hop count; 0 for the rows over 1- and 2-hop items together (hops NULL)."""
    return 0 if row.get("hops") is None else int(row["hops"])


def _number(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(number) else number


# --- tables -----------------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> tuple[str, str]:
    """The same table as Markdown and as HTML."""
    def cell(value: object) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    markdown = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    return "\n".join(markdown), f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _ablation_rows(summaries: Sequence[Mapping[str, object]],
                   comparisons: Sequence[Comparison]) -> list[tuple[object, ...]]:
    """Each ablation next to its full method on the same dataset: the paired accuracy difference with its
    95% CI and McNemar p on the questions both answered ("not run" when the full method was not)."""
    paired = {(c.method, c.dataset): c for c in comparisons if c.kind == "ablation" and c.metric == "correct"}
    rows = []
    for s in summaries:
        name, reader = split_reader(str(s["method"]))
        if name not in ABLATIONS:
            continue
        method = reader_label(ABLATIONS[name][0], reader)
        c = paired.get((s["method"], s["dataset"]))
        if c is None:
            rows.append((s["method"], method, s["dataset"], s["questions"], float(s["accuracy"]), "not run",
                         "", "", "", ""))
            continue
        rows.append((s["method"], method, s["dataset"], c.n, c.method_mean, c.reference_mean, c.difference,
                     _interval(c), c.p_value, c.verdict))
    return rows


def _cell(value: object) -> object:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _grouped(rows: Sequence[Mapping[str, object]], keys: Sequence[str]) -> list[tuple[tuple, list]]:
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return sorted(groups.items(), key=lambda item: tuple(str(k) for k in item[0]))


def _interval(c: Comparison) -> str:
    return f"[{c.ci_low:+.3f}, {c.ci_high:+.3f}]"


def _sample_size_note(comparisons: Sequence[Comparison]) -> str:
    """Whether the answer-level comparisons can separate anything at their n."""
    accuracy = [c for c in comparisons if c.metric == "correct"]
    if not accuracy:
        return "No paired answer-level comparison (the reference method or the others were not run)."
    widest = max(accuracy, key=lambda c: c.ci_width)
    small = [c for c in accuracy if c.too_small]
    separated = [c for c in accuracy if c.ci_low > 0 or c.ci_high < 0]
    n = sorted({c.n for c in accuracy})
    lines = [(f"Answer-level comparisons use n = {', '.join(map(str, n))} paired questions; the widest 95% CI of "
              f"an accuracy difference spans {widest.ci_width:.2f} ({widest.method} vs {widest.reference}).")]
    if small:
        lines.append(f"**{len(small)} of {len(accuracy)} accuracy comparisons have a CI wider than "
                     f"{SEPARABLE_CI_WIDTH:.1f}: at this n they cannot separate differences that matter. Read the "
                     "retrieval-level metrics (evidence recall, GSRM Recall@10) for the comparison, or run the "
                     "`bench` evaluation config (n >= 200 per dataset).**")
    lines.append(f"{len(separated)} of {len(accuracy)} accuracy differences exclude 0 at 95%"
                 + (": " + ", ".join(f"{c.method} vs {c.reference} ({c.dataset})" for c in separated) if separated
                    else "."))
    return "\n\n".join(lines)


def _html_paragraphs(text: str) -> str:
    escaped = html.escape(text).replace("**", "")
    return "</p><p>".join(escaped.split("\n\n"))


Section = tuple[str, str, str, str | None]  # title, markdown, html, png (base64)


def build_report(data: ReportData, out_dir: Path) -> dict[str, Path]:
    """Write `report.md` and `report.html` (plus the PNGs beside the Markdown) atomically, section by section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    builders = (_separation_sections, _shortcuts_sections, _accuracy_sections, _evidence_sections,
                _comparisons_sections, _gsrm_sections, _claims_sections, _decision_sections, _cost_sections,
                _lineage_sections)
    return _write_report([section for build in builders for section in build(data)], out_dir)


def _separation_sections(data: ReportData) -> list[Section]:
    """Whether this run's sample sizes can separate anything (a CI wider than 0.2 cannot)."""
    sections: list[Section] = []
    note = _sample_size_note(data.comparisons)
    sections.append(("Can this run separate the methods?", note, f"<p>{_html_paragraphs(note)}</p>", None))
    return sections


def _shortcuts_sections(data: ReportData) -> list[Section]:
    """What no-LLM shortcuts score per dataset and split, against chance and the relation-aware oracle."""
    sections: list[Section] = []
    if data.shortcuts:
        header = ["dataset", "split", "n", *SHORTCUTS, f"{ORACLE} (ceiling)"]
        table_rows = []
        for (dataset, split), group in _grouped(data.shortcuts, ("dataset", "split")):
            by_rule = {r["rule"]: r for r in group}
            table_rows.append((dataset, split, max(int(r["n"]) for r in group),
                               *(_cell(by_rule[r]["accuracy"]) if r in by_rule else "-" for r in (*SHORTCUTS, ORACLE))))
        md, tab = _table(header, table_rows)
        sections.append((f"Can structure alone answer the KG questions? (no-LLM shortcuts; the blocking check keeps "
                         f"each within chance + {MARGIN:.2f} on test; `random` is chance)", md, tab, None))
    return sections


def _accuracy_sections(data: ReportData) -> list[Section]:
    """Accuracy per method and dataset, with parse failures, truncations and answers asked again."""
    sections: list[Section] = []
    summaries = data.summaries
    rows = [(s["method"], s["dataset"], s["questions"], float(s["accuracy"]), float(s["accuracy_se"]),
             float(s["parse_failure_rate"]), _number(s.get("truncation_rate")), _number(s.get("answer_retry_rate")),
             float(s["mean_f1"]))
            for s in summaries]
    md, tab = _table(["method", "dataset", "n", "accuracy", "s.e.", "parse failures", "truncated",
                      "asked again (no readable answer)", "F1"], rows)
    sections.append(("Accuracy per method and dataset", md, tab, accuracy_plot(summaries) if summaries else None))
    return sections


def _evidence_sections(data: ReportData) -> list[Section]:
    """What the answering call was shown (evidence), whether the reader used it (reading check), and PubMedQA's
    own-document recall."""
    sections: list[Section] = []
    summaries = data.summaries
    evidence = [(s["method"], s["dataset"], int(_number(s.get("gold_fact_seen_n"))),
                 _number(s.get("gold_fact_seen")), _number(s.get("gold_fact_seen_se")),
                 _cell(s["extra"].get("gold_fact_in_graph_tokens_mean")),
                 _number(s.get("gold_fact_top10")), _number(s.get("gold_fact_top10_se")),
                 int(_number(s.get("answer_seen_n"))), _number(s.get("answer_seen")), _number(s.get("answer_seen_se")))
                for s in summaries if _number(s.get("gold_fact_seen_n")) > 0 or _number(s.get("answer_seen_n")) > 0]
    if evidence:
        md, tab = _table(["method", "dataset", "n (gold facts)", "gold fact seen", "s.e.",
                          "gold fact in graph tokens", "gold fact in top 10 shown",
                          "s.e.", "n (answer concept)", "answer concept seen", "s.e."], evidence)
        sections.append(("Evidence: what retrieval put in front of the answering call as text (the gold edge "
                         "itself or a text stating it; a triple of another relation between the same concepts does "
                         "not count; text a model wrote never counts); A2RAG's graph tokens apart", md, tab,
                         evidence_plot(summaries)))

    if data.reading:
        md, tab = _table(["method", "dataset", "accuracy, gold fact shown", "n", "accuracy, not shown", "n",
                          "oracle evidence (same reader)", "n"],
                         [(r["method"], r["dataset"], _cell(r["shown_accuracy"]), r["shown_n"],
                           _cell(r["hidden_accuracy"]), r["hidden_n"], _cell(r["oracle_accuracy"]), r["oracle_n"])
                          for r in data.reading])
        sections.append(("Reading check: retrieval miss or reading failure? (accuracy where the method showed every "
                         "gold fact vs where it did not; `oracle-evidence` gives the reader exactly the gold facts and "
                         "wrong-relation triples of the same concepts: its ceiling)", md, tab, None))

    own_document = [(s["method"], s["dataset"], int(_number(s.get("gold_doc_recall_n"))),
                     _number(s.get("gold_doc_recall")), _number(s.get("gold_doc_recall_se")))
                    for s in summaries if _number(s.get("gold_doc_recall_n")) > 0]
    if own_document:  # PubMedQA: the question's own abstract is in the corpus, not in the prompt
        md, tab = _table(["method", "dataset", "n (gold document in corpus)", "own document shown", "s.e."],
                         own_document)
        title = ("Gold-document recall (a chunk of the question's own abstract among the passages shown; "
                 "recall@k for rag)")
        sections.append((title, md, tab, None))
    return sections


def _comparisons_sections(data: ReportData) -> list[Section]:
    """Paired differences: each method against the reference, each adapted reader against the base reader, each
    ablation against its method."""
    sections: list[Section] = []
    summaries = data.summaries
    versus = [c for c in data.comparisons if c.kind == "method"]
    if versus:
        md, tab = _table(["method", "reference", "dataset", "metric", "n", "method", "reference", "difference",
                          "95% CI", "McNemar / sign p", "verdict"],
                         [(c.method, c.reference, c.dataset, c.metric, c.n, c.method_mean, c.reference_mean,
                           c.difference, _interval(c), c.p_value, c.verdict) for c in versus])
        sections.append((f"Paired comparison with {data.reference} (same questions, same reader: a `@adapted` row "
                         f"is compared with {data.reference}@adapted)", md, tab, forest_plot(versus)))

    readers = [c for c in data.comparisons if c.kind == "reader" and c.metric == "correct"]
    if readers:
        md, tab = _table(["method", "dataset", "n", "adapted reader", "base reader", "difference", "95% CI",
                          "McNemar p", "verdict"],
                         [(split_reader(c.method)[0], c.dataset, c.n, c.method_mean, c.reference_mean, c.difference,
                           _interval(c), c.p_value, c.verdict) for c in readers])
        sections.append(("Adapted reader vs base reader (the answering call only; retrieval and agent turns are the "
                         "base model's; `oracle-evidence` is each reader's ceiling, `cot` its answer without evidence, "
                         "which must stay near chance)", md, tab, forest_plot(readers)))

    ablations = _ablation_rows(summaries, data.comparisons)
    if ablations:
        md, tab = _table(["ablation", "of", "dataset", "n", "ablation accuracy", "method accuracy", "difference",
                          "95% CI", "McNemar p", "verdict"], ablations)
        forest = forest_plot([c for c in data.comparisons if c.kind == "ablation" and c.metric == "correct"])
        sections.append(("Ablations (paired with the full method)", md, tab, forest))
    return sections


def _gsrm_sections(data: ReportData) -> list[Section]:
    """GSRM's recall per refinement iteration on test, and the parameters tuned per dataset on validation."""
    sections: list[Section] = []
    if data.gsrm_recall:
        md, tab = _table(["dataset", "hops", "iteration k", "cutoff", "recall", "s.e.", "n", "tau", "N"],
                         [(r["dataset"], "1+2" if r["hops"] is None else r["hops"], r["iteration"], r["cutoff"],
                           float(r["recall"]),
                           _number(r.get("recall_se")), r["n"], float(r["tau"]), r["top_n"])
                          for r in sorted(data.gsrm_recall, key=lambda r: (r["dataset"], _hops(r), r["cutoff"],
                                                                           r["iteration"]))])
        sections.append(("GSRM Recall@10 / @N per refinement iteration (test split, no LLM)", md, tab,
                         gsrm_recall_plot(data.gsrm_recall)))

    by_dataset = (data.gsrm_params or {}).get("by_dataset") or {}
    if by_dataset:
        md, tab = _table(["dataset", "tau", "K", "N", "Recall@10 after K", "Recall@N", "n (validation)", "note"],
                         [(kind, float(v["tau"]), v["iterations"], v["top_n"], float(v["recall_at10"]),
                           float(v["recall_at_n"]), v["n"], v.get("note", "")) for kind, v in sorted(by_dataset.items())]
                         + [("pooled (other items)", float(data.gsrm_params["tau"]), data.gsrm_params["iterations"],
                             data.gsrm_params["top_n"], float(data.gsrm_params["recall_at10"]),
                             float(data.gsrm_params["recall_at_n"]), data.gsrm_params["n"],
                             data.gsrm_params.get("note", ""))])
        sections.append(("GSRM parameters chosen per dataset (validation; A2RAG uses its item's dataset's)", md,
                         tab, None))
    return sections


def _claims_sections(data: ReportData) -> list[Section]:
    """The seed papers' claims with what this run measured."""
    sections: list[Section] = []
    if data.claims:
        md, tab = _table(["claim", "seed", "measured here", "95% CI", "n", "verdict"],
                         [c.as_row() for c in data.claims])
        sections.append(("Seed claims vs this platform", md, tab, None))
    return sections


# Shares of questions (`evaluate.method_statistics`) shown as their own tables, and the agents' decisions among
# them, each with its label in the report; the statistics table lists every other statistic.
SHARE_SECTIONS = (("routing_share/", "A2RAG routing (KG-only / Text-only / KG+Text)"),
                  ("hiim_share/", "A2RAG HIIM mode"), ("rounds_share/", "SEMA-RAG rounds distribution"),
                  ("action_share/", "Graph-R1 action mix"))
DECISIONS = (("routing_share/", "A2RAG AWC route"), ("stop_share/", "SEMA-RAG E-Agent stop"),
             ("schema_share/", "SEMA-RAG I-Agent schema"), ("first_action_share/", "Graph-R1 first action"))


def degenerate_decisions(summaries: Sequence[Mapping[str, object]]) -> list[tuple[object, ...]]:
    """(method, dataset, n, decision, most frequent choice, its share, flag) for every agent decision a row made:
    "degenerate" when one choice was taken for at least `DEGENERATE_SHARE` of the questions."""
    rows = []
    for s in summaries:
        for prefix, label in DECISIONS:
            shares = {k.removeprefix(prefix): float(v) for k, v in s["extra"].items() if k.startswith(prefix)}
            if shares:
                choice, share = max(shares.items(), key=lambda kv: kv[1])
                rows.append((s["method"], s["dataset"], s["questions"], label, choice, share,
                             "degenerate" if share >= DEGENERATE_SHARE else ""))
    return rows


def _decision_sections(data: ReportData) -> list[Section]:
    rows = degenerate_decisions(data.summaries)
    if not rows:
        return []
    md, tab = _table(["method", "dataset", "n", "decision", "most frequent", "share", "flag"], rows)
    return [(f"Agent decisions (a choice taken for at least {DEGENERATE_SHARE:.0%} of the questions is flagged "
             "degenerate: the row then measures that fixed choice, not the agent's decision)", md, tab, None)]


def _cost_sections(data: ReportData) -> list[Section]:
    """Latency and tokens, each method's decision shares and statistics, and the GRPO curve."""
    sections: list[Section] = []
    summaries = data.summaries
    # "computed": the prompt tokens the model ran; a prefix cache served the rest of those sent.
    cost = [(s["method"], s["dataset"], float(s["prompt_tokens"]),
             float(s.get("prompt_tokens_computed") or s["prompt_tokens"]), float(s["completion_tokens"]),
             float(s["llm_calls"]), float(s["latency_p50_s"]), float(s["latency_p95_s"])) for s in summaries]
    md, tab = _table(["method", "dataset", "prompt tok/q", "computed tok/q", "completion tok/q", "LLM calls/q",
                      "p50 s", "p95 s"], cost)
    sections.append(("Latency and token cost", md, tab, cost_plot(summaries) if summaries else None))

    for prefix, title in SHARE_SECTIONS:
        shares = [(s["method"], s["dataset"], k.removeprefix(prefix), float(v)) for s in summaries
                  for k, v in s["extra"].items() if k.startswith(prefix)]
        if shares:
            md, tab = _table(["method", "dataset", "category", "share"], shares)
            sections.append((title, md, tab, shares_plot(summaries, prefix, title)))

    stats = [(s["method"], s["dataset"], k, float(v)) for s in summaries for k, v in s["extra"].items()
             if not k.startswith(tuple(p for p, _ in (*SHARE_SECTIONS, *DECISIONS)))]
    if stats:
        md, tab = _table(["method", "dataset", "statistic", "value"], stats)
        sections.append(("Method statistics (GSRM recall per iteration, rounds, early stops, steps)", md, tab,
                         None))
    if data.reward_curves:
        curve = curve_plot(data.reward_curves, "Graph-R1 GRPO training (champion run)")
        last = [(name, points[-1][0], points[-1][1]) for name, points in data.reward_curves.items() if points]
        md, tab = _table(["metric", "last step", "value"], last)
        sections.append(("GRPO reward curve", md, tab, curve))
    return sections


def _lineage_sections(data: ReportData) -> list[Section]:
    """Which data and model versions the report read."""
    sections: list[Section] = []
    md, tab = _table(["what", "value"], sorted(data.lineage.items()))
    sections.append(("Lineage", md, tab, None))
    return sections


def _write_report(sections: Sequence[Section], out_dir: Path) -> dict[str, Path]:
    """`report.md` with its PNGs beside it and a self-contained `report.html`, written atomically."""
    markdown = ["# MedGraph evaluation report", ""]
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>MedGraph evaluation report</title>",
            f"<style>{STYLE}</style></head><body>", "<h1>MedGraph evaluation report</h1>"]
    for number, (title, md, tab, png) in enumerate(sections, start=1):
        markdown += [f"## {title}", ""]
        page.append(f"<h2>{html.escape(title)}</h2>")
        if png:
            image = out_dir / f"figure_{number}.png"
            write_atomically(image, base64.b64decode(png))
            markdown += [f"![{title}]({image.name})", ""]
            page.append(f"<img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
        markdown += [md, ""]
        page.append(tab)
    page.append("</body></html>")
    paths = {"markdown": out_dir / "report.md", "html": out_dir / "report.html"}
    write_atomically(paths["markdown"], "\n".join(markdown))
    write_atomically(paths["html"], "\n".join(page))
    return paths


def reading_check(results: Sequence[Mapping[str, object]], oracle: str = "oracle-evidence") -> list[dict[str, object]]:
    """Per (method, dataset): accuracy on the questions whose gold facts the method showed (every one) and on
    those where it did not, and the `oracle-evidence` accuracy on the same dataset with the same reader (that
    reader's ceiling)."""
    groups: dict[tuple[str, str], list[Mapping[str, object]]] = {}
    for row in results:
        groups.setdefault((str(row["method"]), str(row["dataset"])), []).append(row)
    rows = []
    for (method, dataset), group in sorted(groups.items()):
        measured = [r for r in group if r.get("gold_fact_seen") is not None
                    and not (isinstance(r["gold_fact_seen"], float) and math.isnan(r["gold_fact_seen"]))]
        name, reader = split_reader(method)
        if not measured or name == oracle:
            continue
        shown = [bool(r["correct"]) for r in measured if float(r["gold_fact_seen"]) >= 1.0]
        hidden = [bool(r["correct"]) for r in measured if float(r["gold_fact_seen"]) < 1.0]
        ceiling = [bool(r["correct"]) for r in groups.get((reader_label(oracle, reader), dataset), [])]
        rows.append({"method": method, "dataset": dataset,
                     "shown_accuracy": sum(shown) / len(shown) if shown else None, "shown_n": len(shown),
                     "hidden_accuracy": sum(hidden) / len(hidden) if hidden else None, "hidden_n": len(hidden),
                     "oracle_accuracy": sum(ceiling) / len(ceiling) if ceiling else None, "oracle_n": len(ceiling)})
    return rows


def assemble(warehouse: Warehouse, lineage: Mapping[str, str],
             reward_curves: Mapping[str, Sequence[tuple[int, float]]] | None = None,
             reference: str = "rag", gsrm_params: Mapping[str, object] | None = None) -> ReportData:
    """Everything the report shows, from the eval tables: summaries, paired comparisons (also written to
    `eval.paired_comparisons`), GSRM recall and the seed-claims table."""
    summaries = read_summaries(warehouse)
    results = read_results(warehouse)
    comparisons = paired_comparisons(results, reference, {name: spec[0] for name, spec in ABLATIONS.items()})
    if comparisons:
        write_partition(warehouse, "paired_comparisons", "all", [c.as_row() for c in comparisons])
    claims = seed_claims(summaries, results, comparisons, read_rows(warehouse, "eval", "gsrm_recall_items"),
                         lineage.get("graph-r1 policy"))
    return ReportData(summaries, dict(lineage), {k: list(v) for k, v in (reward_curves or {}).items()},
                      comparisons, read_rows(warehouse, "eval", "gsrm_recall"), claims, reference,
                      read_shortcuts(warehouse), reading_check(results), dict(gsrm_params or {}))
