"""The jobs' command-line flags: one parser per framework, the same names everywhere, so runs are comparable.

PyTorch has one parser for every layout: the data-parallel flags of all three jobs, plus the layout
(``--tp``, ``--pp``, ``--dp-shard`` ...), ``--optimizer`` and the transformers' data. A default that depends
on the model (the batch size, the optimizer) or on the optimizer (its LR, weight decay and schedule) is
filled in by :func:`parse_args`, so that the settings hold the values the run uses.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from training.config import sync
from training.config.activation_checkpointing import AC_MODES
from training.config.activation_checkpointing import AUTO as AC_AUTO
from training.config.models import GPT_CONFIGS, IMAGE_MODELS
from training.config.pipeline_schedules import SCHEDULES, stages_per_rank
from training.world.backend_choice import AUTO, BACKENDS, BackendRefused, choose_backend
from training.world.distributed import QUIET_RANK_DELAY_SECONDS, launcher_rank

T = TypeVar("T", int, float)

FRAMEWORKS = ("pytorch", "tensorflow", "keras")
TORCH_MODELS = (*IMAGE_MODELS, *GPT_CONFIGS)
DEFAULT_SYNTHETIC_STEPS = 100
MAX_BATCH_SIZE = 65536  # per data-parallel replica
DEFAULT_BATCH_SIZE = {False: 64, True: 8}  # per replica, by whether the model is a transformer
MAX_DEFAULT_SEQ_LEN = 2048
SGD, ADAMW = "sgd", "adamw"
# The optimizers' defaults: (lr, weight decay, warmup epochs, LR decay epochs). SGD's are Goyal et al.'s
# ResNet-50 recipe (0.1 per 256 images); AdamW's GPT-3's and Llama's, at a constant LR.
OPTIMIZER_DEFAULTS: dict[str, tuple[float, float, float, tuple[float, ...]]] = {
    SGD: (0.025, 1e-4, 5.0, (30.0, 60.0, 80.0)),
    ADAMW: (3e-4, 0.1, 0.0, ()),
}
DEFAULT_MOMENTUM = 0.9
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


def build_parser(framework: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``framework``'s jobs; ``prog``: the command the errors and ``--help`` name (default
    ``python -m training.<framework>``)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}")
    parser = Parser(
        prog=prog or f"python -m training.{framework}",
        description=(
            "PyTorch training: ResNets and transformers, data parallel under horovodrun or torchrun (--backend), "
            "or on a DeviceMesh layout (--tp, --pp, --dp-shard) under torchrun -m training.model_parallel, with "
            "these same flags."
            if framework == "pytorch"
            else f"Data-parallel ResNet training with Horovod ({framework}). Run one process per GPU under horovodrun."
        ),
    )
    _add_data_flags(parser, framework)
    parser.add_argument_group("model").add_argument(
        "--model",
        choices=TORCH_MODELS if framework == "pytorch" else IMAGE_MODELS,
        default="resnet50",
        help="image classifiers (synthetic images or ImageNet)"
        + (
            "; transformers (gpt-*, llama-*: synthetic tokens or text; shapes only, no weights)"
            if framework == "pytorch"
            else ""
        ),
    )
    if framework == "pytorch":
        _add_layout_flags(parser)
    _add_schedule_flags(parser, framework)
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
    rate = "images/s or tokens/s" if framework == "pytorch" else "images/s"
    memory = ", memory per rank (mesh layouts)" if framework == "pytorch" else ""
    _add_reporting(parser, f"loss, LR, {rate}, validation top-1{memory}", rate)
    return parser


def _add_data_flags(parser: argparse.ArgumentParser, framework: str) -> None:
    data = parser.add_argument_group("data")
    torch_job = framework == "pytorch"
    data.add_argument(
        "--data",
        choices=("synthetic", "imagenet", "text") if torch_job else ("synthetic", "imagenet"),
        default="synthetic",
        help="synthetic: random images (image models) or arithmetic token sequences (transformers); imagenet: "
        "--data-dir's JPEGs (image models); text: every file under --data-dir as byte-level tokens (transformers)"
        if torch_job
        else "synthetic: random images; imagenet: --data-dir's JPEGs",
    )
    data.add_argument(
        "--data-dir",
        type=Path,
        help="ImageNet layout: train/<class>/*.JPEG, optional val/<class>/*.JPEG"
        + ("; --data text: any files" if torch_job else ""),
    )
    data.add_argument("--image-size", type=image_size_arg, default=224, help="image models")
    data.add_argument(
        "--num-classes",
        type=positive_int,
        help="image models; default: 1000 for synthetic data, the number of train/ class folders for ImageNet",
    )
    if torch_job:
        data.add_argument(
            "--seq-len",
            type=positive_int,
            help=f"transformers: tokens per sequence (default: the model's context, at most {MAX_DEFAULT_SEQ_LEN})",
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


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group(
        "layout (PyTorch; docs/parallelism.md)",
        "none of them: data parallelism by replication, one model per process (DDP or Horovod); any of "
        "--tp, --pp, --dp-shard: one DeviceMesh, under torchrun -m training.model_parallel",
    )
    layout.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (transformers)")
    layout.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    layout.add_argument(
        "--dp-shard",
        type=_degree,
        help="FSDP degree, -1: every rank left after --tp and --pp; the rest replicate (default: not sharded; "
        "training.model_parallel takes -1)",
    )
    layout.add_argument("--pp-schedule", choices=SCHEDULES, help="with --pp: gpipe, 1f1b (default), interleaved-1f1b")
    layout.add_argument(
        "--microbatches",
        type=positive_int,
        help="with --pp: microbatches per pipeline step (default: --pp, 2 x --pp for interleaved-1f1b)",
    )
    layout.add_argument(
        "--activation-checkpointing",
        choices=(AC_AUTO, *AC_MODES),
        default=AC_AUTO,
        help="mesh layouts: auto: none, unless the memory estimate says the model would not fit the GPU "
        "(then selective, or full); selective recomputes element-wise work, full whole blocks",
    )


def _degree(text: str) -> int:
    if text.strip() == "-1":
        return -1
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or -1 (every rank left), got {text!r}") from None


def _add_schedule_flags(parser: argparse.ArgumentParser, framework: str) -> None:
    torch_job = framework == "pytorch"
    schedule = parser.add_argument_group("schedule and optimizer")
    replica = "one process, or on a mesh a tensor-parallel group or a whole pipeline" if torch_job else "one process"
    by_model = "64 for the image models, 8 for the transformers" if torch_job else DEFAULT_BATCH_SIZE[False]
    schedule.add_argument(
        "--batch-size",
        type=batch_size_arg,
        help=f"per data-parallel replica ({replica}); the global batch is N x replicas (default: {by_model})",
    )
    length = schedule.add_mutually_exclusive_group()
    length.add_argument(
        "--epochs",
        type=positive_int,
        default=1,
        help=f"passes over the training data (default: 1; synthetic data, text: {DEFAULT_SYNTHETIC_STEPS} steps each)",
    )
    length.add_argument(
        "--steps",
        type=positive_int,
        help="optimizer steps of the whole run, instead of --epochs: as many epochs as that takes, "
        "the last one partial (e.g. --steps 20 on data of 4 steps per epoch: 5 epochs)",
    )
    if torch_job:
        schedule.add_argument(
            "--optimizer",
            choices=tuple(OPTIMIZER_DEFAULTS),
            help="sgd (momentum, weight decay as L2) or adamw (betas 0.9/0.95); default: sgd for the image "
            "models, adamw for the transformers",
        )

    def default(index: int) -> str:
        """The optimizers' default of ``OPTIMIZER_DEFAULTS[...][index]``, as --help says it."""
        shown = {name: _shown(values[index]) for name, values in OPTIMIZER_DEFAULTS.items()}
        return f"sgd {shown[SGD]}, adamw {shown[ADAMW]}" if torch_job else shown[SGD]

    scaling = (
        "sgd scales it by the replicas over the warmup (the linear scaling rule), adamw takes it as given"
        if torch_job
        else "the job scales it by the world size over the warmup"
    )
    schedule.add_argument(
        "--lr",
        type=non_negative_float_arg,
        help=f"LR for one data-parallel replica's batch; {scaling} (default: {default(0)})",
    )
    schedule.add_argument(
        "--warmup-epochs",
        type=non_negative_float_arg,
        help=f"epochs of linear warmup to the scaled LR (default: {default(2)})",
    )
    schedule.add_argument(
        "--lr-decay-epochs",
        type=_epoch_list,
        help=f"comma-separated epochs at which the LR is multiplied by 0.1 (default: {default(3)})",
    )
    schedule.add_argument(
        "--momentum", type=non_negative_float_arg, help=f"SGD's momentum (default {DEFAULT_MOMENTUM})"
    )
    schedule.add_argument("--weight-decay", type=non_negative_float_arg, help=f"default: {default(1)}")


