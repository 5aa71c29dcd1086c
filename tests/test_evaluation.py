"""Evaluation assets in-process: benchmark partition, a method family on SmolLM2, tables, MLflow, metadata."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from conftest import TEST_ENCODER, copy_warehouse, share_converted_llm

from medgraph.eval.evaluate import binomial_se, summarize
from medgraph.eval.families import FAMILIES, EvalRequestError, checked_eval_request
from medgraph.methods.common import finish_result
from medgraph.qa.generate import generate_qa_items
from medgraph.qa.item import QaItem
from medgraph.storage import Warehouse
from platform_assets.evaluation import eval_assets, evaluation_report, qa_benchmark
from resources import EncoderResource, LlmResource, MlflowResource, TrainingResource, WarehouseResource


def test_summaries_count_parse_failures_as_wrong_with_binomial_error():
    item = QaItem("ds", "q", "Which?", {"A": "x", "B": "y"}, "B")
    results = [finish_result("m", item, "<answer>B</answer>", []), finish_result("m", item, "no idea", []),
               finish_result("m", item, "A", []), finish_result("m", item, "B", [])]
    (summary,) = summarize(results)
    assert (summary.questions, summary.accuracy, summary.parse_failure_rate) == (4, 0.5, 0.25)
    assert summary.accuracy_se == pytest.approx(binomial_se(2, 4)) == pytest.approx(0.25)


BASELINES = next(f for f in FAMILIES if f.name == "eval_baselines")


@pytest.mark.parametrize(("methods", "limit", "method_config", "message"), [
    (None, -1, "{}", "limit must be at least 1"),
    (None, 0, "{}", "limit must be at least 1"),
    ([], None, "{}", "methods is empty; name at least one, or leave it unset for cot, rag"),
    (["a2rag"], None, "{}", "a2rag not of this family"),
    (["nope"], None, "{}", "unknown method 'nope'"),
    (None, None, "not json", "method_config is not JSON (Expecting value at column 1)"),
    (None, None, "[1, 2]", "method_config must be a JSON object of method name -> object of fields"),
    (None, None, '{"rag": 3}', "method_config must be a JSON object"),
    (None, None, '{"rag": {"no_such_field": 1}}', "rag: unknown configuration fields ['no_such_field']"),
])
def test_an_eval_run_config_that_cannot_mean_what_it_says_is_refused_naming_the_field(methods, limit, method_config,
                                                                                       message):
    with pytest.raises(EvalRequestError, match="^eval_baselines: ") as raised:
        checked_eval_request(BASELINES, methods, limit, method_config)
    assert message in str(raised.value)


def test_a_checked_eval_request_keeps_ablations_limits_and_overrides():
    request = checked_eval_request(BASELINES, None, 3, '{"irag": {"rounds": 1}}')
    assert (request.methods, request.limit, request.overrides) == (BASELINES.methods, 3, {"irag": {"rounds": 1}})
    a2rag = next(f for f in FAMILIES if f.name == "eval_a2rag")
    assert checked_eval_request(a2rag, ["a2rag-no-hiim"], None, "{}").methods == ("a2rag-no-hiim",)


@pytest.fixture
def eval_home(retrieval_warehouse: Warehouse, smollm2, tmp_path: Path) -> Path:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path / "home")
    generate_qa_items(warehouse, tmp_path / "home" / "qa", per_type=20)
    share_converted_llm(tmp_path / "home", smollm2)
    return tmp_path / "home"


@pytest.fixture
def resources(eval_home: Path, mlflow_db: Path) -> dict[str, dg.ConfigurableResource]:
    """The real resources over the test home. `dg.materialize` builds resources anew, so each run loads the LLM
    (the session's conversion, linked into the home by `eval_home`) and the encoder itself."""
    llm = LlmResource(spec="smollm2-135m-instruct", home=str(eval_home))
    return {"warehouse": WarehouseResource(home=str(eval_home)), "llm": llm,
            "encoder": EncoderResource(**TEST_ENCODER),
            "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                              artifact_root=str(eval_home / "artifacts")),
            "training": TrainingResource(profile="tiny")}


def test_an_eval_asset_refuses_a_negative_limit_before_evaluating_anything(resources: dict):
    baselines = next(a for a in eval_assets if a.key.path[-1] == "eval_baselines")
    result = dg.materialize([qa_benchmark, baselines], resources=resources, partition_key="kgqa_mc",
                            raise_on_error=False, run_config=dg.RunConfig(ops={
                                "eval__eval_baselines": {"config": {"limit": -1}}}))
    assert not result.success and not result.asset_materializations_for_node("eval__eval_baselines")
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "eval_baselines: limit must be at least 1" in failure.step_failure_data.error.message


def test_a_dataset_partition_is_evaluated_into_tables_metadata_and_mlflow(eval_home: Path, resources: dict):
    baselines = next(a for a in eval_assets if a.key.path[-1] == "eval_baselines")
    result = dg.materialize([qa_benchmark, baselines], resources=resources, partition_key="kgqa_mc",
                            run_config=dg.RunConfig(ops={
                                "eval__qa_benchmark": {"config": {"limit": 3}},
                                "eval__eval_baselines": {"config": {
                                    "methods": ["cot", "rag"], "batch_size": 3,
                                    "method_config": '{"cot": {"max_new_tokens": 24}, "rag": {"max_new_tokens": 16}}'}}}))
    frozen = json.loads((eval_home / "eval" / "benchmark" / "kgqa_mc.json").read_text())["kgqa_mc"]
    assert len(frozen) == 3 and all(entry["gold_path"] for entry in frozen.values())  # GSRM recall needs them
    (materialization,) = result.asset_materializations_for_node("eval__eval_baselines")
    metadata = materialization.metadata
    assert metadata["questions"].value == 3 and "| cot | kgqa_mc | 3 |" in metadata["summary"].value
    assert 0 <= metadata["rag/accuracy"].value <= 1 and metadata["llm"].value == "smollm2-135m-instruct"

    store = WarehouseResource(home=str(eval_home)).get_warehouse()
    with store.connect(read_only=True) as con:
        per_method = dict(con.execute("SELECT method, count(*) FROM eval.eval_baselines_results GROUP BY 1").fetchall())
        trace_steps = con.execute("SELECT count(*) FROM eval.eval_baselines_traces").fetchone()[0]
    assert per_method == {"cot": 3, "rag": 3} and trace_steps >= 6

    tracking = resources["mlflow_tracking"].tracking()
    run = tracking.client.get_run(metadata["mlflow_run_id"].value)
    assert {"cot/accuracy", "rag/accuracy", "rag/parse_failure_rate"} <= set(run.data.metrics)
    assert run.data.tags["dataset"] == "kgqa_mc"

    dg.materialize([evaluation_report], resources=resources)
    html = (eval_home / "reports" / "report.html").read_text(encoding="utf-8")
    markdown = (eval_home / "reports" / "report.md").read_text(encoding="utf-8")
    assert "data:image/png;base64," in html and "<td>rag</td>" in html  # self-contained, plots inlined
    for section in ("Accuracy per method and dataset", "Latency and token cost", "Lineage"):
        assert f"## {section}" in markdown
    assert "medgraph-gat@champion | none registered" in markdown


def file_state(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `root`: a write anywhere changes it."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_copied_home_writes_its_runs_and_models_only_into_itself(eval_home: Path, _mlflow_template: Path,
                                                                   tmp_path: Path):
    """Issue 58 case 2: MLflow keeps absolute artifact locations, so an evaluation run in a copy of a home
    wrote its artifacts into the original (and failed with `OSError: [Errno 30]` on a read-only original).
    Here the original is made read-only (root ignores that; the file state is the check that holds for
    everyone) and the copy evaluates and logs and registers a model."""
    import shutil

    import torch

    from medgraph.tracking import Tracking

    def home_resources(home: Path) -> dict[str, dg.ConfigurableResource]:
        return {"warehouse": WarehouseResource(home=str(home)),
                "llm": LlmResource(spec="smollm2-135m-instruct", home=str(home)),
                "encoder": EncoderResource(**TEST_ENCODER),
                "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}",
                                                  artifact_root=str(home / "artifacts"))}

    def evaluate_and_log_a_model(home: Path) -> None:
        baselines = next(a for a in eval_assets if a.key.path[-1] == "eval_baselines")
        dg.materialize([qa_benchmark, baselines], resources=home_resources(home), partition_key="kgqa_mc",
                       run_config=dg.RunConfig(ops={
                           "eval__qa_benchmark": {"config": {"limit": 2}},
                           "eval__eval_baselines": {"config": {
                               "methods": ["cot"], "method_config": '{"cot": {"max_new_tokens": 8}}'}}}))
        tracking = home_resources(home)["mlflow_tracking"].tracking()
        with tracking.start_run("gat_model"):  # as a fit asset logs its model
            version = tracking.register(tracking.log_torch_model(torch.nn.Linear(2, 2)), "medgraph-test-model")
        with tracking.model_files(f"models:/medgraph-test-model/{version}") as files:
            assert files.path.is_relative_to(home / "artifacts" / "gat_model"), files.path

    shutil.copy2(_mlflow_template, eval_home / "mlflow.db")
    evaluate_and_log_a_model(eval_home)
    copied = Path(shutil.copytree(eval_home, tmp_path / "copied", symlinks=True))
    before = file_state(eval_home)
    modes = {path: path.stat().st_mode for path in [eval_home, *eval_home.rglob("*")] if not path.is_symlink()}
    for path, mode in modes.items():
        path.chmod(mode & ~0o222)
    try:
        evaluate_and_log_a_model(copied)
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert file_state(eval_home) == before
    tracking = Tracking(f"sqlite:///{copied / 'mlflow.db'}", str(copied / "artifacts"))
    [experiment] = [e for e in tracking.client.search_experiments() if e.name == "medgraph/eval_baselines"]
    runs = tracking.client.search_runs([experiment.experiment_id])
    assert len(runs) == 2 and all(run.info.artifact_uri.startswith((copied / "artifacts").as_uri()) for run in runs)


