"""Submit a run to Slurm: check the request (dtrain/jobs/launch_request.py), turn it into the batch script's
JobSpec, write the run directory on the shared file system, sbatch. Runs on the operator's machine.

One SSH round trip to the login node does the cluster side: make `<shared>/runs/<run-id>/` (mode 0700,
owned by the submitting user; an existing one is refused), unpack the run's files into it (job.sh,
job.json, the remote tools, locally the results SAS), check the dataset is on the share, and sbatch.
"""

from __future__ import annotations

import getpass
import io
import json
import posixpath
import subprocess
import tarfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from dtrain import pricing
from dtrain.cluster.description import REPO_ROOT, ClusterDescription, SlurmAccess
from dtrain.cluster.slurm import Slurm, parse_job_id, require_slurm
from dtrain.cluster.ssh import SSH, q
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.allocation import Allocation, plan_allocation
from dtrain.jobs.batch_script import REMOTE_BOOT_TOOLS, REMOTE_TOOLS, render_job_script
from dtrain.jobs.cluster_fit import fit_to_cluster
from dtrain.jobs.job_spec import JobSpec, Launcher, LocalCopy, ResultsTarget
from dtrain.jobs.kept_checkpoints import require_kept_checkpoint
from dtrain.jobs.launch_request import LaunchRequest, flag_value, with_flag_value
from dtrain.jobs.node_gate import GATE_FRAMEWORK, gate_thresholds
from dtrain.jobs.preflight import ProcessRequest, dataset_under_data_path, plan_preflight
from dtrain.jobs.run_ids import check_run_id, new_run_id, runs_dir
from dtrain.jobs.slow_ranks import SLOW_RANKS_FILE
from dtrain.jobs.task_file import check_environment_size, check_task_request, read_secrets
from dtrain.jobs.task_steps import SECRETS_SUBDIR, SETUP_FILE, setup_cache_dir
from dtrain.jobs.time_warning import warning_lead
from dtrain.jobs.tracking import plan_tracking
from dtrain.jobs.workdir import CODE_SUBDIR, Workdir, check_workdir, send_workdir
from dtrain.remote.job.job_secrets import render_secrets
from infra.contract import FRAMEWORKS
from training.world.backend_choice import AUTO, DDP, HOROVOD

REMOTE_DIR = REPO_ROOT / "dtrain" / "remote"
SAS_FILE = "results.sas"
MODEL_PARALLEL_JOB = "training.model_parallel"
# The training jobs' output flags that `launch` points into the run directory (flag name -> path in it).
RUN_OUTPUTS = {
    "export-dir": "model",
    "tensorboard-dir": "tensorboard",
    "summary-png": "summary.png",
    "slow-ranks-json": SLOW_RANKS_FILE,  # `jobs` and `status` read it while the job runs (dtrain/jobs/slow_ranks.py)
}
_RUN_EXISTS = 17  # the remote step's own exit status (dtrain/jobs/preflight.py has those of its checks)


@dataclass(frozen=True)
class Submission:
    run_id: str
    job_id: str
    run_dir: str
    spec: JobSpec


@dataclass(frozen=True)
class Plan:
    """A checked request: the batch script's spec, the allocation, and the user's code to send."""

    spec: JobSpec
    allocation: Allocation
    workdir: Workdir | None = None
    datasets: tuple[str, ...] = ()  # a task file's file_mounts: staged datasets, checked for on the share


def choose_launcher(request: LaunchRequest) -> Launcher:
    if request.launcher:
        return request.launcher
    if request.workdir:
        # the user's own script: torch.distributed's launcher, unless they ask for Horovod's or the image
        # they chose is TensorFlow's, which has Horovod and no torch
        return "torchrun" if request.framework == "pytorch" else "horovodrun"
    backend = request.job_flags.backend
    return "torchrun" if request.model_parallel or (request.framework == "pytorch" and backend == DDP) else "horovodrun"