def _shown(value: float | tuple[float, ...]) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{item:g}" for item in value) or "none (a constant LR)"
    return f"{value:g}"


def _add_speed_flags(parser: argparse.ArgumentParser, framework: str) -> None:
    speed = parser.add_argument_group("speed")
    speed.add_argument(
        "--precision",
        choices=("fp32", "amp", "bf16") if framework == "pytorch" else ("fp32", "amp"),
        default="fp32",
        help="amp: bfloat16 autocast on CPUs and GPUs with bf16 (Ampere, Hopper), "
        "float16 with loss scaling on older GPUs (data parallelism)"
        + (
            "; bf16: bfloat16 compute over fp32 weights and optimizer: autocast in data parallelism, FSDP's "
            "mixed precision on a mesh (gradients reduced in fp32)"
            if framework == "pytorch"
            else ""
        ),
    )
    speed.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    if framework == "pytorch":
        speed.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            help="torch.compile the model (data parallelism: the DDP wrapper with it; a mesh: each block and the "
            "loss) (default: on with CUDA, off on CPU; compilation runs before the first step: docs/performance.md)",
        )
        _add_profile_flag(speed)


def _add_sync_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_profile_flag(group: argparse._ArgumentGroup) -> None:
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


def _add_reporting(parser: argparse.ArgumentParser, scalars: str, rate: str) -> None:
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
    framework: str, argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ, prog: str | None = None
) -> argparse.Namespace:
    """The checked flags, with the defaults that depend on the model or the optimizer filled in;
    ``--backend auto`` becomes the launcher's backend (``env``: its variables)."""
    parser = build_parser(framework, prog)
    args = parser.parse_args(argv)
    try:
        backend = choose_backend(framework, getattr(args, "backend", None), env)
    except BackendRefused as exc:
        parser.error(str(exc))
    if framework == "pytorch":
        args.backend = backend
    if problem := _data_refusal(args) or _optimizer_refusal(args) or _layout_refusal(args):
        parser.error(problem)
    if args.keep_checkpoints < 2 and args.checkpoint_dir is not None:
        # With one file there is nothing to fall back to when the newest is corrupt.
        parser.error("--keep-checkpoints must be at least 2")
    if args.export_every_epoch and args.export_dir is None:
        parser.error("--export-every-epoch needs --export-dir")
    if problem := sync.sync_refusal(args):
        parser.error(problem)
    _fill_defaults(args)
    return args


