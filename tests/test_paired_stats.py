"""Paired statistics (bootstrap CI, exact McNemar), method-vs-reference comparisons and the seed-claims table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medgraph.eval.claims import CONTRADICTED, HOLDS, NOT_SEPARABLE, gsrm_claims, seed_claims
from medgraph.eval.paired import paired_comparisons
from medgraph.stats import bootstrap_mean_ci, exact_sign_test, paired_difference


def test_exact_mcnemar_matches_the_binomial_test():
    # R: binom.test(2, 12)$p.value == mcnemar exact p for 10 vs 2 discordant pairs.
    assert exact_sign_test(10, 2) == pytest.approx(158 / 4096)
    assert exact_sign_test(2, 10) == exact_sign_test(10, 2)
    assert exact_sign_test(0, 0) == 1.0 and exact_sign_test(5, 5) == 1.0
    assert exact_sign_test(6, 0) == pytest.approx(2 / 64)  # 0.03125: all six discordant one way


def test_bootstrap_ci_covers_the_normal_interval_and_is_seeded():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2, size=400).astype(float)
    low, high = bootstrap_mean_ci(values, resamples=4000, seed=0)
    mean, se = values.mean(), values.std() / math.sqrt(len(values))
    assert low == pytest.approx(mean - 1.96 * se, abs=0.01) and high == pytest.approx(mean + 1.96 * se, abs=0.01)
    assert bootstrap_mean_ci(values, resamples=4000, seed=0) == (low, high)
    assert bootstrap_mean_ci([0.3] * 10) == pytest.approx((0.3, 0.3))


def test_paired_difference_counts_discordant_questions_and_says_when_n_is_too_small():
    a = [1, 1, 1, 0, 1, 0, 1, 1]
    b = [0, 1, 0, 0, 0, 0, 1, 0]
    result = paired_difference(a, b)
    assert (result.n, result.a_better, result.b_better) == (8, 4, 0)
    assert result.difference == pytest.approx(0.5) and result.p_value == pytest.approx(2 / 16)
    assert result.too_small  # 8 questions: the CI is far wider than 0.2
    big = paired_difference([1] * 300 + [0] * 100, [1] * 200 + [0] * 200)
    assert big.verdict == "a better" and not big.too_small
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1, 0], [1])


def _rows(method: str, correct: list[int], dataset: str = "kgqa_mc", recall: list[float] | None = None):
    return [{"method": method, "dataset": dataset, "qid": f"q{i}", "correct": bool(c), "latency_s": 1.0,
             "gold_fact_seen": None if recall is None else recall[i], "asset": "eval_x"}
            for i, c in enumerate(correct)]


def test_comparisons_pair_by_question_and_ablations_compare_with_their_method():
    rows = (_rows("rag", [1, 0, 0, 1], recall=[1.0, 0.0, 0.5, 1.0]) + _rows("a2rag", [1, 1, 1, 1], recall=[1.0] * 4)
            + _rows("a2rag-no-hiim", [1, 1, 0, 0]) + _rows("cot", [0, 0, 0]))
    found = {(c.method, c.reference, c.metric): c for c in
             paired_comparisons(rows, reference="rag", ablations={"a2rag-no-hiim": "a2rag"})}
    accuracy = found[("a2rag", "rag", "correct")]
    assert (accuracy.n, accuracy.method_better, accuracy.reference_better) == (4, 2, 0)
    assert accuracy.difference == pytest.approx(0.5)
    assert found[("a2rag", "rag", "gold_fact_seen")].difference == pytest.approx(0.375)
    assert found[("a2rag-no-hiim", "a2rag", "correct")].difference == pytest.approx(-0.5)
    assert found[("cot", "rag", "correct")].n == 3  # only the questions both answered
    assert ("a2rag-no-hiim", "a2rag", "gold_fact_seen") not in found  # no values: no comparison
    assert ("rag", "rag", "correct") not in found


def test_adapted_reader_rows_compare_with_the_same_reader_and_with_their_base_reader_row():
    rows = (_rows("rag", [1, 0, 0, 0]) + _rows("rag@adapted", [1, 1, 0, 0]) + _rows("rag-kg", [0, 0, 0, 0])
            + _rows("rag-kg@adapted", [1, 1, 1, 1]) + _rows("a2rag", [1, 0, 1, 0])
            + _rows("a2rag-no-hiim@adapted", [1, 1, 1, 0]))
    found = {(c.kind, c.method, c.reference): c for c in
             paired_comparisons(rows, reference="rag", ablations={"a2rag-no-hiim": "a2rag"}) if c.metric == "correct"}
    assert found[("method", "rag-kg@adapted", "rag@adapted")].difference == pytest.approx(0.5)
    assert found[("reader", "rag-kg@adapted", "rag-kg")].difference == pytest.approx(1.0)
    assert found[("reader", "rag@adapted", "rag")].difference == pytest.approx(0.25)
    assert ("method", "rag@adapted", "rag") not in found  # the reference is compared by reader, not as a method
    # The ablation's full method has no adapted row (HIIM keeps the base reader): no ablation pair, a reader pair
    # neither (no base-reader a2rag-no-hiim row), and never a cross-reader ablation comparison.
    assert not [k for k in found if k[1] == "a2rag-no-hiim@adapted"]
    assert ("method", "rag-kg", "rag") in found


def _gsrm(recalls: dict[int, list[float]], hops: int = 2):
    return [{"dataset": "kgqa_short", "qid": f"q{i}", "hops": hops, "iteration": k, "cutoff": 10, "recall": r}
            for k, values in recalls.items() for i, r in enumerate(values)]


def test_gsrm_claims_hold_flat_or_cannot_be_separated():
    n = 200
    rising = _gsrm({0: [0.0] * n, 2: [1.0] * 150 + [0.0] * 50, 3: [1.0] * 150 + [0.0] * 50})
    claims = {c.claim.split(",")[0]: c for c in gsrm_claims(rising)}
    assert claims["GSRM: refinement raises Recall@10 of the ranked triples (K=2 vs K=0)"].verdict == HOLDS
    assert claims["GSRM: a third iteration adds nothing (K=3 vs K=2)"].verdict.startswith(HOLDS)
    falling = gsrm_claims(_gsrm({0: [1.0] * n, 2: [0.0] * n}))
    assert falling[0].verdict == CONTRADICTED and falling[-1].verdict.startswith("not measured")
    few = gsrm_claims(_gsrm({0: [0.0, 1.0, 0.0], 2: [1.0, 0.0, 0.0]}))
    assert few[0].verdict == NOT_SEPARABLE and few[0].n == 3
    assert all(c.verdict.startswith("not measured") for c in gsrm_claims([]))


def test_seed_claims_name_the_missing_runs_and_measure_the_latency_ratio():
    rows = _rows("rag", [1, 0] * 20) + _rows("a2rag", [1, 0] * 20) + _rows("a2rag-no-hiim", [0, 0] * 20)
    for row in rows:
        row["latency_s"] = 3.0 if row["method"] == "a2rag" else 1.0
    comparisons = paired_comparisons(rows, ablations={"a2rag-no-hiim": "a2rag"})
    claims = {c.claim.split(" (")[0]: c for c in seed_claims([], rows, comparisons, [])}
    latency = claims["A2RAG latency per question is 2-4x single-round RAG"]
    assert latency.measured.startswith("3.00x") and latency.verdict == HOLDS
    hiim = claims["A2RAG ablation: a2rag-no-hiim"]
    assert hiim.verdict == HOLDS and hiim.n == 40
    assert claims["A2RAG ablation: a2rag-no-awc"].verdict.startswith("not measured: run a2rag-no-awc")
    assert claims["SEMA-RAG: early stopping saves rounds at equal accuracy"].verdict == "not measured: run sema-rag"
    base = {c.claim: c for c in seed_claims([], rows, comparisons, [], graph_r1_policy="base LLM")}
    assert "base LLM" in base["Graph-R1: removing SFT (cold start) hurts"].verdict


def test_seed_claims_have_a_row_for_every_ablation_and_name_a_fixed_route():
    rows = (_rows("graph-r1", [1, 0] * 20) + _rows("graph-r1-sft-only", [0, 0] * 20)
            + _rows("sema-rag", [1, 1] * 20) + _rows("sema-rag-no-e-agent", [0, 0] * 20)
            + _rows("sema-rag-no-i-agent", [1, 0] * 20))
    comparisons = paired_comparisons(rows, ablations={"graph-r1-sft-only": "graph-r1", "sema-rag-no-e-agent": "sema-rag",
                                                      "sema-rag-no-i-agent": "sema-rag"})
    summaries = [{"method": "a2rag", "dataset": "kgqa_mc", "questions": 40,
                  "extra": {"routing_share/KG-only": 0.975, "routing_share/none": 0.025}}]
    claims = {c.claim.split(" (")[0]: c for c in seed_claims(summaries, rows, comparisons, [])}
    assert claims["Graph-R1: removing RL hurts"].verdict == HOLDS
    for action in ("search", "traverse"):
        assert claims[f"Graph-R1: removing {action} hurts"].verdict.startswith(f"not measured: run graph-r1-no-{action}")
    e_agent = claims["SEMA-RAG: the E-Agent matters most"]
    assert e_agent.verdict == HOLDS and "vs sema-rag-no-i-agent: -50.0 pts" in e_agent.measured
    assert claims["SEMA-RAG: removing the A-Agent hurts"].verdict.startswith("not measured: run sema-rag-no-a-agent")
    route = claims["A2RAG: AWC routes each question"]
    assert route.verdict == "contradicted (degenerate: KG-only for 98%)" and route.n == 40
