"""GSRM as the seed measures it: Recall@c of the ranked triple list after each refinement iteration.

For a question with gold facts (KG-derived items carry `gold_pairs`, the
unordered concept pair of each gold edge), GSRM's ranked list after iteration
k is G_k's triples sorted by cosine(emb(triple), emb(question)); Recall@c is
the share of the gold pairs that some triple among its top c connects (either
direction, any relation). This needs the encoder and the graph, not the LLM,
so it runs over every validation and test item:

- `gsrm_recall_curves`: Recall@c for k = 0..K of each item, entities linked
  exactly as A2RAG links them (`KnowledgeTools.question_entities`) and the
  same hub guard (`A2RagConfig.max_triples_per_relation`);
- `sweep_gsrm` / `choose_gsrm_params`: a (tau, K, N) grid on the validation
  split and the rule that picks from it (Recall@10 after K iterations, ties to
  the smaller K, then the larger tau; N the smallest grid N within 0.01 of the
  best Recall@N);
- `gsrm_recall_table_rows` / `gsrm_recall_rows`: the `eval.gsrm_recall` table
  (mean and standard error per dataset, hops, iteration and cutoff).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from medgraph.files import write_atomically
from medgraph.home import HomeLayout
from medgraph.methods.a2rag import A2RagConfig, gsrm_refine
from medgraph.methods.registry import make_config, method_of
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.item import QaItem, gold_pairs
from medgraph.storage import Warehouse, read_rows

log = logging.getLogger(__name__)

RECALL_CUTOFF = 10  # the seed's Recall@10
DEFAULT_TAUS = (0.3, 0.4, 0.5, 0.6, 0.7)
DEFAULT_ITERATIONS = (0, 1, 2, 3)
DEFAULT_TOP_NS = (20, 50)
TOP_N_TOLERANCE = 0.01  # N: the smallest grid N whose Recall@N is this close to the best
RECALL_TABLE, RECALL_ITEMS_TABLE = "gsrm_recall", "gsrm_recall_items"


def measurable_items(items: Sequence[QaItem], limit: int | None = None) -> list[QaItem]:
    """The items GSRM recall is measured on: those with gold pairs and 1 or 2 hops (kgqa_mc, kgqa_short and
    the "yes" items of kgqa_yesno; a "no" item has no gold fact, MIRAGE items carry none).

    `limit` keeps that many, taken in turn from each (dataset, hops) group in file order, so a capped run
    still covers every kind of question (the first N of a file would all be multiple choice)."""
    found = [item for item in items if gold_pairs(item) and int(item.extra.get("hops") or 0) in (1, 2)]
    if limit is None or limit >= len(found):
        return found
    groups: dict[tuple[str, int], list[QaItem]] = {}
    for item in found:
        groups.setdefault((item.dataset, int(item.extra.get("hops") or 0)), []).append(item)
    taken: list[QaItem] = []
    for rank in range(max(len(g) for g in groups.values())):
        taken += [group[rank] for group in groups.values() if rank < len(group)]
    return taken[:limit]


@dataclass(frozen=True)
class ItemCurve:
    """One item's Recall@c of GSRM's ranked list for k = 0..K."""

    qid: str
    dataset: str
    hops: int
    recall: dict[int, list[float]]  # cutoff -> Recall@cutoff at k = 0..K
    tau: float = float("nan")  # the threshold the curve was grown with
    top_n: int = 0  # the N of its type


def gsrm_recall_curves(tools: KnowledgeTools, items: Sequence[QaItem], tau: float, iterations: int,
                       cutoffs: Sequence[int], per_relation_limit: int | None = A2RagConfig.max_triples_per_relation,
                       batch_size: int = 64, entity_sets: Sequence[Sequence[str]] | None = None,
                       progress: Callable[[str], None] | None = None) -> list[ItemCurve]:
    """Recall@c at k = 0..`iterations` for each item with gold pairs (others are skipped), in batches of
    `batch_size` questions (one graph query and one encode per iteration and batch). `entity_sets` (E_q per
    item, as `question_entities` returns) saves relinking when the same items are measured again."""
    items = measurable_items(items)
    if entity_sets is None:
        entity_sets = link_entities(tools, items, batch_size)
    curves: list[ItemCurve] = []
    started = time.perf_counter()
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        results = gsrm_refine(tools, entity_sets[start:start + batch_size], [item.question for item in batch],
                              tau, iterations, max(cutoffs), per_relation_limit)
        for item, result in zip(batch, results):
            recall = result.ranked_recall(gold_pairs(item) or (), cutoffs, iterations)
            curves.append(ItemCurve(item.qid, item.dataset, int(item.extra.get("hops") or 0), recall, float(tau),
                                    max(cutoffs)))
        if progress is not None:
            progress(f"GSRM recall tau={tau} K={iterations}: {len(curves)}/{len(items)} items, "
                     f"{tools.triples_encoded} triples encoded{_cache_note(tools)}, "
                     f"{time.perf_counter() - started:.0f}s")
    return curves


def gsrm_recall_by_dataset(tools: KnowledgeTools, items: Sequence[QaItem], params: Mapping[str, object],
                           min_iterations: int = 3, batch_size: int = 64,
                           progress: Callable[[str], None] | None = None) -> list[ItemCurve]:
    """Recall@10 and Recall@N at k = 0..max(K, min_iterations) for each measurable item, each dataset with its
    own tuned tau, K and N (the pooled choice for a dataset that was not tuned)."""
    by_dataset = params_by_dataset(params)
    default = (float(params["tau"]), int(params["iterations"]), int(params["top_n"]))
    hub_guard = params.get("max_triples_per_relation", A2RagConfig.max_triples_per_relation)
    curves: list[ItemCurve] = []
    for dataset, group in _measurable_by_dataset(items).items():
        tau, iterations, top_n = by_dataset.get(dataset, default)
        curves += gsrm_recall_curves(tools, group, tau, max(iterations, min_iterations),
                                     sorted({RECALL_CUTOFF, top_n}), hub_guard, batch_size, progress=progress)
    return curves


def _cache_note(tools: KnowledgeTools) -> str:
    cache = tools.vector_cache
    return "" if cache is None else f" ({cache.hits} read from the vector cache)"


def link_entities(tools: KnowledgeTools, items: Sequence[QaItem], batch_size: int = 64) -> list[list[str]]:
    """E_q of each item, exactly as A2RAG links them."""
    return [cuis for start in range(0, len(items), batch_size)
            for cuis in tools.question_entities(items[start:start + batch_size])]


def mean_curve(curves: Sequence[ItemCurve], cutoff: int) -> list[float]:
    """Mean Recall@cutoff at each k over the items."""
    if not curves:
        return []
    return [float(v) for v in np.mean([c.recall[cutoff] for c in curves], axis=0)]


# --------------------------------------------------------------------------- the sweep and the choice


@dataclass(frozen=True)
class SweepPoint:
    """One grid point: mean Recall@10 and Recall@N of the ranked list after K iterations at threshold tau."""

    tau: float
    iterations: int
    top_n: int
    recall_at10: float
    recall_at_n: float
    n: int  # items


@dataclass(frozen=True)
class GsrmChoice:
    tau: float
    iterations: int
    top_n: int
    recall_at10: float
    recall_at_n: float
    n: int
    note: str = ""
    rule: str = ("max Recall@10 after K iterations over (tau, K), ties -> smaller K, then larger tau; "
                 f"N = smallest grid N with Recall@N within {TOP_N_TOLERANCE} of the best")


@dataclass
class GsrmSweep:
    points: list[SweepPoint]
    curves: dict[float, dict[int, list[float]]]  # tau -> cutoff -> mean Recall@cutoff at k = 0..max K
    n: int
    seconds: float
    triples_encoded: int
    max_triples_per_relation: int | None  # the hub guard the subgraphs were built with
    grid: dict[str, list[float] | list[int]] = field(default_factory=dict)


def sweep_gsrm(tools: KnowledgeTools, items: Sequence[QaItem], taus: Sequence[float] = DEFAULT_TAUS,
               iterations: Sequence[int] = DEFAULT_ITERATIONS, top_ns: Sequence[int] = DEFAULT_TOP_NS,
               per_relation_limit: int | None = A2RagConfig.max_triples_per_relation, batch_size: int = 64,
               progress: Callable[[str], None] | None = None) -> GsrmSweep:
    """Every (tau, K, N) of the grid on `items`. K and N do not change how G grows (G_K is a prefix of
    G_maxK) nor the ranking, so one GSRM run per tau at the largest K gives every point; triple vectors
    are shared across taus (KnowledgeTools caches them) and entities are linked once."""
    items = measurable_items(items)
    started = time.perf_counter()
    entity_sets = link_entities(tools, items, batch_size)
    cutoffs = sorted({RECALL_CUTOFF, *top_ns})
    points, curves = [], {}
    for tau in taus:
        item_curves = gsrm_recall_curves(tools, items, tau, max(iterations), cutoffs, per_relation_limit,
                                         batch_size, entity_sets, progress)
        curves[tau] = {c: mean_curve(item_curves, c) for c in cutoffs}
        for k in iterations:
            for top_n in top_ns:
                at10 = curves[tau][RECALL_CUTOFF][k] if item_curves else 0.0
                at_n = curves[tau][top_n][k] if item_curves else 0.0
                points.append(SweepPoint(float(tau), int(k), int(top_n), at10, at_n, len(item_curves)))
    grid = {"taus": [float(t) for t in taus], "iterations": [int(k) for k in iterations],
            "top_ns": [int(n) for n in top_ns]}
    return GsrmSweep(points, curves, len(items), time.perf_counter() - started, tools.triples_encoded,
                     per_relation_limit, grid)


def _measurable_by_dataset(items: Sequence[QaItem]) -> dict[str, list[QaItem]]:
    """The measurable items (`measurable_items`) of each dataset, datasets in name order."""
    groups: dict[str, list[QaItem]] = {}
    for item in measurable_items(items):
        groups.setdefault(item.dataset, []).append(item)
    return dict(sorted(groups.items()))


def sweep_gsrm_by_dataset(tools: KnowledgeTools, items: Sequence[QaItem], taus: Sequence[float] = DEFAULT_TAUS,
                          iterations: Sequence[int] = DEFAULT_ITERATIONS, top_ns: Sequence[int] = DEFAULT_TOP_NS,
                          per_relation_limit: int | None = A2RagConfig.max_triples_per_relation,
                          batch_size: int = 64,
                          progress: Callable[[str], None] | None = None) -> dict[str, GsrmSweep]:
    """`sweep_gsrm` on each dataset's items apart: refinement can only act where the gold fact is not already
    in G_0 (2-hop short answers), and pooling datasets would hide that. Not per question type: A2RAG cannot
    tell a 1-hop question from a 2-hop one without the gold path."""
    return {dataset: sweep_gsrm(tools, group, taus, iterations, top_ns, per_relation_limit, batch_size, progress)
            for dataset, group in _measurable_by_dataset(items).items()}


def pooled_points(sweeps: Mapping[str, GsrmSweep]) -> list[SweepPoint]:
    """The grid over every dataset's items together (each dataset's means weighted by its n)."""
    groups: dict[tuple[float, int, int], list[SweepPoint]] = {}
    for sweep in sweeps.values():
        for p in sweep.points:
            groups.setdefault((p.tau, p.iterations, p.top_n), []).append(p)
    pooled = []
    for (tau, k, top_n), points in groups.items():
        n = sum(p.n for p in points)
        pooled.append(SweepPoint(tau, k, top_n, sum(p.recall_at10 * p.n for p in points) / max(n, 1),
                                 sum(p.recall_at_n * p.n for p in points) / max(n, 1), n))
    return pooled


def choose_gsrm_params(points: Sequence[SweepPoint], tolerance: float = TOP_N_TOLERANCE) -> GsrmChoice:
    """(tau, K) with the highest Recall@10 after K iterations, ties to the smaller K, then the larger tau;
    N the smallest grid N whose Recall@N at that (tau, K) is within `tolerance` of the best grid N's."""
    if not points:
        raise ValueError("no sweep points to choose from (no validation items with gold pairs?)")
    best = min(points, key=lambda p: (-round(p.recall_at10, 9), p.iterations, -p.tau))
    same = [p for p in points if p.tau == best.tau and p.iterations == best.iterations]
    best_at_n = max(p.recall_at_n for p in same)
    pick = min((p for p in same if p.recall_at_n >= best_at_n - tolerance), key=lambda p: p.top_n)
    note = ("K = 0: no refinement ranked the gold facts better on validation (tau does not act at K = 0; the "
            "largest grid tau is kept)" if pick.iterations == 0 else "")
    return GsrmChoice(pick.tau, pick.iterations, pick.top_n, pick.recall_at10, pick.recall_at_n, pick.n, note)