def test_the_reader_adapter_is_trained_gated_and_answers_the_adapted_rows(eval_home: Path, resources: dict,
                                                                          tiny_llm_dir: Path, one_torch_thread):
    """The adapter's asset, gate and `@adapted` rows on the tiny random Llama: the plumbing, not the reading
    (benchmarks/reader_adapter.py measures that on SmolLM2)."""
    from medgraph.tracking import READER_ADAPTER_MODEL
    from platform_assets.models import reader_adapter

    resources = {**resources, "llm": LlmResource(spec=str(tiny_llm_dir), home=str(eval_home))}
    trained = dg.materialize([reader_adapter], resources=resources, run_config=dg.RunConfig(
        ops={"models__reader_adapter": {"config": {"profile": "tiny"}}}))
    (materialization,) = trained.asset_materializations_for_node("models__reader_adapter")
    metadata = {k: v.value for k, v in materialization.metadata.items()}
    assert metadata["validation_questions"] == 4 and metadata["examples"] > 0
    assert metadata["baseline_name"] == f"base reader {tiny_llm_dir.name}"
    assert metadata["baseline_value"] == metadata["valid_base_oracle_accuracy"]
    gain = metadata["valid_no_evidence_accuracy"] - metadata["valid_base_no_evidence_accuracy"]
    assert metadata["valid_no_evidence_gain"] == pytest.approx(gain)
    # Two steps on 4 questions may or may not win; the decision is the gate's rule either way.
    assert metadata["promoted"] == (metadata["valid_oracle_accuracy"] > metadata["valid_base_oracle_accuracy"]
                                    and gain <= 0.10)
    tracking = resources["mlflow_tracking"].tracking()
    if not metadata["promoted"]:  # the evaluation below needs a champion: make this version one by hand
        tracking.client.set_registered_model_alias(READER_ADAPTER_MODEL.name, "champion", metadata["model_version"])

    baselines = next(a for a in eval_assets if a.key.path[-1] == "eval_baselines")
    result = dg.materialize([qa_benchmark, baselines], resources=resources, partition_key="kgqa_mc",
                            run_config=dg.RunConfig(ops={
                                "eval__qa_benchmark": {"config": {"limit": 3}},
                                "eval__eval_baselines": {"config": {
                                    "methods": ["rag-kg", "oracle-evidence"], "readers": ["base", "adapted"],
                                    "batch_size": 3, "adapted_probe_items": 0}}}))
    (evaluated,) = result.asset_materializations_for_node("eval__eval_baselines")
    assert f"models:/{READER_ADAPTER_MODEL.name}/{metadata['model_version']}" in evaluated.metadata["readers"].value
    store = WarehouseResource(home=str(eval_home)).get_warehouse()
    with store.connect(read_only=True) as con:
        answered = con.execute("SELECT method, count(*) FROM eval.eval_baselines_results GROUP BY 1 ORDER BY 1").fetchall()
    assert answered == [("oracle-evidence", 3), ("oracle-evidence@adapted", 3),
                                                 ("rag-kg", 3), ("rag-kg@adapted", 3)]

    dg.materialize([evaluation_report], resources=resources)
    markdown = (eval_home / "reports" / "report.md").read_text(encoding="utf-8")
    assert "## Adapted reader vs base reader" in markdown
    assert "| rag-kg | kgqa_mc | 3 |" in markdown.split("## Adapted reader vs base reader")[1]

    # With the validation probe (as `make reproduce` runs): the random reader leaves no readable answer, so its
    # rows are not run, and the metadata says so with the rate.
    result = dg.materialize([baselines], resources=resources, partition_key="kgqa_mc", run_config=dg.RunConfig(
        ops={"eval__eval_baselines": {"config": {"methods": ["oracle-evidence"], "readers": ["base", "adapted"],
                                                 "batch_size": 3, "adapted_probe_items": 3}}}))
    (evaluated,) = result.asset_materializations_for_node("eval__eval_baselines")
    assert evaluated.metadata["adapted_probe"].value == ("oracle-evidence@adapted not run: asked again 1.00 of 3 "
                                                         "validation questions")
    with store.connect(read_only=True) as con:
        assert con.execute("SELECT DISTINCT method FROM eval.eval_baselines_results").fetchall() == [
            ("oracle-evidence",)]
