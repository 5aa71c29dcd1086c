"""Issue 30, faults 3 and 4: reading a model writes nothing, and a copied MEDGRAPH_HOME that cannot be written
answers with every method; a model that cannot be read is named, with its file and what to do.

The registry of a copied home still names the original's artifact folders (absolute paths). Before: loading a
model wrote `registered_model_meta` into the *original's* artifact folder; with it read-only, graph-r1 crashed
with `OSError [Errno 30]` and a2rag dropped to text-only while its JSON said "no HIIM projector registered"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, TINY_LLM, copy_warehouse

from medgraph.storage import Warehouse

METHODS = ("a2rag", "graph-r1", "sema-rag", "cot", "rag", "rag-kg", "irag")
# A2RAG's router under a random LLM may never ask for triples; the fixed plan always does, so HIIM is used.
FIXED_PLAN = "a2rag-no-awc"
POLICY_ENV = {"env_max_steps": 2, "env_max_new_tokens": 16}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built_home(retrieval_warehouse: Warehouse, tiny_llm_dir: Path, _mlflow_template: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home as `make demo` leaves it: the tiny KG, corpus and embeddings, and in its own MLflow registry a
    champion GAT, a champion HIIM projector for the tiny LLM (pinned to that GAT) and a champion Graph-R1
    policy (the tiny LLM, trained nowhere: its files are what matters)."""
    import mlflow

    from medgraph.gnn.graph_tokens import HiimProjector
    from medgraph.gnn.train import GatConfig, train_gat
    from medgraph.rl.policy import log_policy
    from medgraph.tracking import GAT_MODEL, GRAPH_R1_POLICY_MODEL, HIIM_PROJECTOR_MODEL, Tracking

    home = tmp_path_factory.mktemp("built") / "home"
    warehouse = copy_warehouse(retrieval_warehouse, home)
    warehouse.open_connection().close()  # its views now read this home's lake, as if built in place
    shutil.copy2(_mlflow_template, home / "mlflow.db")
    tracking = Tracking(f"sqlite:///{home / 'mlflow.db'}", str(home / "artifacts"))

    def champion(asset: str, name: str, log) -> str:
        with tracking.start_run(asset):
            uri = log()
        version = tracking.register(uri, name)
        tracking.client.set_registered_model_alias(name, "champion", version)
        return f"models:/{name}/{version}"

    gat = train_gat(warehouse, GatConfig.profile("tiny", epochs=1, steps_per_epoch=2)).model
    gat_uri = champion("gat_model", GAT_MODEL.name, lambda: tracking.log_torch_model(gat))
    projector = HiimProjector(gat.triple.out_features, 64, 1.0)
    projector.llm_name, projector.gat_model_uri = TINY_LLM, gat_uri
    champion("hiim_projector", HIIM_PROJECTOR_MODEL.name, lambda: tracking.log_torch_model(projector))
    champion("graph_r1_policy", GRAPH_R1_POLICY_MODEL.name,
             lambda: log_policy(tiny_llm_dir, TINY_LLM, metadata={"graph_r1_config": POLICY_ENV}))
    mlflow.set_tracking_uri(None)
    return home


def file_state(*roots: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `roots`: a write anywhere changes it."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


ASK_ALL = """
import contextlib, io, json, sys
from medgraph.cli import main
llm, methods = sys.argv[1], sys.argv[2:]
results = {}
for method in methods:
    out, err = io.StringIO(), io.StringIO()
    args = ["ask", "Which drug may treat hypertension?", "--option", "A=amlodipine", "--option", "B=insulin",
            "--method", method, "--json", "--timeout", "0", "--set", "max_new_tokens=16"]
    args += {"irag": ["--set", "rounds=1", "--set", "query_tokens=8", "--set", "query_answer_tokens=8"],
             "sema-rag": ["--set", "max_rounds=1"]}.get(method, [])  # each method runs; briefly
    if method != "graph-r1":  # graph-r1 runs its registered champion policy
        args += ["--llm", llm]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    results[method] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
print("RESULTS " + json.dumps(results))
"""


def ask_read_only(read_only: list[Path], home: Path, llm: Path, methods: tuple[str, ...], tmp_path: Path
                  ) -> dict[str, dict]:
    """`medgraph ask --json` with each method, in one process, with MEDGRAPH_HOME=`home` and every path of
    `read_only` read-only: a read-only bind mount in a private mount namespace (root, as in CI containers,
    which permissions do not stop), else permissions. Nothing is mounted for any other process."""
    script = tmp_path / "ask_all.py"
    script.write_text(ASK_ALL)
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "MEDGRAPH_PROFILE": "tiny", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MEDGRAPH_POLICY_DEVICE": "cpu", "TMPDIR": str(tmp_path)}
    for name in ("MLFLOW_TRACKING_URI", "MEDGRAPH_MLFLOW_ARTIFACTS", "MEDGRAPH_LAKE", "MEDGRAPH_LLM"):
        env.pop(name, None)
    command = [sys.executable, str(script), str(llm), *methods]
    restore: list[tuple[Path, int]] = []
    if read_only and os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("running as root without `unshare`: cannot make the home read-only")
        mounts = " && ".join(f"mount --bind '{p}' '{p}' && mount -o remount,ro,bind '{p}' '{p}'" for p in read_only)
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f"{mounts} && exec \"$@\"", "sh", *command]
    else:
        for root in read_only:
            for path in [root, *root.rglob("*")]:
                restore.append((path, path.stat().st_mode))
                path.chmod(path.stat().st_mode & ~0o222)
    try:
        proc = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                              check=False)
    finally:
        for path, mode in reversed(restore):
            path.chmod(mode)
    if "mount" in proc.stderr and proc.returncode != 0 and "RESULTS" not in proc.stdout:
        pytest.skip(f"cannot make the home read-only here: {proc.stderr[-500:]}")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.slow
