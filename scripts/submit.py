"""Submit a run to Slurm: check the request, write the run directory on the shared file system, sbatch.

One SSH round trip to the login node does the cluster side: make `<shared>/runs/<run-id>/` (mode 0700,
owned by the submitting user; an existing one is refused), unpack the run's files into it (job.sh,
job.json, the remote tools, locally the results SAS), check the dataset is on the share, and sbatch.
"""

from __future__ import annotations

import getpass
import io
import json
import posixpath
import re
import secrets
import subprocess
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from infra.contract import FRAMEWORKS, RUNS_DIR
from scripts import cost
from scripts.batch import REMOTE_TOOLS, JobSpec, Launcher, LocalCopy, ResultsTarget, render_job_script
from scripts.cluster import REPO_ROOT, ClusterDescription
from scripts.errors import ExitCode, OperatorError
from scripts.preflight import dataset_under_data_path, plan_preflight
from scripts.preflight import flag_value as _flag_value
from scripts.slurm import Slurm, parse_job_id
from scripts.sshutil import SSH, q

# A run id names a directory on the share, a Slurm job and a blob prefix: one plain path component.
RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")
REMOTE_DIR = REPO_ROOT / "scripts" / "remote"
SAS_FILE = "results.sas"
MODEL_PARALLEL_JOB = "training.model_parallel"
# The training jobs' output flags that `launch` points into the run directory (flag name -> path in it).
RUN_OUTPUTS = {"export-dir": "model", "tensorboard-dir": "tensorboard", "summary-png": "summary.png"}
_RUN_EXISTS = 17  # the remote step's own exit status (scripts/preflight.py has those of its checks)


@dataclass
class LaunchOptions:
    framework: str
    job_args: list[str] = field(default_factory=list)
    nodes: int | None = None  # default: every node of the cluster
    processes_per_node: int | None = None  # default: GPUs per node (1 on CPU nodes)
    launcher: Launcher | None = None  # default: torchrun for `--backend ddp` and model parallelism, else horovodrun
    model_parallel: bool = False  # PyTorch FSDP / pipeline / tensor parallel: training.model_parallel under torchrun
    entrypoint: str | None = None  # default: python -m training.<framework>; a .py path or a module
    image: str | None = None  # docker runtime: instead of the framework's image
    run_id: str | None = None
    requeue: bool = False
    time_limit_minutes: int | None = None
    local_copy: bool = False  # copy --data-dir to every node's local_data_path first, and train from there


@dataclass(frozen=True)
class Submission:
    run_id: str
    job_id: str
    run_dir: str
    spec: JobSpec


def new_run_id(framework: str) -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{framework}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise OperatorError(
            f"invalid run id {run_id!r}: use up to 100 letters, digits, '-', '_' and '.' (no '/', not '.' or '..')"
        )
    return run_id


def runs_dir(desc: ClusterDescription) -> str:
    return posixpath.join(desc.shared_mount_path, RUNS_DIR)


def choose_launcher(opts: LaunchOptions) -> Launcher:
    if opts.launcher:
        return opts.launcher
    backend = _flag_value(opts.job_args, "--backend")
    return "torchrun" if opts.model_parallel or (opts.framework == "pytorch" and backend == "ddp") else "horovodrun"


def check_model_parallel(opts: LaunchOptions) -> None:
    """--model-parallel runs the PyTorch model-parallel job, which torch.distributed's launcher starts."""
    if not opts.model_parallel:
        return
    if opts.framework != "pytorch":
        raise OperatorError(f"--model-parallel is PyTorch's (FSDP, pipeline, tensor parallel), not {opts.framework}")
    if opts.launcher == "horovodrun":
        raise OperatorError("--model-parallel runs under torchrun: leave out --launcher horovodrun")
    if opts.entrypoint:
        raise OperatorError(f"--model-parallel runs {MODEL_PARALLEL_JOB}: leave out --entrypoint")