def _data_refusal(args: argparse.Namespace) -> str | None:
    cfg = GPT_CONFIGS.get(args.model)
    if args.data in ("imagenet", "text") and args.data_dir is None:
        return f"--data {args.data} needs --data-dir"
    if args.data == "synthetic" and args.data_dir is not None:
        return f"--data-dir is only used with --data {'imagenet' if cfg is None else 'text'}"
    if args.data == "synthetic" and getattr(args, "decode", None) == "gpu":
        return "--decode gpu is only used with --data imagenet (synthetic batches are made on the device)"
    if cfg is None and args.data == "text":
        return f"{args.model} trains on synthetic images or ImageNet: --data text is for the transformers"
    if cfg is not None and args.data == "imagenet":
        return f"{args.model} is a transformer: --data imagenet is for the image models"
    seq_len = getattr(args, "seq_len", None)
    if cfg is None and seq_len is not None:
        return f"--seq-len is for the transformers, not {args.model}"
    if cfg is not None and seq_len is not None and seq_len > cfg.max_seq_len:
        return f"--seq-len {seq_len} is longer than {args.model}'s context of {cfg.max_seq_len}"
    return None


def _optimizer_refusal(args: argparse.Namespace) -> str | None:
    if _optimizer(args) == ADAMW and args.momentum is not None:
        return "--momentum is SGD's: --optimizer adamw has betas 0.9/0.95"
    return None


def _layout_refusal(args: argparse.Namespace) -> str | None:
    if not hasattr(args, "pp"):  # a job without the layout flags (TensorFlow, Keras)
        return None
    pipeline_only = {"--pp-schedule": args.pp_schedule, "--microbatches": args.microbatches}
    given = [flag for flag, value in pipeline_only.items() if value is not None]
    if args.pp == 1 and given:
        return f"{', '.join(given)}: only used with --pp 2 or more"
    return None


def _optimizer(args: argparse.Namespace) -> str:
    """``--optimizer``, or its default for the model (TensorFlow and Keras: SGD)."""
    chosen = getattr(args, "optimizer", None)
    return chosen or (ADAMW if args.model in GPT_CONFIGS else SGD)


def _fill_defaults(args: argparse.Namespace) -> None:
    """The defaults that depend on the model or the optimizer, in place: the settings hold what the run uses."""
    cfg = GPT_CONFIGS.get(args.model)
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_SIZE[cfg is not None]
    args.optimizer = _optimizer(args)
    lr, weight_decay, warmup_epochs, decay_epochs = OPTIMIZER_DEFAULTS[args.optimizer]
    args.lr = lr if args.lr is None else args.lr
    args.weight_decay = weight_decay if args.weight_decay is None else args.weight_decay
    args.warmup_epochs = warmup_epochs if args.warmup_epochs is None else args.warmup_epochs
    args.lr_decay_epochs = decay_epochs if args.lr_decay_epochs is None else args.lr_decay_epochs
    if args.optimizer == SGD and args.momentum is None:
        args.momentum = DEFAULT_MOMENTUM
    if cfg is not None and args.seq_len is None:
        args.seq_len = min(cfg.max_seq_len, MAX_DEFAULT_SEQ_LEN)
    if hasattr(args, "pp") and args.pp > 1:
        args.pp_schedule = args.pp_schedule or "1f1b"
        if args.microbatches is None:
            args.microbatches = args.pp * stages_per_rank(args.pp_schedule)
