"""Crash recovery for the local Dagster instance: runs whose process died (kill -9, OOM, power loss, a failure
the SQLite event log could not record) are marked failed and their pool slots freed, so the next run does not
wait forever on `warehouse`/`gpu`. Every run does this itself before its first step (`jobs.executor`);
`python -m jobs.recovery` does it by hand."""

import os
import sys

import dagster as dg
import psutil
from dagster import DagsterEventType, DagsterRunStatus, RunsFilter

# Private: the one way to tell a local SQLite instance (whose dead runs only we can recover) from PostgreSQL.
from dagster._core.storage.runs import SqliteRunStorage


def main() -> int:
    """Runs of the local Dagster instance whose process is gone (kill -9, OOM, power loss): mark them
    failed and free their pool slots, so the next run does not wait forever on `warehouse`/`gpu`.

    Dagster itself frees slots only through the daemon's run monitoring, and its default run launcher
    cannot tell that a run's process died; `dg launch` / `dagster asset materialize` run without a daemon at all."""
    if not os.environ.get("DAGSTER_HOME"):
        print("jobs.recovery: DAGSTER_HOME is not set: no Dagster instance to recover", file=sys.stderr)
        return 0
    with dg.DagsterInstance.get() as instance:
        if not is_local_instance(instance):
            # A shared (PostgreSQL) instance runs on other machines, whose pids mean nothing here: there the
            # run launcher's health checks and the daemon's run monitoring handle dead runs.
            print(f"jobs.recovery: the instance in {os.environ['DAGSTER_HOME']} is not a local (SQLite) one; "
                  "nothing done", file=sys.stderr)
            return 1
        for line in recover_dead_runs(instance):
            print(line)
    return 0


def is_local_instance(instance: dg.DagsterInstance) -> bool:
    """A SQLite instance, whose runs all ran on this machine (their pids mean something here)."""
    return isinstance(instance.run_storage, SqliteRunStorage)


def run_process(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, start time) of a run's process, from its RUN_START event; None when it has not started."""
    starts = instance.all_logs(run_id, of_type=DagsterEventType.RUN_START)
    if not starts or starts[-1].dagster_event is None or starts[-1].dagster_event.pid is None:
        return None
    return starts[-1].dagster_event.pid, starts[-1].timestamp


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark STARTED/CANCELING runs of `instance` (a DagsterInstance on this machine) whose run process is
    gone as failed, and free the pool slots of every finished run that still holds some; what was done.

    A run's process is the pid of its RUN_START event (the `dg launch` process, or the
    run worker a launcher started). It is gone when no such process exists, it is a zombie, or the pid
    now belongs to a process started after the run (pid reuse)."""
    done: list[str] = []
    running = instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]))
    for run in running:
        process = run_process(instance, run.run_id)
        if process is None:
            continue  # cannot tell which process ran it: leave it alone
        pid, started_at = process
        if process_alive(pid, started_at):
            continue
        held = pools_held(instance, run.run_id)  # before the failure event (whose handling may free some)
        instance.report_run_failed(run, message=f"The run's process (pid {pid}) is gone: it was killed or crashed. "
                                                f"Marked failed (jobs.recovery), which freed its pool slots.")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        done.append(f"run {run.run_id} ({run.job_name}): its process {pid} is gone; marked FAILURE, "
                    f"freed {describe_slots(held)}")
    if instance.event_log_storage.supports_global_concurrency_limits:
        holders = instance.event_log_storage.get_concurrency_run_ids()
        finished = instance.get_runs(filters=RunsFilter(run_ids=sorted(holders), statuses=[
            DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED])) if holders else []
        for run in finished:
            held = pools_held(instance, run.run_id)
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            done.append(f"run {run.run_id} ({run.job_name}, {run.status.value}): freed {describe_slots(held)}")
    if not done:
        done.append("no dead runs, no pool slots held by finished runs")
    return done


def pools_held(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The pool of each slot a run holds."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    return sorted(key for key in storage.get_concurrency_keys()
                  for slot in storage.get_concurrency_info(key).claimed_slots if slot.run_id == run_id)


def describe_slots(pools: list[str]) -> str:
    return f"{len(pools)} pool slot(s)" + (f" ({', '.join(pools)})" if pools else "")


def process_alive(pid: int, started_at: float) -> bool:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return process.create_time() <= started_at + 1.0  # else the pid was reused by a newer process
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    sys.exit(main())
