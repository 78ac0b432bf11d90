"""The boot test's Azure cluster (host side): the custom data of the Pulumi program
(tests/boot/custom_data.py) booted on the head node and two GPU nodes, as system containers
(tests/boot/containers.py, `make test-boot`) or, with the NFS server, as VMs under software emulation
(tests/boot/vms.py, `make test-boot-vm`), with Azure's endpoints beside them on a hub namespace
(tests/boot/endpoints.py), the scale set's start and deallocate calls mapped to starting and stopping
the nodes, and the packages served where Azure's hosts take them (tests/boot/seed.py).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Protocol

from infra.cloud_init._common import DATABASE_PASSWORD_SECRET
from infra.cloud_init.slurm_packages import (
    SLURM_REPOSITORY_COMPONENT,
    SLURM_REPOSITORY_HOST,
    SLURM_REPOSITORY_SUITE,
)
from infra.contract import BOOT_REPORT_DIR, HEALTH_REPORT_DIR
from infra.health_thresholds import node_health
from tests.boot import blob, containers, endpoints, seed, tls, vms
from tests.boot.custom_data import BOOT_CONFIG, Rendered, render

Kind = Literal["container", "vm"]
IMAGE_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "build_boot_image.sh"
HOST_ADDRESS = "10.40.255.254"  # the hub on the hosts' network: the endpoints, the package repositories
BLOB_ADDRESS = "10.40.255.253"  # the hub's second address: the results account (tests/boot/blob.py)
PREFIXLEN = 16  # the stack's VNet: every subnet's machines reach each other, as Azure routes them
IMDS_ADDRESS = "169.254.169.254"
HUB_PREFIX = "dtrain-boot-"  # + the test's process id: the hub namespace, and its hosts' (+ -<index>)
NODE_ADDRESSES = ("10.40.0.4", "10.40.0.5")  # Azure hands these out by DHCP in the cluster subnet
GPUS = 8  # Standard_ND96isr_H100_v5's, as slurm.conf and gres.conf say
# Its InfiniBand ports and their rate, as its health check counts them (the one thresholds table)
INFINIBAND = node_health(BOOT_CONFIG["gpuSku"])
NVME_DISKS = 8
# What the image carries for other roles that each role's Azure image does not run: plain Ubuntu (head,
# NFS server) has no docker; only the NFS server serves NFS.
_DOCKER = ("docker.service", "docker.socket", "containerd.service")
ABSENT_SERVICES = {"head": (*_DOCKER, "nfs-server.service"), "nfs": _DOCKER, "node": ("nfs-server.service",)}
# A container sees the host's CPUs and memory: slurm.conf says what slurmd will find, less a margin.
CONTAINER_REAL_MEMORY_MB = 2048


_NOT_READY = {"POWERED_DOWN", "POWERING_UP", "POWERING_DOWN", "DRAIN", "DOWN", "NOT_RESPONDING"}


class Host(Protocol):
    """A machine of the test: a container or a VM."""

    @property
    def console(self) -> Path: ...

    def running(self) -> bool: ...

    def start(self) -> None: ...

    def request_start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class BootCluster:
    kind: Kind
    rendered: Rendered
    azure: endpoints.Azure
    hub: vms.Namespace
    hosts: dict[str, Host]  # head, the nodes by Slurm name, and (VMs) nfs
    addresses: dict[str, str]
    key: Path  # the admin user's SSH private key
    shared: Path | None  # the hub directory at /shared (containers)
    results: blob.ResultsAccount  # the results container's account
    power_calls: list[tuple[str, str]] = field(default_factory=list)  # (action, host), as ARM performed them
    started: dict[str, str] = field(default_factory=dict)  # node -> when Azure last started it (ISO 8601)

    def ssh(
        self, host: str, command: str, *, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """command as the admin user on host, over SSH, as an operator runs it."""
        argv = ["ssh", "-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
                f"{self.rendered.admin_user}@{self.addresses[host]}", command]  # fmt: skip
        try:
            return self.hub.run(argv, timeout=timeout, check=check)
        except subprocess.TimeoutExpired as timed_out:
            if check:
                raise
            return subprocess.CompletedProcess(argv, 255, "", f"timed out after {timed_out.timeout} s")

    def nodes(self) -> dict[str, dict[str, str]]:
        """slurmctld's view of the nodes (scontrol show node), by name; empty while it does not answer."""
        out = self.ssh("head", "scontrol show node -o", check=False).stdout
        nodes = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "NodeName" in fields:
                nodes[fields["NodeName"]] = fields
        return nodes

    def registered(self, node: str) -> bool:
        """node's slurmd has registered with slurmctld since it last booted or ever (it may be powered down since)."""
        return self.nodes().get(node, {}).get("SlurmdStartTime", "None") not in ("None", "")

    def ready(self, node: str) -> bool:
        """node is registered and idle: powered up, responding, not drained."""
        states = set(self.nodes().get(node, {}).get("State", "").split("+"))
        return "IDLE" in states and not states & _NOT_READY

    def sbatch(self, options: str, command: str, timeout: float) -> tuple[int, str]:
        """A job submitted on the head node by the admin user over SSH; its exit status and output."""
        out = f"/shared/runs/boot-test-{time.monotonic_ns()}.out"
        submitted = self.ssh(
            "head",
            f"mkdir -p /shared/runs; sbatch --wait --parsable {options} -o {out} --wrap '{command}'; "
            f"echo rc=$?; cat {out}",
            timeout=timeout,
            check=False,
        )
        match = re.search(r"^rc=(\d+)$", submitted.stdout, re.MULTILINE)
        assert match, f"sbatch: {submitted.stdout}{submitted.stderr}"
        return int(match[1]), submitted.stdout

    @contextmanager
    def power_settings(self, **values: int) -> Iterator[None]:
        """The head's slurm-power settings (/etc/slurm/azure-power.json) changed for the block, then put
        back: the test's way to shorten the reaper's hour-long bounds."""
        path = "/etc/slurm/azure-power.json"
        edit = f"import json,sys; p='{path}'; c=json.load(open(p)); c.update(json.loads(sys.argv[1])); "
        edit += "json.dump(c, open(p, 'w'), indent=2)"
        before = json.loads(self.ssh("head", f"sudo cat {path}").stdout)
        self.ssh("head", f"sudo python3 -c {shlex.quote(edit)} {shlex.quote(json.dumps(values))}")
        try:
            yield
        finally:
            restore = {key: before[key] for key in values}
            self.ssh("head", f"sudo python3 -c {shlex.quote(edit)} {shlex.quote(json.dumps(restore))}", check=False)

    def reap(self) -> subprocess.CompletedProcess[str]:
        """One round of the reaper on the head (its timer's unit, started now rather than in 5 minutes)."""
        return self.ssh("head", "sudo systemctl start slurm-power-reap.service", timeout=600, check=False)

    def boot_report(self, host: str) -> dict[str, str]:
        """The host's boot report (boot-steps.sh's key=value lines on the shared file system)."""
        return self._report(BOOT_REPORT_DIR, host if host != "head" else self.rendered.head_hostname)

    def health_report(self, node: str) -> dict[str, str]:
        """The node's last health check report (slurm-health-check's key=value lines on the shared file system)."""
        return self._report(HEALTH_REPORT_DIR, node)

    def _report(self, folder: str, name: str) -> dict[str, str]:
        assert self.shared is not None, "the nodes' reports are read from the hub's /shared"
        report = self.shared / folder / name
        if not report.exists():
            return {}
        return dict(line.split("=", 1) for line in report.read_text().splitlines() if "=" in line)

    def wait_for(self, what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 3) -> None:
        deadline = time.monotonic() + timeout_s
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{self.diagnostics()}")
            time.sleep(every_s)

    def diagnostics(self) -> str:
        """The last lines of every host's console, for a failure's message."""
        parts = []
        for name, host in self.hosts.items():
            text = host.console.read_text(errors="replace") if host.console.exists() else "(no console)"
            parts.append(
                f"--- {name} ({'running' if host.running() else 'stopped'}), console:\n"
                + "\n".join(text.splitlines()[-25:])
            )
        return "\n".join(parts)

    def power(self, action: str, instance_ids: list[str]) -> None:
        """ARM's scale-set call, on the nodes: instance id i is the node with suffix i in base 36."""
        for instance_id in instance_ids:
            name = self.rendered.node_names[int(instance_id)]
            self.power_calls.append((action, name))
            host = self.hosts[name]
            if action == "start":
                self.started[name] = _now()
                host.request_start()
            else:
                host.stop()

    def running_instances(self) -> dict[str, str]:
        """Instance id -> when the node last started, for the nodes that run (ARM's instance view)."""
        return {
            str(index): self.started[name]
            for index, name in enumerate(self.rendered.node_names)
            if self.hosts[name].running() and name in self.started
        }