def build_spec(desc: ClusterDescription, opts: LaunchOptions, slurm: Slurm) -> JobSpec:
    """Everything about the run that can be wrong is found here, before any connection."""
    if opts.framework not in FRAMEWORKS:
        raise OperatorError(f"--framework must be one of {', '.join(FRAMEWORKS)}")
    check_model_parallel(opts)
    nodes = opts.nodes or desc.node_count
    if nodes > desc.node_count:
        raise OperatorError(f"--nodes {nodes}: the cluster has {desc.node_count} nodes")
    slots = opts.processes_per_node or desc.gpus_per_node or 1
    if desc.gpus_per_node and slots > desc.gpus_per_node:
        raise OperatorError(f"--gpus-per-node {slots} is more than the {desc.gpus_per_node} GPUs of a node")
    launcher = choose_launcher(opts)
    if launcher == "torchrun" and opts.framework != "pytorch":
        raise OperatorError(f"--launcher torchrun runs PyTorch jobs only, not {opts.framework}")
    image = None
    if desc.runtime.kind == "docker":
        image = opts.image or desc.image_for(opts.framework)
        if not image:
            raise OperatorError(f"no image for {opts.framework} in the cluster description: pass --image")
    local_copy = plan_local_copy(desc, opts)
    run_id = check_run_id(opts.run_id) if opts.run_id else new_run_id(opts.framework)
    run_dir = posixpath.join(runs_dir(desc), run_id)
    return JobSpec(
        run_id=run_id,
        run_dir=run_dir,
        launcher=launcher,
        nodes=nodes,
        processes_per_node=slots,
        gpus_per_node=slots if desc.gpus_per_node else 0,
        partition=slurm.access.partition,
        command=training_command(desc, opts, run_dir, local_copy),
        workdir=desc.runtime.workdir,
        python=desc.runtime.python,
        remote_python=desc.remote_python,
        results=_results_target(desc),
        image=image,
        shared_mount=desc.shared_mount_path,
        network_interface=desc.runtime.network_interface,
        infiniband=desc.expect_infiniband,
        requeue=opts.requeue,
        time_limit_minutes=opts.time_limit_minutes,
        git_revision=git_revision(),
        env=dict(desc.nccl_env),
        local_copy=local_copy,
    )


def plan_local_copy(desc: ClusterDescription, opts: LaunchOptions) -> LocalCopy | None:
    """--local-copy: the dataset on the share (--data-dir, under data_path) and where each node keeps its copy."""
    if not opts.local_copy:
        return None
    if desc.local_data_path is None:
        raise OperatorError(f"--local-copy: cluster {desc.name} has no node-local data path (local_data_path)")
    source = _flag_value(opts.job_args, "--data-dir")
    if not source:
        raise OperatorError("--local-copy copies the job's --data-dir: pass -- --data-dir DIR (under data_path)")
    relative = dataset_under_data_path(desc, source, "--local-copy: --data-dir")
    return LocalCopy(source=posixpath.normpath(source), dest=posixpath.join(desc.local_data_path, relative))


