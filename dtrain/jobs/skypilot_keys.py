"""SkyPilot's task-file keys (its docs' "SkyPilot YAML" reference) as `launch task.yaml` reads them: the
keys this deployment cannot honour, each refused with why, and the readers of the forms SkyPilot writes
its values in (`accelerators: H100:8`, `memory: 32+`, `disk_size: 256GB`, `image_id: docker:REF`,
`infra: azure/eastus`, `file_mounts`). What the cluster must then have is checked in
dtrain/jobs/cluster_fit.py. Runs on the operator's machine.

A file is in SkyPilot's dialect when it uses a key only SkyPilot has (`num_nodes`, `file_mounts`, or one
of SKYPILOT_RESOURCES), or when its `run` reads a `SKYPILOT_` variable: SkyPilot runs `run` once per node,
so such a file runs in per-node mode unless it says `mode:` itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Top-level keys SkyPilot has and this deployment cannot honour: key -> why (one `error:` line each)
REFUSED_KEYS = {
    "service": "SkyServe (replicas of a model server behind a load balancer): this cluster runs training jobs",
    "pool": "SkyPilot's pools of workers for managed jobs: Slurm queues the jobs of this cluster",
    "config": "SkyPilot's own settings for its clouds and Kubernetes: nothing here reads them",
    "volumes": "creates cloud volumes: stage data with `dtrain stage` and mount it with file_mounts",
    "managed_secrets": "secrets kept by SkyPilot's API server: list the names under secrets (values from your "
    "environment at launch)",
    "event_callback": "a command SkyPilot runs on the job's events: follow the job with `dtrain logs` and `jobs`",
    "inputs": "a hint to SkyPilot's optimizer for placing data among clouds: this is one cluster",
    "outputs": "a hint to SkyPilot's optimizer for placing data among clouds: this is one cluster",
    "api_server_access": "SkyPilot's API server: there is none here",
}
_PLACED_BY_THE_STACK = "the nodes are where the stack put them (`cluster show`)"
# resources.<key> SkyPilot has and this deployment cannot honour: key -> why
REFUSED_RESOURCES = {
    "zone": f"an availability zone: {_PLACED_BY_THE_STACK}",
    "any_of": "candidate resources across clouds or regions: this is one cluster (list several accelerators "
    "in accelerators instead)",
    "ordered": "candidate resources across clouds or regions: this is one cluster (list several accelerators "
    "in accelerators instead)",
    "ports": "opens ports to the Internet: the nodes have no public address (reach a port with `dtrain ssh`)",
    "autostop": "the stack's power saving deallocates idle nodes (suspendTime in its config), not a job",
    "job_recovery": "SkyPilot's managed-job recovery: launch --requeue requeues a job whose node fails, "
    "use_spot (--spot) one that a Spot eviction ends",
    "disk_tier": "the nodes' disks are the stack's: a job cannot choose their tier",
    "local_disk": "the nodes' disks are the stack's: the local NVMe is at the description's local_data_path",
    "ephemeral_storage": "Kubernetes' ephemeral storage: write disk_size",
    "labels": "tags on the machines SkyPilot creates: the nodes exist already (the stack tags them)",
    "accelerator_args": "TPU settings: the nodes have NVIDIA GPUs",
    "max_hourly_cost": "no price cap per job: launch shows the estimated cost before it submits",
    "priority": "SkyPilot's job priority: Slurm orders this cluster's queue",
    "priority_class": "Kubernetes' priority class: Slurm orders this cluster's queue",
    "volumes": "creates cloud volumes: stage data with `dtrain stage` and mount it with file_mounts",
}
SKYPILOT_RESOURCES = (
    "accelerators", "cpus", "memory", "disk_size", "use_spot", "image_id", "instance_type", "network_tier",
    "cloud", "region", "infra",
)  # fmt: skip
# Other clouds' storage, by URL scheme (SkyPilot's stores): file_mounts from them are refused
OTHER_CLOUDS_STORAGE = ("s3", "gs", "r2", "cos", "oci", "nebius", "hf", "cw")
_AZURE = "azure"


def refused_key(data: Mapping[object, object]) -> str | None:
    """`key: why` for the first key of a task file (its top level, or under resources) that is refused."""
    for key, why in REFUSED_KEYS.items():
        if key in data:
            return f"{key}: {why}"
    resources = data.get("resources")
    if isinstance(resources, Mapping):
        for key, why in REFUSED_RESOURCES.items():
            if key in resources:
                return f"resources.{key}: {why}"
    return None


_ACCELERATOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?::\s*([0-9]+(?:\.[0-9]+)?))?\s*$")


def parse_accelerators(value: object) -> tuple[tuple[str, int], ...]:
    """SkyPilot's accelerators in any of its forms, as (name, count) candidates in order: `H100:8`, `H100` (1),
    `{H100: 8}`, a list `[A100:8, H100:8]` (tried in order), a set `{A100:8, H100:8}` (YAML reads it as
    keys with empty values). A fraction of a GPU is refused: Slurm gives a job whole GPUs."""
    if isinstance(value, str):
        items: list[tuple[str, object]] = [_split_accelerator(value)]
    elif isinstance(value, list):
        if not value or not all(isinstance(item, str) for item in value):
            raise ValueError("a list of NAME:COUNT, e.g. [H100:8, A100-80GB:8]")
        items = [_split_accelerator(item) for item in value]
    elif isinstance(value, dict) and value:
        items = [_split_accelerator(key) if count is None else (str(key), count) for key, count in value.items()]
    else:
        raise ValueError("NAME:COUNT (H100:8), a list of them, or {NAME: COUNT}")
    return tuple((name, _whole_count(name, count)) for name, count in items)


def _split_accelerator(text: object) -> tuple[str, object]:
    match = _ACCELERATOR.match(str(text))
    if not match:
        raise ValueError(f"{text!r}: expected NAME or NAME:COUNT, e.g. H100:8")
    name, count = match.groups()
    return name, 1 if count is None else float(count)


def _whole_count(name: str, count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int | float) or count <= 0:
        raise ValueError(f"{name}: the count must be a positive number of GPUs, got {count!r}")
    if count != int(count):
        raise ValueError(f"{name}:{count}: a fraction of a GPU; Slurm gives a job whole GPUs (ask for 1)")
    return int(count)


_AMOUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*\+?\s*$")
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]B?)?\s*(\+)?\s*$", re.IGNORECASE)
_GIB_PER_UNIT = {"K": 2.0**-20, "M": 2.0**-10, "G": 1.0, "T": 2.0**10, "P": 2.0**20}  # SkyPilot's: powers of 2


def parse_cpus(value: object) -> float:
    """`cpus: 4` or `4+` (at least 4), as the least a node must have."""
    match = _AMOUNT.match(str(value)) if isinstance(value, str | int | float) and not isinstance(value, bool) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{value!r}: expected a count of vCPUs, N or N+ (at least N), e.g. 4+")
    return float(match.group(1))


def parse_size_gib(value: object, plus: bool = True) -> float:
    """`memory: 32`, `32+`, `64GB`, `1024MB`, `1TB` (plus: the `+` form allowed), in GiB: SkyPilot's units are
    powers of 2 and a bare number is GB."""
    text = str(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else ""
    match = _SIZE.match(text)
    if not match or (match.group(3) and not plus) or float(match.group(1)) <= 0:
        form = "N, N+ or N with a unit (32+, 64GB, 1TB)" if plus else "N (GB) or N with a unit (256GB, 1TB)"
        raise ValueError(f"{value!r}: expected {form}")
    unit = (match.group(2) or "G")[0].upper()
    return float(match.group(1)) * _GIB_PER_UNIT[unit]


def parse_disk_gib(value: object) -> float:
    """`disk_size: 256` or `256GB`, in GiB (no `+`: SkyPilot sizes the disk it makes)."""
    return parse_size_gib(value, plus=False)


def parse_image_id(value: object) -> str:
    """`image_id: docker:REF`: the image the job runs in (as --image REF). A machine image is the stack's."""
    if isinstance(value, str) and value.startswith("docker:") and value[len("docker:") :].strip():
        return value[len("docker:") :].strip()
    if isinstance(value, dict):
        raise ValueError("an image per region: the nodes boot the stack's image; a container image is docker:REF")
    raise ValueError(
        f"{value!r} names a machine image: the nodes boot the stack's (Azure's ubuntu-hpc); a container image for "
        "the job is docker:REF"
    )


