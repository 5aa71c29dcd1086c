"""Every method against a reference, and every ablation against its full method, on the same questions.

Reads the per-question tables `eval.<asset>_results` of all evaluation
assets, pairs two methods' outcomes by (dataset, qid), and gives for each
metric the mean difference with its paired-bootstrap 95% CI and the exact
McNemar / sign-test p-value (`medgraph.stats`). The rows become the table
`eval.paired_comparisons`, MLflow metrics and the report's forest plot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from medgraph.eval.evaluate import read_eval_views
from medgraph.eval.readers import reader_label, split_reader
from medgraph.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, paired_difference
from medgraph.storage import Warehouse

RESULTS_SUFFIX = "_results"
DEFAULT_REFERENCE = "rag"
# Per-question outcomes compared: correctness, and the evidence-recall columns where the results have them.
METRICS = ("correct", "gold_fact_seen", "answer_seen")


@dataclass(frozen=True)
class Comparison:
    kind: str  # "method" (vs the reference), "ablation" (vs its full method), "reader" (adapted vs base reader)
    method: str
    reference: str
    dataset: str
    metric: str
    n: int
    method_mean: float
    reference_mean: float
    difference: float  # method - reference
    ci_low: float
    ci_high: float
    p_value: float
    method_better: int
    reference_better: int
    verdict: str  # "method better" / "reference better" / "not separable at this n"
    too_small: bool  # the CI is wider than 0.2: n cannot separate differences that matter

    @property
    def ci_width(self) -> float:
        return self.ci_high - self.ci_low

    def as_row(self) -> dict[str, object]:
        return asdict(self)


def read_results(warehouse: Warehouse) -> list[dict[str, object]]:
    """Every row of every `eval.*_results` view, with the asset it came from."""
    return read_eval_views(warehouse, RESULTS_SUFFIX)


def _value(row: Mapping[str, object], metric: str) -> float | None:
    value = row.get(metric)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def outcomes_by_method(rows: Iterable[Mapping[str, object]]) -> dict[tuple[str, str], dict[str, Mapping[str, object]]]:
    """(method, dataset) -> qid -> result row (a method evaluated by two assets keeps the later asset's row)."""
    table: dict[tuple[str, str], dict[str, Mapping[str, object]]] = {}
    for row in sorted(rows, key=lambda r: str(r.get("asset", ""))):
        table.setdefault((str(row["method"]), str(row["dataset"])), {})[str(row["qid"])] = row
    return table


def compare(by_method: Mapping[tuple[str, str], Mapping[str, Mapping[str, object]]], method: str, reference: str,
            dataset: str, metric: str, kind: str, resamples: int = BOOTSTRAP_RESAMPLES,
            seed: int = BOOTSTRAP_SEED) -> Comparison | None:
    """`method` vs `reference` on the questions of `dataset` both answered (and both have `metric` for)."""
    mine, theirs = by_method.get((method, dataset)), by_method.get((reference, dataset))
    if not mine or not theirs:
        return None
    pairs = [(_value(mine[q], metric), _value(theirs[q], metric)) for q in sorted(mine.keys() & theirs.keys())]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        return None
    result = paired_difference([a for a, _ in pairs], [b for _, b in pairs], resamples, seed)
    verdict = {"a better": "method better", "b better": "reference better"}.get(result.verdict, result.verdict)
    return Comparison(kind, method, reference, dataset, metric, result.n, result.mean_a, result.mean_b,
                      result.difference, result.ci_low, result.ci_high, result.p_value, result.a_better,
                      result.b_better, verdict, result.too_small)


def paired_comparisons(rows: Sequence[Mapping[str, object]], reference: str = DEFAULT_REFERENCE,
                       ablations: Mapping[str, str] | None = None, metrics: Sequence[str] = METRICS,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> list[Comparison]:
    """Each method (not an ablation) vs `reference`, and each ablation vs the method it ablates
    (`ablations`: ablation name -> method name), per dataset and metric. Rows of the adapted reader
    (`rag@adapted`, `methods.registry.reader_label`) are compared with the same reader's reference or full
    method, and each with its own base-reader row (kind "reader": what the adapted reader changes)."""
    ablations = dict(ablations or {})
    by_method = outcomes_by_method(rows)
    comparisons = []
    for method, dataset in sorted(by_method):
        name, reader = split_reader(method)
        pairs = []
        if name in ablations:
            pairs.append(("ablation", reader_label(ablations[name], reader)))
        elif name != reference:
            pairs.append(("method", reader_label(reference, reader)))
        if reader != "base":
            pairs.append(("reader", name))
        for kind, against in pairs:
            for metric in metrics:
                found = compare(by_method, method, against, dataset, metric, kind, resamples, seed)
                if found is not None:
                    comparisons.append(found)
    return comparisons
