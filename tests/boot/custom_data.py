"""The custom data the boot test boots: taken from the Pulumi program under mocks, as Azure would
receive it (gzipped), with the few documented substitutions that the test's hosts (system containers
or 1-vCPU VMs) and a test of minutes need.

Each substitution is a (what, old, new) edit of one text; applying it fails when the old text is
not there, so a change in the renderers shows up here instead of being silently skipped. The test
prints every substitution. Everything else (addresses, endpoint URLs, hostnames) stays as the
program rendered it: the VMs get the addresses the stack gives them, and the emulated Azure
answers at Azure's own names (tests/boot/seed.py, tests/boot/endpoints.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from infra.cloud_init._common import cloud_config, custom_data_bytes
from tests.infra.azure_mocks import Registered
from tests.infra.conftest import VALID_CONFIG, deploy
from tests.infra.documents import decode_custom_data

# A small cluster of the default GPU size: two nodes, an NFS server of two data disks; the Slurm release
# the test's repository serves (tools/build_slurm_packages.sh), one the renderer supports.
SLURM_VERSION = "24.11.5"
BOOT_CONFIG: dict[str, Any] = {
    **VALID_CONFIG, "nodeCount": "2", "nfsDiskCount": "2", "autostopMinutes": "10", "slurmVersion": SLURM_VERSION,
}  # fmt: skip
SLURM_CONF = "/etc/slurm/slurm.conf"
VM_CPUS = 1
VM_REAL_MEMORY_MB = 768  # of the VMs' 1024 MiB, what slurmd finds free with room to spare
AUTOSTOP_S = 60
SUSPEND_TIMEOUT_S = 30


@dataclass(frozen=True)
class Substitution:
    role: str  # nfs, head, node
    path: str  # the file of the custom data, or "" for the document itself
    old: str
    new: str
    why: str

    def __str__(self) -> str:
        where = f"{self.role}:{self.path}" if self.path else self.role
        return f"{where}: {self.old!r} -> {self.new!r} ({self.why})"


@dataclass(frozen=True)
class Rendered:
    documents: dict[str, str]  # role -> custom data, substituted
    custom_data: dict[str, bytes]  # role -> the same, gzipped as the customData property carries it
    substitutions: list[Substitution]
    admin_user: str
    ssh_public_key: str
    head_address: str
    nfs_address: str
    head_hostname: str
    nfs_hostname: str
    node_names: list[str]
    vault_uri: str
    acr_login_server: str
    scale_set_id: str
    munge_secret_name: str
    results_account: str  # the account of the results container, and its name
    results_container: str
    cluster_client_id: str  # the nodes' identity: it writes the results


def _custom_data(resource: Registered) -> str:
    profile = resource.inputs.get("osProfile") or resource.inputs["virtualMachineProfile"]["osProfile"]
    return decode_custom_data(profile["customData"])


def _node_line(slurm_conf: str) -> str:
    (line,) = [line for line in slurm_conf.splitlines() if line.startswith("NodeName=")]
    return line


def substitutions(head: str, cpus: int, real_memory_mb: int) -> list[Substitution]:
    """What the boot test changes, and why: nothing but what the test's hosts and its length need."""
    slurm_conf = _files(head)[SLURM_CONF]
    node = _node_line(slurm_conf)
    resources = re.search(r"CPUs=\d+ RealMemory=\d+", node)
    assert resources is not None, node
    suspend = re.search(r"^SuspendTime=\d+$", slurm_conf, re.MULTILINE)
    suspend_timeout = re.search(r"^SuspendTimeout=\d+$", slurm_conf, re.MULTILINE)
    assert suspend is not None and suspend_timeout is not None, "autostop is on in BOOT_CONFIG"
    shares = re.search(r"DefCpuPerGPU=\d+ DefMemPerGPU=\d+", slurm_conf)
    assert shares is not None, "the GPU partition gives each GPU its share of the node"
    gpus = int(re.search(r"Gres=gpu:(\d+)", node)[1])  # type: ignore[index]
    return [
        Substitution("head", SLURM_CONF, resources[0], f"CPUs={cpus} RealMemory={real_memory_mb}",
                     "the test hosts' own: slurmd reports what it finds, and Slurm refuses less than slurm.conf says"),
        Substitution("head", SLURM_CONF, shares[0], f"DefMemPerGPU={real_memory_mb // gpus}",
                     "each GPU's share of the test hosts' CPUs and memory (fewer CPUs than GPUs: one per task)"),
        Substitution("head", SLURM_CONF, suspend[0], f"SuspendTime={AUTOSTOP_S}",
                     "autostop within the test (autostopMinutes allows 10 at least)"),
        Substitution("head", SLURM_CONF, suspend_timeout[0], f"SuspendTimeout={SUSPEND_TIMEOUT_S}",
                     "a stopped host may be started again sooner; a test host stops in seconds"),
    ]  # fmt: skip


