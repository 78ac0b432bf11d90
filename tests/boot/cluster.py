"""The boot test's Azure cluster in VMs (host side): the custom data of the Pulumi program
(tests/boot/custom_data.py) booted on the NFS server, the head node and two GPU nodes
(tests/boot/vms.py), with Azure's endpoints beside them (tests/boot/endpoints.py), the scale set's
start and deallocate calls mapped to starting and stopping the node VMs.
"""

from __future__ import annotations

import base64
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.boot import endpoints, seed, tls, vms
from tests.boot.custom_data import Rendered, render

IMAGE_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "build_boot_image.sh"
HOST_ADDRESS = "10.40.255.254"  # the host on the VMs' network: the endpoints, the package repository
PREFIXLEN = 16  # the stack's VNet: every subnet's machines reach each other, as Azure routes them
IMDS_ADDRESS = "169.254.169.254"
NODE_ADDRESSES = ("10.40.0.4", "10.40.0.5")  # Azure hands these out by DHCP in the cluster subnet
GPUS = 8  # Standard_ND96isr_H100_v5's, as slurm.conf and gres.conf say
NVME_DISKS = 8
# What the image carries for other roles that each role's Azure image does not run: plain Ubuntu (head,
# NFS server) has no docker; only the NFS server serves NFS.
_DOCKER = ("docker.service", "docker.socket", "containerd.service")
ABSENT_SERVICES = {"head": (*_DOCKER, "nfs-server.service"), "nfs": _DOCKER, "node": ("nfs-server.service",)}


@dataclass
class BootCluster:
    rendered: Rendered
    azure: endpoints.Azure
    namespace: vms.Namespace
    vms: dict[str, vms.Vm]  # nfs, head, and the nodes by Slurm name
    key: Path  # the admin user's SSH private key

    def ssh(
        self, vm: str, command: str, *, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """command as the admin user on vm, over SSH, as an operator runs it."""
        address = self.vms[vm].spec.address
        argv = ["ssh", "-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
                f"{self.rendered.admin_user}@{address}", command]  # fmt: skip
        return self.namespace.run(argv, timeout=timeout, check=check)

    def wait_for(self, what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 3) -> None:
        deadline = time.monotonic() + timeout_s
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{self.diagnostics()}")
            time.sleep(every_s)

    def diagnostics(self) -> str:
        """The last lines of every VM's console, for a failure's message."""
        parts = []
        for name, vm in self.vms.items():
            text = vm.console.read_text(errors="replace") if vm.console.exists() else "(no console)"
            parts.append(
                f"--- {name} ({'running' if vm.running() else 'stopped'}), console:\n"
                + "\n".join(text.splitlines()[-25:])
            )
        return "\n".join(parts)

    def power(self, action: str, instance_ids: list[str]) -> None:
        """ARM's scale-set call, on the node VMs: instance id i is the node with suffix i in base 36."""
        for instance_id in instance_ids:
            vm = self.vms[self.rendered.node_names[int(instance_id)]]
            vm.start() if action == "start" else vm.stop()

    def running_instances(self) -> set[str]:
        return {str(index) for index, name in enumerate(self.rendered.node_names) if self.vms[name].running()}


def build_image() -> Path:
    out = subprocess.run([str(IMAGE_SCRIPT)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _ssh_key(work: Path) -> Path:
    key = work / "admin_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "boot-test", "-f", str(key)], check=True)
    return key


@contextmanager
def boot_cluster(work: Path, *, forbid_vault_s: dict[int, float]) -> Iterator[BootCluster]:
    """Boot the cluster; forbid_vault_s: node index -> seconds its Key Vault reads are refused (403)."""
    image = build_image()
    key = _ssh_key(work)
    rendered = render(key.with_suffix(".pub").read_text().strip())
    ca = tls.make_ca(work / "ca")
    specs = {
        "nfs": vms.VmSpec(rendered.nfs_hostname, rendered.nfs_address, "52:54:00:40:00:01", data_disks=2),
        "head": vms.VmSpec(rendered.head_hostname, rendered.head_address, "52:54:00:40:00:02"),
    }
    for index, (name, address) in enumerate(zip(rendered.node_names, NODE_ADDRESSES, strict=True)):
        specs[name] = vms.VmSpec(
            name, address, f"52:54:00:40:00:1{index}", gpus=GPUS, infiniband=True, nvme_disks=NVME_DISKS
        )
    hostnames = {
        "nfs": rendered.nfs_hostname,
        "head": rendered.head_hostname,
        **{name: _azure_hostname(name) for name in rendered.node_names},
    }
    vault_host = rendered.vault_uri.removeprefix("https://").rstrip("/")
    hosts = {
        HOST_ADDRESS: f"{vault_host} {endpoints.ARM_HOST} {rendered.acr_login_server}",
        **{spec.address: hostnames[role] for role, spec in specs.items()},
    }
    repository = seed.make_flat_repository(work / "repo")

    def vendor(role: str) -> str:
        return seed.vendor_data(
            admin_user=rendered.admin_user,
            ssh_public_key=rendered.ssh_public_key,
            ca_certificate=ca.certificate,
            hosts=hosts,
            sources=seed.package_sources(HOST_ADDRESS),
            absent_services=ABSENT_SERVICES.get(role, ()),
        )

    azure = endpoints.Azure(
        names={spec.address: hostnames[role] for role, spec in specs.items()},
        secrets={rendered.munge_secret_name: base64.b64encode(os.urandom(1024)).decode()},
        scale_set_id=rendered.scale_set_id,
        power=lambda action, ids: cluster.power(action, ids),
    )
    for index, seconds in forbid_vault_s.items():
        azure.forbid(NODE_ADDRESSES[index], seconds)
    namespace = vms.Namespace(f"dtrain-boot-{os.getpid()}", HOST_ADDRESS, PREFIXLEN, IMDS_ADDRESS)
    with ExitStack() as stack:
        stack.callback(namespace.delete)
        machines: dict[str, vms.Vm] = {}
        stack.callback(lambda: [vm.stop() for vm in machines.values()])
        for index, (role, spec) in enumerate(specs.items()):
            document = rendered.documents["node" if role in rendered.node_names else role]
            vm_seed = seed.make_seed(
                work / role / "seed.iso",
                instance_id=f"boot-test-{role}",
                hostname=hostnames[role],
                user_data=document,
                vendor=vendor("node" if role in rendered.node_names else role),
                network=seed.network_config(
                    mac=spec.mac, address=spec.address, prefixlen=PREFIXLEN, gateway=HOST_ADDRESS
                ),
            )
            machines[role] = vms.Vm(spec, image, work / role, vm_seed, namespace, f"tap{index}")
        cluster = BootCluster(rendered, azure, namespace, machines, key)
        imds_state = work / "imds"
        imds_state.mkdir()
        with namespace.entered():
            repo_server = subprocess.Popen(
                ["ip", "netns", "exec", namespace.name, "python3", "-m", "http.server", "--bind", HOST_ADDRESS,
                 "--directory", str(repository), str(seed.REPO_PORT)],
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
        for vm in machines.values():
            vm.start()
        yield cluster


def _azure_hostname(node: str) -> str:
    """The hostname Azure gives a scale-set instance: the prefix as given, the base-36 digits upper case."""
    prefix, digits = node[:-6], node[-6:]
    return prefix + digits.upper()
