"""Operational alarms on the evaluation assets, called directly on summary/results tables written here."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from medgraph.eval.evaluate import write_partition
from medgraph.eval.monitoring import TokenPrice
from medgraph.storage import Lake, Warehouse
from platform_assets import evaluation
from resources import WarehouseResource


def summary_row(method: str, p95: float, prompt: float, completion: float) -> dict[str, object]:
    return {"method": method, "dataset": "kg", "questions": 20, "accuracy": 0.5, "accuracy_se": 0.11,
            "parse_failure_rate": 0.0, "mean_f1": 0.5, "prompt_tokens": prompt, "completion_tokens": completion,
            "llm_calls": 3.0, "latency_p50_s": p95 / 2, "latency_p95_s": p95, "extra": "{}"}


def result_row(method: str, qid: str, steps: int, gsrm_iterations: int | None = None) -> dict[str, object]:
    stats = {} if gsrm_iterations is None else {"gsrm_iterations": gsrm_iterations}
    return {"method": method, "dataset": "kg", "qid": qid, "answer": "A", "prediction": "A", "parse_failed": False,
            "correct": True, "f1": 1.0, "steps": steps, "prompt_tokens": 900, "completion_tokens": 100,
            "latency_s": 1.0, "stats": json.dumps(stats)}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    warehouse = Warehouse(tmp_path / "warehouse.duckdb", Lake(tmp_path / "lake"))
    write_partition(warehouse, "eval_a2rag_summary", "kg",
                    [summary_row("a2rag", p95=12.0, prompt=3000, completion=400),
                     summary_row("a2rag-no-gsrm", p95=3.0, prompt=1500, completion=200)])
    write_partition(warehouse, "eval_a2rag_results", "kg",
                    [result_row("a2rag", "q1", steps=4, gsrm_iterations=2),
                     result_row("a2rag", "q2", steps=12, gsrm_iterations=3),
                     result_row("a2rag-no-gsrm", "q1", steps=3)])
    return tmp_path


def checks_of(asset: str) -> dict[str, dg.AssetChecksDefinition]:
    return {next(iter(c.check_keys)).name: c for c in evaluation.eval_checks
            if next(iter(c.check_keys)).asset_key == dg.AssetKey(["eval", asset])}


def test_every_evaluation_asset_has_the_three_warn_alarms():
    for asset in ("eval_baselines", "eval_a2rag", "eval_graph_r1", "eval_sema_rag"):
        assert set(checks_of(asset)) == {"latency_p95_within_budget", "cost_per_question_within_budget",
                                         "step_budgets_respected"}


def test_latency_alarm_warns_with_the_worst_method_over_the_threshold(home: Path):
    check = checks_of("eval_a2rag")["latency_p95_within_budget"]
    warehouse = WarehouseResource(home=str(home))
    over = check(config=evaluation.LatencyBudget(max_p95_s=10.0), warehouse=warehouse)
    assert not over.passed and over.severity == dg.AssetCheckSeverity.WARN
    assert "1 method/dataset pairs" in over.description and "a2rag on kg: 12.00 s" in over.description
    assert over.metadata["a2rag/kg/latency_p95_s"].value == 12.0
    assert over.metadata["over_threshold"].value == 1
    assert check(config=evaluation.LatencyBudget(max_p95_s=12.0), warehouse=warehouse).passed


def test_cost_alarm_multiplies_tokens_by_the_configured_price(home: Path):
    check = checks_of("eval_a2rag")["cost_per_question_within_budget"]
    config = evaluation.CostBudget(prompt_usd_per_1k_tokens=0.5, completion_usd_per_1k_tokens=1.5,
                                   max_usd_per_question=1.0)
    result = check(config=config, warehouse=WarehouseResource(home=str(home)))
    # a2rag: 3000/1000*0.5 + 400/1000*1.5 = 2.1; without GSRM: 0.75 + 0.3 = 1.05; both over $1.
    assert result.metadata["a2rag/kg/usd_per_question"].value == pytest.approx(2.1)
    assert result.metadata["a2rag-no-gsrm/kg/usd_per_question"].value == pytest.approx(1.05)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert "2 method/dataset pairs over $1" in result.description
    free = check(config=evaluation.CostBudget(), warehouse=WarehouseResource(home=str(home)))
    assert free.passed, "a self-hosted model (price 0) never trips the cost alarm"


def test_step_budget_alarm_counts_questions_over_each_budget(home: Path):
    check = checks_of("eval_a2rag")["step_budgets_respected"]
    result = check(config=evaluation.StepBudget(max_agent_steps=10, max_gsrm_iterations=2),
                   warehouse=WarehouseResource(home=str(home)))
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert result.description == "1 questions of a2rag over 10 steps; 1 questions of a2rag over 2 GSRM iterations"
    assert result.metadata["a2rag/max_steps"].value == 12
    assert result.metadata["a2rag/max_gsrm_iterations"].value == 3
    relaxed = check(config=evaluation.StepBudget(max_agent_steps=12, max_gsrm_iterations=3),
                    warehouse=WarehouseResource(home=str(home)))
    assert relaxed.passed


def test_alarm_on_a_never_materialized_asset_says_so(home: Path):
    result = checks_of("eval_sema_rag")["latency_p95_within_budget"](
        config=evaluation.LatencyBudget(), warehouse=WarehouseResource(home=str(home)))
    assert not result.passed and "eval.eval_sema_rag_summary does not exist" in result.description


def test_token_price_is_per_thousand_tokens():
    assert TokenPrice(2.0, 4.0).cost(500, 250) == pytest.approx(2.0)
