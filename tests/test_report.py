"""The evaluation report from summary rows: sections, the ablation comparison, GSRM recall, lineage."""

from __future__ import annotations

from pathlib import Path

from medgraph.eval.claims import seed_claims
from medgraph.eval.paired import paired_comparisons
from medgraph.eval.report import ReportData, build_report


def summary(method: str, accuracy: float, **extra: float) -> dict[str, object]:
    return {"asset": "eval_a2rag", "method": method, "dataset": "kgqa_mc", "questions": 8, "accuracy": accuracy,
            "accuracy_se": 0.1, "parse_failure_rate": 0.0, "mean_f1": accuracy, "prompt_tokens": 900.0,
            "completion_tokens": 40.0, "llm_calls": 3.0, "latency_p50_s": 2.0, "latency_p95_s": 3.0, "extra": extra}


def test_report_compares_ablations_with_their_method_and_shows_gsrm_recall(tmp_path: Path):
    summaries = [summary("a2rag", 0.5, **{"gsrm_recall/iter0": 0.25, "gsrm_recall/iter1": 0.75,
                                          "routing_share/KG-only": 1.0}),
                 {**summary("a2rag-no-hiim", 0.375), "prompt_tokens_computed": 300.0},
                 summary("sema-rag-no-e-agent", 0.25)]
    lineage = {"release fingerprint": "0123abcd", "LLM": "smollm2-135m-instruct"}
    results = [{"method": m, "dataset": "kgqa_mc", "qid": f"q{i}", "correct": c, "latency_s": 1.0}
               for m, outcomes in (("a2rag", [1, 1, 1, 1, 0, 0, 0, 0]), ("a2rag-no-hiim", [1, 1, 1, 0, 0, 0, 0, 0]))
               for i, c in enumerate(outcomes)]
    comparisons = paired_comparisons(results, ablations={"a2rag-no-hiim": "a2rag"})
    paths = build_report(ReportData(summaries, lineage, {"reward": [(1, 0.1), (2, 0.3)]}, comparisons), tmp_path)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    ablations = markdown.split("## Ablations")[1].split("##")[0]
    assert "| a2rag-no-hiim | a2rag | kgqa_mc | 8 | 0.375 | 0.500 | -0.125 | [" in ablations
    assert "| 1.000 | not separable at this n |" in ablations  # McNemar p for 1 discordant question
    assert "| sema-rag-no-e-agent | sema-rag | kgqa_mc | 8 | 0.250 | not run |" in ablations
    assert "cannot separate differences that matter" in markdown.split("## Accuracy")[0]
    assert "gsrm_recall/iter1" in markdown and "0.750" in markdown
    assert "| release fingerprint | 0123abcd |" in markdown
    # Prompt tokens sent and computed (a prefix cache served the rest); a summary without the column: all computed.
    cost = markdown.split("## Latency and token cost")[1].split("##")[0]
    assert "| a2rag-no-hiim | kgqa_mc | 900.000 | 300.000 | 40.000 |" in cost
    assert "| a2rag | kgqa_mc | 900.000 | 900.000 | 40.000 |" in cost
    html = paths["html"].read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") >= 3  # accuracy, cost, routing, reward curve plots inlined


def test_report_shows_evidence_recall_paired_differences_gsrm_recall_and_seed_claims(tmp_path: Path):
    summaries = [summary("rag", 0.5), summary("a2rag", 0.6)]
    for row, recall in zip(summaries, (0.4, 0.9)):
        row.update(gold_fact_seen=recall, gold_fact_seen_se=0.05, gold_fact_seen_n=200,
                   gold_fact_top10=recall / 2, gold_fact_top10_se=0.04, gold_fact_top10_n=200,
                   answer_seen=recall, answer_seen_se=0.05, answer_seen_n=200, truncation_rate=0.125)
    results = [{"method": m, "dataset": "kgqa_mc", "qid": f"q{i}", "latency_s": 1.0 if m == "rag" else 3.0,
                "correct": i % 2 == 0 or (m == "a2rag" and i % 5 == 0),
                "gold_fact_seen": 1.0 if (m == "a2rag" or i % 3 == 0) else 0.0}
               for m in ("rag", "a2rag") for i in range(200)]
    comparisons = paired_comparisons(results)
    gsrm = [{"dataset": "kgqa_short", "hops": 2, "iteration": k, "cutoff": 10, "recall": r, "recall_se": 0.03,
             "n": 120, "tau": 0.4, "top_n": 50} for k, r in ((0, 0.31), (1, 0.52), (2, 0.55))]
    gsrm += [{**row, "hops": None, "n": 300} for row in gsrm]  # eval.gsrm_recall's rows over all hops
    claims = seed_claims(summaries, results, comparisons, [])
    paths = build_report(ReportData(summaries, {"LLM": "x"}, {}, comparisons, gsrm, claims), tmp_path)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    assert "## Evidence: what retrieval put in front" in markdown
    assert "| rag | kgqa_mc | 200 | 0.400 | 0.050 | - | 0.200 | 0.040 | 200 | 0.400 | 0.050 |" in markdown
    paired = markdown.split("## Paired comparison with rag")[1].split("## ")[0]
    evidence = next(line for line in paired.splitlines() if "| gold_fact_seen |" in line)
    assert "| a2rag | rag | kgqa_mc | gold_fact_seen | 200 | 1.000 | 0.335 | 0.665 |" in evidence
    assert evidence.endswith("| method better |")
    assert "| kgqa_short | 2 | 2 | 10 | 0.550 | 0.030 | 120 | 0.400 | 50 |" in markdown
    assert "| kgqa_short | 1+2 | 2 | 10 | 0.550 | 0.030 | 300 | 0.400 | 50 |" in markdown
    claims_table = markdown.split("## Seed claims vs this platform")[1]
    assert "A2RAG latency per question is 2-4x single-round RAG | 2-4x | 3.00x" in claims_table
    assert "not measured: materialize eval/gsrm_recall" in claims_table
    assert "| 0.125 |" in markdown.split("## Accuracy per method")[1].split("##")[0]  # truncation column
    html = paths["html"].read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") >= 5  # accuracy, evidence, forest, gsrm, cost