def build_image(kind: Kind) -> Path:
    out = subprocess.run([str(IMAGE_SCRIPT), kind], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _ssh_key(work: Path) -> Path:
    key = work / "admin_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "boot-test", "-f", str(key)], check=True)
    return key


def _role(rendered: Rendered, host: str) -> str:
    return "node" if host in rendered.node_names else host


def _azure_hostname(node: str) -> str:
    """The hostname Azure gives a scale-set instance: the prefix as given, the base-36 digits upper case."""
    prefix, digits = node[:-6], node[-6:]
    return prefix + digits.upper()


def _served(work: Path, image: Path) -> Path:
    """The hub's plain HTTP root: the distribution archive's stand-in and PyPI's."""
    root = work / "www"
    root.mkdir()
    (root / seed.ARCHIVE_PATH).symlink_to(image / "archive")
    (root / seed.WHEELS_PATH).symlink_to(image / "wheels")
    return root


@contextmanager
def boot_cluster(
    work: Path,
    *,
    kind: Kind = "container",
    forbid_vault_s: dict[int, float] | None = None,
    host_files: dict[str, dict[str, bytes]] | None = None,
    faults: Callable[[BootCluster], None] | None = None,
) -> Iterator[BootCluster]:
    """Boot the cluster. forbid_vault_s: node index -> seconds its Key Vault reads are refused (403);
    host_files: host -> {path: content} laid into a container's file system before its first boot;
    faults: called with the cluster before its first boot (the endpoints' faults)."""
    for stale in containers.remove_stale(HUB_PREFIX):
        print(f"removed what a killed boot test left: {stale}")
    image = build_image(kind)
    key = _ssh_key(work)
    if kind == "container":
        rendered = render(key.with_suffix(".pub").read_text().strip(), cpus=os.cpu_count() or 1,
                          real_memory_mb=CONTAINER_REAL_MEMORY_MB)  # fmt: skip
    else:
        rendered = render(key.with_suffix(".pub").read_text().strip())
    ca = tls.make_ca(work / "ca", addresses=(BLOB_ADDRESS,))
    gnupg = seed.make_signing_key(work)
    slurm_repository = seed.make_slurm_repository(
        work / "slurm-repository", image / "slurm", gnupg, suite=SLURM_REPOSITORY_SUITE,
        component=SLURM_REPOSITORY_COMPONENT,
    )  # fmt: skip
    keyring = seed.public_keyring(gnupg)
    seed.stop_gpg_agent(gnupg)
    roles = (["nfs"] if kind == "vm" else []) + ["head", *rendered.node_names]
    addresses = {"nfs": rendered.nfs_address, "head": rendered.head_address,
                 **dict(zip(rendered.node_names, NODE_ADDRESSES, strict=True))}  # fmt: skip
    hostnames = {"nfs": rendered.nfs_hostname, "head": rendered.head_hostname,
                 **{name: _azure_hostname(name) for name in rendered.node_names}}  # fmt: skip
    macs = {"nfs": "52:54:00:40:00:01", "head": "52:54:00:40:00:02",
            **{name: f"52:54:00:40:00:1{index}" for index, name in enumerate(rendered.node_names)}}  # fmt: skip
    vault_host = rendered.vault_uri.removeprefix("https://").rstrip("/")
    hosts_lines = {
        HOST_ADDRESS: f"{vault_host} {endpoints.ARM_HOST} {rendered.acr_login_server} {SLURM_REPOSITORY_HOST}",
        BLOB_ADDRESS: f"{rendered.results_account}.blob.core.windows.net",
        **{addresses[role]: hostnames[role] for role in roles},
    }

    def vendor(role: str) -> str:
        return seed.vendor_data(
            admin_user=rendered.admin_user,
            ssh_public_key=rendered.ssh_public_key,
            ca_certificate=ca.certificate,
            hosts=hosts_lines,
            sources=seed.package_sources(HOST_ADDRESS),
            pip_find_links=f"http://{HOST_ADDRESS}:{seed.REPO_PORT}/{seed.WHEELS_PATH}/",
            absent_services=ABSENT_SERVICES.get(role, ()),
        )

    azure = endpoints.Azure(
        names={addresses[role]: hostnames[role] for role in roles},
        secrets={
            rendered.munge_secret_name: base64.b64encode(os.urandom(1024)).decode(),
            DATABASE_PASSWORD_SECRET: secrets.token_hex(16),  # slurmdbd's, which the head node reads
        },
        scale_set_id=rendered.scale_set_id,
        instances=[str(index) for index in range(len(rendered.node_names))],
        power=lambda action, ids: cluster.power(action, ids),
        repository=slurm_repository,
    )
    for index, seconds in (forbid_vault_s or {}).items():
        azure.forbid(NODE_ADDRESSES[index], seconds)
    hub = vms.Namespace(f"{HUB_PREFIX}{os.getpid()}", HOST_ADDRESS, PREFIXLEN, IMDS_ADDRESS)
    hub.run(["ip", "addr", "add", f"{BLOB_ADDRESS}/32", "dev", vms.BRIDGE])
    results = blob.ResultsAccount(rendered.results_account, BLOB_ADDRESS, hub)
    shared = work / "shared" if kind == "container" else None
    with ExitStack() as stack:
        stack.callback(hub.delete)
        machines: dict[str, Host] = {}
        stack.callback(lambda: [_remove(host) for host in machines.values()])
        for index, role in enumerate(roles):
            seed_args = dict(
                instance_id=f"boot-test-{role}",
                hostname=hostnames[role],
                user_data=rendered.custom_data[_role(rendered, role)],
                vendor=vendor(_role(rendered, role)),
                network=seed.network_config(
                    mac=macs[role], address=addresses[role], prefixlen=PREFIXLEN, gateway=HOST_ADDRESS
                ),
            )
            is_node = role in rendered.node_names
            if kind == "container":
                assert shared is not None
                shared.mkdir(exist_ok=True)
                machines[role] = containers.Container(
                    containers.ContainerSpec(role, addresses[role], macs[role], gpus=GPUS if is_node else 0,
                                             **_infiniband(is_node), nvme=is_node, database_disk=role == "head"),
                    image, work / role, seed.write_seed(work / role / "seed", **seed_args), hub, index, shared,
                    files={seed.MICROSOFT_KEYRING: keyring, **(host_files or {}).get(role, {})},
                )  # fmt: skip
            else:
                spec = vms.VmSpec(role, addresses[role], macs[role], gpus=GPUS if is_node else 0,
                                  **_infiniband(is_node), nvme_disks=NVME_DISKS if is_node else 0,
                                  data_disks={"nfs": 2, "head": 1}.get(role, 0))  # fmt: skip
                iso = seed.make_seed(work / role / "seed.iso", **seed_args)
                machines[role] = vms.Vm(spec, image, work / role, iso, hub, f"tap{index}")
        cluster = BootCluster(kind, rendered, azure, hub, machines, addresses, key, shared, results)
        imds_state = work / "imds"
        imds_state.mkdir()
        www = _served(work, image)
        with hub.entered():
            repo_server = subprocess.Popen(
                ["ip", "netns", "exec", hub.name, "python3", "-m", "http.server", "--bind", HOST_ADDRESS,
                 "--directory", str(www), str(seed.REPO_PORT)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            stack.callback(repo_server.wait)
            stack.callback(repo_server.terminate)
            stack.enter_context(
                endpoints.serving(
                    azure, address=HOST_ADDRESS, imds_address=IMDS_ADDRESS, tls=ca.server,
                    state_dir=imds_state, running=cluster.running_instances,
                )
            )  # fmt: skip
        (work / "azurite").mkdir()
        stack.enter_context(results.serving(work / "azurite", ca.directory / "server.pem",
                                            ca.directory / "server.key", ca.directory / "ca.pem"))  # fmt: skip
        with hub.entered():
            results.client().create_container(rendered.results_container)
        if faults is not None:
            faults(cluster)
        for name, host in machines.items():
            cluster.started[name] = _now()  # pulumi up creates them running
            host.start()
        yield cluster


def _infiniband(is_node: bool) -> dict[str, int]:
    """A host's emulated InfiniBand: a node's ports, all ACTIVE at the size's rate; none elsewhere."""
    if not is_node:
        return {}
    return {"infiniband_ports": INFINIBAND.infiniband_ports, "infiniband_rate_gbps": INFINIBAND.infiniband_rate_gbps}


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _remove(host: Host) -> None:
    delete = getattr(host, "delete", None)
    delete() if delete is not None else host.stop()


def assert_nothing_left(work: Path, hub: str) -> None:
    """After a run: no process of the test's (its work directory in the command line), no namespace."""
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
    assert not Path(f"/run/netns/{hub}").exists(), "the test's network namespace is left"