def check_backend(request: LaunchRequest, launcher: Launcher) -> None:
    """Our data-parallel job's backend is its launcher's: under the other launcher each process would
    see a world of one and train alone (training/world/backend_choice.py)."""
    if launcher == "torchrun" and request.framework != "pytorch":
        framework = request.framework
        what = f"--framework {framework}'s image has no torch" if request.workdir else f"not {framework}"
        raise OperatorError(f"--launcher torchrun runs PyTorch jobs only, {what}")
    if request.framework != "pytorch" or request.workdir or request.entrypoint or request.model_parallel:
        return
    backend = request.job_flags.backend
    wanted = DDP if launcher == "torchrun" else HOROVOD
    if backend not in (None, AUTO, wanted):
        raise OperatorError(
            f"--backend {backend} does not run under --launcher {launcher}: pass --backend {wanted}, "
            "or leave out --launcher (it follows --backend)"
        )


def check_model_parallel(request: LaunchRequest) -> None:
    """--model-parallel runs the PyTorch model-parallel job, which torch.distributed's launcher starts."""
    if not request.model_parallel:
        return
    if request.framework != "pytorch":
        raise OperatorError(f"--model-parallel is PyTorch's (FSDP, pipeline, tensor parallel), not {request.framework}")
    if request.launcher == "horovodrun":
        raise OperatorError("--model-parallel runs under torchrun: leave out --launcher horovodrun")
    if request.entrypoint:
        raise OperatorError(f"--model-parallel runs {MODEL_PARALLEL_JOB}: leave out --entrypoint")


def check_own_code(request: LaunchRequest) -> None:
    """--workdir runs the command after `--` as written: none of our job's options apply to it."""
    if not request.workdir:
        return
    if not request.job_args:
        raise OperatorError("--workdir runs the command after `--`: add it, e.g. -- python train.py --epochs 1")
    for given, flag in ((request.entrypoint, "--entrypoint"), (request.model_parallel, "--model-parallel")):
        if given:
            raise OperatorError(f"--workdir runs the command after `--`: leave out {flag}")
    if request.local_copy:
        raise OperatorError("--local-copy rewrites our jobs' --data-dir: with --workdir, copy the data in your script")


def build_spec(desc: ClusterDescription, request: LaunchRequest) -> Plan:
    """Everything about the run that can be wrong is found here, before any connection."""
    if request.framework not in FRAMEWORKS:
        raise OperatorError(f"--framework must be one of {', '.join(FRAMEWORKS)}")
    check_model_parallel(request)
    check_own_code(request)
    fit = fit_to_cluster(desc, request.needs) if request.needs else None
    if fit and fit.gpus_per_node and request.processes_per_node is None and request.gpus is None:
        # the accelerators' count, unless a flag says
        request = replace(request, processes_per_node=fit.gpus_per_node)
    check_task_request(
        workdir=request.workdir, command=request.job_args, mode=request.mode, launcher=request.launcher,
        setup=request.setup, envs=request.envs, secrets=request.secrets, nodes=request.nodes or 1,
    )  # fmt: skip
    # a missing secret is named, and the variables measured, before anything is sent
    check_environment_size(request.envs | read_secrets(request.secrets))
    workdir = check_workdir(request.workdir, request.workdir_max_mb) if request.workdir else None
    if request.image and desc.runtime.kind != "docker":
        raise OperatorError(
            f"--image runs the job in a container, and cluster {desc.name} runs jobs on the hosts (runtime host)"
        )
    alloc = plan_allocation(
        desc,
        nodes=request.nodes,
        gpus=request.gpus,
        gpus_per_node=request.processes_per_node,
        exclusive=request.exclusive,
        time_limit=request.time_limit,
    )
    # per-node: the command is the launcher; its output comes through srun --label, read as torchrun's is
    launcher = "torchrun" if request.mode == "per-node" else choose_launcher(request)
    if request.mode != "per-node":
        check_backend(request, launcher)
    image = None
    if desc.runtime.kind == "docker":
        image = request.image or desc.image_for(request.framework)
        if not image:
            raise OperatorError(f"no image for {request.framework} in the cluster description: pass --image")
    local_copy = plan_local_copy(desc, request)
    prefix = request.name or (workdir.name if workdir else request.framework)
    run_id = check_run_id(request.run_id) if request.run_id else new_run_id(prefix)
    run_dir = posixpath.join(runs_dir(desc), run_id)
    spec = JobSpec(
        run_id=run_id,
        run_dir=run_dir,
        launcher=launcher,
        nodes=alloc.nodes,
        processes_per_node=alloc.processes_per_node,
        gpus_per_node=alloc.gpus_per_node,
        partition=choose_partition(require_slurm(desc), request),
        command=training_command(desc, request, run_dir, local_copy),
        workdir=posixpath.join(run_dir, CODE_SUBDIR) if workdir else desc.runtime.workdir,
        python=desc.runtime.python,
        remote_python=desc.remote_python,
        results=_results_target(desc),
        image=image,
        shared_mount=desc.shared_mount_path,
        network_interface=desc.runtime.network_interface,
        infiniband=desc.expect_infiniband,
        requeue=request.requeued,
        time_limit=alloc.time_limit,
        exclusive=alloc.exclusive,
        git_revision=git_revision(),
        env=dict(desc.nccl_env) | request.envs,
        local_copy=local_copy,
        mode="per-node" if request.mode == "per-node" else "per-rank",
        setup_cache_dir=setup_cache_dir(desc.local_data_path, runs_dir(desc)) if request.setup else None,
        secrets=tuple(request.secrets),
        tracking=plan_tracking(
            desc.tracking_uri,
            request.tracking_uri,
            request.experiment,
            cluster=desc.name,
            framework=request.framework,
            prometheus_url=desc.telemetry.prometheus_url if desc.telemetry else None,
        ),
        resume_from=request.resume_from,
        warn_before_s=warning_lead(request.warn_before, alloc.time_limit),
        gate=gate_thresholds(desc) if request.gate else None,
        gate_image=desc.image_for(GATE_FRAMEWORK) if image else None,
        cluster_info=cluster_info(desc),
    )
    return Plan(spec, alloc, workdir, fit.datasets if fit else ())


