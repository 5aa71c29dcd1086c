"""GSRM as the seed measures it: Recall@10 of the ranked triple list by refinement iteration, the tau/K/N
sweep and its choice rule, and the two assets (validation sweep -> gsrm_params.json, test -> eval.gsrm_recall)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from conftest import TEST_ENCODER, copy_warehouse

from medgraph.eval.gsrm import (
    SweepPoint,
    choose_gsrm_params,
    gsrm_recall_curves,
    gsrm_recall_rows,
    mean_curve,
    measurable_items,
    read_gsrm_params,
    with_tuned_gsrm,
)
from medgraph.methods.a2rag import gsrm_refine
from medgraph.methods.registry import make_config
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.generate import generate_qa_items
from medgraph.qa.item import QaItem
from medgraph.qa.mirage import load_mirage
from medgraph.retrieval import Retriever
from medgraph.storage import Lake, Warehouse
from platform_assets.gsrm import gsrm_params, gsrm_recall
from resources import EncoderResource, MlflowResource, WarehouseResource

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------- a hand-built graph
# Zorblax syndrome -has_manifestation-> Quellitis -may_be_treated_by-> Frumadol is the gold path of
# "Which drug may treat a manifestation of Zorblax syndrome?". The question names only Zorblax syndrome,
# so G_init (its 1-hop) holds the first gold edge and never the second; the second joins when Quellitis
# is expanded (iteration 1), among 12 distractor edges of Quellitis, 2 of Zorblax syndrome and their
# reverse edges: G_1 has 19 triples, so Recall@10 depends on the ranking (MiniLM ranks the gold edge 7th).
ZORBLAX, QUELLITIS, FRUMADOL = "C0000001", "C0000002", "C0000003"
NAMES = {ZORBLAX: "Zorblax syndrome", QUELLITIS: "Quellitis", FRUMADOL: "Frumadol",
         "C0000011": "Gravel pit", "C0000012": "Ocean liner"}
DISTRACTORS = {f"C00001{i:02d}": name for i, name in enumerate(
    ["Granite quarry", "Harbour crane", "Oak timber", "Copper wire", "Glass marble", "Paper kite", "Brick wall",
     "Silk thread", "Iron anvil", "Clay pot", "Wool blanket", "Tin roof"])}
EDGES = [(ZORBLAX, "has_manifestation", QUELLITIS), (QUELLITIS, "manifestation_of", ZORBLAX),
         (QUELLITIS, "may_be_treated_by", FRUMADOL), (FRUMADOL, "may_treat", QUELLITIS),
         *[(ZORBLAX, "located_near", cui) for cui in ("C0000011", "C0000012")],
         *[(cui, "located_near", ZORBLAX) for cui in ("C0000011", "C0000012")],
         *[(QUELLITIS, "sibling_of", cui) for cui in DISTRACTORS]]
TWO_HOP = QaItem("kgqa_short", "two-hop", "Which drug may treat a manifestation of Zorblax syndrome?", {}, "Frumadol",
                 extra={"hops": 2, "gold_pairs": [sorted([ZORBLAX, QUELLITIS]), sorted([QUELLITIS, FRUMADOL])]})
NO_GOLD = QaItem("kgqa_yesno", "no", "Is Frumadol a manifestation of Zorblax syndrome?", {"A": "yes", "B": "no"}, "B",
                 extra={"hops": 1, "gold_pairs": []})


def _edge_id(src: str, relation: str, dst: str) -> str:
    return hashlib.md5(f"{src}|RO|{relation}|{dst}".encode()).hexdigest()  # the dbt model's edge id


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory, encoder) -> Iterator[KnowledgeTools]:
    home = tmp_path_factory.mktemp("hand_built")
    warehouse = Warehouse(home / "warehouse.duckdb", Lake(home / "lake"))
    nodes = {**NAMES, **DISTRACTORS}
    with warehouse.connect() as con:
        con.execute("CREATE SCHEMA kg")
        con.execute("CREATE TABLE kg.kg_nodes (cui VARCHAR, preferred_name VARCHAR, synonyms VARCHAR[], "
                    "semantic_types VARCHAR[], tuis VARCHAR[], definition VARCHAR, sources VARCHAR[])")
        con.executemany("INSERT INTO kg.kg_nodes VALUES (?, ?, [], [], [], NULL, ['TEST'])", list(nodes.items()))
        con.execute("CREATE TABLE kg.kg_node_names AS SELECT cui, preferred_name AS name, "
                    "trim(regexp_replace(lower(preferred_name), '[^a-z0-9]+', ' ', 'g')) AS normalized_name, "
                    "true AS is_preferred FROM kg.kg_nodes")
        con.execute("CREATE TABLE kg.kg_edges (edge_id VARCHAR, src_cui VARCHAR, rel VARCHAR, rela VARCHAR, "
                    "relation VARCHAR, dst_cui VARCHAR, sab VARCHAR, source_count BIGINT)")
        con.executemany("INSERT INTO kg.kg_edges VALUES (?, ?, 'RO', ?, ?, ?, 'TEST', 1)",
                        [(_edge_id(s, r, d), s, r, r, d) for s, r, d in EDGES])
    with Retriever(warehouse, encoder) as retriever:
        yield KnowledgeTools(retriever)


def test_refinement_finds_the_two_hop_gold_edge_that_iteration_0_misses(tools: KnowledgeTools):
    (entities,) = tools.question_entities([TWO_HOP])
    assert entities == [ZORBLAX]
    (curve,) = gsrm_recall_curves(tools, [TWO_HOP, NO_GOLD], tau=-1.0, iterations=2, cutoffs=[10, 50])
    assert curve.qid == "two-hop" and curve.hops == 2  # the "no" item has no gold fact: not measured
    assert curve.recall[10][0] == 0.5 < curve.recall[10][1] == 1.0 == curve.recall[10][2]
    assert curve.recall[50] == [0.5, 1.0, 1.0]
    # The ranked list is G_k sorted by score: G_1 is larger than 10, and the gold edge is in its top 10.
    (result,) = gsrm_refine(tools, [entities], [TWO_HOP.question], tau=-1.0, iterations=1, top_n=10)
    assert result.sizes == [3, 19]
    assert [t.edge_id for t in result.ranked(1)[:10]] == [t.edge_id for t, _ in result.triples]
    assert _edge_id(QUELLITIS, "may_be_treated_by", FRUMADOL) in {t.edge_id for t in result.ranked(1)[:10]}
    assert _edge_id(QUELLITIS, "may_be_treated_by", FRUMADOL) not in {t.edge_id for t in result.ranked(0)}


def test_a_cutoff_below_the_gold_rank_and_a_tau_that_expands_nothing_keep_recall_low(tools: KnowledgeTools):
    (flat,) = gsrm_recall_curves(tools, [TWO_HOP], tau=1.01, iterations=2, cutoffs=[10])
    assert flat.recall[10] == [0.5, 0.5, 0.5]  # no triple scores >= 1.01: G never grows
    (top1,) = gsrm_recall_curves(tools, [TWO_HOP], tau=-1.0, iterations=1, cutoffs=[1])
    assert all(value <= 0.5 for value in top1.recall[1])  # one triple connects at most one of the two pairs


def test_a2rag_records_ranked_recall_by_iteration_from_the_gold_path(tools: KnowledgeTools):
    from medgraph.methods.a2rag import record_gold_recall

    (result,) = gsrm_refine(tools, [[ZORBLAX]], [TWO_HOP.question], tau=-1.0, iterations=2, top_n=50)
    # The second gold fact stored in the other direction counts: a pair is unordered.
    gold_path = [_edge_id(ZORBLAX, "has_manifestation", QUELLITIS), _edge_id(FRUMADOL, "may_treat", QUELLITIS)]
    record_gold_recall(tools, [result], [gold_path])
    assert result.recall_at10_by_iteration == [0.5, 1.0, 1.0] == result.recall_atN_by_iteration
    assert result.gold_recall == 1.0
    assert result.stats()["gsrm_recall_at10_by_iteration"] == [0.5, 1.0, 1.0]


# --------------------------------------------------------------------------- the choice rule


def _point(tau: float, k: int, n: int, at10: float, at_n: float) -> SweepPoint:
    return SweepPoint(tau, k, n, at10, at_n, 100)


def test_the_choice_maximises_recall_at_10_then_prefers_fewer_iterations_then_a_larger_tau():
    points = [_point(0.4, 1, 20, 0.70, 0.80), _point(0.4, 1, 50, 0.70, 0.85),
              _point(0.5, 2, 20, 0.75, 0.80), _point(0.5, 2, 50, 0.75, 0.805),
              _point(0.6, 2, 20, 0.75, 0.79), _point(0.6, 2, 50, 0.75, 0.83),
              _point(0.6, 3, 20, 0.75, 0.90), _point(0.6, 3, 50, 0.75, 0.95)]
    choice = choose_gsrm_params(points)
    # 0.75 at K=2 and K=3: K=2; tau 0.5 and 0.6 tie at K=2: 0.6; N=20 is 0.04 below N=50's Recall@N: N=50.
    assert (choice.tau, choice.iterations, choice.top_n) == (0.6, 2, 50)
    assert (choice.recall_at10, choice.recall_at_n, choice.n) == (0.75, 0.83, 100)
    within = choose_gsrm_params([p for p in points if p.tau == 0.5])
    assert (within.tau, within.iterations, within.top_n) == (0.5, 2, 20)  # 0.80 is within 0.01 of 0.805
    with pytest.raises(ValueError, match="no sweep points"):
        choose_gsrm_params([])


def test_a2rag_evaluation_uses_the_tuned_values_unless_method_config_overrides_them():
    params = {"tau": 0.6, "iterations": 1, "top_n": 20, "n": 40}
    overrides, lineage = with_tuned_gsrm(params, ["a2rag", "a2rag-no-hiim"], {"a2rag-no-hiim": {"tau": 0.3}})
    assert overrides == {"a2rag": {"tau": 0.6, "iterations": 1, "top_n": 20},
                         "a2rag-no-hiim": {"tau": 0.3, "iterations": 1, "top_n": 20}}
    assert lineage == {"gsrm_tau": 0.6, "gsrm_iterations": 1, "gsrm_top_n": 20, "gsrm_by_dataset": "none (one tau/K/N)",
                       "gsrm_params_source": "models/gsrm_params (validation, n=40)"}
    by_dataset = {**params, "by_dataset": {"kgqa_short": {"tau": 0.4, "iterations": 2, "top_n": 50}}}
    overrides, lineage = with_tuned_gsrm(by_dataset, ["a2rag"], {})
    config = make_config("a2rag", overrides["a2rag"])
    assert config.gsrm_by_dataset == (("kgqa_short", 0.4, 2, 50),)
    assert lineage["gsrm_by_dataset"] == "kgqa_short: tau=0.4 K=2 N=50"
    short = QaItem("kgqa_short", "s", "?", {}, "x")
    other = QaItem("kgqa_mc", "m", "?", {}, "x", extra={"question_type": "kgqa_short"})  # a gold field: not read
    assert config.gsrm_for(short) == (0.4, 2, 50) and config.gsrm_for(other) == (0.6, 1, 20)
    _, explicit = with_tuned_gsrm(params, ["a2rag"], {"a2rag": {"tau": 0.45}})
    assert explicit["gsrm_tau"] == 0.45 and explicit["gsrm_params_source"] == \
        "models/gsrm_params (validation, n=40) + method_config"
    untuned, defaults = with_tuned_gsrm(None, ["a2rag"], {})
    assert untuned == {"a2rag": {}} and defaults["gsrm_tau"] == 0.5
    assert defaults["gsrm_params_source"].startswith("A2RagConfig defaults")
    assert with_tuned_gsrm(params, ["rag"], {}) == ({}, {})


# --------------------------------------------------------------------------- the assets


@pytest.fixture
def gsrm_home(retrieval_warehouse: Warehouse, tmp_path: Path) -> Path:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path / "home")
    generate_qa_items(warehouse, tmp_path / "home" / "qa", per_type=20)
    return tmp_path / "home"


def test_gsrm_assets_tune_on_validation_and_measure_every_test_item(gsrm_home: Path, mlflow_db: Path):
    encoder_resource = EncoderResource(**TEST_ENCODER)
    resources = {"warehouse": WarehouseResource(home=str(gsrm_home)), "encoder": encoder_resource,
                 "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                                   artifact_root=str(gsrm_home / "artifacts"))}
    result = dg.materialize([gsrm_params, gsrm_recall], resources=resources, run_config=dg.RunConfig(ops={
        "models__gsrm_params": {"config": {"taus": [0.5, 1.01], "iterations": [0, 1], "top_ns": [10, 20],
                                           "limit": 6, "max_triples_per_relation": 5}},
        "eval__gsrm_recall": {"config": {"limit": 5}}}))

    params = read_gsrm_params(gsrm_home)
    validation = measurable_items(load_mirage(gsrm_home / "qa" / "qa_items.validation.json"), 6)
    assert params["n"] == len(validation) > 0 and params["split"] == "validation"
    assert params["grid"]["taus"] == [0.5, 1.01]
    datasets = {i.dataset for i in validation}
    assert set(params["by_dataset"]) == datasets  # each dataset tuned apart, on its own validation items
    for name, chosen in params["by_dataset"].items():
        assert chosen["n"] == sum(i.dataset == name for i in validation)
        assert len(chosen["points"]) == 2 * 2 * 2
        assert chosen["recall_at10"] == max(p["recall_at10"] for p in chosen["points"])
    assert params["tau"] in (0.5, 1.01) and params["top_n"] in (10, 20)
    (materialization,) = result.asset_materializations_for_node("models__gsrm_params")
    metadata = materialization.metadata
    assert metadata["tau"].value == params["tau"] and "| dataset | tau | K | N |" in metadata["sweep"].value
    run = resources["mlflow_tracking"].tracking().client.get_run(metadata["mlflow_run_id"].value)
    kind = sorted(datasets)[0]
    assert {"chosen_tau", "recall_at10", f"{kind}/recall_at10_tau0.5", f"{kind}/chosen_tau"} <= set(run.data.metrics)
    artifacts = {a.path for a in resources["mlflow_tracking"].tracking().client.list_artifacts(run.info.run_id)}
    assert {"gsrm_params.json", "recall_at10_by_iteration.png"} <= artifacts

    test_items = measurable_items(load_mirage(gsrm_home / "qa" / "qa_items.test.json"), 5)
    rows = gsrm_recall_rows(WarehouseResource(home=str(gsrm_home)).get_warehouse())
    assert {r["iteration"] for r in rows} == {0, 1, 2, 3}  # k = 0..max(K, 3): the seed claims need K=2 and K=3
    assert {r["cutoff"] for r in rows} == {10} | {v["top_n"] for v in params["by_dataset"].values()}
    per_hops = [r for r in rows if r["dataset"] == "all" and r["iteration"] == 0 and r["cutoff"] == 10]
    assert sum(r["n"] for r in per_hops if r["hops"] is not None) == len(test_items) > 0
    (overall,) = [r for r in per_hops if r["hops"] is None]
    assert overall["n"] == len(test_items)
    assert all(0 <= r["recall"] <= 1 for r in rows)
    store = WarehouseResource(home=str(gsrm_home)).get_warehouse()
    with store.connect(read_only=True) as con:
        per_item = con.execute("SELECT count(DISTINCT qid), count(DISTINCT qid || iteration) FROM "
                               "eval.gsrm_recall_items").fetchone()
        taus = dict(con.execute("SELECT qid, any_value(tau) FROM eval.gsrm_recall_items GROUP BY qid").fetchall())
    assert per_item == (len(test_items), len(test_items) * 4)  # k = 0..3
    tuned = {kind: v["tau"] for kind, v in params["by_dataset"].items()}
    assert all(taus[i.qid] == tuned.get(i.dataset, params["tau"]) for i in test_items)
    (recall,) = result.asset_materializations_for_node("eval__gsrm_recall")
    assert recall.metadata["items"].value == len(test_items) and "k=2" in recall.metadata["recall"].value


def test_eval_a2rag_runs_gsrm_with_the_tuned_values_and_records_them(gsrm_home: Path, mlflow_db: Path):
    from medgraph.llm.scripted import ScriptedChatModel
    from platform_assets.evaluation import eval_assets, qa_benchmark
    from resources import LlmResource

    (gsrm_home / "models").mkdir()
    (gsrm_home / "models" / "gsrm_params.json").write_text(json.dumps({"tau": 0.65, "iterations": 1, "top_n": 7,
                                                                       "n": 12}))
    class ScriptedLlm(LlmResource):  # Dagster copies resources, so a preloaded private model would not survive
        def load(self) -> ScriptedChatModel:
            return ScriptedChatModel(lambda conversation: "<answer>A</answer>")

    llm = ScriptedLlm(home=str(gsrm_home))
    encoder_resource = EncoderResource(**TEST_ENCODER)
    resources = {"warehouse": WarehouseResource(home=str(gsrm_home)), "encoder": encoder_resource, "llm": llm,
                 "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                                   artifact_root=str(gsrm_home / "artifacts"))}
    a2rag = next(a for a in eval_assets if a.key.path[-1] == "eval_a2rag")
    result = dg.materialize([qa_benchmark, a2rag], resources=resources, partition_key="kgqa_mc",
                            run_config=dg.RunConfig(ops={
                                "eval__qa_benchmark": {"config": {"limit": 2}},
                                "eval__eval_a2rag": {"config": {"methods": ["a2rag"],
                                                                "method_config": '{"a2rag": {"use_awc": false, "max_triples_per_relation": 3}}'}}}))
    (materialization,) = result.asset_materializations_for_node("eval__eval_a2rag")
    metadata = materialization.metadata
    assert (metadata["gsrm_tau"].value, metadata["gsrm_iterations"].value, metadata["gsrm_top_n"].value) == (0.65, 1, 7)
    assert metadata["gsrm_params_source"].value == "models/gsrm_params (validation, n=12)"
    with WarehouseResource(home=str(gsrm_home)).get_warehouse().connect(read_only=True) as con:
        arguments = [json.loads(a) for (a,) in con.execute(
            "SELECT arguments FROM eval.eval_a2rag_traces WHERE action = 'T_KG'").fetchall()]
    assert len(arguments) == 2 and all((a["tau"], a["iterations"], a["top_n"]) == (0.65, 1, 7) for a in arguments)
    run = resources["mlflow_tracking"].tracking().client.get_run(metadata["mlflow_run_id"].value)
    assert run.data.tags["lineage/gsrm_tau"] == "0.65" and metadata["llm"].value == "scripted"


def test_a_capped_item_list_takes_each_dataset_and_hop_count_in_turn():
    def item(qid: str, dataset: str, hops: int, pairs: list) -> QaItem:
        return QaItem(dataset, qid, "?", {}, "x", extra={"hops": hops, "gold_pairs": pairs})

    pair = [["C1", "C2"]]
    items = [item("m1", "mc", 1, pair), item("m2", "mc", 1, pair), item("m3", "mc", 1, pair),
             item("no", "yn", 1, []), item("s1", "short", 2, pair), item("s2", "short", 2, pair),
             item("mirage", "medqa", 0, pair)]
    assert [i.qid for i in measurable_items(items)] == ["m1", "m2", "m3", "s1", "s2"]
    assert [i.qid for i in measurable_items(items, 3)] == ["m1", "s1", "m2"]


def test_the_recall_table_has_means_with_standard_errors_per_group_and_overall():
    from medgraph.eval.gsrm import ItemCurve, gsrm_recall_table_rows

    curves = [ItemCurve("a", "mc", 1, {10: [1.0, 1.0]}), ItemCurve("b", "mc", 1, {10: [0.0, 1.0]}),
              ItemCurve("c", "short", 2, {10: [0.5, 1.0]})]
    curves = [ItemCurve(c.qid, c.dataset, c.hops, c.recall, 0.6 if c.dataset == "mc" else 0.4, 10) for c in curves]
    rows, items = gsrm_recall_table_rows(curves)
    assert len(items) == 6 and {"qid", "dataset", "hops", "iteration", "cutoff", "recall", "tau", "top_n"} \
        == set(items[0])
    by_key = {(r["dataset"], r["hops"], r["iteration"]): r for r in rows}
    mc = by_key[("mc", 1, 0)]
    assert (mc["recall"], mc["n"], mc["tau"], mc["top_n"]) == (0.5, 2, 0.6, 10)
    assert mc["recall_se"] == pytest.approx(0.5)  # sd 0.7071 / sqrt(2)
    assert by_key[("all", None, 0)]["recall"] == pytest.approx(0.5) and by_key[("all", None, 1)]["recall"] == 1.0
    assert by_key[("short", 2, 0)]["recall_se"] == 0.0  # one item: no spread to estimate
    assert by_key[("short", 2, 0)]["tau"] == 0.4 and math.isnan(by_key[("all", None, 0)]["tau"])  # types mixed


def test_mean_curve_averages_items_per_iteration():
    from medgraph.eval.gsrm import ItemCurve

    curves = [ItemCurve("a", "d", 1, {10: [0.0, 1.0]}), ItemCurve("b", "d", 2, {10: [0.5, 0.5]})]
    assert mean_curve(curves, 10) == [0.25, 0.75] and mean_curve([], 10) == []
    assert json.loads(json.dumps(mean_curve(curves, 10))) == [0.25, 0.75]
