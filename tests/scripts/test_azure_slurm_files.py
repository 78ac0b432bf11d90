"""The Azure head node's slurm.conf, gres.conf and cgroup.conf, exactly as its cloud-config writes them,
run by a real slurmctld and a configless slurmd in network namespaces, and a one-GPU job confined by
them to its own GPU; with the head node's slurmdbd.conf, MariaDB settings and associations run by a real
slurmdbd and MariaDB beside slurmctld, which records the job with its GPU (sacct).

Debian 12's Slurm here is 22.05, where Azure's hosts run 25.11: tests/infra/test_slurm_source.py holds
the files to 25.11's keys, this proves that real daemons take them and that a GPU node registers as
an Azure node would. The cluster is 100 on-demand and 100 Spot ND96isr_H100_v5 nodes (autostop on and
off); the node is the first on-demand one, with eight GPU device files (major 240: no driver answers)
under /dev in its own mount namespace, and the cgroup v1 hierarchies that Slurm's cgroup plugins use
on this machine (freezer, cpuset, memory, devices) mounted at /sys/fs/cgroup, each rooted at a cgroup
of the test's own. slurmd is given no slurm.conf: it fetches all three files from slurmctld.

Only the settings that place the daemons on this machine differ from Azure's (SANDBOX), and the test
checks that every other line is Azure's. Where 22.05 needs DNS that 25.11 does not (a cloud node's
address), the head's /etc/hosts names the node.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.local import network as local_network
from dtrain.local import slurm_conf as local_slurm_conf
from infra.cloud_init import render_cgroup_conf, render_gres_conf
from infra.cloud_init.accounting import (
    ASSOCIATIONS_PATH,
    MARIADB_CONF_PATH,
    PASSWORD_SLOT,
    SLURMDBD_SETUP_PATH,
    SLURMDBD_TEMPLATE_PATH,
    database_grant_template,
)
from infra.cloud_init.head_node import CGROUP_CONF_PATH, GRES_CONF_PATH, SLURM_CONF_PATH
from infra.cloud_init.slurm import NodeSet
from infra.cloud_init.slurm_packages import SLURM_USER
from infra.contract import SLURMCTLD_PORT, SLURMDBD_PORT
from infra.skus import GPU_SKUS
from tests.infra.documents import files_of, head_doc, power, slurm_conf
from tests.polling import wait_for

from .conftest import address, cluster_name, free_subnet

SKU = GPU_SKUS["Standard_ND96isr_H100_v5"]
NODES = [f"hvd-gpu-{i:06x}" for i in range(100)]
SPOT_NODES = [f"hvd-spot-{i:06x}" for i in range(100)]
NODE = NODES[0]
CONTROLLER = "hvd-head"
GPUS = 8
DEVICE_MAJOR = 240  # Linux's devices.txt: for local and experimental use
CGROUP_ROOT = Path("/sys/fs/cgroup")
# freezer and cpuset for proctrack/cgroup, memory and devices for the job's limits, cpuacct and memory for
# jobacct_gather/cgroup's usage
CONTROLLERS = ("freezer", "cpuset", "memory", "devices", "cpuacct")
STAND_INS = ("SuspendProgram", "ResumeProgram", "ResumeFailProgram", "HealthCheckProgram", "Prolog", "Epilog")
# What places the daemons on this machine; every other line of slurm.conf is Azure's.
SANDBOX = {
    "SlurmctldHost",  # Azure's name, this namespace's address
    "StateSaveLocation",
    "SlurmdSpoolDir",
    "AuthInfo",  # munged's socket in the test's directory
    "SlurmctldPidFile",
    "SlurmdPidFile",
    # slurmd reports the node's configured 96 CPUs and 1.7 TB, not this machine's
    "SlurmdParameters",
    # slurmdbd at this namespace's address, reached through the test's munged socket
    "AccountingStorageHost",
    "AccountingStoragePass",
    # stand-ins that succeed: Azure's programs are not on this machine (without them slurmctld would
    # switch its power saving off instead of reading its settings, and drain the node after a job)
    *STAND_INS,
}


# What the head node's cloud-config writes for slurmdbd (the configuration, without its password, and the
# associations) and MariaDB, by the names the test gives them.
ACCOUNTING_FILES = {
    SLURMDBD_TEMPLATE_PATH: "slurmdbd.conf.in",
    ASSOCIATIONS_PATH: "associations.cfg",
    MARIADB_CONF_PATH: "mariadb.cnf",
}
# slurmdbd.conf's lines that place the daemon here; every other line is Azure's
DBD_SANDBOX = {"DbdAddr", "LogFile", "PidFile", "AuthInfo"}
PASSWORD = "sandbox-Passw0rd"


def azure_files(autostop_s: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """The three files the head node's cloud-config writes that slurmctld serves to every slurmd, and those
    of slurmdbd and MariaDB, with the SQL of slurmdbd-setup's grant."""
    node_set = NodeSet(names=NODES, cpus=SKU.vcpus, real_memory_mb=SKU.slurm_real_memory_mb, gpus=GPUS)
    spot_set = NodeSet(names=SPOT_NODES, cpus=SKU.vcpus, real_memory_mb=SKU.slurm_real_memory_mb, gpus=GPUS)
    conf = slurm_conf(nodes=node_set, spot_nodes=spot_set, power=power(suspend_time_s=autostop_s))
    document = head_doc(slurm_conf=conf, gres_conf=render_gres_conf(GPUS), cgroup_conf=render_cgroup_conf())
    files = files_of(document)
    slurm = {
        Path(path).name: str(files[path]["content"]) for path in (SLURM_CONF_PATH, GRES_CONF_PATH, CGROUP_CONF_PATH)
    }
    accounting = {name: str(files[path]["content"]) for path, name in ACCOUNTING_FILES.items()}
    # slurmdbd-setup's SQL (GRANT_SQL), with the password it fetches from Key Vault
    assert shlex.quote(database_grant_template()) in str(files[SLURMDBD_SETUP_PATH]["content"])
    accounting["grant.sql"] = database_grant_template().replace(PASSWORD_SLOT, PASSWORD)
    return slurm, accounting