def cluster_info(desc: ClusterDescription) -> str:
    """SKYPILOT_CLUSTER_INFO's JSON, as SkyPilot writes it: the cluster's name, cloud, region and zone (none:
    the stack places the nodes in a proximity placement group, not a zone)."""
    cloud = "Azure" if desc.provider == "azure" else "local"
    return json.dumps({"cluster_name": desc.name, "cloud": cloud, "region": desc.region, "zone": None})


def choose_partition(access: SlurmAccess, request: LaunchRequest) -> str:
    """--spot: the Spot partition; --spot-fallback: both, Spot first (its PriorityTier is higher), so that
    a job Slurm cannot start on Spot nodes (Azure refused the capacity, the nodes are busy) runs on demand."""
    if not (request.spot or request.spot_fallback):
        return access.partition
    if request.spot and request.spot_fallback:
        raise OperatorError("--spot and --spot-fallback exclude each other: pass one")
    if access.spot_partition is None:
        flag = "--spot" if request.spot else "--spot-fallback"
        raise OperatorError(
            f"{flag}: the cluster has no Spot partition (set spotNodeCount in the stack config, `pulumi up`, "
            "then `dtrain cluster from-stack` again)"
        )
    return f"{access.spot_partition},{access.partition}" if request.spot_fallback else access.spot_partition


def plan_local_copy(desc: ClusterDescription, request: LaunchRequest) -> LocalCopy | None:
    """--local-copy: the dataset on the share (--data-dir, under data_path) and where each node keeps its copy."""
    if not request.local_copy:
        return None
    if desc.local_data_path is None:
        raise OperatorError(f"--local-copy: cluster {desc.name} has no node-local data path (local_data_path)")
    source = request.job_flags.data_dir
    if not source:
        raise OperatorError("--local-copy copies the job's --data-dir: pass -- --data-dir DIR (under data_path)")
    relative = dataset_under_data_path(desc, source, "--local-copy: --data-dir")
    return LocalCopy(source=posixpath.normpath(source), dest=posixpath.join(desc.local_data_path, relative))