def parse_infra(value: object) -> tuple[str, str | None]:
    """`infra: CLOUD[/REGION[/ZONE]]` as (cloud, region): `*` is any; a zone is refused (the stack placed them)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected CLOUD[/REGION], e.g. azure/eastus")
    parts = value.strip().split("/")
    if parts[0].lower() in ("k8s", "kubernetes"):
        raise ValueError(f"{value}: a Kubernetes cluster; this is an Azure one")
    if len(parts) > 3:
        raise ValueError(f"{value}: expected CLOUD[/REGION[/ZONE]]")
    if len(parts) == 3 and parts[2] != "*":
        raise ValueError(f"{value}: an availability zone: {_PLACED_BY_THE_STACK}")
    region = parts[1] if len(parts) > 1 and parts[1] != "*" else None
    return parts[0], region


def check_cloud(cloud: str) -> str:
    """`cloud:` (or infra's first part): Azure, or `*`; another cloud is refused here, before any cluster is read."""
    if cloud.lower() not in (_AZURE, "*"):
        raise ValueError(f"{cloud}: another cloud; this cluster is on Azure (or the local emulation of it)")
    return cloud.lower()


def parse_file_mounts(value: object) -> tuple[tuple[str, str], ...]:
    """file_mounts as (path on the nodes, source URL) pairs. Only a dataset that `dtrain stage` put in the data
    container can be mounted (checked against the cluster in cluster_fit.py); local files, other clouds'
    buckets and new buckets or volumes are refused, with where they belong instead."""
    if not isinstance(value, dict):
        raise ValueError("a mapping of PATH_ON_THE_NODES: SOURCE")
    return tuple(_file_mount(str(path), source) for path, source in value.items())


def _file_mount(path: str, source: object) -> tuple[str, str]:
    if isinstance(source, dict):
        source = _storage_source(path, source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"{path}: expected a source (the URL of a dataset staged with `dtrain stage`)")
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    if scheme in OTHER_CLOUDS_STORAGE:
        raise ValueError(f"{path}: {source} is another cloud's storage: stage the data with `dtrain stage`")
    if scheme not in ("http", "https"):
        raise ValueError(
            f"{path}: {source} copies files from this machine: put code and small files in workdir, and data in "
            "the data container with `dtrain stage`"
        )
    return path, source.rstrip("/")


def _storage_source(path: str, storage: dict[object, object]) -> object:
    """A storage mount's source: read-only use of an existing container path (a staged dataset) only."""
    if "name" in storage or "source" not in storage:
        raise ValueError(f"{path}: names or creates a bucket: mount a staged dataset by its URL (source: URL)")
    if str(storage.get("store", _AZURE)).lower() != _AZURE:
        raise ValueError(f"{path}: store {storage['store']} is another cloud's storage")
    if storage.get("persistent", True) is not True:
        raise ValueError(f"{path}: persistent: false would delete the data when the job ends: the data stays")
    if str(storage.get("mode", "MOUNT")).upper() not in ("MOUNT", "COPY", "MOUNT_CACHED"):
        raise ValueError(f"{path}: mode {storage['mode']}: expected MOUNT, COPY or MOUNT_CACHED")
    if other := sorted(set(map(str, storage)) - {"source", "store", "persistent", "mode"}):
        raise ValueError(f"{path}: {other[0]}: not read here (a staged dataset is mounted as it is)")
    return storage["source"]


def reads_skypilot_variables(run: str | None) -> bool:
    """Whether a command reads SkyPilot's variables (SKYPILOT_NODE_RANK, ...): it was written to run per node."""
    return "SKYPILOT_" in (run or "")
