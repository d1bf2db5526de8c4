"""Commands that make new revisions: `mint release` (train on data), `mint rl` (GRPO) and
`mint import` (an adapter trained elsewhere)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from control.status import format_stage_times
from mint_cli.options import (
    DATA,
    FOLDER,
    REGISTRY,
    WORKERS,
    FlowOptions,
    actor_option,
    adapter_option,
    base_model_option,
    given,
    principal_option,
    real,
    whole,
)

if TYPE_CHECKING:
    from prefect import Flow

    from mint_cli.options import Commands
    from mint_core.config import MintConfig

R = TypeVar("R")


def run_flow(flow: Flow[..., R], /, *args: Any, **kwargs: Any) -> R:
    """`flow(*args, **kwargs)` run in this process: its result, or a failed run's error raised
    as the call raises it. A run that ended Cancelled because this command was stopped (SIGTERM
    or Ctrl-C: `flows.ending`) ends the command as interrupted (KeyboardInterrupt)."""
    state = flow(*args, return_state=True, **kwargs)
    if state.is_cancelled():
        raise KeyboardInterrupt(state.message)
    return state.result()


def check_release(args: argparse.Namespace, config: MintConfig) -> None:
    """Every row of the data files, read and checked before anything starts or loads: a bad
    line is told in seconds. (The flow reads the files again: a UI run has only their names.)"""
    from mint_core.model.datasets import DEFAULT_EVAL_FRACTION, load_datasets

    def read(location: str) -> bytes:
        if not location.startswith("s3://"):
            return Path(location).read_bytes()  # a path argparse found to be a file
        from mint_core.artifacts.stores import read_data  # boto3 and torch: only for S3

        return read_data(config, location)

    load_datasets(
        read,
        args.data,
        args.eval_data,
        getattr(args, "eval_fraction", DEFAULT_EVAL_FRACTION),
        args.adapter,
    )


def cmd_release(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import release

    report = run_flow(
        release,
        args.adapter,
        args.data,
        eval_data=args.eval_data,
        actor=args.actor,
        principals=args.principal or None,
        base_model=args.base_model,
        **given(args),
    )
    metrics = report.eval_metrics
    print(
        f"released {report.revision} (exact match {metrics['eval_exact_match']:.0%} on "
        f"{report.eval_rows}, eval loss {metrics['eval_loss']:.4f})"
    )
    print(format_stage_times(report.stage_seconds))


def cmd_rl(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.rl import rl

    report = run_flow(rl, args.adapter, actor=args.actor, base_model=args.base_model, **given(args))
    figures = ", ".join(f"{name} {value:.3f}" for name, value in sorted(report.metrics.items()))
    print(f"shipped {', '.join(report.revisions)} on {args.adapter}@rl; last step: {figures}")
    print(f"MLflow run {report.run_id}")


def check_import(args: argparse.Namespace, config: MintConfig) -> None:
    """DoRA, `modules_to_save`, NaN weights: refused before anything starts or loads."""
    from mint_core.model.imports import check_adapter_files

    check_adapter_files(args.path)


def cmd_import(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import import_adapter

    report = run_flow(
        import_adapter,
        args.adapter,
        str(args.path),
        actor=args.actor,
        principals=args.principal or None,
        base_model=args.base_model,
        same_base_as=args.same_base_as,
    )
    print(f"imported {args.path} as {report.revision}")
    print(format_stage_times(report.stage_seconds))


def add_commands(commands: Commands) -> None:
    release = commands.add_parser(
        "release", help="train and release the next revision of an adapter"
    )
    adapter_option(release, "adapter name, e.g. support-bot")
    release.add_argument(
        "--data",
        type=DATA,
        required=True,
        help="training rows: a JSONL file (path or s3:// URI) of {prompt, completion} or "
        "{messages} rows",
    )
    release.add_argument(
        "--eval-data", type=DATA, default=None, help="held-out rows (default: --eval-fraction)"
    )
    # TrainingConfig's defaults, through the release flow's.
    hyper = FlowOptions(release, "training (defaults: the release flow's)")
    hyper.add(
        "--eval-fraction",
        type=real("eval fraction", 0, 1),
        help="share of --data held out when --eval-data is not given (chosen by each row's "
        "content: the same rows in every release of the adapter, whatever --seed)",
    )
    hyper.add("--rank", type=whole("rank"), help="LoRA rank")
    hyper.add("--alpha", type=whole("alpha"), help="LoRA alpha")
    hyper.add(
        "--target-modules",
        nargs="+",
        help="module names to adapt (default: the base family's attention and MLP projections)",
    )
    hyper.add(
        "--expert-targets",
        nargs="*",
        help="fused MoE expert parameters to adapt, e.g. mlp.experts.down_proj (default: an MoE "
        "family's gate_up_proj and down_proj; none given: no expert LoRA)",
    )
    hyper.add("--dropout", type=real("dropout", 0, 1, closed_low=True))
    hyper.add("--learning-rate", type=real("learning rate", 0))
    hyper.add("--epochs", type=real("epochs", 0))
    hyper.add("--steps", type=whole("steps"), help="optimizer steps (overrides --epochs)")
    hyper.add("--batch-size", type=whole("batch size"))
    hyper.add("--gradient-accumulation", type=whole("gradient accumulation"))
    hyper.add(
        "--max-length",
        type=whole("max length"),
        help="longest row in tokens (default: the base's context); longer rows are refused",
    )
    hyper.add("--seed", type=whole("seed", minimum=0))
    launch = FlowOptions(release, "processes (torchrun's; defaults: one, in the run's process)")
    launch.add(
        "--nproc-per-node",
        type=whole("nproc per node"),
        help="training processes on each host: data parallel over the LoRA (gloo on CPUs, "
        "NCCL on GPUs)",
    )
    launch.add(
        "--nnodes",
        type=whole("nnodes"),
        help="train hosts: this run's and NNODES - 1 more from the train pool",
    )
    launch.add(
        "--rdzv-endpoint",
        metavar="HOST[:PORT]",
        help="where the other hosts reach this one (default: MINT_TRAIN_ADDRESS, a free port)",
    )
    launch.add(
        "--shard-base",
        action="store_true",
        help="shard the frozen base over the processes (FSDP2), for a base larger than a device",
    )
    launch.add(
        "--dist-timeout-s",
        type=real("dist timeout", 0),
        help="torch.distributed's timeout: a lost process fails the training after this long",
    )
    actor_option(release)
    principal_option(release)
    base_model_option(release)
    release.set_defaults(
        run=cmd_release, check=check_release, needs=(REGISTRY, WORKERS), loads_models=True
    )

    rl = commands.add_parser(
        "rl", help="GRPO on a toy task, sampling from the worker serving ADAPTER@rl"
    )
    adapter_option(rl, "adapter name, e.g. rl-bot")
    grpo = FlowOptions(rl, "GRPO (defaults: the rl flow's)")
    grpo.add("--task", help="toy task: upper or reverse")
    for option in ("steps", "prompts", "group", "sync-every", "max-chars", "rank"):
        grpo.add(f"--{option}", type=whole(option.replace("-", " ")))
    grpo.add("--learning-rate", type=real("learning rate", 0))
    grpo.add("--reward", help="exact or chars (share of right characters)")
    grpo.add("--seed", type=whole("seed", minimum=0))
    grpo.add("--start", help="start from this revision: ADAPTER:rN or ADAPTER@alias")
    grpo.add(
        "--nproc-per-node",
        type=whole("nproc per node"),
        help="processes for the policy update, on this host only (the sampler loop is "
        "interactive); each takes a share of every step's prompts",
    )
    actor_option(rl)
    base_model_option(rl)
    rl.set_defaults(run=cmd_rl, needs=(REGISTRY, WORKERS), loads_models=True)

    imports = commands.add_parser(
        "import", help="release a PEFT LoRA adapter trained elsewhere, after checking it fits"
    )
    imports.add_argument("path", type=FOLDER, help="PEFT adapter folder (adapter_config.json, ...)")
    adapter_option(imports, "adapter name to release it under")
    actor_option(imports)
    principal_option(imports)
    base_model_option(imports)
    imports.add_argument(
        "--same-base-as",
        metavar="NAME",
        default="",
        help="the base the adapter records (NAME, as its base_model_name_or_path says) is a "
        "renamed copy of the base it is imported on: accept it (a different model family is "
        "refused all the same)",
    )
    imports.set_defaults(
        run=cmd_import, check=check_import, needs=(REGISTRY, WORKERS), loads_models=True
    )
