"""The evaluation report from summary rows: sections, the ablation comparison, GSRM recall, lineage."""

from __future__ import annotations

from pathlib import Path

from medgraph.eval.report import ReportData, build_report


def summary(method: str, accuracy: float, **extra: float) -> dict[str, object]:
    return {"asset": "eval_a2rag", "method": method, "dataset": "kgqa_mc", "questions": 8, "accuracy": accuracy,
            "accuracy_se": 0.1, "parse_failure_rate": 0.0, "mean_f1": accuracy, "prompt_tokens": 900.0,
            "completion_tokens": 40.0, "llm_calls": 3.0, "latency_p50_s": 2.0, "latency_p95_s": 3.0, "extra": extra}


def test_report_compares_ablations_with_their_method_and_shows_gsrm_recall(tmp_path: Path):
    summaries = [summary("a2rag", 0.5, **{"gsrm_recall/iter0": 0.25, "gsrm_recall/iter1": 0.75,
                                          "routing_share/KG-only": 1.0}),
                 summary("a2rag-no-hiim", 0.375), summary("sema-rag-no-e-agent", 0.25)]
    lineage = {"release fingerprint": "0123abcd", "LLM": "smollm2-135m-instruct"}
    paths = build_report(ReportData(summaries, lineage, {"reward": [(1, 0.1), (2, 0.3)]}), tmp_path)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    ablations = markdown.split("## Ablations")[1].split("##")[0]
    assert "| a2rag-no-hiim | a2rag | kgqa_mc | 8 | 0.375 | 0.100 | 0.500 | -0.125 | 0.000 |" in ablations
    assert "| sema-rag-no-e-agent | sema-rag | kgqa_mc | 8 | 0.250 | 0.100 | not run |" in ablations
    assert "gsrm_recall/iter1" in markdown and "0.750" in markdown
    assert "| release fingerprint | 0123abcd |" in markdown
    html = paths["html"].read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") >= 3  # accuracy, cost, routing, reward curve plots inlined