def git_revision(root: Path = REPO_ROOT) -> str | None:
    """The commit of the checkout at root, this tool's by default (with '-dirty' when it has uncommitted
    changes), or None outside a git checkout: recorded in the model export, so a model can be traced to
    its code."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True)
    except OSError:  # no git
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")


def workdir_revision(workdir: str | None) -> dict[str, str | bool] | None:
    """The git commit of the user's --workdir where it is in a git checkout, and whether its tracked files
    differ from it (dirty): job.json's `workdir_git`, beside this tool's own `git_revision`."""
    revision = git_revision(Path(workdir).expanduser().resolve()) if workdir else None
    if revision is None:
        return None
    return {"commit": revision.removesuffix("-dirty"), "dirty": revision.endswith("-dirty")}


def node_hour_price(desc: ClusterDescription, spot: bool = False) -> tuple[float | None, str]:
    """What a node-hour of this cluster costs (USD), on demand or Spot, and where that figure comes from."""
    if desc.provider == "local":
        return 0.0, "local cluster: no charge"
    if desc.gpu_sku is None or desc.region is None:
        return None, "the cluster description names no GPU size or region (write it again with `cluster from-stack`)"
    price = pricing.node_hour_price(desc.gpu_sku, desc.region, spot=spot)
    kind = "Spot price" if spot else "price"
    if price is None:
        return None, f"no {kind} for {desc.gpu_sku} in {desc.region} in the price table (`dtrain cost`)"
    return float(price.usd_per_hour), f"{price.source}, price table of {price.as_of}"


def partition_prices(desc: ClusterDescription, access: SlurmAccess) -> dict[str, float | None]:
    """partition -> price per node-hour: what record_run.py charges each attempt, by where it ran."""
    prices = {access.partition: node_hour_price(desc)[0]}
    if access.spot_partition is not None:
        prices[access.spot_partition] = node_hour_price(desc, spot=True)[0]
    return prices


def training_command(
    desc: ClusterDescription, request: LaunchRequest, run_dir: str, local_copy: LocalCopy | None
) -> list[str]:
    if request.workdir:  # the user's command, exactly as they wrote it
        return list(request.job_args)
    python = desc.runtime.python
    entry = request.entrypoint or (MODEL_PARALLEL_JOB if request.model_parallel else f"training.{request.framework}")
    command = [python, entry] if entry.endswith(".py") else [python, "-m", entry]
    args = list(request.job_args)
    if local_copy:  # the ranks read each node's own copy, not the share
        args = with_flag_value(args, "--data-dir", local_copy.dest)
    if request.entrypoint:  # someone else's program: its arguments are its own ($OUTPUT_DIR says where to write)
        return command + args
    # what a run of our jobs leaves in its directory, and so in the results container: metrics, the
    # deployable model and curves
    defaults = {"--metrics-json": f"{run_dir}/metrics.json"}
    defaults |= {f"--{name}": f"{run_dir}/{path}" for name, path in RUN_OUTPUTS.items()}
    # a requeued job starts again from the top: its checkpoints are what makes it resume; the time limit's
    # warning (on unless --warn-before 0) saves one
    if request.requeued or request.resume_from or request.warn_before != 0:
        defaults["--checkpoint-dir"] = f"{run_dir}/checkpoints"
    for flag, value in defaults.items():
        if flag_value(args, flag) is None:
            args += [flag, value]
    return command + args


def _results_target(desc: ClusterDescription) -> ResultsTarget:
    cred = desc.results_upload
    if cred.kind == "sas":
        return ResultsTarget(desc.results.endpoint, desc.results.container, sas_file=SAS_FILE)
    if cred.kind == "managed_identity":
        return ResultsTarget(desc.results.endpoint, desc.results.container, client_id=cred.client_id)
    raise OperatorError(f"results_upload: jobs cannot upload with a {cred.kind} credential (use sas or an identity)")


def _processes_flag(request: LaunchRequest) -> str:
    """The flag that set the processes per node, as the user gave it."""
    if request.gpus is not None:
        spread = f" over {request.nodes} nodes" if request.nodes and request.nodes > 1 else ""
        return f"--gpus {request.gpus}{spread}"
    if request.processes_per_node is not None:
        return f"--gpus-per-node {request.processes_per_node}"
    return "the default (a process per GPU, or 1)"


def submit(desc: ClusterDescription, request: LaunchRequest, ssh: SSH, plan: Plan | None = None) -> Submission:
    """Send the user's code (if any), write the run directory and sbatch (plan: build_spec's, if made already)."""
    slurm = Slurm(desc, ssh)
    plan = plan or build_spec(desc, request)
    spec = plan.spec
    processes = ProcessRequest(spec.processes_per_node, spec.partition, _processes_flag(request))
    checks = plan_preflight(
        desc, request.job_flags, entrypoint=request.entrypoint, model_parallel=request.model_parallel,
        processes=processes, datasets=plan.datasets,
    )  # fmt: skip
    if spec.resume_from:  # the job fetches it (fetch_checkpoint.py): here only whether there is one
        require_kept_checkpoint(desc, spec.resume_from, ours=not (request.workdir or request.entrypoint))
    files = _run_files(desc, request, spec, slurm.access)
    code = ""
    if plan.workdir:  # the last upload of this directory, copied: the job runs a snapshot, whatever changes next
        cache = send_workdir(plan.workdir, desc, ssh, runs_dir(desc))
        code = f"cp -a {q(cache + '/.')} {q(posixpath.join(spec.run_dir, CODE_SUBDIR))} || exit 1; "
    remote = (
        f"umask 077; {checks.script}mkdir -p -m 0755 {q(runs_dir(desc))} || exit 1; "
        f"mkdir {q(spec.run_dir)} 2>/dev/null || exit {_RUN_EXISTS}; "
        f"tar -xf - -C {q(spec.run_dir)} || exit 1; {code}"
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


def _run_files(
    desc: ClusterDescription, request: LaunchRequest, spec: JobSpec, access: SlurmAccess
) -> dict[str, tuple[bytes, int]]:
    price, price_source = node_hour_price(desc)
    record = {
        "run_id": spec.run_id,
        "framework": request.framework,
        "cluster": desc.name,
        "gpu_sku": desc.gpu_sku,
        "region": desc.region,
        "price_per_node_hour_usd": price,  # record_run.py prices the run's node-hours with it
        "price_source": price_source,
        "prices_per_node_hour_usd": partition_prices(desc, access),  # per attempt, by its partition
        "node_gpus": desc.gpus_per_node,  # record_run.py charges the job's GPUs as this share of a node
        "submitted_by": getpass.getuser(),
        "submitted_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "job_args": request.job_args,
        "envs": request.envs,
        "workdir": request.workdir and str(Path(request.workdir).expanduser().resolve()),
        "workdir_git": workdir_revision(request.workdir),  # the user's project's revision (git_revision: ours)
        "results_url": f"{desc.results.url}/{spec.run_id}/",
        **{k: v for k, v in asdict(spec).items() if k not in ("results", "env")},
    }
    files = {
        "job.sh": (render_job_script(spec).encode(), 0o700),
        "job.json": (json.dumps(record, indent=2).encode() + b"\n", 0o600),
    }
    for tool in REMOTE_TOOLS:
        files[f"remote/{tool}"] = ((REMOTE_DIR / "job" / tool).read_bytes(), 0o700)
    for tool in REMOTE_BOOT_TOOLS:
        files[f"remote/{tool}"] = ((REMOTE_DIR / "boot" / tool).read_bytes(), 0o700)
    cred = desc.results_upload
    if cred.kind == "sas" and cred.secret is not None:
        files[SAS_FILE] = (cred.secret.get_secret_value().encode(), 0o600)
    if request.setup:
        files[SETUP_FILE] = (request.setup.encode(), 0o600)
    if request.secrets:  # over SSH's stdin with the rest, never in argv; removed when the job ends
        files[f"{SECRETS_SUBDIR}/env"] = (render_secrets(read_secrets(request.secrets)), 0o600)
    return files


def _tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