def sweep_markdown(sweeps: Mapping[str, GsrmSweep], choices: Mapping[str, GsrmChoice]) -> str:
    """Every dataset's grid as one Markdown table, each dataset's chosen point marked."""
    lines = ["| dataset | tau | K | N | Recall@10 | Recall@N | n | chosen |", "|---|---|---|---|---|---|---|---|"]
    for kind, sweep in sweeps.items():
        choice = choices[kind]
        for p in sweep.points:
            chosen = "**yes**" if (p.tau, p.iterations, p.top_n) == (choice.tau, choice.iterations, choice.top_n) \
                else ""
            lines.append(f"| {kind} | {p.tau:g} | {p.iterations} | {p.top_n} | {p.recall_at10:.3f} "
                         f"| {p.recall_at_n:.3f} | {p.n} | {chosen} |")
    return "\n".join(lines)


def sweep_figure(sweeps: Mapping[str, GsrmSweep]):  # -> matplotlib Figure
    """Recall@10 against k, one panel per dataset, one line per tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(sweeps), 1), figsize=(3.2 * max(len(sweeps), 1), 3.4), squeeze=False)
    for axis, (kind, sweep) in zip(axes[0], sweeps.items()):
        for tau, by_cutoff in sweep.curves.items():
            values = by_cutoff.get(RECALL_CUTOFF, [])
            axis.plot(range(len(values)), values, "o-", label=f"tau={tau:g}")
        axis.set_xlabel("refinement iteration k")
        axis.set_title(f"{kind} (n={sweep.n})", fontsize=9)
    axes[0][0].set_ylabel("Recall@10 (validation)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def log_sweep(sweeps: Mapping[str, GsrmSweep], choices: Mapping[str, GsrmChoice], default: GsrmChoice,
              params_file: Path) -> None:
    """Into the active MLflow run: the grid (params), each dataset's Recall@c-by-k curve per tau and cutoff
    (metric `<dataset>/recall_at<c>_tau<tau>`, step k), each dataset's choice and the pooled default, the parameters
    file and the Recall@10 plot."""
    import mlflow

    first = next(iter(sweeps.values()), None)
    mlflow.log_params({**({k: str(v) for k, v in first.grid.items()} if first else {}), "split": "validation",
                       "items": sum(s.n for s in sweeps.values()),
                       "max_triples_per_relation": str(first.max_triples_per_relation if first else None)})
    for kind, sweep in sweeps.items():
        for tau, curves in sweep.curves.items():
            for cutoff, values in curves.items():
                for k, value in enumerate(values):
                    mlflow.log_metric(f"{kind}/recall_at{cutoff}_tau{tau:g}", value, step=k)
        choice = choices[kind]
        mlflow.log_metrics({f"{kind}/chosen_tau": choice.tau, f"{kind}/chosen_iterations": choice.iterations,
                            f"{kind}/chosen_top_n": choice.top_n, f"{kind}/recall_at10": choice.recall_at10,
                            f"{kind}/items": choice.n})
    mlflow.log_metrics({"chosen_tau": default.tau, "chosen_iterations": default.iterations,
                        "chosen_top_n": default.top_n, "recall_at10": default.recall_at10,
                        "recall_at_n": default.recall_at_n,
                        "sweep_seconds": sum(s.seconds for s in sweeps.values())})
    mlflow.log_artifact(str(params_file))
    mlflow.log_figure(sweep_figure(sweeps), "recall_at10_by_iteration.png")


# --------------------------------------------------------------------------- the chosen parameters on disk


def params_path(home: Path) -> Path:
    return HomeLayout(home).gsrm_params


def write_gsrm_params(home: Path, default: GsrmChoice, sweeps: Mapping[str, GsrmSweep],
                      choices: Mapping[str, GsrmChoice]) -> Path:
    """`$MEDGRAPH_HOME/models/gsrm_params.json` (atomically): the pooled choice (items of no tuned type use it),
    and under `by_dataset` each dataset's choice, its n and its grid points."""
    first = next(iter(sweeps.values()), None)
    payload = {**asdict(default), "split": "validation", "grid": first.grid if first else {},
               "max_triples_per_relation": first.max_triples_per_relation if first else None,
               "by_dataset": {name: {**asdict(choices[name]), "points": [asdict(p) for p in sweeps[name].points]}
                              for name in sweeps},
               "seconds": round(sum(s.seconds for s in sweeps.values()), 1),
               "triples_encoded": max((s.triples_encoded for s in sweeps.values()), default=0)}
    return write_atomically(params_path(home), json.dumps(payload, indent=2))