@dataclass
class Sandbox:
    root: Path
    name: str
    subnet: str

    @property
    def head_address(self) -> str:
        return address(self.subnet, 2)

    @property
    def node_address(self) -> str:
        return address(self.subnet, 3)

    @property
    def conf_dir(self) -> Path:
        return self.root / "etc"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"  # the name slurmd looks for before it has a config

    @property
    def stand_in(self) -> Path:
        return self.root / "succeed"

    @property
    def namespaces(self) -> tuple[str, str]:
        return f"{self.name}-head", f"{self.name}-n0"

    @property
    def cgroup(self) -> str:
        return f"hvd-azure-files-{self.name}"

    @property
    def database(self) -> Path:
        return self.root / "mariadb"

    def sandboxed_dbd(self, conf: str) -> str:
        """Azure's slurmdbd.conf with the lines that place the daemon here, and the password slurmdbd-setup adds."""
        return (
            local_slurm_conf.override(
                conf,
                {
                    "DbdAddr": self.head_address,
                    "LogFile": str(self.root / "logs" / "slurmdbd-file.log"),
                    "PidFile": str(self.root / "slurmdbd.pid"),
                    "AuthInfo": f"socket={self.munge_socket}",
                },
            )
            + f"StoragePass={PASSWORD}\n"
        )

    def sandboxed(self, conf: str) -> str:
        return local_slurm_conf.override(
            conf,
            {
                "SlurmctldHost": f"{CONTROLLER}({self.head_address})",
                "StateSaveLocation": str(self.root / "state"),
                "SlurmdSpoolDir": str(self.spool),
                "AuthInfo": f"socket={self.munge_socket}",
                "SlurmctldPidFile": str(self.root / "slurmctld.pid"),
                "SlurmdPidFile": str(self.root / "slurmd.pid"),
                "SlurmdParameters": "config_overrides",
                "AccountingStorageHost": self.head_address,
                "AccountingStoragePass": str(self.munge_socket),
                **dict.fromkeys(STAND_INS, str(self.stand_in)),
            },
        )


def lines_without(text: str, keys: set[str]) -> list[str]:
    return [line for line in text.splitlines() if line.split("=", 1)[0] not in keys and not line.startswith("#")]


