"""The code location's executor: Dagster's in-process executor, made safe against runs that died.

Every run, however it was launched (`dg launch`, `make demo`, the UI's launchpad, a sensor or schedule through
the daemon), executes its steps through this executor, so what it does happens before any step waits on a
pool (`warehouse`, `gpu`; one slot each):

- on a local (SQLite) instance, runs whose process is gone (kill -9, OOM, a failure the event log could not
  record) are marked failed and their slots freed first (`jobs.recovery.recover_dead_runs`), and again
  whenever a step finds its pool full, so a holder that dies while this run waits does not wedge it;
- a step that waits for a slot says which run holds it (its job, step, process and whether that process is
  alive) and how to free it, and says it again whenever the holders change;
- the wait wakes every second, so SIGTERM / SIGINT (which Dagster's in-process executor otherwise records and
  never reads between steps) end the run promptly, failed, with its pending claim withdrawn. Dagster 1.13.27's
  own wait computes a sleep of 0 while blocked (`min([0, ...])`), so it also spun at 100% CPU.

This uses Dagster internals (`InstanceConcurrencyContext`, `inner_plan_execution_iterator`) that the pinned
`dagster==1.13.27` has; a PostgreSQL instance (deploy/production) gets only the wait's message and signal
handling, its dead runs being the daemon's run monitoring's job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import dagster as dg

# Private on purpose (module docstring): the in-process executor with our pool wait has no public hook.
from dagster._core.definitions.executor_definition import IN_PROC_CONFIG, _core_in_process_executor_creation
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.events import DagsterEvent, EngineEventData
from dagster._core.execution.api import ExecuteRunWithPlanIterable
from dagster._core.execution.context.system import PlanExecutionContext, PlanOrchestrationContext
from dagster._core.execution.context_creation_job import PlanExecutionContextManager
from dagster._core.execution.plan.execute_plan import inner_plan_execution_iterator
from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext
from dagster._core.execution.plan.plan import ExecutionPlan
from dagster._core.executor.in_process import InProcessExecutor
from dagster._utils.interrupts import pop_captured_interrupt

from jobs.recovery import is_local_instance, process_alive, recover_dead_runs, run_process

# How often a blocked step wakes up to look for a signal (a slot is asked for on Dagster's own back-off).
WAKE_INTERVAL_S = 1.0


def describe_pool_holders(instance: dg.DagsterInstance, pool: str, waiting_run_id: str) -> str:
    """Who holds `pool`'s slots, for a run that waits on it, and how to free them."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    holders = [slot for slot in info.claimed_slots if slot.run_id != waiting_run_id]
    limit = f"limit {info.slot_count}" if info.slot_count is not None else "no limit"
    if not holders:
        return f"pool {pool} ({limit}): no other run holds a slot now; asking again shortly"
    local = is_local_instance(instance)
    described = []
    for slot in holders:
        run = instance.get_run_by_id(slot.run_id)
        status = run.status.value if run else "unknown run"
        job = f"job {run.job_name}, " if run else ""
        process = run_process(instance, slot.run_id)
        if process is None:
            where = "its process is not known (it has not started)"
        elif not local:
            where = f"process {process[0]} on its own machine"
        else:
            alive = "alive" if process_alive(*process) else "gone"
            where = f"process {process[0]} on this machine, {alive}"
        since = f", since {time.strftime('%H:%M:%S', time.localtime(process[1]))}" if process else ""
        described.append(f"held by run {slot.run_id} ({job}step {slot.step_key}, {status}{since}, {where})")
    how = ("This run starts when it ends. To stop waiting: end that run (Dagster UI > Runs > Terminate, or "
           "kill its process); a run whose process is gone is marked failed and its slot freed by the next run "
           "that waits, or now by `python -m jobs.recovery`")
    if not local:
        how = ("This run starts when it ends. To stop waiting: terminate that run in the Dagster UI; the daemon's "
               "run monitoring frees the slots of runs whose worker died")
    return f"pool {pool} ({limit}): " + "; ".join(described) + f". {how}."


