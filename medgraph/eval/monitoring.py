"""Operational alarms over the evaluation tables: latency, cost and step budgets.

Inputs are the tables `medgraph.eval.evaluate` writes: `eval.<asset>_summary`
(one row per method and dataset: tokens per question, latency p50/p95) and
`eval.<asset>_results` (one row per question: steps taken, method statistics
such as `gsrm_iterations`). Budgets are checked per question, not on the mean,
because one runaway agent loop is what the budget exists to catch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from medgraph.storage import Warehouse, quote_ident


@dataclass(frozen=True)
class Alarm:
    """The outcome of one alarm: passed, a sentence, and numbers for the metadata."""

    passed: bool
    description: str
    metadata: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenPrice:
    """USD per 1,000 tokens (an OpenAI-compatible or Bedrock price sheet; 0 for a local model)."""

    prompt_per_1k: float = 0.0
    completion_per_1k: float = 0.0

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return prompt_tokens / 1000 * self.prompt_per_1k + completion_tokens / 1000 * self.completion_per_1k


class EvalTableMissing(LookupError):
    """The evaluation table does not exist yet (the asset was never materialized)."""


def _rows(warehouse: Warehouse, relation: str, columns: str) -> list[tuple]:
    schema, table = relation.split(".", 1)
    if not warehouse.exists(schema, table):
        raise EvalTableMissing(f"{relation} does not exist: materialize the evaluation asset first")
    with warehouse.connect(read_only=True) as con:
        return con.execute(f"SELECT {columns} FROM {quote_ident(schema)}.{quote_ident(table)} "
                           "ORDER BY method, dataset").fetchall()


def latency_p95_alarm(warehouse: Warehouse, asset: str, max_p95_s: float) -> Alarm:
    """Every (method, dataset) of `eval.<asset>_summary` has latency p95 <= max_p95_s."""
    rows = _rows(warehouse, f"eval.{asset}_summary", "method, dataset, latency_p95_s")
    over = [(m, d, p95) for m, d, p95 in rows if p95 > max_p95_s]
    metadata: dict[str, object] = {f"{m}/{d}/latency_p95_s": round(p95, 3) for m, d, p95 in rows}
    metadata.update(threshold_s=max_p95_s, over_threshold=len(over))
    if over:
        worst = max(over, key=lambda r: r[2])
        return Alarm(False, f"{len(over)} method/dataset pairs over the p95 latency budget of {max_p95_s:g} s; "
                            f"worst {worst[0]} on {worst[1]}: {worst[2]:.2f} s", metadata)
    return Alarm(True, f"p95 latency within {max_p95_s:g} s for all {len(rows)} method/dataset pairs", metadata)


def cost_alarm(warehouse: Warehouse, asset: str, price: TokenPrice, max_usd_per_question: float) -> Alarm:
    """Estimated cost per question (mean tokens x price) of each (method, dataset) <= the budget."""
    rows = _rows(warehouse, f"eval.{asset}_summary", "method, dataset, prompt_tokens, completion_tokens")
    costs = [(m, d, price.cost(p, c)) for m, d, p, c in rows]
    over = [r for r in costs if r[2] > max_usd_per_question]
    metadata: dict[str, object] = {f"{m}/{d}/usd_per_question": round(c, 6) for m, d, c in costs}
    metadata.update(threshold_usd=max_usd_per_question, prompt_usd_per_1k=price.prompt_per_1k,
                    completion_usd_per_1k=price.completion_per_1k, over_threshold=len(over))
    if over:
        worst = max(over, key=lambda r: r[2])
        return Alarm(False, f"{len(over)} method/dataset pairs over ${max_usd_per_question:g} per question; "
                            f"worst {worst[0]} on {worst[1]}: ${worst[2]:.4f}", metadata)
    return Alarm(True, f"estimated cost within ${max_usd_per_question:g} per question for all {len(rows)} pairs",
                 metadata)


def step_budget_alarm(warehouse: Warehouse, asset: str, max_agent_steps: int, max_gsrm_iterations: int) -> Alarm:
    """No question took more agent steps than `max_agent_steps` or more GSRM iterations than
    `max_gsrm_iterations` (from `eval.<asset>_results`: the `steps` column and `stats.gsrm_iterations`)."""
    rows = _rows(warehouse, f"eval.{asset}_results", "method, dataset, steps, stats")
    steps_over: dict[str, int] = {}
    gsrm_over: dict[str, int] = {}
    most_steps: dict[str, int] = {}
    most_gsrm: dict[str, float] = {}
    for method, _, steps, stats in rows:
        most_steps[method] = max(most_steps.get(method, 0), int(steps or 0))
        if int(steps or 0) > max_agent_steps:
            steps_over[method] = steps_over.get(method, 0) + 1
        iterations = json.loads(stats or "{}").get("gsrm_iterations")
        if iterations is not None:
            most_gsrm[method] = max(most_gsrm.get(method, 0), float(iterations))
            if float(iterations) > max_gsrm_iterations:
                gsrm_over[method] = gsrm_over.get(method, 0) + 1
    metadata: dict[str, object] = {f"{m}/max_steps": v for m, v in most_steps.items()}
    metadata.update({f"{m}/max_gsrm_iterations": v for m, v in most_gsrm.items()})
    metadata.update(max_agent_steps=max_agent_steps, max_gsrm_iterations=max_gsrm_iterations,
                    questions_over_step_budget=sum(steps_over.values()),
                    questions_over_gsrm_budget=sum(gsrm_over.values()))
    problems = [f"{n} questions of {m} over {max_agent_steps} steps" for m, n in sorted(steps_over.items())]
    problems += [f"{n} questions of {m} over {max_gsrm_iterations} GSRM iterations"
                 for m, n in sorted(gsrm_over.items())]
    if problems:
        return Alarm(False, "; ".join(problems), metadata)
    return Alarm(True, f"all {len(rows)} questions within {max_agent_steps} steps and "
                       f"{max_gsrm_iterations} GSRM iterations", metadata)
