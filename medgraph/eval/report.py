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
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medgraph.storage import Warehouse

SUMMARY_SUFFIX = "_summary"
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
         "th{background:#f3f3f3}img{max-width:100%}")


@dataclass
class ReportData:
    summaries: list[dict[str, object]]  # one row per (asset, method, dataset); "extra" decoded
    lineage: dict[str, str]
    reward_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)


def read_summaries(warehouse: Warehouse) -> list[dict[str, object]]:
    with warehouse.connect(read_only=True) as con:
        views = [row[0] for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'eval' "
            f"AND table_name LIKE '%{SUMMARY_SUFFIX}' ORDER BY 1").fetchall()]
        rows = []
        for view in views:
            cursor = con.execute(f"SELECT * FROM eval.{view}")
            columns = [c[0] for c in cursor.description]
            for values in cursor.fetchall():
                row = dict(zip(columns, values, strict=True))
                row["asset"] = view.removesuffix(SUMMARY_SUFFIX)
                row["extra"] = json.loads(row.get("extra") or "{}")
                rows.append(row)
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


def _ablation_rows(summaries: Sequence[Mapping[str, object]]) -> list[tuple[object, ...]]:
    """Each ablation next to its full method on the same dataset (change = ablation - method accuracy)."""
    from medgraph.methods.registry import ABLATIONS

    accuracy = {(s["method"], s["dataset"]): float(s["accuracy"]) for s in summaries}
    rows = []
    for s in summaries:
        if s["method"] not in ABLATIONS:
            continue
        method = ABLATIONS[str(s["method"])][0]
        full = accuracy.get((method, s["dataset"]))
        rows.append((s["method"], method, s["dataset"], s["questions"], float(s["accuracy"]), float(s["accuracy_se"]),
                     "not run" if full is None else full,
                     "" if full is None else float(s["accuracy"]) - full, float(s["parse_failure_rate"])))
    return rows


def build_report(data: ReportData, out_dir: Path) -> dict[str, Path]:
    """Write `report.md` and `report.html` (plus the PNGs beside the Markdown) atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = data.summaries
    sections: list[tuple[str, str, str, str | None]] = []  # title, markdown, html, png (base64)

    rows = [(s["method"], s["dataset"], s["questions"], float(s["accuracy"]), float(s["accuracy_se"]),
             float(s["parse_failure_rate"]), float(s["mean_f1"])) for s in summaries]
    md, tab = _table(["method", "dataset", "n", "accuracy", "s.e.", "parse failures", "F1"], rows)
    sections.append(("Accuracy per method and dataset", md, tab, accuracy_plot(summaries) if summaries else None))

    ablations = _ablation_rows(summaries)
    if ablations:
        md, tab = _table(["ablation", "of", "dataset", "n", "accuracy", "s.e.", "method accuracy",
                          "change", "parse failures"], ablations)
        sections.append(("Ablations", md, tab, None))

    cost = [(s["method"], s["dataset"], float(s["prompt_tokens"]), float(s["completion_tokens"]),
             float(s["llm_calls"]), float(s["latency_p50_s"]), float(s["latency_p95_s"])) for s in summaries]
    md, tab = _table(["method", "dataset", "prompt tok/q", "completion tok/q", "LLM calls/q", "p50 s", "p95 s"], cost)
    sections.append(("Latency and token cost", md, tab, cost_plot(summaries) if summaries else None))

    for prefix, title in (("routing_share/", "A2RAG routing (KG-only / Text-only / KG+Text)"),
                          ("hiim_share/", "A2RAG HIIM mode"),
                          ("rounds_share/", "SEMA-RAG rounds distribution"),
                          ("action_share/", "Graph-R1 action mix")):
        shares = [(s["method"], s["dataset"], k.removeprefix(prefix), float(v)) for s in summaries
                  for k, v in s["extra"].items() if k.startswith(prefix)]
        if shares:
            md, tab = _table(["method", "dataset", "category", "share"], shares)
            sections.append((title, md, tab, shares_plot(summaries, prefix, title)))

    stats = [(s["method"], s["dataset"], k, float(v)) for s in summaries for k, v in s["extra"].items()
             if not any(k.startswith(p) for p in ("routing_share/", "hiim_share/", "rounds_share/", "action_share/"))]
    if stats:
        md, tab = _table(["method", "dataset", "statistic", "value"], stats)
        sections.append(("Method statistics (GSRM recall per iteration, rounds, early stops, steps)", md, tab,
                         None))
    if data.reward_curves:
        curve = curve_plot(data.reward_curves, "Graph-R1 GRPO training (champion run)")
        last = [(name, points[-1][0], points[-1][1]) for name, points in data.reward_curves.items() if points]
        md, tab = _table(["metric", "last step", "value"], last)
        sections.append(("GRPO reward curve", md, tab, curve))

    md, tab = _table(["what", "value"], sorted(data.lineage.items()))
    sections.append(("Lineage", md, tab, None))

    markdown = ["# MedGraph evaluation report", ""]
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>MedGraph evaluation report</title>",
            f"<style>{STYLE}</style></head><body>", "<h1>MedGraph evaluation report</h1>"]
    for number, (title, md, tab, png) in enumerate(sections, start=1):
        markdown += [f"## {title}", ""]
        page.append(f"<h2>{html.escape(title)}</h2>")
        if png:
            image = out_dir / f"figure_{number}.png"
            image.write_bytes(base64.b64decode(png))
            markdown += [f"![{title}]({image.name})", ""]
            page.append(f"<img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
        markdown += [md, ""]
        page.append(tab)
    page.append("</body></html>")
    paths = {"markdown": out_dir / "report.md", "html": out_dir / "report.html"}
    for path, text in ((paths["markdown"], "\n".join(markdown)), (paths["html"], "\n".join(page))):
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    return paths