class PoolWaitContext(InstanceConcurrencyContext):
    """Dagster's pool claims for one run, which wait without spinning, notice signals, free the slots of dead
    runs and say who holds what a step waits for."""

    def __init__(self, job_context: PlanExecutionContext):
        super().__init__(job_context.instance, job_context.dagster_run)
        self._job_context = job_context
        self._shown: dict[str, str] = {}  # pool -> the holders last reported

    def claim(self, concurrency_key: str, step_key: str, step_priority: int = 0) -> bool:
        if pop_captured_interrupt():
            raise DagsterExecutionInterruptedError(
                f"interrupted (SIGTERM/SIGINT) while step {step_key} waited for a slot of pool {concurrency_key}")
        asking = step_key not in self._pending_claims or time.time() > self._pending_timeouts[step_key]
        if super().claim(concurrency_key, step_key, step_priority):
            self._shown.pop(concurrency_key, None)
            return True
        if not asking:
            return False
        instance = self._instance
        if is_local_instance(instance) and self._holders_dead(concurrency_key):
            done = [line for line in recover_dead_runs(instance) if not line.startswith("no dead runs")]
            for line in done:
                self._report(f"pool {concurrency_key}: {line}")
            if done:
                self._pending_timeouts[step_key] = 0.0  # ask again at once
                return False
        holders = describe_pool_holders(instance, concurrency_key, self._run_id)
        if self._shown.get(concurrency_key) != holders:
            self._shown[concurrency_key] = holders
            self._report(f"Step {step_key} waits for a slot of {holders}")
        return False

    def _holders_dead(self, pool: str) -> bool:
        """Whether a run holding a slot of `pool` has ended or lost its process."""
        for slot in self._instance.event_log_storage.get_concurrency_info(pool).claimed_slots:
            run = self._instance.get_run_by_id(slot.run_id)
            if run is not None and run.is_finished:
                return True
            process = run_process(self._instance, slot.run_id)
            if process is not None and not process_alive(*process):
                return True
        return False

    def _report(self, message: str) -> None:
        DagsterEvent.engine_event(self._job_context, message, EngineEventData())  # logged as it is made

    def interval_to_next_pending_claim_check(self) -> float:
        if not self._pending_claims:
            return 0.0
        until = min((ready - time.time() for ready in self._pending_timeouts.values()), default=0.0)
        return min(max(until, 0.0), WAKE_INTERVAL_S)


def _execution_iterator(job_context: PlanExecutionContext, execution_plan: ExecutionPlan) -> Iterator[DagsterEvent]:
    instance = job_context.instance
    if is_local_instance(instance):
        for line in recover_dead_runs(instance):
            if not line.startswith("no dead runs"):
                yield DagsterEvent.engine_event(job_context, f"Before the first step: {line}", EngineEventData())
    with PoolWaitContext(job_context) as concurrency:
        yield from inner_plan_execution_iterator(job_context, execution_plan, concurrency)


class RecoveringInProcessExecutor(InProcessExecutor):
    """`InProcessExecutor` whose steps claim pool slots through `PoolWaitContext`, after freeing dead runs' slots."""

    def execute(self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan) -> Iterator[DagsterEvent]:
        step_keys = execution_plan.step_keys_to_execute
        pid = os.getpid()
        yield DagsterEvent.engine_event(plan_context, f"Executing steps in process (pid: {pid})",
                                        event_specific_data=EngineEventData.in_process(pid, step_keys))
        started = time.perf_counter()
        yield from iter(ExecuteRunWithPlanIterable(
            execution_plan=plan_context.execution_plan,
            iterator=_execution_iterator,
            execution_context_manager=PlanExecutionContextManager(
                job=plan_context.job,
                retry_mode=plan_context.retry_mode,
                execution_plan=plan_context.execution_plan,
                run_config=plan_context.run_config,
                dagster_run=plan_context.dagster_run,
                instance=plan_context.instance,
                raise_on_error=plan_context.raise_on_error,
                output_capture=plan_context.output_capture,
                step_dependency_config=self.step_dependency_config,
            ),
        ))
        yield DagsterEvent.engine_event(
            plan_context, f"Finished steps in process (pid: {pid}) in {time.perf_counter() - started:.1f} s",
            event_specific_data=EngineEventData.in_process(pid, step_keys))


@dg.executor(name="in_process", config_schema=IN_PROC_CONFIG)
def recovering_in_process_executor(init_context: dg.InitExecutorContext) -> RecoveringInProcessExecutor:
    """The in-process executor (same name and config as Dagster's), which first fails runs whose process is
    gone and frees their pool slots, and whose pool waits say who holds the slot and end on SIGTERM."""
    core = _core_in_process_executor_creation(init_context.executor_config)
    return RecoveringInProcessExecutor(core.retries, core.step_dependency_config, core.marker_to_close)
