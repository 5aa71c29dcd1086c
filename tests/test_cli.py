"""The `medgraph` command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from medgraph.cli import main


def test_status_before_anything_is_built_says_so(medgraph_home: Path, capsys: pytest.CaptureFixture):
    assert main(["status"]) == 1
    out = capsys.readouterr().out
    assert str(medgraph_home) in out and "not built yet" in out


def test_status_lists_tables_with_row_counts(medgraph_home: Path, warehouse, release_copy: Path,
                                             capsys: pytest.CaptureFixture):
    from conftest import ingest_release

    ingest_release(release_copy, warehouse)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"umls.mrsty{' ' * 30}" in out
    assert f"{warehouse.count('umls.mrrel'):,} rows" in out


def test_models_list_and_show_read_the_registry(medgraph_home: Path, mlflow_db: Path,
                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    import mlflow
    import torch

    from medgraph.tracking import Tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{mlflow_db}")
    assert main(["models", "list"]) == 1 and "no registered models" in capsys.readouterr().out
    tracking = Tracking(f"sqlite:///{mlflow_db}", str(medgraph_home / "artifacts"))
    with tracking.start_run("gat_model", tags={"data_version/kg/kg_edges": "abc123"}):
        mlflow.log_metric("valid_roc_auc", 0.9)
        uri = tracking.log_torch_model(torch.nn.Linear(2, 1))
    tracking.promote_if_better("medgraph-gat", tracking.register(uri, "medgraph-gat"), "valid_roc_auc")

    assert main(["models", "list"]) == 0
    assert "medgraph-gat" in capsys.readouterr().out
    assert main(["models", "show", "medgraph-gat@champion"]) == 0
    out = capsys.readouterr().out
    assert "medgraph-gat v1" in out and "valid_roc_auc = 0.9" in out and "data_version/kg/kg_edges = abc123" in out
    assert main(["models", "show", "medgraph-gat/7"]) == 1


def test_a_damaged_mlflow_registry_is_named_with_its_remedy(mlflow_db: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture):
    """Issue 58: a truncated mlflow.db gave a raw sqlite3 DatabaseError marked unexpected, naming neither file nor fix."""
    damaged = tmp_path / "mlflow.db"
    data = mlflow_db.read_bytes()
    damaged.write_bytes(data[: len(data) // 3])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{damaged}")
    assert main(["models", "list"]) == 1
    err = capsys.readouterr().err
    assert f"the MLflow registry {damaged} cannot be read (database disk image is malformed)" in err
    assert f"mv {damaged} {damaged}.broken" in err and "unexpected" not in err


def test_ask_picks_the_graph_r1_policy_as_evaluation_does(mlflow_db: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture):
    from medgraph.cli import _champion_policy
    from medgraph.settings import load_settings

    settings = load_settings({"MEDGRAPH_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}"})
    assert _champion_policy(settings, "graph-r1") == (None, {})  # nothing registered: the base LLM plays the policy
    assert "policy: base LLM" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # an SFT-only run without an SFT policy never runs the base LLM
        _champion_policy(settings, "graph-r1-sft-only")
    assert exited.value.code == 2 and "medgraph-graph-r1-sft@champion" in capsys.readouterr().err


def test_status_reports_an_unreadable_table_and_lists_every_other(medgraph_home: Path, warehouse, release_copy: Path,
                                                                 capsys: pytest.CaptureFixture):
    """Issue 30, fault 4. Before: one garbage Parquet file made `status` die with a raw `No magic bytes found`
    and list no table after it."""
    from conftest import ingest_release

    ingest_release(release_copy, warehouse)
    tables = ["mrconso", "mrdef", "mrrel", "mrsab", "mrsty"]
    rows = {table: warehouse.count(f"umls.{table}") for table in tables}
    [broken] = warehouse.view_files("umls")["mrdef"]
    Path(broken).write_bytes(b"not a parquet file")
    assert main(["status"]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    for table in (t for t in tables if t != "mrdef"):
        assert any(line.startswith(f"  umls.{table} ") and line.endswith(f"{rows[table]:,} rows") for line in lines)
    [line] = [line for line in lines if line.startswith("  umls.mrdef ")]
    assert "unreadable" in line and "No magic bytes found" in line and broken in line
    assert "MLflow" in captured.out  # it went on to the end
    assert "1 table is unreadable" in captured.err and """--assets 'key:"umls/mrdef"'""" in captured.err


def test_status_reads_every_value_and_names_the_damaged_tables_own_asset(medgraph_home: Path, warehouse,
                                                                        release_copy: Path,
                                                                        capsys: pytest.CaptureFixture):
    """Issue 58: a lake file damaged in its middle passed `status` (its row count comes from the footer), and the
    remedy always named umls/mrdef whatever table was broken."""
    from conftest import ingest_release

    ingest_release(release_copy, warehouse)
    [damaged] = warehouse.view_files("umls")["mrrel"]
    data = bytearray(Path(damaged).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(4096)  # the footer (row counts) intact, a stretch of column data zeroed
    Path(damaged).write_bytes(bytes(data))
    assert main(["status"]) == 1
    captured = capsys.readouterr()
    [line] = [line for line in captured.out.splitlines() if line.startswith("  umls.mrrel ")]
    assert "unreadable" in line
    assert """--assets 'key:"umls/mrrel"'""" in captured.err and "umls/mrdef" not in captured.err


def test_ask_with_the_adapted_reader_needs_a_registered_one_and_a_method_it_can_answer(
        mlflow_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    from medgraph.cli import _adapted_reader
    from medgraph.settings import load_settings

    settings = load_settings({"MEDGRAPH_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}"})
    with pytest.raises(SystemExit) as exited:
        _adapted_reader(settings, ["starting"])
    assert exited.value.code == 2
    assert "no medgraph-reader-adapter@champion (materialize models/reader_adapter)" in capsys.readouterr().err
    # Graph-R1's policy answers itself: the adapted reader is refused before anything loads.
    assert main(["ask", "Which drug treats hypertension?", "--method", "graph-r1", "--reader", "adapted"]) == 2
    assert "--reader adapted does not apply to graph-r1" in capsys.readouterr().err
