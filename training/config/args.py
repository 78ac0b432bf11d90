"""Command-line flags shared by the three jobs (same names everywhere, so runs are comparable)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from training.world.backend_choice import AUTO, BACKENDS, BackendRefused, choose_backend
from training.world.distributed import QUIET_RANK_DELAY_SECONDS, launcher_rank

T = TypeVar("T", int, float)

MODELS = ("resnet50", "resnet_tiny", "simple_cnn")
FRAMEWORKS = ("pytorch", "tensorflow", "keras")
DEFAULT_SYNTHETIC_STEPS = 100
MAX_BATCH_SIZE = 65536  # per worker
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 4096  # pixels, square


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, like every other error of the jobs, and which
    takes flags only as spelled in full: `--lr` must not quietly mean `--lr-decay-epochs`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        if launcher_rank() != 0:  # every rank parses the same flags: rank 0 alone says what is wrong
            time.sleep(QUIET_RANK_DELAY_SECONDS)
            self.exit(2)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: type[T], least: T, description: str, most: T | None = None) -> T:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}") from None
    if not value >= least or (most is not None and value > most):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be {description}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, "a positive integer")


def batch_size_arg(text: str) -> int:
    # Past this a batch no longer fits any accelerator's memory; a typo, not a plan.
    return _number(text, int, 1, f"a positive integer up to {MAX_BATCH_SIZE}", MAX_BATCH_SIZE)


def image_size_arg(text: str) -> int:
    return _number(text, int, MIN_IMAGE_SIZE, f"an integer from {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE}", MAX_IMAGE_SIZE)


def non_negative_int_arg(text: str) -> int:
    return _number(text, int, 0, "an integer, 0 or more")


def non_negative_float_arg(text: str) -> float:
    return _number(text, float, 0.0, "a number, 0 or more")


def seconds_arg(text: str) -> float:
    """A duration in seconds: at least one (a budget or a timeout of zero would do nothing)."""
    return _number(text, float, 1.0, "a number of seconds, at least 1")


def _epoch_list(text: str) -> tuple[float, ...]:
    if not text.strip():
        return ()
    try:
        epochs = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs, got {text!r}") from None
    if any(b <= a for a, b in pairwise(epochs)) or epochs[0] <= 0:
        raise argparse.ArgumentTypeError(f"epochs must be positive and increasing, got {text!r}")
    return epochs


def build_parser(framework: str) -> argparse.ArgumentParser:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}")
    parser = Parser(
        prog=f"python -m training.{framework}",
        description=f"Data-parallel ResNet training with Horovod ({framework}). "
        "Run one process per GPU under horovodrun"
        + (", or under torchrun with --backend ddp." if framework == "pytorch" else "."),
    )
    _add_data_flags(parser, framework)
    parser.add_argument_group("model").add_argument("--model", choices=MODELS, default="resnet50")
    _add_schedule_flags(parser)
    _add_speed_flags(parser, framework)
    if framework == "pytorch":
        parser.add_argument(
            "--backend",
            choices=BACKENDS,
            default=AUTO,
            help="horovod: under horovodrun; ddp: torch DistributedDataParallel under torchrun (nccl on GPU, "
            "gloo on CPU); auto: the launcher's, ddp under torchrun, else horovod (default: %(default)s)",
        )
        _add_sync_flags(parser)
    _add_checkpoint_flags(parser)
    _add_export_flags(parser)
    add_reporting(parser, "loss, LR, images/s, validation top-1", "images/s")
    return parser


def _add_data_flags(parser: argparse.ArgumentParser, framework: str) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--data", choices=("synthetic", "imagenet"), default="synthetic")
    data.add_argument(
        "--data-dir", type=Path, help="ImageNet layout: train/<class>/*.JPEG, optional val/<class>/*.JPEG"
    )
    data.add_argument("--image-size", type=image_size_arg, default=224)
    data.add_argument(
        "--num-classes",
        type=positive_int,
        help="default: 1000 for synthetic data, the number of train/ class folders for ImageNet",
    )
    data.add_argument(
        "--data-workers",
        type=non_negative_int_arg,
        help="decode workers per process (default: the node's CPUs per local process minus one, 1 to 8)",
    )
    if framework == "pytorch":
        data.add_argument(
            "--decode",
            choices=("cpu", "gpu", "auto"),
            default="cpu",
            help="where JPEGs are decoded: cpu (DataLoader workers), gpu (nvJPEG on the job's GPU; "
            "an error without one), auto (gpu where it works and a start-up probe finds, on every rank, "
            "the CPU loader slower than the model and the GPU path 1.1x faster than the CPU loader; else cpu)",
        )


def _add_schedule_flags(parser: argparse.ArgumentParser) -> None:
    schedule = parser.add_argument_group("schedule")
    schedule.add_argument("--batch-size", type=batch_size_arg, default=64, help="per worker")
    length = schedule.add_mutually_exclusive_group()
    length.add_argument(
        "--epochs",
        type=positive_int,
        default=1,
        help=f"passes over the training data (default: 1; synthetic data: {DEFAULT_SYNTHETIC_STEPS} steps each)",
    )
    length.add_argument(
        "--steps",
        type=positive_int,
        help="optimizer steps of the whole run, instead of --epochs: as many epochs as that takes, "
        "the last one partial (e.g. --steps 20 on data of 4 steps per epoch: 5 epochs)",
    )
    schedule.add_argument(
        "--base-lr",
        type=non_negative_float_arg,
        default=0.025,
        help="LR for one worker's batch; the job uses base-lr x world size after warmup",
    )
    schedule.add_argument("--warmup-epochs", type=non_negative_float_arg, default=5.0)
    schedule.add_argument(
        "--lr-decay-epochs",
        type=_epoch_list,
        default=(30.0, 60.0, 80.0),
        help="comma-separated epochs at which the LR is multiplied by 0.1",
    )
    schedule.add_argument("--momentum", type=non_negative_float_arg, default=0.9)
    schedule.add_argument("--weight-decay", type=non_negative_float_arg, default=1e-4)


def _add_speed_flags(parser: argparse.ArgumentParser, framework: str) -> None:
    speed = parser.add_argument_group("speed")
    speed.add_argument(
        "--precision",
        choices=("fp32", "amp"),
        default="fp32",
        help="amp: bfloat16 autocast on CPUs and GPUs with bf16 (Ampere, Hopper), "
        "float16 with loss scaling on older GPUs",
    )
    speed.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    if framework == "pytorch":
        speed.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            help="torch.compile the model (default: on with CUDA, off on CPU; compilation runs before "
            "the first step: docs/performance.md)",
        )
        add_profile_flag(speed)


def _add_sync_flags(parser: argparse.ArgumentParser) -> None:
    from training.torch import sync

    group = parser.add_argument_group(
        "synchronisation (PyTorch, --backend ddp; see docs/training.md, 'Local SGD')",
        "example: torchrun --nnodes 2 --nproc-per-node 2 ... -m training.pytorch --backend ddp "
        "--sync hierarchical --sync-every 8 --sync-warmup-steps 100",
    )
    group.add_argument(
        "--sync",
        choices=sync.SYNC_MODES,
        default=sync.EVERY_STEP,
        help="every-step: allreduce gradients every step (default); local-sgd: local steps, weights averaged "
        "over every rank every H steps; hierarchical: weights averaged inside each node every step and over "
        "every rank every H steps",
    )
    group.add_argument(
        "--sync-every",
        type=positive_int,
        metavar="H",
        help=f"steps between two averages over every rank (default {sync.DEFAULT_SYNC_EVERY}; 1 equals every-step)",
    )
    group.add_argument(
        "--sync-warmup-steps",
        type=non_negative_int_arg,
        metavar="N",
        help="fully synchronous steps before the local ones (default 0)",
    )
    group.add_argument(
        "--outer-optimizer",
        choices=sync.OUTER_OPTIMIZERS,
        default=sync.AVERAGE,
        help="average: the replicas' weights become their mean (default); nesterov: DiLoCo's outer step, "
        "Nesterov SGD on the averaged change since the last average",
    )
    for flag, what, default in (
        ("--outer-lr", "outer learning rate", sync.DEFAULT_OUTER_LR),
        ("--outer-momentum", "outer Nesterov momentum", sync.DEFAULT_OUTER_MOMENTUM),
    ):
        group.add_argument(flag, type=non_negative_float_arg, help=f"{what}, with nesterov (default {default})")


def _add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group("checkpoints (resume is automatic)")
    ckpt.add_argument("--checkpoint-dir", type=Path)
    ckpt.add_argument(
        "--checkpoint-every",
        type=positive_int,
        help="steps between checkpoints (default: every epoch); the last step is always saved",
    )
    ckpt.add_argument("--keep-checkpoints", type=positive_int, default=3)
    ckpt.add_argument(
        "--ignore-bad-checkpoints",
        action="store_true",
        help="when every checkpoint is damaged, rename them to *.corrupt and start from step 0 (default: refuse)",
    )


def _add_export_flags(parser: argparse.ArgumentParser) -> None:
    export = parser.add_argument_group("export (see python -m training.predict)")
    export.add_argument(
        "--export-dir",
        type=Path,
        help="rank 0 writes the trained model here at the end, with model.json (default: no export)",
    )
    export.add_argument(
        "--export-every-epoch", action="store_true", help="also export at the end of every epoch (needs --export-dir)"
    )


def add_profile_flag(group: argparse._ArgumentGroup) -> None:
    """``--profile-dir`` of the PyTorch jobs (training.torch.profiling)."""
    group.add_argument(
        "--profile-dir",
        type=Path,
        help="torch.profiler over 5 steps after the timing warmup: a Chrome trace per rank here, the top "
        "operators in rank 0's log (those steps' rates are not figures; default: off)",
    )


DEFAULT_LOG_EVERY = 10
LOG_POINTS = 20  # the fewest log points (loss curve points) a run gets when --log-every is not given


def log_interval(requested: int | None, total_steps: int) -> int:
    """Steps between logs: --log-every, else DEFAULT_LOG_EVERY, or fewer where the run is too short for
    LOG_POINTS points (a curve of two points says nothing)."""
    if requested is not None:
        return requested
    return max(1, min(DEFAULT_LOG_EVERY, total_steps // LOG_POINTS))


def add_reporting(parser: argparse.ArgumentParser, scalars: str, rate: str) -> None:
    """The reporting flags of every job: ``scalars`` is what ``--tensorboard-dir`` records, ``rate``
    the throughput's unit (images/s, tokens/s)."""
    report = parser.add_argument_group("reporting")
    report.add_argument("--metrics-json", type=Path, help="rank 0 writes the run's metrics here")
    report.add_argument("--tensorboard-dir", type=Path, help=f"rank 0 writes TensorBoard event files here: {scalars}")
    report.add_argument(
        "--summary-png", type=Path, help=f"rank 0 plots loss and {rate} over the steps into this PNG at the end"
    )
    report.add_argument(
        "--slow-ranks-json",
        type=Path,
        help="rank 0 keeps here, while the job runs, the ranks whose compute per step is persistently slower than "
        "the others' (training/run/slow_ranks.py); `dtrain launch` puts it in the run directory",
    )
    report.add_argument("--seed", type=non_negative_int_arg, default=42)
    report.add_argument(
        "--log-every",
        type=positive_int,
        help=f"steps between rank-0 logs (default: {DEFAULT_LOG_EVERY}, fewer in a short run, so that its loss curve "
        f"has at least {LOG_POINTS} points: every step of a 20-step run)",
    )
    report.add_argument(
        "--timing-warmup-steps",
        type=non_negative_int_arg,
        default=10,
        help=f"first steps of a run left out of {rate} (compilation, autotuning, allocator warmup)",
    )
    report.add_argument("--debug", action="store_true", help="print the traceback of every error")


def parse_args(
    framework: str, argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ
) -> argparse.Namespace:
    """The checked flags; ``--backend auto`` becomes the launcher's backend (``env``: its variables)."""
    parser = build_parser(framework)
    args = parser.parse_args(argv)
    try:
        backend = choose_backend(framework, getattr(args, "backend", None), env)
    except BackendRefused as exc:
        parser.error(str(exc))
    if framework == "pytorch":
        args.backend = backend
    if args.data == "imagenet" and args.data_dir is None:
        parser.error("--data imagenet needs --data-dir")
    if args.data == "synthetic" and args.data_dir is not None:
        parser.error("--data-dir is only used with --data imagenet")
    if args.data == "synthetic" and getattr(args, "decode", None) == "gpu":
        parser.error("--decode gpu is only used with --data imagenet (synthetic batches are made on the device)")
    if args.keep_checkpoints < 2 and args.checkpoint_dir is not None:
        # With one file there is nothing to fall back to when the newest is corrupt.
        parser.error("--keep-checkpoints must be at least 2")
    if args.export_every_epoch and args.export_dir is None:
        parser.error("--export-every-epoch needs --export-dir")
    from training.torch.sync import sync_refusal

    if problem := sync_refusal(args):
        parser.error(problem)
    return args