def _files(document: str) -> dict[str, str]:
    return {entry["path"]: entry["content"] for entry in yaml.safe_load(document)["write_files"]}


def apply(document: str, role: str, edits: list[Substitution]) -> str:
    """The document with each of its role's edits made to the YAML text of the file it names."""
    mine = [edit for edit in edits if edit.role == role]
    if not mine:
        return document
    parsed = yaml.safe_load(document)
    if cloud_config(parsed) != document:
        raise AssertionError(
            f"{role}: the renderers' YAML writer does not reproduce the document; edits would change more"
        )
    for edit in mine:
        (entry,) = [entry for entry in parsed["write_files"] if entry["path"] == edit.path]
        if entry["content"].count(edit.old) != 1:
            raise AssertionError(f"{edit}: the old text is not there exactly once")
        entry["content"] = entry["content"].replace(edit.old, edit.new)
    # Written by the renderers' own YAML writer (checked above), so that only the edited lines differ.
    return cloud_config(parsed)


def _script_value(script: str, name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", script, re.MULTILINE)
    assert match is not None, f"{name} not in the script"
    return match[1].strip("'")


def render(ssh_public_key: str, *, cpus: int = VM_CPUS, real_memory_mb: int = VM_REAL_MEMORY_MB) -> Rendered:
    """The stack's custom data for a deployment whose admin key is ssh_public_key (the test's own), for
    hosts of cpus CPUs and real_memory_mb of memory that slurmd may count on."""
    deployment = deploy({**BOOT_CONFIG, "sshPublicKey": ssh_public_key})
    by_name = {resource.name: resource for resource in deployment.mocks.resources}
    raw = {
        "nfs": _custom_data(by_name["hvd-nfs-vm"]),
        "head": _custom_data(by_name["hvd-head-vm"]),
        "node": _custom_data(by_name["hvd-gpu-vmss"]),
    }
    edits = substitutions(raw["head"], cpus, real_memory_mb)
    documents = {role: apply(text, role, edits) for role, text in raw.items()}
    outputs = {
        str(key.value if hasattr(key, "value") else key): value.value for key, value in deployment.outputs.items()
    }
    munge_key = _files(raw["node"])["/usr/local/sbin/munge-key"]
    head_power = yaml.safe_load(_files(raw["head"])["/etc/slurm/azure-power.json"])
    names = _node_line(_files(raw["head"])[SLURM_CONF]).split()[0].removeprefix("NodeName=").split(",")
    return Rendered(
        documents=documents,
        custom_data={role: custom_data_bytes(text) for role, text in documents.items()},
        substitutions=edits,
        admin_user=outputs["admin_user"],
        ssh_public_key=ssh_public_key,
        head_address=outputs["head_private_ip"],
        nfs_address=outputs["nfs_private_ip"],
        head_hostname=outputs["head_hostname"],
        nfs_hostname=by_name["hvd-nfs-vm"].inputs["osProfile"]["computerName"],
        node_names=names,
        vault_uri=_script_value(munge_key, "VAULT_URI"),
        acr_login_server=outputs["acr_login_server"],
        scale_set_id=head_power["scale_set_id"],
        munge_secret_name=_script_value(munge_key, "SECRET_NAME"),
        results_account=outputs["results_blob_endpoint"].removeprefix("https://").split(".")[0],
        results_container=outputs["results_container"],
        cluster_client_id=outputs["cluster_identity_client_id"],
    )