def test_report_shows_the_shortcut_table_the_reading_check_and_gsrm_per_dataset(tmp_path: Path):
    from medgraph.eval.report import reading_check

    shortcuts = [{"dataset": "kgqa_mc", "split": "test", "rule": rule, "accuracy": value, "n": 88, "chance": 0.25,
                  "shortcut": rule != "relation_oracle"}
                 for rule, value in (("random", 0.25), ("majority", 0.27), ("adjacency", 0.25), ("name_overlap", 0.28),
                                     ("semantic_type", 0.247), ("relation_oracle", 1.0))]
    # a2rag showed the gold fact for q0-q3 (3 of them right) and not for q4-q7 (1 right); the oracle: 6 of 8.
    results = [{"method": "a2rag", "dataset": "kgqa_mc", "qid": f"q{i}", "correct": i in (0, 1, 2, 5),
                "gold_fact_seen": 1.0 if i < 4 else 0.0} for i in range(8)]
    results += [{"method": "oracle-evidence", "dataset": "kgqa_mc", "qid": f"q{i}", "correct": i < 6,
                 "gold_fact_seen": 1.0} for i in range(8)]
    reading = reading_check(results)
    assert reading == [{"method": "a2rag", "dataset": "kgqa_mc", "shown_accuracy": 0.75, "shown_n": 4,
                        "hidden_accuracy": 0.25, "hidden_n": 4, "oracle_accuracy": 0.75, "oracle_n": 8}]
    params = {"tau": 0.6, "iterations": 0, "top_n": 50, "recall_at10": 0.8, "recall_at_n": 0.9, "n": 80, "note": "",
              "by_dataset": {"kgqa_short": {"tau": 0.5, "iterations": 1, "top_n": 50, "recall_at10": 0.45,
                                         "recall_at_n": 0.8, "n": 16, "note": ""}}}
    data = ReportData([summary("a2rag", 0.5)], {"LLM": "x"}, shortcuts=shortcuts, reading=reading, gsrm_params=params)
    markdown = build_report(data, tmp_path)["markdown"].read_text(encoding="utf-8")
    table = markdown.split("## Can structure alone answer the KG questions?")[1].split("## ")[0]
    assert "| kgqa_mc | test | 88 | 0.250 | 0.270 | 0.250 | 0.280 | 0.247 | 1.000 |" in table
    check = markdown.split("## Reading check")[1].split("## ")[0]
    assert "| a2rag | kgqa_mc | 0.750 | 4 | 0.250 | 4 | 0.750 | 8 |" in check
    gsrm = markdown.split("## GSRM parameters chosen per dataset")[1].split("## ")[0]
    assert "| kgqa_short | 0.500 | 1 | 50 | 0.450 | 0.800 | 16 |" in gsrm
    assert "| pooled (other items) | 0.600 | 0 | 50 | 0.800 | 0.900 | 80 |" in gsrm


def test_report_flags_agent_decisions_taken_for_nearly_every_question(tmp_path: Path):
    summaries = [summary("a2rag", 0.5, **{"routing_share/KG-only": 0.25, "routing_share/none": 0.75,
                                          "gold_fact_in_graph_tokens_mean": 0.5}),
                 summary("sema-rag", 0.25, **{"stop_share/sufficient": 1.0, "schema_share/question as query": 0.96,
                                              "schema_share/parsed": 0.04}),
                 summary("graph-r1", 0.25, **{"first_action_share/search": 0.5, "first_action_share/answer": 0.5})]
    for row in summaries:
        row.update(gold_fact_seen=0.5, gold_fact_seen_se=0.1, gold_fact_seen_n=8)
    markdown = build_report(ReportData(summaries, {"LLM": "x"}), tmp_path)["markdown"].read_text(encoding="utf-8")
    decisions = markdown.split("## Agent decisions")[1].split("## ")[0]
    assert "| a2rag | kgqa_mc | 8 | A2RAG AWC route | none | 0.750 |  |" in decisions
    assert "| sema-rag | kgqa_mc | 8 | SEMA-RAG E-Agent stop | sufficient | 1.000 | degenerate |" in decisions
    assert "| sema-rag | kgqa_mc | 8 | SEMA-RAG I-Agent schema | question as query | 0.960 | degenerate |" in decisions
    assert "| graph-r1 | kgqa_mc | 8 | Graph-R1 first action |" in decisions and decisions.count("degenerate |") == 2
    evidence = markdown.split("## Evidence")[1].split("## ")[0]
    assert "| a2rag | kgqa_mc | 8 | 0.500 | 0.100 | 0.500 |" in evidence  # gold fact in graph tokens
    assert "| sema-rag | kgqa_mc | 8 | 0.500 | 0.100 | - |" in evidence