def params_by_dataset(params: Mapping[str, object] | None) -> dict[str, tuple[float, int, int]]:
    """dataset -> (tau, K, N) from a gsrm_params.json payload ({} without one, or without `by_dataset`)."""
    by_dataset = (params or {}).get("by_dataset") or {}
    return {name: (float(v["tau"]), int(v["iterations"]), int(v["top_n"])) for name, v in by_dataset.items()}


def read_gsrm_params(home: Path) -> dict[str, object] | None:
    """The tuned {tau, iterations, top_n, ...}, or None when `models/gsrm_params` has not run."""
    path = params_path(home)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


# --------------------------------------------------------------------------- the test-split table


def gsrm_recall_table_rows(curves: Sequence[ItemCurve]) -> tuple[list[dict], list[dict]]:
    """(`eval.gsrm_recall` rows, `eval.gsrm_recall_items` rows). The first has the mean Recall@c and its
    standard error over the items of each (dataset, hops) — one question type each —, iteration and cutoff,
    with the tau and N the dataset was measured with; plus `dataset = "all"` rows over every dataset per hops
    and, with `hops` NULL, over 1- and 2-hop items together (tau NaN where types with another tau mix)."""
    item_rows = [{"qid": c.qid, "dataset": c.dataset, "hops": c.hops, "iteration": k, "cutoff": cutoff,
                  "recall": float(value), "tau": c.tau, "top_n": c.top_n}
                 for c in curves for cutoff, values in sorted(c.recall.items()) for k, value in enumerate(values)]
    groups: dict[tuple[str, int | None, int, int], list[dict]] = {}
    for row in item_rows:
        for dataset, hops in ((row["dataset"], row["hops"]), ("all", row["hops"]), ("all", None)):
            groups.setdefault((dataset, hops, row["iteration"], row["cutoff"]), []).append(row)
    rows = []
    order = sorted(groups, key=lambda g: (g[0] == "all", g[0], g[1] is None, g[1] or 0, g[2], g[3]))
    for dataset, hops, iteration, cutoff in order:
        group = groups[(dataset, hops, iteration, cutoff)]
        values = [r["recall"] for r in group]
        n = len(values)
        se = float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        taus, top_ns = {r["tau"] for r in group}, {r["top_n"] for r in group}
        rows.append({"dataset": dataset, "hops": hops, "iteration": iteration, "cutoff": cutoff,
                     "recall": float(np.mean(values)), "recall_se": se, "n": n,
                     "tau": taus.pop() if len(taus) == 1 else float("nan"),
                     "top_n": top_ns.pop() if len(top_ns) == 1 else 0})
    return rows, item_rows


