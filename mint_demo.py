"""`mint demo`: the whole release path on the embedded default, start to finish.

Starts an MLflow server and a serving worker on loopback, writes two generated JSONL datasets
and releases an adapter from each through the Prefect release flow (the path a user's file
takes), asks the worker for held-out words with each adapter and with the base alone, prints
the answers side by side with each stage's time, and stops what it started.
"""

import dataclasses
import os
import time

from control.services import start_mlflow
from control.status import format_stage_times, format_table, status_rows
from mint_core.config import MintConfig
from mint_core.model.base import load_base
from mint_core.model.toy import (
    RECIPE,
    Task,
    held_out_words,
    prompt_for,
    write_held_out_data,
    write_task_data,
)
from mint_core.registry_accounts import ACCOUNTS_FILE, RegistryAccounts
from processes import ManagedProcess, stop_all
from serving.http.client import WorkerClient
from serving.worker.server import start_worker

ADAPTERS = {"upper-bot": Task.UPPER, "reverse-bot": Task.REVERSE}
SHOWN_WORDS = 6


def run_demo(config: MintConfig, steps: int | None = None) -> None:
    print(f"MinT demo; state in {config.home}")
    started: list[ManagedProcess] = []
    try:
        clock = time.perf_counter()
        base = load_base(config.base, config.home)
        print(
            f"base model {base.model_id} ({base.digest[:19]}...) ready in "
            f"{time.perf_counter() - clock:.1f} s"
        )
        accounts = RegistryAccounts.load_or_create(config.home)
        mlflow = start_mlflow(config.home, accounts=accounts, store=config)
        started.append(mlflow)
        config = dataclasses.replace(config, tracking_uri=mlflow.url)
        print(f"MLflow server and UI at {mlflow.url} (passwords in {config.home / ACCOUNTS_FILE})")
        # The demo's releases run in this process, as the pipeline; the worker only reads.
        os.environ.update(accounts.pipeline.env())
        worker = start_worker(config, env=accounts.worker.env())
        started.append(worker)
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        print(f"serving worker at {worker.url}")
        # The release flow reads its configuration from the environment, as any entry point.
        os.environ["MLFLOW_TRACKING_URI"] = config.tracking_uri
        os.environ["MINT_WORKER_URLS"] = worker.url
        _release_and_compare(config, steps)
    finally:
        stop_all(started)
        print("stopped the worker and the MLflow server")


def _release_and_compare(config: MintConfig, steps: int | None) -> None:
    from flows.release import release

    reports = {}
    data = config.home / "data"
    for adapter, task in ADAPTERS.items():
        train, held_out = write_task_data(task, data), write_held_out_data(task, data)
        length = f"{steps} steps" if steps else f"{RECIPE['epochs']:g} epoch(s)"
        print(f"\nreleasing {adapter} from {train} ({length}) ...")
        options = RECIPE | ({"steps": steps} if steps else {})
        reports[adapter] = release(adapter, str(train), eval_data=str(held_out), **options)
        report = reports[adapter]
        exact = report.eval_metrics["eval_exact_match"]
        print(f"  -> {report.revision} (exact match {exact:.0%} on {report.eval_rows})")

    client = WorkerClient(config.worker_urls[0])
    words = held_out_words()
    targets: list[tuple[str, str | None]] = [("base", None)]
    targets += [(adapter, adapter) for adapter in ADAPTERS]
    answers = {name: [client.generate(prompt_for(w), a)[0] for w in words] for name, a in targets}

    rows = [["prompt", *[name for name, _ in targets]]]
    rows += [[prompt_for(w), *[answers[n][i] for n, _ in targets]] for i, w in enumerate(words)]
    print("\nheld-out prompts, greedy answers over HTTP (/generate):")
    print(format_table(rows[: SHOWN_WORDS + 1]))

    print(f"\nexact-answer rate over {len(words)} held-out words:")
    score_rows = [["served by", *[t.value for t in ADAPTERS.values()]]]
    for name, _ in targets:
        rates = [_exact_rate(answers[name], words, task) for task in ADAPTERS.values()]
        score_rows.append([name, *[f"{rate:.0%}" for rate in rates]])
    print(format_table(score_rows))

    print("\npipeline stage times:")
    for report in reports.values():
        print(f"  {report.revision:<16} {format_stage_times(report.stage_seconds)}")
    print("\nmint status:")
    print(format_table(status_rows(config)))


def _exact_rate(answers: list[str], words: list[str], task: Task) -> float:
    return sum(a == task.answer(w) for a, w in zip(answers, words, strict=True)) / len(words)
