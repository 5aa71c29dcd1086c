"""Crash recovery for the local Dagster instance: `python -m jobs.recovery` (the first step of `make demo` and
`make ui`) marks runs whose process died (kill -9, OOM, power loss) as failed and frees their pool slots, so the
next run does not wait forever on `warehouse`/`gpu`."""

import os
import sys

import dagster as dg
import psutil
from dagster import DagsterEventType, DagsterRunStatus, RunsFilter
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
        if not isinstance(instance.run_storage, SqliteRunStorage):
            # A shared (PostgreSQL) instance runs on other machines, whose pids mean nothing here: there the
            # run launcher's health checks and the daemon's run monitoring handle dead runs.
            print(f"jobs.recovery: the instance in {os.environ['DAGSTER_HOME']} is not a local (SQLite) one; "
                  "nothing done", file=sys.stderr)
            return 1
        for line in recover_dead_runs(instance):
            print(line)
    return 0


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark STARTED/CANCELING runs of `instance` (a DagsterInstance on this machine) whose run process is
    gone as failed, and free the pool slots of every finished run that still holds some; what was done.

    A run's process is the pid of its RUN_START event (the `dg launch` process, or the
    run worker a launcher started). It is gone when no such process exists, it is a zombie, or the pid
    now belongs to a process started after the run (pid reuse)."""
    done: list[str] = []
    running = instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]))
    for run in running:
        starts = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_START)
        if not starts or starts[-1].dagster_event is None or starts[-1].dagster_event.pid is None:
            continue  # cannot tell which process ran it: leave it alone
        pid, started_at = starts[-1].dagster_event.pid, starts[-1].timestamp
        if _process_alive(pid, started_at):
            continue
        held = _pools_held(instance, run.run_id)  # before the failure event (whose handling may free some)
        instance.report_run_failed(run, message=f"The run's process (pid {pid}) is gone: it was killed or crashed. "
                                                f"Marked failed by `python -m jobs.recovery`, which freed its pool slots.")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        done.append(f"run {run.run_id} ({run.job_name}): its process {pid} is gone; marked FAILURE, "
                    f"freed {_describe_slots(held)}")
    if instance.event_log_storage.supports_global_concurrency_limits:
        holders = instance.event_log_storage.get_concurrency_run_ids()
        finished = instance.get_runs(filters=RunsFilter(run_ids=sorted(holders), statuses=[
            DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED])) if holders else []
        for run in finished:
            held = _pools_held(instance, run.run_id)
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            done.append(f"run {run.run_id} ({run.job_name}, {run.status.value}): freed {_describe_slots(held)}")
    if not done:
        done.append("no dead runs, no pool slots held by finished runs")
    return done


def _pools_held(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The pool of each slot a run holds."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    return sorted(key for key in storage.get_concurrency_keys()
                  for slot in storage.get_concurrency_info(key).claimed_slots if slot.run_id == run_id)


def _describe_slots(pools: list[str]) -> str:
    return f"{len(pools)} pool slot(s)" + (f" ({', '.join(pools)})" if pools else "")


def _process_alive(pid: int, started_at: float) -> bool:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return process.create_time() <= started_at + 1.0  # else the pid was reused by a newer process
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    sys.exit(main())
