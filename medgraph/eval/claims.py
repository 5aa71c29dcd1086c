"""The seed papers' claims (docs/ARCHITECTURE.md "The three methods"), each set beside what this platform measured.

One row per claim: what the paper says, the platform's value with its 95% CI
and n, and a verdict. A directional claim *holds* when the CI lies on the
claimed side of zero, is *contradicted* when it lies on the other side, and is
otherwise *not separable at this n* — the honest answer for most answer-level
claims with a small CPU model. A claim whose runs are missing says which run
would measure it. Retrieval-level claims (GSRM Recall@10) need no LLM and are
measured on every test item.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from medgraph.eval.paired import Comparison, compare, outcomes_by_method
from medgraph.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, paired_difference

HOLDS, CONTRADICTED, NOT_SEPARABLE = "holds", "contradicted", "not separable at this n"
FLAT_MARGIN = 0.02  # "flat": the whole CI of the change within +-2 points
DEGENERATE_SHARE = 0.95  # a decision taken the same way for this share of questions is no decision


@dataclass(frozen=True)
class Claim:
    claim: str
    seed: str  # what the paper reports
    measured: str
    ci: str
    n: int
    verdict: str

    def as_row(self) -> tuple[object, ...]:
        return self.claim, self.seed, self.measured, self.ci, self.n, self.verdict


def _ci(low: float, high: float, points: bool = True) -> str:
    if math.isnan(low):
        return "n/a"
    scale, unit = (100, " pts") if points else (1, "")
    return f"[{low * scale:+.1f}, {high * scale:+.1f}]{unit}" if points else f"[{low:.2f}, {high:.2f}]"


def _direction(low: float, high: float, expected: int) -> str:
    """expected +1 (should rise) or -1 (should fall)."""
    if math.isnan(low):
        return "not measured"
    if (low > 0 and expected > 0) or (high < 0 and expected < 0):
        return HOLDS
    if (high < 0 and expected > 0) or (low > 0 and expected < 0):
        return CONTRADICTED
    return NOT_SEPARABLE


def _missing(claim: str, seed: str, what: str) -> Claim:
    return Claim(claim, seed, "not measured", "", 0, f"not measured: {what}")


# --- GSRM (retrieval level, no LLM) --------------------------------------------------------------------------


def _recall_by_item(gsrm_items: Sequence[Mapping[str, object]], iteration: int, cutoff: int,
                    hops: int | None) -> dict[str, float]:
    return {f"{r['dataset']}/{r['qid']}": float(r["recall"]) for r in gsrm_items
            if int(r["iteration"]) == iteration and int(r["cutoff"]) == cutoff
            and (hops is None or int(r["hops"]) == hops)}


def _gsrm_change(gsrm_items: Sequence[Mapping[str, object]], start: int, end: int, hops: int | None):
    before, after = _recall_by_item(gsrm_items, start, 10, hops), _recall_by_item(gsrm_items, end, 10, hops)
    common = sorted(before.keys() & after.keys())
    return paired_difference([after[q] for q in common], [before[q] for q in common],
                             BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)


def gsrm_claims(gsrm_items: Sequence[Mapping[str, object]]) -> list[Claim]:
    rise = "GSRM: refinement raises Recall@10 of the ranked triples (K=2 vs K=0)"
    rise_seed = "62.3% -> 75.8% (+13.5 pts)"
    flat = "GSRM: a third iteration adds nothing (K=3 vs K=2)"
    if not gsrm_items:
        return [_missing(rise, rise_seed, "materialize eval/gsrm_recall"),
                _missing(flat, "flat", "materialize eval/gsrm_recall")]
    claims = []
    iterations = {int(r["iteration"]) for r in gsrm_items}
    for hops, label in ((None, "all test items"), (2, "2-hop items")):
        if not {0, 2} <= iterations:
            claims.append(_missing(rise, rise_seed, "GSRM recall lacks iteration 0 or 2"))
            break
        change = _gsrm_change(gsrm_items, 0, 2, hops)
        if change.n == 0:
            continue
        claims.append(Claim(f"{rise}, {label}", rise_seed,
                            f"{change.mean_b:.1%} -> {change.mean_a:.1%} ({change.difference * 100:+.1f} pts)",
                            _ci(change.ci_low, change.ci_high), change.n,
                            _direction(change.ci_low, change.ci_high, +1)))
    if {2, 3} <= iterations:
        change = _gsrm_change(gsrm_items, 2, 3, None)
        verdict = (HOLDS if -FLAT_MARGIN <= change.ci_low and change.ci_high <= FLAT_MARGIN else
                   "contradicted (still rising)" if change.ci_low > FLAT_MARGIN else
                   "contradicted (falling)" if change.ci_high < -FLAT_MARGIN else NOT_SEPARABLE)
        claims.append(Claim(flat, "flat", f"{change.mean_b:.1%} -> {change.mean_a:.1%}",
                            _ci(change.ci_low, change.ci_high), change.n, f"{verdict} (flat = CI within ±2 pts)"))
    else:
        claims.append(_missing(flat, "flat", "GSRM recall was not measured at iteration 3"))
    return claims


# --- answer-level claims -------------------------------------------------------------------------------------


def _accuracy(comparisons: Sequence[Comparison], method: str, reference: str) -> list[Comparison]:
    return [c for c in comparisons if c.method == method and c.reference == reference and c.metric == "correct"]


def _drop_claim(comparisons: Sequence[Comparison], ablation: str, method: str, text: str, seed: str) -> Claim:
    found = _accuracy(comparisons, ablation, method)
    if not found:
        return _missing(text, seed, f"run {ablation} and {method} on the same questions")
    c = max(found, key=lambda c: c.n)  # the dataset with the most paired questions
    return Claim(f"{text} ({c.dataset})", seed, f"{c.method_mean:.3f} vs {c.reference_mean:.3f} "
                 f"({c.difference * 100:+.1f} pts)", _ci(c.ci_low, c.ci_high), c.n,
                 _direction(c.ci_low, c.ci_high, -1))


def _latency_claim(results: Sequence[Mapping[str, object]]) -> Claim:
    text, seed = "A2RAG latency per question is 2-4x single-round RAG", "2-4x"
    latency: dict[str, dict[str, float]] = {}
    for row in results:
        if row["method"] in ("a2rag", "rag"):
            latency.setdefault(str(row["method"]), {})[f"{row['dataset']}/{row['qid']}"] = float(row["latency_s"])
    common = sorted(latency.get("a2rag", {}).keys() & latency.get("rag", {}).keys())
    if not common:
        return _missing(text, seed, "run a2rag and rag on the same questions")
    a2rag = np.array([latency["a2rag"][q] for q in common])
    rag = np.array([latency["rag"][q] for q in common])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = rng.integers(0, len(common), size=(BOOTSTRAP_RESAMPLES, len(common)))
    ratios = a2rag[draws].mean(axis=1) / np.maximum(rag[draws].mean(axis=1), 1e-9)
    low, high = (float(x) for x in np.quantile(ratios, [0.025, 0.975]))
    verdict = (HOLDS if 2 <= low and high <= 4 else "contradicted" if high < 2 or low > 4 else NOT_SEPARABLE)
    return Claim(text, seed, f"{a2rag.mean() / max(rag.mean(), 1e-9):.2f}x (mean latency, batched)",
                 _ci(low, high, points=False), len(common), verdict)


def _most_important_claim(comparisons: Sequence[Comparison], results: Sequence[Mapping[str, object]], method: str,
                          key: str, others: Sequence[str], text: str, seed: str) -> Claim:
    """`key` (an ablation of `method`) hurts most: its drop against `method`, then, paired directly, against each
    other ablation in `others` that was run on the same questions."""
    drop = _accuracy(comparisons, key, method)
    if not drop:
        return _missing(text, seed, f"run {key} and {method} on the same questions")
    c = max(drop, key=lambda c: c.n)
    run = [name for name in others if _accuracy(comparisons, name, method)]
    if not run:
        return Claim(f"{text} ({c.dataset})", seed, f"without it {c.difference * 100:+.1f} pts vs {method}; "
                     f"other ablations not run ({', '.join(others)})", _ci(c.ci_low, c.ci_high), c.n,
                     f"{_direction(c.ci_low, c.ci_high, -1)} (drop only; ranking needs the other ablations)")
    by_method = outcomes_by_method(results)
    versus = [compare(by_method, key, other, c.dataset, "correct", "claim") for other in run]
    versus = [v for v in versus if v is not None]
    worst_high = max(v.ci_high for v in versus)
    verdict = (HOLDS if worst_high < 0 else "contradicted" if any(v.ci_low > 0 for v in versus) else NOT_SEPARABLE)
    measured = "; ".join(f"vs {v.reference}: {v.difference * 100:+.1f} pts" for v in versus)
    return Claim(f"{text} ({c.dataset})", seed, f"without it {c.difference * 100:+.1f} pts; {measured}",
                 "; ".join(_ci(v.ci_low, v.ci_high) for v in versus), min(v.n for v in versus), verdict)


def _routing_claim(summaries: Sequence[Mapping[str, object]]) -> list[Claim]:
    """AWC chooses the route per question: one row per dataset with the route shares; a route taken for at least
    `DEGENERATE_SHARE` of the questions is no choice."""
    text, seed = "A2RAG: AWC routes each question (KG-only / Text-only / KG+Text / none)", "routes vary by question"
    rows = [s for s in summaries if s["method"] == "a2rag" and any(k.startswith("routing_share/") for k in s["extra"])]
    if not rows:
        return [_missing(text, seed, "run a2rag")]
    claims = []
    for row in rows:
        shares = {k.removeprefix("routing_share/"): float(v) for k, v in row["extra"].items()
                  if k.startswith("routing_share/")}
        route, top = max(shares.items(), key=lambda kv: kv[1])
        verdict = f"contradicted (degenerate: {route} for {top:.0%})" if top >= DEGENERATE_SHARE else HOLDS
        claims.append(Claim(f"{text} ({row['dataset']})", seed,
                            ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items())), "",
                            int(row["questions"]), verdict))
    return claims


def _early_stop_claim(summaries: Sequence[Mapping[str, object]], comparisons: Sequence[Comparison]) -> Claim:
    text = "SEMA-RAG: early stopping saves rounds at equal accuracy"
    seed = "fewer rounds, accuracy unchanged"
    rows = [s for s in summaries if s["method"] == "sema-rag" and "rounds_mean" in s["extra"]]
    if not rows:
        return _missing(text, seed, "run sema-rag")
    row = max(rows, key=lambda s: int(s["questions"]))
    rounds = float(row["extra"]["rounds_mean"])
    full = _accuracy(comparisons, "sema-rag-no-early-stop", "sema-rag")
    if not full:
        return Claim(text, seed, f"{rounds:.2f} rounds on average, early-stop rate "
                     f"{float(row['extra'].get('early_stop_rate', float('nan'))):.0%}", "", int(row["questions"]),
                     "accuracy at equal rounds not measured: run sema-rag-no-early-stop")
    c = max(full, key=lambda c: c.n)
    ablation = next((s for s in summaries if s["method"] == "sema-rag-no-early-stop" and s["dataset"] == c.dataset
                     and "rounds_mean" in s["extra"]), None)
    without = float(ablation["extra"]["rounds_mean"]) if ablation else float("nan")
    measured = (f"{rounds:.2f} vs {without:.2f} rounds (early stop vs none); without early stop accuracy "
                f"{c.difference * 100:+.1f} pts")
    if not without > rounds:  # the ablation asks only what the E-Agent writes: no follow-up, no further round
        return Claim(f"{text} ({c.dataset})", seed, measured, _ci(c.ci_low, c.ci_high), c.n,
                     "not measured: no round saved (the E-Agent wrote no follow-up query when it stopped)")
    equal = -0.05 <= c.ci_low and c.ci_high <= 0.05
    verdict = (HOLDS if equal else "contradicted" if c.ci_low > 0.05 or c.ci_high < -0.05 else NOT_SEPARABLE)
    return Claim(f"{text} ({c.dataset})", seed, measured, _ci(c.ci_low, c.ci_high), c.n,
                 f"{verdict} (equal = CI within ±5 pts)")


def seed_claims(summaries: Sequence[Mapping[str, object]], results: Sequence[Mapping[str, object]],
                comparisons: Sequence[Comparison], gsrm_items: Sequence[Mapping[str, object]],
                graph_r1_policy: str | None = None) -> list[Claim]:
    """Every claim of docs/ARCHITECTURE.md's method specifications beside the platform's measurement."""
    claims = gsrm_claims(gsrm_items)
    for ablation, seed in (("a2rag-no-awc", "removing AWC lowers accuracy"),
                           ("a2rag-no-gsrm", "removing GSRM lowers accuracy"),
                           ("a2rag-no-hiim", "removing HIIM lowers accuracy")):
        claims.append(_drop_claim(comparisons, ablation, "a2rag", f"A2RAG ablation: {ablation}", seed))
    claims += _routing_claim(summaries)
    claims.append(_latency_claim(results))
    claims.append(_most_important_claim(
        comparisons, results, "graph-r1", "graph-r1-no-analyze", ("graph-r1-no-search", "graph-r1-no-traverse"),
        "Graph-R1: analyze is the most important action (its removal hurts most)",
        "-12 to -15% F1 without analyze, the largest drop"))
    for action in ("search", "traverse"):
        claims.append(_drop_claim(comparisons, f"graph-r1-no-{action}", "graph-r1",
                                  f"Graph-R1: removing {action} hurts", f"lower accuracy without {action}"))
    trained = graph_r1_policy is None or not graph_r1_policy.startswith("base")
    for ablation, text, seed in (("graph-r1-no-sft", "Graph-R1: removing SFT (cold start) hurts",
                                  "lower accuracy without SFT"),
                                 ("graph-r1-sft-only", "Graph-R1: removing RL hurts",
                                  "lower accuracy with the SFT policy alone, no GRPO")):
        claims.append(_drop_claim(comparisons, ablation, "graph-r1", text, seed) if trained else
                      _missing(text, seed, "graph-r1 itself ran with the base LLM (no trained policy)"))
    for agent in ("i", "a"):
        claims.append(_drop_claim(comparisons, f"sema-rag-no-{agent}-agent", "sema-rag",
                                  f"SEMA-RAG: removing the {agent.upper()}-Agent hurts",
                                  f"lower accuracy without the {agent.upper()}-Agent"))
    claims.append(_most_important_claim(
        comparisons, results, "sema-rag", "sema-rag-no-e-agent", ("sema-rag-no-i-agent", "sema-rag-no-a-agent"),
        "SEMA-RAG: the E-Agent matters most (its removal hurts most)", "the largest drop without the E-Agent"))
    claims.append(_early_stop_claim(summaries, comparisons))
    return claims
