"""Flow runs that start warm.

Prefect starts each run of a served deployment, and each run a process worker takes, in a
fresh interpreter (`python -m prefect.engine`, or a `spawn`ed one for a flow it holds in
memory), which imports Prefect, MLflow and the flow's module all over again: 3 of the 4 s
between a rollback's Submit and its first step (issue 48). MinT's flow server and the control
pool's worker (`WarmProcessWorker`) hold their flows in memory and start each run instead from
a `multiprocessing` forkserver that imported them once (`warm_runs`): the run's process is a
fork of it, running in a tenth of a second. The forkserver is a fresh interpreter of its own
(not a fork of the serving process, with its threads and event loop), started before the first
run is asked for, with the environment the runs would have had; each run still sets its own,
as Prefect does. A flow that trains imports torch in its run, as before: the forkserver imports
only what the control flows need, so it stays at the size of a control run, and the train
pool's worker stays Prefect's own (`control.services.start_prefect_worker`).
"""

import asyncio
import multiprocessing
import multiprocessing.forkserver
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import anyio
import anyio.abc
import prefect.flow_engine
from prefect import Flow
from prefect.client.schemas.objects import FlowRun
from prefect.flow_engine import run_flow_in_subprocess
from prefect.flows import load_flow_from_flow_run
from prefect.runner._control_channel import ControlChannel
from prefect.runner._flow_run_executor import FlowRunExecutionResult, FlowRunExecutorContext
from prefect.runner._process_manager import ProcessHandle
from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

ENGINE = "prefect.flow_engine"
"""What every run's process runs (`run_flow_in_subprocess`'s target), so always preloaded."""


class _StartMethod:
    """Stands in for the `multiprocessing` module inside `prefect.flow_engine`, whose
    `run_flow_in_subprocess` asks it for a "spawn" context: it gets the forkserver's."""

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self._context = context

    def get_context(self, method: str | None = None) -> multiprocessing.context.BaseContext:
        return self._context

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


def warm_runs(modules: Sequence[str]) -> None:
    """From now on, this process starts its flow runs as forks of a forkserver that has
    imported `modules` (and Prefect's engine), started here, so that the first run is warm
    too. Call it once, in the process that starts runs (`mint flows serve`, a pool worker)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([ENGINE, *modules])
    multiprocessing.forkserver.ensure_running()
    engine: ModuleType = prefect.flow_engine
    engine.multiprocessing = _StartMethod(context)  # type: ignore[attr-defined]


class _WarmStarter:
    """Starts one run of an in-memory `flow` as a fork of the forkserver, with the worker's
    job environment (`env`): Prefect's `DirectSubprocessStarter`, which passes only its own
    few variables, with the job's too (a deployment's job variables, the crash heartbeat)."""

    def __init__(
        self, flow: Flow[..., Any], env: Mapping[str, str | None], channel: ControlChannel
    ) -> None:
        self._flow = flow
        self._env = dict(env)
        self._channel = channel

    async def start(
        self,
        flow_run: FlowRun,
        task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        env = dict(self._env)
        registered = False
        try:
            port, token = self._channel.register(flow_run.id)
            env |= {"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token}
            registered = True
        except RuntimeError:
            pass  # no loopback channel: Prefect falls back to killing a cancelled run
        try:
            process = run_flow_in_subprocess(self._flow, flow_run=flow_run, env=env)
        except BaseException:
            if registered:
                self._channel.unregister(flow_run.id)
            raise
        task_status.started(ProcessHandle(process))
        await anyio.to_thread.run_sync(process.join)


class WarmProcessWorker(ProcessWorker):
    """Prefect's process worker, for the same process pools, whose runs start warm: it loads
    each run's flow itself (its module imported once per worker) and starts the run as a fork
    of the forkserver (`warm_runs`), as MinT's flow server does, where Prefect's would start
    `python -m prefect.engine`. `mint flows work` runs it."""

    @classmethod
    def __dispatch_key__(cls) -> str:
        # Prefect keys worker classes by their pool type; ours serves "process" pools too,
        # and must not take that key from Prefect's own worker.
        return "mint-warm-process"

    async def run(
        self,
        flow_run: FlowRun,
        configuration: ProcessJobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> ProcessWorkerResult:
        flow = await load_flow_from_flow_run(flow_run)
        execution: FlowRunExecutionResult | None = None
        async with FlowRunExecutorContext() as context:
            executor = context.create_executor(
                flow_run,
                _WarmStarter(flow, configuration.env, context.control_channel),
                resolve_flow=load_flow_from_flow_run,
                propose_submitting=False,
            )

            async def execute(
                *, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED
            ) -> None:
                nonlocal execution
                execution = await executor.submit(task_status=task_status)

            async with anyio.create_task_group() as runs:
                handle: ProcessHandle = await runs.start(execute)
                (task_status or anyio.TASK_STATUS_IGNORED).started(handle.pid)
        if execution is None or execution.status_code is None:
            raise RuntimeError(f"flow run {flow_run.id} did not start")
        return ProcessWorkerResult(
            status_code=execution.status_code, identifier=str(execution.handle.pid)
        )


def work(
    pool: str, name: str, modules: Sequence[str], limit: int | None, queues: Sequence[str]
) -> None:
    """Run `pool`'s flow runs on this host, warm, until stopped: a `WarmProcessWorker` named
    `name`, polling `queues` (none: all of the pool's), running at most `limit` runs at once,
    its forkserver preloaded with `modules`."""
    warm_runs(modules)
    worker = WarmProcessWorker(
        name=name,
        work_pool_name=pool,
        work_queues=list(queues) or None,
        limit=limit,
        heartbeat_interval_seconds=PREFECT_WORKER_HEARTBEAT_SECONDS.value(),
    )
    asyncio.run(worker.start(printer=print))