def node_script(sandbox: Sandbox) -> str:
    """Run in the node's own mount and UTS namespaces before slurmd: GPU device files under a /dev of
    its own, munged's socket where slurmd looks for it, the cgroup hierarchies rooted at the test's
    cgroup, the node's hostname."""
    devices = " && ".join(
        [
            "mount -t tmpfs -o mode=755 dev /dev",
            "mknod -m 666 /dev/null c 1 3",
            "mknod -m 666 /dev/zero c 1 5",
            "mknod -m 666 /dev/urandom c 1 9",
            *(f"mknod -m 666 /dev/nvidia{index} c {DEVICE_MAJOR} {index}" for index in range(GPUS)),
        ]
    )
    cgroups = " && ".join(
        [f"mount -t tmpfs cgroups {CGROUP_ROOT}", f"mkdir {CGROUP_ROOT}/all"]
        + [
            f"mkdir {CGROUP_ROOT}/{name} && mount -t cgroup -o {name} {name} {CGROUP_ROOT}/all && "
            f"mount --bind {CGROUP_ROOT}/all/{sandbox.cgroup} {CGROUP_ROOT}/{name} && umount {CGROUP_ROOT}/all"
            for name in CONTROLLERS
        ]
        # cgroup/v1 is told from v2 by the file system at systemd/ (autodetect), never written to
        + [f"mkdir {CGROUP_ROOT}/systemd && mount -t cgroup -o ro,none,name=systemd systemd {CGROUP_ROOT}/systemd"]
    )
    munge = f"mkdir -p /run/munge && mount --bind {sandbox.munge_socket.parent} /run/munge"
    return f'{devices} && {cgroups} && {munge} && hostname {NODE} && exec "$@"'


def make_cgroups(sandbox: Sandbox) -> None:
    for name in CONTROLLERS:
        group = CGROUP_ROOT / name / sandbox.cgroup
        group.mkdir()
        if name == "cpuset":  # a new cpuset has no CPUs nor memory nodes until given its parent's
            for key in ("cpuset.cpus", "cpuset.mems"):
                (group / key).write_text((CGROUP_ROOT / name / key).read_text())


def remove_cgroups(sandbox: Sandbox) -> None:
    """What Slurm made below the test's cgroups, deepest first, then those."""
    for name in CONTROLLERS:
        top = CGROUP_ROOT / name / sandbox.cgroup
        if top.is_dir():
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


def cgroups_available() -> bool:
    return all((CGROUP_ROOT / name / "cgroup.procs").exists() for name in CONTROLLERS) and os.access(
        CGROUP_ROOT / "devices", os.W_OK
    )


@contextlib.contextmanager
def daemons(
    sandbox: Sandbox, files: dict[str, str], accounting: dict[str, str]
) -> Iterator[dict[str, subprocess.Popen]]:
    """munged on the host; MariaDB, slurmdbd (with the cluster's associations loaded) and slurmctld in the
    head namespace, as head-setup starts them; slurmd (configless) in the node's."""
    head_ns, node_ns = sandbox.namespaces
    bridge, veths = f"{sandbox.name}br", [f"{sandbox.name}vh", f"{sandbox.name}v0"]
    processes: dict[str, subprocess.Popen] = {}
    logs = sandbox.root / "logs"
    try:
        for directory in (sandbox.conf_dir, sandbox.spool, sandbox.root / "state", sandbox.munge_socket.parent, logs):
            directory.mkdir(parents=True, mode=0o755)
        # slurmctld runs as Azure's SlurmUser, slurm (Debian's package made the account here)
        shutil.chown(sandbox.root / "state", SLURM_USER, SLURM_USER)
        for name, text in files.items():
            (sandbox.conf_dir / name).write_text(text)
        sandbox.stand_in.write_text("#!/bin/sh\nexit 0\n")
        sandbox.stand_in.chmod(0o755)
        key = sandbox.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        make_cgroups(sandbox)
        local_network.add_bridge(bridge, address(sandbox.subnet, 1), 24)
        for namespace, veth, host in zip((head_ns, node_ns), veths, (2, 3), strict=True):
            local_network.add_namespace(namespace, veth, bridge, address(sandbox.subnet, host), 24)
        head_etc = local_network.etc_dir(head_ns)
        head_etc.mkdir(parents=True, exist_ok=True)
        (head_etc / "hosts").write_text(
            local_network.hosts_file_text([(sandbox.head_address, CONTROLLER), (sandbox.node_address, NODE)])
        )
        env = {key: value for key, value in os.environ.items() if key != "SLURM_CONF"}

        def start(role: str, argv: list[str]) -> None:
            with (logs / f"{role}.log").open("w") as log:
                processes[role] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

        munge = sandbox.munge_socket
        start("munged", ["/usr/sbin/munged", "--foreground", f"--key-file={key}", f"--socket={munge}",
                         f"--pid-file={munge.parent / 'munged.pid'}", f"--seed-file={munge.parent / 'seed'}",
                         "--force"])  # fmt: skip
        wait_for(munge.is_socket, 30, "munged's socket")
        conf = sandbox.conf_dir / "slurm.conf"
        start_accounting(sandbox, accounting, start, env)
        start(
            "slurmctld",
            ["ip", "netns", "exec", head_ns, "unshare", "--uts", "sh", "-c",
             f'hostname {CONTROLLER} && exec /usr/sbin/slurmctld -D -f "$0"', str(conf)],
        )  # fmt: skip
        start(
            "slurmd",
            ["ip", "netns", "exec", node_ns, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", node_script(sandbox), "node",
             "/usr/sbin/slurmd", "-D", "-N", NODE, "--conf-server", f"{sandbox.head_address}:{SLURMCTLD_PORT}"],
        )  # fmt: skip
        yield processes
    finally:
        for process in reversed(list(processes.values())):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        local_network.remove([head_ns, node_ns], [*veths, bridge], [str(local_network.etc_dir(head_ns))])
        remove_cgroups(sandbox)