def recall_markdown(rows: Sequence[Mapping[str, object]]) -> str:
    """`eval.gsrm_recall` as a Markdown table: one line per (dataset, hops, cutoff), Recall at each k."""
    lines: dict[tuple[str, str, int], dict[int, str]] = {}
    for row in rows:
        key = (str(row["dataset"]), "1+2" if row["hops"] is None else str(row["hops"]), int(row["cutoff"]))
        lines.setdefault(key, {})[int(row["iteration"])] = f"{row['recall']:.3f} ± {row['recall_se']:.3f} (n={row['n']})"
    iterations = sorted({int(r["iteration"]) for r in rows})
    table = ["| dataset | hops | cutoff | " + " | ".join(f"k={k}" for k in iterations) + " |",
             "|---|---|---|" + "---|" * len(iterations)]
    for (dataset, hops, cutoff), cells in lines.items():
        table.append(f"| {dataset} | {hops} | @{cutoff} | " + " | ".join(cells.get(k, "") for k in iterations) + " |")
    return "\n".join(table)


def gsrm_recall_rows(warehouse: Warehouse) -> list[dict[str, object]]:
    """The rows of `eval.gsrm_recall` as dicts (for the report); [] when it has not been written."""
    return read_rows(warehouse, "eval", RECALL_TABLE,
                     order_by="dataset = 'all', dataset, hops NULLS LAST, cutoff, iteration")


