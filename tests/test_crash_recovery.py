"""Crash recovery (issue 17, fault 3): a run killed with SIGKILL no longer wedges the next one, stale
staging files go away, and the `medgraph` CLI ends promptly on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import REPO_ROOT

from medgraph.storage import Lake
from medgraph.umls.ingest import remove_stale_staging

BIN = Path(sys.executable).parent


class Launch:
    """`dg launch -m definitions --assets SELECTION` in its own process group, its output collected as it comes."""

    def __init__(self, env: dict[str, str], selection: str):
        self.proc = subprocess.Popen([str(BIN / "dg"), "launch", "-m", "definitions", "--assets", selection],
                                     cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s:.0f} s:\n{self.output[-3000:]}") from None
        self._reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _wait_for(what: str, condition, timeout_s: float, launch: Launch):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if launch.proc.poll() is not None:
            raise AssertionError(f"the process ended ({launch.proc.returncode}) before {what}:\n{launch.output[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{launch.output[-3000:]}")


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


@pytest.mark.slow
def test_a_run_killed_with_sigkill_does_not_wedge_the_next_run(dagster_env: dict[str, str], instance):
    """Run A holds the `warehouse` pool slot. Run B, launched meanwhile, waits for it, says which run holds it
    and how to free it, and stops on SIGTERM. A is killed with SIGKILL: it stays STARTED holding the slot
    (Dagster cannot tell its process is gone). Run C, launched with no manual recovery, fails A, frees its
    slot and succeeds; A's stale staging file is gone.

    Before: B (and C) spun at 100% CPU on "Step blocked by limit for pool warehouse", ignored SIGTERM and
    SIGINT, and never said who held the slot; only `python -m jobs.recovery` by hand unblocked them.
    ~60 s, most of it three Dagster start-ups: it is the acceptance test of the fault."""
    from dagster import DagsterRunStatus

    home = Path(dagster_env["MEDGRAPH_HOME"])
    # MRSAB: the smallest table, whose checks need no other table (any table wedged the same way).
    # The test holds the warehouse's write lock, so the ingestion cannot finish before it is killed
    # (it claims its pool slot, parses, then waits on the lock to publish its view).
    home.mkdir(parents=True, exist_ok=True)
    blocker = duckdb.connect(str(home / "warehouse.duckdb"))
    first = Launch(dagster_env, "umls/mrsab")
    second = None
    try:
        def started_holding_slot():
            runs = instance.get_runs()
            # A claimed slot, not only a pending claim: `get_concurrency_run_ids` also lists runs whose step
            # still waits for its slot (CI once killed the run in that window and saw 0 slots freed).
            claimed = {slot.run_id for slot in instance.event_log_storage.get_concurrency_info("warehouse").claimed_slots}
            return runs and runs[0].status == DagsterRunStatus.STARTED and runs[0].run_id in claimed and runs[0]

        run = _wait_for("STARTED run holding a pool slot", started_holding_slot, 180, first)

        second = Launch(dagster_env, "umls/mrsab")
        _wait_for("the waiting run to name the run holding the slot",
                  lambda: f"held by run {run.run_id}" in second.output, 120, second)
        assert f"process {first.proc.pid}" in second.output and "python -m jobs.recovery" in second.output
        waiting = next(r for r in instance.get_runs() if r.run_id != run.run_id)
        sent = time.monotonic()
        second.proc.send_signal(signal.SIGTERM)  # as `timeout` sends it: to the process, not its group
        assert second.wait(30) != 0
        assert time.monotonic() - sent < 15, second.output[-3000:]
        assert instance.get_run_by_id(waiting.run_id).status in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED  # the live holder is untouched

        first.kill()
    finally:
        first.kill()
        if second is not None:
            second.kill()
        blocker.close()
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED  # what the killed run leaves
    # A staging file as a kill during the Parquet write leaves it (the kill above may or may not have).
    stale = home / "lake" / "umls" / ".mrsab.0123456789ab.tmp.parquet"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"")

    started = time.monotonic()
    third = Launch(dagster_env, "umls/mrsab")  # no `python -m jobs.recovery` first
    try:
        assert third.wait(120) == 0, third.output[-3000:]
    finally:
        third.kill()
    assert time.monotonic() - started < 120
    assert f"run {run.run_id}" in third.output and "freed 1 pool slot(s) (warehouse)" in third.output
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE
    assert not list((home / "lake" / "umls").glob(".mrsab.*.tmp.parquet"))
    with duckdb.connect(str(home / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM umls.mrsab").fetchone()[0] > 0
    # Nothing left to do: the recovery command finds nothing.
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


def test_a_waiting_step_is_told_who_holds_the_pool(instance):
    """What a step waiting on `warehouse` logs names the holding run, its step and its process, and how to
    free it; once the holder has finished, the recovery every run does first frees its slot."""
    import dagster as dg

    from jobs.executor import describe_pool_holders
    from jobs.recovery import recover_dead_runs

    @dg.op
    def noop() -> None:
        pass

    @dg.job
    def holder() -> None:
        noop()

    storage = instance.event_log_storage
    storage.set_concurrency_slots("warehouse", 1)
    run = instance.create_run_for_job(holder, run_id=None)
    instance.report_dagster_event(dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_START.value,
                                                  job_name="holder", pid=os.getpid()), run_id=run.run_id)
    assert storage.claim_concurrency_slot("warehouse", run.run_id, "umls__mrsab").is_claimed
    shown = describe_pool_holders(instance, "warehouse", waiting_run_id="another-run")
    assert shown.startswith(f"pool warehouse (limit 1): held by run {run.run_id} (job holder, step umls__mrsab, "
                            "STARTED, since ")
    assert f"process {os.getpid()} on this machine, alive)" in shown and "python -m jobs.recovery" in shown
    assert recover_dead_runs(instance) == ["no dead runs, no pool slots held by finished runs"]  # alive: kept

    instance.report_run_failed(instance.get_run_by_id(run.run_id))  # finished, its slot still claimed
    assert recover_dead_runs(instance) == [f"run {run.run_id} (holder, FAILURE): freed 1 pool slot(s) (warehouse)"]
    assert describe_pool_holders(instance, "warehouse", "another-run").endswith("no other run holds a slot now; "
                                                                                 "asking again shortly")