def start_accounting(sandbox: Sandbox, accounting: dict[str, str], start: Callable, env: dict[str, str]) -> None:
    """MariaDB with the head node's settings (and this sandbox's paths), slurmdbd with its slurmdbd.conf,
    then the associations, as slurmdbd-setup does it."""
    head_ns = sandbox.namespaces[0]
    for name in ("mariadb.cnf", "grant.sql", "associations.cfg"):
        (sandbox.root / name).write_text(accounting[name])
    sandbox.database.mkdir(mode=0o700)
    paths = [f"--datadir={sandbox.database}", f"--socket={sandbox.root / 'mariadb.socket'}",
             f"--pid-file={sandbox.root / 'mariadbd.pid'}"]  # fmt: skip
    defaults = f"--defaults-file={sandbox.root / 'mariadb.cnf'}"
    installed = subprocess.run(
        ["mariadb-install-db", defaults, *paths, "--user=root", "--skip-test-db"], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    start("mariadb", ["ip", "netns", "exec", head_ns, "/usr/sbin/mariadbd", defaults, *paths, "--user=root",
                      f"--init-file={sandbox.root / 'grant.sql'}"])  # fmt: skip
    wait_for((sandbox.root / "mariadb.socket").is_socket, 60, "MariaDB's socket")
    # slurmdbd runs as SlurmUser (slurm): its configuration is slurm's alone, as slurmdbd-setup writes it
    dbd_conf = sandbox.conf_dir / "slurmdbd.conf"
    dbd_conf.write_text(sandbox.sandboxed_dbd(accounting["slurmdbd.conf.in"]))
    dbd_conf.chmod(0o600)
    shutil.chown(dbd_conf, SLURM_USER, SLURM_USER)
    (sandbox.root / "logs" / "slurmdbd-file.log").touch()
    shutil.chown(sandbox.root / "logs" / "slurmdbd-file.log", SLURM_USER, SLURM_USER)
    conf = sandbox.conf_dir / "slurm.conf"
    dbd = f'hostname {CONTROLLER} && export SLURM_CONF="$0" && exec /usr/sbin/slurmdbd -D -s'
    start("slurmdbd", ["ip", "netns", "exec", head_ns, "unshare", "--uts", "sh", "-c", dbd, str(conf)])

    def loaded() -> bool:
        load = subprocess.run(
            ["sacctmgr", "--immediate", "load", str(sandbox.root / "associations.cfg")],
            env={**env, **local_slurm_conf.client_env(conf)}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return load.returncode == 0

    wait_for(loaded, 60, f"slurmdbd on port {SLURMDBD_PORT} to take the associations", interval=0.5)


def show_node(conf: Path) -> dict[str, str]:
    proc = subprocess.run(
        ["scontrol", "show", "node", NODE, "--oneliner"],
        env={**os.environ, **local_slurm_conf.client_env(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word)


def logs_of(sandbox: Sandbox) -> str:
    return "".join(f"\n--- {log.name} ---\n{log.read_text()[-3000:]}" for log in (sandbox.root / "logs").glob("*.log"))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("/usr/sbin/slurmctld") is None
    or subprocess.run(["getent", "passwd", SLURM_USER], capture_output=True).returncode != 0
    or not cgroups_available(),
    reason="needs root, Debian's Slurm and munge (and its slurm account), the cgroup v1 freezer, cpuset, memory "
    "and devices hierarchies",
)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that the slurm account can reach (pytest's are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="hvd-azure-slurm-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
@pytest.mark.parametrize("autostop_s", [1800, None], ids=["autostop", "no-autostop"])
def test_azure_files_start_the_daemons_and_a_gpu_node_registers_configless(
    open_dir: Path, autostop_s: int | None
) -> None:
    files, accounting = azure_files(autostop_s)
    sandbox = Sandbox(open_dir, cluster_name("z" if autostop_s else "y"), free_subnet())
    controller_files = {**files, "slurm.conf": sandbox.sandboxed(files["slurm.conf"])}
    # Azure's files, but for the lines that place the daemons here
    assert lines_without(controller_files["slurm.conf"], SANDBOX) == lines_without(files["slurm.conf"], SANDBOX)
    dbd = accounting["slurmdbd.conf.in"]
    assert lines_without(sandbox.sandboxed_dbd(dbd), DBD_SANDBOX | {"StoragePass"}) == lines_without(dbd, DBD_SANDBOX)
    with daemons(sandbox, controller_files, accounting) as processes:
        conf = sandbox.conf_dir / "slurm.conf"

        def registered() -> dict[str, str] | None:
            assert all(p.poll() is None for p in processes.values()), logs_of(sandbox)
            node = show_node(conf)
            # 22.05 keeps the CLOUD flag on a cloud node that is up; POWERED_DOWN, DRAIN or DOWN would say more
            return node if node.get("State") in ("IDLE", "IDLE+CLOUD") else None

        try:
            node = wait_for(registered, 60, f"{NODE} to register idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {show_node(conf)}{logs_of(sandbox)}") from None
        assert (node["CPUTot"], node["RealMemory"], node["Gres"]) == (
            str(SKU.vcpus),
            str(SKU.slurm_real_memory_mb),
            "gpu:8",
        )
        # configless: slurmd was given no file; it runs on the controller's three, fetched into its spool
        cache = sandbox.spool / "conf-cache"
        assert {name: (cache / name).read_text() for name in files} == controller_files
        # Azure's cgroup.conf, for real: a one-GPU job (tracked by proctrack/cgroup) may open its own GPU's
        # device file (no driver answers: ENXIO) and no other (EPERM, the job's devices cgroup)
        probe = (
            "import errno, glob\n"
            "for path in sorted(glob.glob('/dev/nvidia*')):\n"
            "    try:\n        open(path, 'rb')\n    except OSError as exc:\n"
            "        print(path, errno.errorcode[exc.errno])\n"
        )
        (sandbox.root / "probe.py").write_text(probe)
        job = subprocess.run(
            ["sbatch", "--wait", "--gres=gpu:1", "--cpus-per-gpu=1", f"--output={sandbox.root / 'job.out'}",
             f"--wrap=python3 {sandbox.root / 'probe.py'}"],
            env={**os.environ, **local_slurm_conf.client_env(conf)}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr + logs_of(sandbox)
        assert (sandbox.root / "job.out").read_text().splitlines() == [
            "/dev/nvidia0 ENXIO",
            *(f"/dev/nvidia{index} EPERM" for index in range(1, GPUS)),
        ]
        # slurmdbd recorded it, with its one GPU (AccountingStorageTRES)
        job_id = job.stdout.split()[-1]

        def recorded() -> str | None:
            sacct = subprocess.run(
                ["sacct", "-X", "-n", "-P", "-j", job_id, "--format=State,AllocTRES"],
                env={**os.environ, **local_slurm_conf.client_env(conf)}, capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            return sacct.stdout.strip() if sacct.stdout.startswith("COMPLETED|") else None

        record = wait_for(recorded, 60, f"job {job_id} in sacct")
        assert "gres/gpu=1" in record.split("|")[1].split(","), record + logs_of(sandbox)
        # both partitions of 100, the other 199 nodes powered down (22.05's sinfo hides those: 23.11+ shows them)
        partitions = subprocess.run(
            ["scontrol", "show", "partition", "--oneliner"],
            env={**os.environ, **local_slurm_conf.client_env(conf)},
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
        totals = {line.split()[0]: re.search(r" TotalNodes=(\d+) ", line)[1] for line in partitions}
        assert totals == {"PartitionName=gpu": "100", "PartitionName=spot": "100"}