# --------------------------------------------------------------------------- A2RAG's evaluation uses the choice


GSRM_FIELDS = {"tau": "gsrm_tau", "iterations": "gsrm_iterations", "top_n": "gsrm_top_n"}


def with_tuned_gsrm(params: Mapping[str, object] | None, methods: Sequence[str],
                    overrides: Mapping[str, Mapping[str, object]]) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    """(overrides, lineage): the tuned tau, K and N (pooled, and per dataset) under every A2RAG method or
    ablation in `methods`, explicit `overrides` winning field by field; the lineage says what the first of them
    runs with and where it came from (`gsrm_params_source`: "models/gsrm_params", "method_config", both, or
    the defaults)."""
    merged = {name: dict(values) for name, values in overrides.items()}
    a2rag = [m for m in methods if method_of(m) == "a2rag"]
    tuned: dict[str, object] = {key: params[key] for key in GSRM_FIELDS if params and key in params}
    if params_by_dataset(params):
        tuned["gsrm_by_dataset"] = [[name, *values] for name, values in sorted(params_by_dataset(params).items())]
    for method in a2rag:
        merged[method] = {**tuned, **merged.get(method, {})}
    if not a2rag:
        return merged, {}
    first = a2rag[0]
    config = make_config(first, merged.get(first))
    explicit = set(overrides.get(first, {})) & {*GSRM_FIELDS, "gsrm_by_dataset"}
    sources = ([f"models/gsrm_params (validation, n={params.get('n')})"] if set(tuned) - explicit else []) + \
              (["method_config"] if explicit else [])
    lineage: dict[str, object] = {label: getattr(config, key) for key, label in GSRM_FIELDS.items()}
    lineage["gsrm_by_dataset"] = "; ".join(f"{dataset}: tau={tau:g} K={k} N={n}" for dataset, tau, k, n
                                           in config.gsrm_by_dataset) or "none (one tau/K/N)"
    lineage["gsrm_params_source"] = " + ".join(sources) or "A2RagConfig defaults (no models/gsrm_params.json)"
    return merged, lineage


def tuned_a2rag_config(home: Path) -> A2RagConfig:
    """A2RAG's configuration with the tau, K and N that models/gsrm_params chose, pooled and per dataset
    (the defaults without it), so that whatever trains on A2RAG's retrieval (the HIIM projector) sees what
    evaluation will."""
    params = read_gsrm_params(home) or {}
    fields: dict[str, object] = {key: type(getattr(A2RagConfig(), key))(params[key])
                                 for key in GSRM_FIELDS if key in params}
    fields["gsrm_by_dataset"] = tuple((name, *values) for name, values in sorted(params_by_dataset(params).items()))
    return replace(A2RagConfig(), **fields)