def git_revision() -> str | None:
    """The commit of the checkout that submits (with '-dirty' when it has uncommitted changes), or None
    outside a git checkout: recorded in the model export, so a model can be traced to its code."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD"], capture_output=True)
    except OSError:  # no git
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")


def node_hour_price(desc: ClusterDescription) -> tuple[float | None, str]:
    """What a node-hour of this cluster costs (USD), and where that figure comes from."""
    if desc.provider == "local":
        return 0.0, "local cluster: no charge"
    if desc.gpu_sku is None or desc.region is None:
        return None, "the cluster description names no GPU size or region (write it again with `cluster from-stack`)"
    price = cost.node_hour_price(desc.gpu_sku, desc.region)
    if price is None:
        return None, f"no price for {desc.gpu_sku} in {desc.region} in the price table (`python -m scripts cost`)"
    return float(price.usd_per_hour), f"{price.source}, price table of {price.as_of}"


def training_command(
    desc: ClusterDescription, opts: LaunchOptions, run_dir: str, local_copy: LocalCopy | None
) -> list[str]:
    python = desc.runtime.python
    entry = opts.entrypoint or (MODEL_PARALLEL_JOB if opts.model_parallel else f"training.{opts.framework}")
    command = [python, entry] if entry.endswith(".py") else [python, "-m", entry]
    args = list(opts.job_args)
    if local_copy:  # the ranks read each node's own copy, not the share
        args = _with_flag_value(args, "--data-dir", local_copy.dest)
    defaults = {"--metrics-json": f"{run_dir}/metrics.json"}
    if opts.entrypoint is None:
        # what a run leaves in its directory, and so in the results container: the deployable model and curves
        defaults |= {f"--{name}": f"{run_dir}/{path}" for name, path in RUN_OUTPUTS.items()}
        # a requeued job starts again from the top: its checkpoints are what makes it resume
        if opts.requeue:
            defaults["--checkpoint-dir"] = f"{run_dir}/checkpoints"
    for flag, value in defaults.items():
        if _flag_value(args, flag) is None:
            args += [flag, value]
    return command + args


def _results_target(desc: ClusterDescription) -> ResultsTarget:
    cred = desc.results_upload
    if cred.kind == "sas":
        return ResultsTarget(desc.results.endpoint, desc.results.container, sas_file=SAS_FILE)
    if cred.kind == "managed_identity":
        return ResultsTarget(desc.results.endpoint, desc.results.container, client_id=cred.client_id)
    raise OperatorError(f"results_upload: jobs cannot upload with a {cred.kind} credential (use sas or an identity)")


def submit(desc: ClusterDescription, opts: LaunchOptions, ssh: SSH) -> Submission:
    slurm = Slurm(desc, ssh)
    spec = build_spec(desc, opts, slurm)
    checks = plan_preflight(desc, opts.job_args, entrypoint=opts.entrypoint, model_parallel=opts.model_parallel)
    files = _run_files(desc, opts, spec)
    remote = (
        f"umask 077; {checks.script}mkdir -p -m 0755 {q(runs_dir(desc))} || exit 1; "
        f"mkdir {q(spec.run_dir)} 2>/dev/null || exit {_RUN_EXISTS}; "
        f"tar -xf - -C {q(spec.run_dir)} || exit 1; "
        f"id=$(sbatch --parsable {q(spec.run_dir + '/job.sh')}) || {{ rc=$?; rm -rf {q(spec.run_dir)}; exit $rc; }}; "
        f'echo "$id" >{q(spec.run_dir + "/job_id")}; echo "$id"'
    )
    out = slurm.run_unchecked(remote, input=_tar(files), timeout=120)
    if out.returncode == _RUN_EXISTS:
        raise OperatorError(f"run id {spec.run_id} is already used ({spec.run_dir} exists): pass another --run-id")
    refusal = checks.refusal(out.returncode)
    if refusal is not None:
        raise refusal
    if out.returncode != 0:
        raise OperatorError(f"sbatch refused the job: {out.stderr.strip()[-600:]}", ExitCode.FAILED)
    return Submission(spec.run_id, parse_job_id(out.stdout), spec.run_dir, spec)


def _run_files(desc: ClusterDescription, opts: LaunchOptions, spec: JobSpec) -> dict[str, tuple[bytes, int]]:
    price, price_source = node_hour_price(desc)
    record = {
        "run_id": spec.run_id,
        "framework": opts.framework,
        "cluster": desc.name,
        "gpu_sku": desc.gpu_sku,
        "region": desc.region,
        "price_per_node_hour_usd": price,  # record_run.py prices the run's node-hours with it
        "price_source": price_source,
        "submitted_by": getpass.getuser(),
        "submitted_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "job_args": opts.job_args,
        "results_url": f"{desc.results.url}/{spec.run_id}/",
        **{k: v for k, v in asdict(spec).items() if k not in ("results", "env")},
    }
    files = {
        "job.sh": (render_job_script(spec).encode(), 0o700),
        "job.json": (json.dumps(record, indent=2).encode() + b"\n", 0o600),
    }
    for tool in REMOTE_TOOLS:
        files[f"remote/{tool}"] = ((REMOTE_DIR / tool).read_bytes(), 0o700)
    cred = desc.results_upload
    if cred.kind == "sas" and cred.secret is not None:
        files[SAS_FILE] = (cred.secret.get_secret_value().encode(), 0o600)
    return files


def _tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _with_flag_value(args: Sequence[str], flag: str, value: str) -> list[str]:
    """args with every value of flag (`--flag V` or `--flag=V`) replaced by value."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
        elif arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
    return out