def test_a_read_only_copied_home_answers_with_every_method(built_home: Path, tiny_llm_dir: Path, tmp_path: Path):
    """Both homes and the LLM read-only. ~30 s: one process asks with every method in turn."""
    copied = Path(shutil.copytree(built_home, tmp_path / "copied"))  # its registry names the original's folders
    before = file_state(built_home, copied, tiny_llm_dir)
    results = ask_read_only([built_home, copied, tiny_llm_dir], copied, tiny_llm_dir, (*METHODS, FIXED_PLAN),
                            tmp_path)
    for method, result in results.items():
        assert result["code"] == 0, (method, result["err"][-3000:])
        assert "Traceback" not in result["err"] and "unreadable" not in result["err"], (method, result["err"][-3000:])
        payload = json.loads(result["out"])
        assert payload["method"] == method and payload["steps"], method
    fixed_plan = json.loads(results[FIXED_PLAN]["out"])
    assert fixed_plan["stats"]["hiim"] == "graph-tokens", fixed_plan["stats"]  # the projector and its GAT were read
    assert "policy: medgraph-graph-r1-policy v1 (GRPO champion)" in results["graph-r1"]["err"]
    assert file_state(built_home, copied, tiny_llm_dir) == before  # nothing written, in either home


def own_artifacts(home: Path, asset: str) -> Path:
    """The one logged model folder of `asset` under the home's artifacts."""
    [folder] = (home / "artifacts" / asset / "models").iterdir()
    return folder / "artifacts"


def test_a_damaged_model_is_named_with_its_file_and_what_to_do(built_home: Path, tiny_llm_dir: Path, tmp_path: Path):
    """A copy whose own policy weights and projector are damaged (its registry still names the intact
    original's folders: the home's own copy is what it reads). Before: a raw SafetensorError traceback
    for graph-r1; a2rag's JSON said "no HIIM projector registered"."""
    copied = Path(shutil.copytree(built_home, tmp_path / "copied"))
    weights = own_artifacts(copied, "graph_r1_policy") / "artifacts" / TINY_LLM / "model.safetensors"
    weights.write_bytes(b"\0" * 100)
    projector = own_artifacts(copied, "hiim_projector") / "data" / "model.pth"
    projector.write_bytes(b"not a torch file")
    results = ask_read_only([], copied, tiny_llm_dir, ("graph-r1", FIXED_PLAN), tmp_path)

    policy = results["graph-r1"]
    assert policy["code"] == 1 and "Traceback" not in policy["err"]
    [error] = [line for line in policy["err"].splitlines() if line.startswith("medgraph ask: error: ")]
    assert error.startswith(f"medgraph ask: error: medgraph-graph-r1-policy v1: cannot load "
                            f"{own_artifacts(copied, 'graph_r1_policy')} (")
    assert error.endswith("Its files are damaged or incomplete: restore them, or train and register the model again; "
                          "or answer with the base LLM instead (--method graph-r1-no-sft)")

    hiim = results[FIXED_PLAN]
    assert hiim["code"] == 0 and "Traceback" not in hiim["err"]
    reason = json.loads(hiim["out"])["stats"]["hiim_reason"]
    assert reason.startswith("the HIIM projector is registered but unreadable: medgraph-hiim-projector v1: cannot "
                             f"load {own_artifacts(copied, 'hiim_projector')} (")
    assert "--method a2rag-no-hiim" in reason and reason in hiim["err"]


def test_loading_a_model_writes_nothing_and_missing_files_are_named(tmp_path: Path, _mlflow_template: Path):
    """In process: `Tracking.load_model` reads the registered folder without writing into it (MLflow's own
    `models:/` loading wrote `registered_model_meta` there), and a registry whose folders are gone (a home moved
    without its artifacts) names both places it looked and what to do."""
    import mlflow
    import torch

    from medgraph.tracking import ModelUnavailableError, Tracking

    original = tmp_path / "original"
    original.mkdir()
    shutil.copy2(_mlflow_template, original / "mlflow.db")
    tracking = Tracking(f"sqlite:///{original / 'mlflow.db'}", str(original / "artifacts"))
    with tracking.start_run("gat_model"):
        uri = tracking.log_torch_model(torch.nn.Linear(2, 1))
    version = tracking.register(uri, "medgraph-gat")
    tracking.client.set_registered_model_alias("medgraph-gat", "champion", version)
    before = file_state(original / "artifacts")
    model = tracking.load_model("models:/medgraph-gat@champion", lambda path: mlflow.pytorch.load_model(path))
    assert isinstance(model, torch.nn.Linear) and file_state(original / "artifacts") == before

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy2(original / "mlflow.db", moved / "mlflow.db")  # the artifacts were not moved with it
    shutil.rmtree(original / "artifacts")
    elsewhere = Tracking(f"sqlite:///{moved / 'mlflow.db'}", str(moved / "artifacts"))
    with pytest.raises(ModelUnavailableError) as missing:
        elsewhere.load_model("models:/medgraph-gat@champion", lambda path: mlflow.pytorch.load_model(path),
                             what_to_do="or do without it")
    message = str(missing.value)
    assert message.startswith("medgraph-gat v1 (models:/medgraph-gat@champion): its files are missing: no MLmodel in "
                              f"{original / 'artifacts' / 'gat_model'}")
    assert f"nor {moved / 'artifacts' / 'gat_model'}" in message and "Restore that folder" in message
    assert message.endswith("or train and register the model again; or do without it")
    with pytest.raises(ModelUnavailableError, match="models:/medgraph-gat/7 is not registered"):
        elsewhere.load_model("models:/medgraph-gat/7", lambda path: None)
