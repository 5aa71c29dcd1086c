"""Crash recovery (issue 17, fault 3): a run killed with SIGKILL no longer wedges the next one, stale
staging files go away, and the `medgraph` CLI ends promptly on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import REPO_ROOT

from medgraph.storage import Lake
from medgraph.umls.ingest import remove_stale_staging

BIN = Path(sys.executable).parent


def _wait_for(what: str, condition, timeout_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def test_stale_staging_files_of_the_table_are_removed_and_nothing_else(tmp_path: Path):
    lake = Lake(tmp_path / "lake")
    umls = tmp_path / "lake" / "umls"
    umls.mkdir(parents=True)
    stale = [umls / ".mrrel.0123456789ab.tmp.parquet", umls / ".mrrel_rejects.ba9876543210.tmp.parquet"]
    kept = [umls / "mrrel.parquet", umls / ".mrrel.snapshot.0123456789ab.tmp.parquet",
            umls / ".mrconso.0123456789ab.tmp.parquet", umls / ".mrrelx.0123456789ab.tmp.parquet"]
    for path in stale + kept:
        path.write_bytes(b"")
    assert sorted(remove_stale_staging(lake, "mrrel")) == sorted(stale)
    assert [p for p in stale + kept if p.exists()] == kept


def test_an_ingestion_removes_the_stale_staging_file_a_killed_one_left(release_copy: Path, warehouse):
    """Before: a killed ingestion's `.mrsab.<id>.tmp.parquet` stayed in the lake for good."""
    from medgraph.umls.ingest import ingest_rrf_file

    umls = warehouse.lake.root / "umls"
    umls.mkdir(parents=True)
    stale, other_table = umls / ".mrsab.0123456789ab.tmp.parquet", umls / ".mrconso.0123456789ab.tmp.parquet"
    stale.write_bytes(b"")
    other_table.write_bytes(b"")
    ingest_rrf_file(release_copy, "MRSAB", warehouse)
    assert not stale.exists() and other_table.exists()  # another table's file waits for that table's run
    assert warehouse.count("umls.mrsab") > 0


@pytest.fixture
def dagster_env(tiny_release: Path, tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / "dagster").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "deploy" / "local" / "dagster.yaml", home / "dagster" / "dagster.yaml")
    return {**os.environ, "MEDGRAPH_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"),
            "MEDGRAPH_UMLS_DIR": str(tiny_release), "MEDGRAPH_PROFILE": "tiny", "DAGSTER_DISABLE_TELEMETRY": "true"}


@pytest.fixture
def instance(dagster_env: dict[str, str]) -> Iterator[object]:
    import dagster as dg

    with dg.DagsterInstance.from_config(dagster_env["DAGSTER_HOME"]) as instance:
        yield instance


def _materialize(env: dict[str, str], selection: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "dg"), "launch", "-m", "definitions", "--assets", selection],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_a_run_killed_with_sigkill_does_not_wedge_the_next_run(dagster_env: dict[str, str], instance):
    """The killed run stays STARTED holding the `warehouse` pool slot (Dagster cannot tell its process is
    gone); before the fix the re-run waited on that slot forever. `python -m jobs.recovery` (the first step of
    `make demo`) marks it failed and frees the slot; the re-run then succeeds and the stale staging file is
    gone. ~40 s, most of it two Dagster start-ups: it is the acceptance test of the fault."""
    from dagster import DagsterRunStatus

    home = Path(dagster_env["MEDGRAPH_HOME"])
    # MRSAB: the smallest table, whose checks need no other table (any table wedged the same way).
    # The test holds the warehouse's write lock, so the ingestion cannot finish before it is killed
    # (it claims its pool slot, parses, then waits on the lock to publish its view).
    home.mkdir(parents=True, exist_ok=True)
    blocker = duckdb.connect(str(home / "warehouse.duckdb"))
    first = _materialize(dagster_env, "umls/mrsab")
    try:
        def started_holding_slot():
            runs = instance.get_runs()
            # A claimed slot, not only a pending claim: `get_concurrency_run_ids` also lists runs whose step
            # still waits for its slot (CI once killed the run in that window and saw 0 slots freed).
            claimed = {slot.run_id for slot in instance.event_log_storage.get_concurrency_info("warehouse").claimed_slots}
            return runs and runs[0].status == DagsterRunStatus.STARTED and runs[0].run_id in claimed and runs[0]

        run = _wait_for("STARTED run holding a pool slot", started_holding_slot, 180, first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        blocker.close()
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED  # what the killed run leaves
    # A staging file as a kill during the Parquet write leaves it (the kill above may or may not have).
    stale = home / "lake" / "umls" / ".mrsab.0123456789ab.tmp.parquet"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"")

    recovered = subprocess.run([sys.executable, "-m", "jobs.recovery"], cwd=REPO_ROOT, env=dagster_env,
                               capture_output=True, text=True, timeout=120, check=False)
    assert recovered.returncode == 0, recovered.stderr
    assert f"run {run.run_id}" in recovered.stdout and "marked FAILURE, freed 1 pool slot(s) (warehouse)" in recovered.stdout
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE

    started = time.monotonic()
    second = _materialize(dagster_env, "umls/mrsab")
    try:
        out, _ = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert second.returncode == 0, out[-3000:]
    assert time.monotonic() - started < 120
    assert not list((home / "lake" / "umls").glob(".mrsab.*.tmp.parquet"))
    with duckdb.connect(str(home / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM umls.mrsab").fetchone()[0] > 0
    # Nothing left to do: a second recover changes nothing.
    again = subprocess.run([sys.executable, "-m", "jobs.recovery"], cwd=REPO_ROOT, env=dagster_env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert "no dead runs" in again.stdout


def test_recover_fails_only_runs_whose_process_is_gone(instance):
    """A STARTED run whose process is alive (this test's own) is left alone; one whose process has exited
    is marked failed."""
    import dagster as dg

    from jobs.recovery import recover_dead_runs

    @dg.op
    def noop() -> None:
        pass

    @dg.job
    def alive() -> None:
        noop()

    run = instance.create_run_for_job(alive, run_id=None)
    event = dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_START.value, job_name="alive", pid=os.getpid())
    instance.report_dagster_event(event, run_id=run.run_id)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    assert recover_dead_runs(instance) == ["no dead runs, no pool slots held by finished runs"]
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    event = dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_START.value, job_name="alive", pid=dead.pid)
    other = instance.create_run_for_job(alive, run_id=None)
    instance.report_dagster_event(event, run_id=other.run_id)
    [line] = recover_dead_runs(instance)
    assert f"run {other.run_id}" in line and f"process {dead.pid} is gone" in line
    assert instance.get_run_by_id(other.run_id).status == dg.DagsterRunStatus.FAILURE
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
