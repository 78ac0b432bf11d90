"""Tests for the cloud-init renderers.

Each rendered document goes through Debian's `cloud-init schema`, each embedded shell script through
shellcheck (every severity, style included), the systemd units through `systemd-analyze verify`,
and the scripts themselves run here against stub commands (mdadm, mount, curl, docker, ...) with
their system paths pointed into a temporary directory. Slurm's files and programs: test_slurm.py.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shlex
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from infra.cloud_init import check_nccl_env, custom_data_bytes
from infra.cloud_init._common import MAX_CUSTOM_DATA_BYTES
from infra.cloud_init.shared_storage import LustreShare, NfsShare
from infra.head import RESUME_TIMEOUT_S
from infra.skus import GPU_SKUS, GpuSku
from tests.infra.documents import (
    ACR,
    BLOB_PULL,
    CLIENT_ID,
    CLUSTER_CIDR,
    DOCUMENTS,
    HEAD_IP,
    NFS_IP,
    SHELL_SCRIPTS,
    SKUS,
    files_of,
    head_doc,
    nfs_doc,
    node_doc,
    script_of,
    setup_packages,
)
from tests.infra.sandbox import PACKAGED_UNITS_DIR, Sandbox, shell_value, systemd_verify, tool, with_value

AAD_TOKEN = "AAD-SECRET-eyJ0eXAiOiJKV1Qi"
ACR_REFRESH_TOKEN = "ACR-SECRET-refresh-token"
UNITS_DIR = "/etc/systemd/system/"


# --- validators: cloud-init schema, shellcheck, systemd-analyze -------------------------------


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_document_passes_cloud_init_schema(name: str, tmp_path: Path) -> None:
    document = DOCUMENTS[name]
    assert document.startswith("#cloud-config\n")
    path = tmp_path / "user-data"
    path.write_text(document)
    result = subprocess.run(
        [tool("cloud-init"), "schema", "--config-file", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Valid cloud-config" in result.stdout


@pytest.mark.parametrize("name", sorted(SHELL_SCRIPTS))
def test_embedded_shell_script_passes_shellcheck(name: str) -> None:
    shell, text = SHELL_SCRIPTS[name]
    result = subprocess.run(
        [tool("shellcheck"), "--severity=style", f"--shell={shell}", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def runnable(unit: str) -> str:
    """The unit with each ExecStart= that names a program (continuation lines too) running /bin/true:
    verify insists that the programs exist; the scripts they run are checked above."""
    return re.sub(r"^ExecStart=/(?:.*\\\n)*.*$", "ExecStart=/bin/true", unit, flags=re.MULTILINE)


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    files = files_of(node_doc())
    units = [path for path in files if re.fullmatch(r"/etc/systemd/system/[^/]+", path)]
    assert sorted(Path(unit).name for unit in units) == [
        "acr-login-boot.service",
        "acr-login.service",
        "acr-login.timer",
        "azure-health-checks.service",
        "dcgm-exporter.service",
        "dtrain-users.service",
        "dtrain-users.timer",
        "nccl-conf.service",
        "node-setup.service",
        "nvme-raid.service",
        "spot-agent.service",
    ]
    for unit in units:
        (tmp_path / Path(unit).name).write_text(runnable(files[unit]["content"]))
    # The slurmd drop-in, over a stand-in for the packaged unit it amends.
    (tmp_path / "slurmd.service").write_text("[Service]\nExecStart=/bin/true\n")
    drop_in = tmp_path / "slurmd.service.d" / "configless.conf"
    drop_in.parent.mkdir()
    drop_in.write_text(runnable(files["/etc/systemd/system/slurmd.service.d/configless.conf"]["content"]))
    # drop-in directories are read from the unit search path only: systemd_verify sets it to tmp_path
    result = systemd_verify(tmp_path, [*(Path(unit).name for unit in units), "slurmd.service"])
    assert result.returncode == 0, result.stderr
    # Unknown keys are only warnings: any mention of our units is a finding.
    found = [
        line
        for line in result.stderr.splitlines()
        if re.search(r"acr-login|azure-health|dcgm-export|dtrain-users|nccl-conf|node-setup|nvme-raid|configless", line)
    ]
    assert not found, result.stderr


# The DCGM of the ubuntu-hpc image's host engine (nvidia-dcgm.service) at the time of writing.
HOST_DCGM = (4, 5, 2)


def test_dcgm_exporter_runs_its_own_embedded_engine_from_a_pinned_image() -> None:
    """A client of the host engine must match its DCGM version, which a pinned image cannot follow: the
    exporter runs the engine embedded in its image, with the GPUs and the capability NVIDIA's docs give it."""
    unit = files_of(node_doc())["/etc/systemd/system/dcgm-exporter.service"]["content"]
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    args = shlex.split(exec_start)
    assert not [arg for arg in args if arg == "-r" or arg.startswith("--remote-hostengine-info")]
    ordering = re.findall(r"^(?:After|Wants|Requires)=(.*)$", unit, re.MULTILINE)
    assert not [line for line in ordering if "nvidia-dcgm.service" in line]  # it waits for no host engine
    assert "--gpus all" in exec_start and "--cap-add SYS_ADMIN" in exec_start
    image = re.search(r"^Environment=IMAGE=(\S+)$", unit, re.MULTILINE)[1]
    repository, tag = image.rsplit(":", 1)
    assert repository == "nvcr.io/nvidia/k8s/dcgm-exporter" and "${IMAGE}" in args
    dcgm, exporter, base = tag.split("-", 2)  # <DCGM>-<exporter>-<base image>: a release, not a moving tag
    assert re.fullmatch(r"\d+\.\d+\.\d+", exporter) and base == "ubuntu22.04"
    assert tuple(int(part) for part in dcgm.split(".")) >= HOST_DCGM
    # Slurm's prolog and epilog keep the job mapping (one file per GPU index): the hpc_job label
    job_map = re.search(r"^Environment=JOB_MAP=(\S+)$", unit, re.MULTILINE)[1]
    assert job_map == "/run/dcgm-job-map" and "${JOB_MAP}:${JOB_MAP}:ro" in args
    assert args[args.index("--hpc-job-mapping-dir") + 1] == "${JOB_MAP}"
    assert "ExecStartPre=/bin/mkdir -p ${JOB_MAP}" in unit


# SchedMD's packaged units as far as the boot order goes (etc/slurmd.service.in, slurmctld.service.in):
# the setup scripts enable them, into multi-user.target.
PACKAGED_SLURM_UNITS = {
    "slurmd.service": "After=munge.service network-online.target remote-fs.target",
    "slurmctld.service": "After=network-online.target munge.service",
}
# Debian's cloud-init: its package enables these into cloud-init.target, and on a cloud its generator
# enables cloud-init.target into multi-user.target (cloud-final.service is After=multi-user.target).
CLOUD_INIT_SERVICES = ("cloud-init-local.service", "cloud-init.service", "cloud-config.service", "cloud-final.service")
_SYSTEMCTL_ENABLE = re.compile(r"systemctl enable ([^;&|\n]+)")


def enabled_by(document: str) -> set[str]:
    """The units that a document's runcmd and programs enable (`systemctl enable [--now] UNIT...`)."""
    parsed = yaml.safe_load(document)
    texts = [entry["content"] for entry in parsed["write_files"]] + [shlex.join(item) for item in parsed["runcmd"]]
    words = [word for text in texts for found in _SYSTEMCTL_ENABLE.finditer(text) for word in found[1].split()]
    return {word if "." in word else f"{word}.service" for word in words if not word.startswith("-")}


def enable(directory: Path, unit: str) -> None:
    """`systemctl enable unit` into directory: a link in the .wants/ of each target its [Install] names."""
    path = directory / unit if (directory / unit).exists() else PACKAGED_UNITS_DIR / unit
    for targets in re.findall(r"^WantedBy=(.+)$", path.read_text(), re.MULTILINE):
        for target in targets.split():
            wants = directory / f"{target}.wants"
            wants.mkdir(exist_ok=True)
            (wants / unit).symlink_to(path)


def units_at_a_later_boot(directory: Path, document: str) -> list[str]:
    """directory as a machine's units at every boot after its first: the document's (drop-ins too) and
    Slurm's packaged ones, enabled as its runcmd and programs enable them, and Debian's cloud-init as a
    cloud enables it. The names of the document's units."""
    ours = {
        path.removeprefix(UNITS_DIR): entry for path, entry in files_of(document).items() if path.startswith(UNITS_DIR)
    }
    for name, entry in ours.items():
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_text(runnable(str(entry["content"])))
    for name, after in PACKAGED_SLURM_UNITS.items():
        (directory / name).write_text(
            f"[Unit]\n{after}\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n"
        )
    for unit in sorted(enabled_by(document)) + list(CLOUD_INIT_SERVICES):
        enable(directory, unit)
    (directory / "multi-user.target.wants" / "cloud-init.target").symlink_to(PACKAGED_UNITS_DIR / "cloud-init.target")
    return sorted(name for name in ours if "/" not in name)


@pytest.mark.parametrize("render", [node_doc, head_doc], ids=["node", "head"])
def test_no_ordering_cycle_at_a_later_boot(render: Callable[[], str], tmp_path: Path) -> None:
    """Once enabled, the setup unit and what the scripts enable start with multi-user.target beside
    cloud-init's stages, and cloud-final.service comes after multi-user.target: a unit wanted by
    multi-user.target and ordered after cloud-final is a cycle, which systemd breaks by deleting a job
    (the setup's, or another's) at every boot (issue 40)."""
    units = units_at_a_later_boot(tmp_path, render())
    assert (tmp_path / "cloud-init.target.wants" / "cloud-final.service").exists()
    result = systemd_verify(tmp_path, ["multi-user.target", *units], packaged_units_only=True)
    assert "ordering cycle" not in result.stderr.lower(), result.stderr
    assert result.returncode == 0, result.stderr


def test_slurmd_drop_in_runs_configless_under_the_node_name_that_setup_writes() -> None:
    files = files_of(node_doc())
    drop_in = files["/etc/systemd/system/slurmd.service.d/configless.conf"]["content"]
    assert re.search(r"^ConditionPathExists=$", drop_in, re.MULTILINE)  # clears the packaged unit's condition
    exec_starts = re.findall(r"^ExecStart=(.*)$", drop_in, re.MULTILINE)
    assert exec_starts == ["", "/usr/sbin/slurmd -D -s -N ${SLURMD_NODENAME} --conf-server ${SLURMCTLD_ADDRESS}"]
    assert "Restart=on-failure" in drop_in
    environment_file = re.search(r"^EnvironmentFile=(.*)$", drop_in, re.MULTILINE)[1]
    setup = script_of(node_doc(), "/usr/local/sbin/slurmd-setup")
    assert shell_value(setup, "ENV_FILE") == environment_file
    assert shell_value(setup, "SLURMCTLD_ADDRESS") == f"{HEAD_IP}:6817"


def test_slurmd_setup_names_the_node_in_lower_case_and_restarts_munge_first(sandbox: Sandbox) -> None:
    env_file = sandbox.root / "slurmd-configless"
    script = with_value(script_of(node_doc(), "/usr/local/sbin/slurmd-setup"), "ENV_FILE", str(env_file))
    script = with_value(script, "MUNGE_KEY", str(sandbox.bin / "munge-key"))
    sandbox.stub("hostname", 'echo "hvd-gpu-00000A"')
    sandbox.stub("systemctl")
    sandbox.stub("munge-key")
    result = sandbox.run(script)
    assert result.returncode == 0, result.stderr
    assert env_file.read_text() == f"SLURMD_NODENAME=hvd-gpu-00000a\nSLURMCTLD_ADDRESS={HEAD_IP}:6817\n"
    assert shell_value(script_of(node_doc(), "/usr/local/sbin/slurmd-setup"), "MUNGE_KEY") in files_of(node_doc())
    # the cluster's key is fetched from Key Vault before munged restarts with it
    assert [line for line in sandbox.log.read_text().splitlines() if line.split()[0] != "hostname"] == [
        "munge-key ",
        "systemctl restart munge",
        "systemctl daemon-reload",
        "systemctl enable slurmd",
        "systemctl restart slurmd",
    ]


def test_no_script_traces_and_tokens_only_travel_through_stdin() -> None:
    for name, (_, text) in SHELL_SCRIPTS.items():
        assert not re.search(r"set\s+-\w*x|xtrace|bash\s+-x", text), name
    acr_login = script_of(node_doc(), "/usr/local/sbin/acr-login")
    assert "--password-stdin" in acr_login
    assert "--data @-" in acr_login
    assert not re.search(r"--password[ =]|\s-p\s|--data-urlencode|echo .*token", acr_login)


def test_what_the_hosts_run_comes_from_dtrain_remote() -> None:
    """One folder holds every program a host runs; the documents install its files as they are
    (or rendered, where they have placeholders), and infra/ keeps no copies."""
    remote = Path(__file__).parents[2] / "dtrain" / "remote"
    node = files_of(node_doc())
    assert node["/usr/local/sbin/slurm-epilog"]["content"] == (remote / "slurm" / "slurm-epilog.sh").read_text()
    assert "@EXPECTED_GPUS@" in (remote / "slurm" / "slurm-health-check.sh").read_text()
    assert not list((Path(__file__).parents[2] / "infra").rglob("*.sh"))


# --- NFS server ----------------------------------------------------------------------------


def test_nfs_export_names_only_the_allowed_cidr() -> None:
    setup = script_of(nfs_doc(allowed_cidr="10.20.1.0/24"), "/usr/local/sbin/nfs-data-setup")
    export_line = shell_value(setup, "EXPORT_LINE")
    assert export_line == "/export 10.20.1.0/24(rw,sync,no_subtree_check,no_root_squash)"
    path, client = str(export_line).split()
    assert path == "/export"
    assert client.split("(")[0] == "10.20.1.0/24"
    # Nothing else is written to the exports file.
    writes = re.findall(r".*>\"\$EXPORTS_FILE\"$", setup, re.MULTILINE)
    assert writes == ['  printf \'%s\\n\' "$EXPORT_LINE" >"$EXPORTS_FILE"']


@pytest.mark.parametrize("count", [1, 2, 4])
def test_nfs_data_disks_are_exactly_the_attached_luns(count: int) -> None:
    setup = script_of(nfs_doc(data_disk_count=count), "/usr/local/sbin/nfs-data-setup")
    assert shell_value(setup, "DATA_DISKS") == [f"/dev/disk/azure/scsi1/lun{lun}" for lun in range(count)]


def test_nfs_installs_packages_blob_pull_and_mount_guard() -> None:
    document = nfs_doc()
    parsed = yaml.safe_load(document)
    assert set(parsed["packages"]) == {"nfs-kernel-server", "mdadm", "xfsprogs", "python3"}
    files = files_of(document)
    blob_pull = files["/usr/local/bin/blob-pull"]
    assert blob_pull["content"] == BLOB_PULL
    assert blob_pull["permissions"] == "0755"
    guard = files["/etc/systemd/system/nfs-server.service.d/10-require-export.conf"]["content"]
    assert guard == "[Unit]\nRequiresMountsFor=/export\n"
    # then the people's accounts (tests/infra/test_users.py): after the export, which holds their list
    assert parsed["runcmd"][0] == ["/usr/local/sbin/nfs-data-setup"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"data_disk_count": 0}, "data_disk_count"),
        ({"data_disk_count": 65}, "data_disk_count"),
        ({"data_disk_count": True}, "data_disk_count"),
        ({"export_path": "export"}, "export_path"),
        ({"export_path": "/srv/my data"}, "export_path"),
        ({"export_path": "/"}, "export_path"),
        ({"export_path": "/srv/../etc"}, "export_path"),
        ({"allowed_cidr": "0.0.0.0/0"}, "allowed_cidr"),
        ({"allowed_cidr": "10.0.0.1/24"}, "allowed_cidr"),
        ({"allowed_cidr": "*"}, "allowed_cidr"),
        ({"blob_pull_script": "print('no shebang')"}, "blob_pull_script"),
    ],
)
def test_nfs_rejects_bad_input(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        nfs_doc(**overrides)


def test_document_over_the_azure_custom_data_limit_is_refused() -> None:
    # counted gzipped, as Azure receives it: random text, which gzip cannot shrink below the limit
    padding = random.Random(0).randbytes(80_000).hex()
    with pytest.raises(ValueError, match="bytes gzipped; Azure custom data allows 65535"):
        nfs_doc(blob_pull_script=f"#!/usr/bin/env python3\n# {padding}\n")


def test_custom_data_is_the_gzipped_document_cloud_init_unpacks() -> None:
    document = node_doc()
    packed = custom_data_bytes(document)
    assert gzip.decompress(packed).decode() == document and packed == custom_data_bytes(document)  # stable
    # the largest document keeps 40% of Azure's 65,535 bytes free for what comes next (gzip does the work)
    assert len(packed) < MAX_CUSTOM_DATA_BYTES * 0.6 < len(document.encode())


def nfs_setup_in(sandbox: Sandbox, count: int) -> tuple[str, list[str], Path]:
    """The rendered setup script with its disks and system files moved into the sandbox."""
    script = script_of(nfs_doc(data_disk_count=count), "/usr/local/sbin/nfs-data-setup")
    disks = [f"{sandbox.root}{disk}" for disk in shell_value(script, "DATA_DISKS")]
    for disk in disks:
        Path(disk).parent.mkdir(parents=True, exist_ok=True)
        Path(disk).touch()
    export = sandbox.root / "export"
    script = with_value(script, "DATA_DISKS", disks)
    script = with_value(script, "EXPORT_PATH", str(export))
    script = with_value(script, "FSTAB", str(sandbox.root / "fstab"))
    script = with_value(script, "MDADM_CONF", str(sandbox.root / "mdadm.conf"))
    script = with_value(script, "EXPORTS_FILE", str(sandbox.root / "exports.d" / "training.exports"))
    script = with_value(script, "MD_UUID_LINK_PREFIX", f"{sandbox.root}/by-id/md-uuid-")
    (sandbox.root / "by-id").mkdir()
    # A stateful mdadm/blkid/mount: enough of their behaviour for the script's decisions.
    sandbox.stub(
        "mdadm",
        """state=$STUB_STATE
link() { echo "$STUB_MD_LINK_PREFIX$(cat "$state/md_uuid")"; }
case "$1" in
  --examine) [ -f "$state/md_uuid" ] || exit 1; echo "MD_UUID=$(cat "$state/md_uuid")" ;;
  --create)
    for arg in "$@"; do case $arg in --raid-devices=*) echo "${arg#*=}" >"$state/md_devices" ;; esac; done
    echo 0a1b2c3d:4e5f6a7b:8c9d0e1f:2a3b4c5d >"$state/md_uuid"
    touch "$(link)" ;;
  --assemble) touch "$(link)" ;;
  --detail)
    case "$2" in
      --export) echo MD_LEVEL=raid0; echo "MD_DEVICES=$(cat "$state/md_devices")" ;;
      --brief) echo "ARRAY /dev/md/nfsdata metadata=1.2 name=nfs:nfsdata UUID=$(cat "$state/md_uuid")" ;;
    esac ;;
esac""",
    )
    sandbox.stub(
        "blkid",
        """case "$*" in
  *"-s TYPE"*) [ -f "$STUB_STATE/formatted" ] || exit 2; echo xfs ;;
  *"-s UUID"*) echo 5e7a1c2d-0000-4000-8000-000000000001 ;;
esac""",
    )
    sandbox.stub("mkfs.xfs", 'touch "$STUB_STATE/formatted"')
    sandbox.stub("mountpoint", '[ -f "$STUB_STATE/mounted" ]')
    sandbox.stub("mount", 'touch "$STUB_STATE/mounted"')
    for name in ("udevadm", "systemctl", "exportfs", "update-initramfs"):
        sandbox.stub(name)
    return script, disks, export


def run_nfs_setup(sandbox: Sandbox, script: str) -> subprocess.CompletedProcess[str]:
    return sandbox.run(script, {"STUB_MD_LINK_PREFIX": f"{sandbox.root}/by-id/md-uuid-"})


@pytest.mark.parametrize("count", [1, 2, 4])
def test_nfs_setup_stripes_exactly_the_luns_formats_mounts_and_exports(sandbox: Sandbox, count: int) -> None:
    script, disks, export = nfs_setup_in(sandbox, count)
    result = run_nfs_setup(sandbox, script)
    assert result.returncode == 0, result.stderr

    creates = [call for call in sandbox.calls("mdadm") if "--create" in call]
    if count == 1:
        assert not creates
        assert sandbox.calls("mkfs.xfs") == [f"mkfs.xfs -K {disks[0]}"]
    else:
        assert creates == [
            f"mdadm --create /dev/md/nfsdata --name=nfsdata --level=0 --raid-devices={count} --run {' '.join(disks)}"
        ]
        assert sandbox.calls("mkfs.xfs") == ["mkfs.xfs -K /dev/md/nfsdata"]
        assert (sandbox.root / "mdadm.conf").read_text().count("ARRAY /dev/md/nfsdata") == 1
        assert len(sandbox.calls("update-initramfs")) == 1
    fstab = (sandbox.root / "fstab").read_text()
    assert fstab == f"UUID=5e7a1c2d-0000-4000-8000-000000000001 {export} xfs defaults,noatime,nofail 0 0\n"
    exports = (sandbox.root / "exports.d" / "training.exports").read_text()
    assert exports == f"/export {CLUSTER_CIDR}(rw,sync,no_subtree_check,no_root_squash)\n"
    # data/ only: the head node makes runs/ for the admin user, the nodes' health check .health/.
    assert [path.name for path in export.iterdir()] == ["data"]
    assert not stat.S_IMODE((export / "data").stat().st_mode) & stat.S_IWOTH
    assert "systemctl enable --now nfs-server" in sandbox.calls("systemctl")
    assert sandbox.calls("exportfs") == ["exportfs -ra"]


def test_nfs_setup_rerun_and_reboot_never_recreate_the_array(sandbox: Sandbox) -> None:
    script, _, _ = nfs_setup_in(sandbox, 4)
    for _ in range(2):
        assert run_nfs_setup(sandbox, script).returncode == 0
    # Reboot with the array not yet assembled and nothing mounted.
    for leftover in [*(sandbox.root / "by-id").iterdir(), sandbox.state / "mounted"]:
        leftover.unlink()
    result = run_nfs_setup(sandbox, script)
    assert result.returncode == 0, result.stderr

    mdadm = sandbox.calls("mdadm")
    assert len([call for call in mdadm if "--create" in call]) == 1
    assert len([call for call in mdadm if "--assemble" in call]) == 1
    assert len(sandbox.calls("mkfs.xfs")) == 1
    assert len(sandbox.calls("update-initramfs")) == 1
    assert len((sandbox.root / "fstab").read_text().splitlines()) == 1
    assert len((sandbox.root / "mdadm.conf").read_text().splitlines()) == 1


def test_nfs_setup_refuses_an_array_of_other_disks(sandbox: Sandbox) -> None:
    script, _, _ = nfs_setup_in(sandbox, 4)
    (sandbox.state / "md_uuid").write_text("0a1b2c3d:4e5f6a7b:8c9d0e1f:2a3b4c5d\n")
    (sandbox.state / "md_devices").write_text("2\n")
    result = run_nfs_setup(sandbox, script)
    assert result.returncode != 0
    assert "refusing to guess" in result.stderr
    assert not sandbox.calls("mkfs.xfs")


# --- GPU node ------------------------------------------------------------------------------


def test_node_mounts_the_nfs_export_of_the_right_server() -> None:
    mount = script_of(node_doc(), "/usr/local/sbin/nfs-mount")
    assert shell_value(mount, "SOURCE") == f"{NFS_IP}:/export"
    assert shell_value(mount, "MOUNT_PATH") == "/mnt/shared"
    assert set(str(shell_value(mount, "MOUNT_OPTIONS")).split(",")) >= {"_netdev", "nofail", "hard"}
    assert "nfs-common" in setup_packages(node_doc())  # what mounts it


def nfs_mount_in(sandbox: Sandbox, *, wait_seconds: int, failures: int) -> tuple[str, Path]:
    script = script_of(node_doc(), "/usr/local/sbin/nfs-mount")
    mount_path = sandbox.root / "mnt" / "shared"
    script = with_value(script, "MOUNT_PATH", str(mount_path))
    script = with_value(script, "FSTAB", str(sandbox.root / "fstab"))
    script = with_value(script, "WAIT_SECONDS", wait_seconds)
    script = with_value(script, "RETRY_SECONDS", 0)
    (sandbox.root / "fstab").write_text("UUID=1234 / ext4 defaults 0 1\n")
    sandbox.stub("mountpoint", '[ -f "$STUB_STATE/mounted" ]')
    # Fails `failures` times (server not up yet), then mounts.
    sandbox.stub(
        "mount",
        'n=$(($(cat "$STUB_STATE/attempts" 2>/dev/null || echo 0) + 1)); echo "$n" >"$STUB_STATE/attempts"\n'
        f'[ "$n" -gt {failures} ] || exit 32\n'
        'touch "$STUB_STATE/mounted"',
    )
    sandbox.stub("systemctl")
    return script, mount_path


def test_nfs_mount_adds_fstab_entry_once_and_retries_until_the_server_answers(sandbox: Sandbox) -> None:
    script, mount_path = nfs_mount_in(sandbox, wait_seconds=60, failures=2)
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    assert len(sandbox.calls("mount")) == 3
    assert sandbox.run(script).returncode == 0
    assert len(sandbox.calls("mount")) == 3  # already mounted: left alone
    assert (sandbox.root / "fstab").read_text().splitlines()[1:] == [
        f"{NFS_IP}:/export {mount_path} nfs _netdev,nofail,hard,noatime,x-systemd.before=slurmd.service 0 0"
    ]


def test_nfs_mount_wait_is_bounded(sandbox: Sandbox) -> None:
    script, _ = nfs_mount_in(sandbox, wait_seconds=1, failures=10**6)
    started = time.monotonic()
    result = sandbox.run(script)
    assert result.returncode == 1
    assert "did not answer within 1s" in result.stderr
    assert time.monotonic() - started < 15


def acr_login_in(sandbox: Sandbox, *, imds_fails: bool = False, admin_user: str | None = None) -> str:
    """acr-login against a stand-in IMDS and ACR. admin_user: a real user of this machine, whose own
    runuser and getent are used (the caller stubs docker); None: hpcadmin, with those stubbed too."""
    script = script_of(node_doc(admin_user=admin_user or "hpcadmin"), "/usr/local/sbin/acr-login")
    script = with_value(script, "DEFAULT_RETRY_FOR_SECONDS", 2)
    script = with_value(script, "RETRY_SECONDS", 1)
    imds = "exit 22" if imds_fails else f'echo \'{{"access_token":"{AAD_TOKEN}","expires_in":"86399"}}\''
    sandbox.stub(
        "curl",
        f"""for arg in "$@"; do case $arg in http*) url=$arg ;; esac; done
case "$url" in
  http://169.254.169.254/*) {imds} ;;
  https://{ACR}/oauth2/exchange) cat >"$STUB_STATE/exchange-body"; echo '{{"refresh_token":"{ACR_REFRESH_TOKEN}"}}' ;;
  *) exit 22 ;;
esac""",
    )
    if admin_user:
        return script
    sandbox.stub("docker", 'cat >"$STUB_STATE/docker-password"; echo "Login Succeeded"')
    sandbox.stub("getent", "echo hpcadmin:x:1000:1000::/home/hpcadmin:/bin/bash")
    sandbox.stub("runuser", 'shift 3; exec "$@"')  # runuser -u USER -- COMMAND...
    sandbox.stub("env", 'shift; exec "$@"')  # env DOCKER_CONFIG=... COMMAND...
    return script


def test_acr_login_exchanges_the_identity_token_and_never_exposes_tokens(sandbox: Sandbox) -> None:
    result = sandbox.run(acr_login_in(sandbox))
    assert result.returncode == 0, result.stderr

    imds_call, exchange_call = sandbox.calls("curl")
    assert "-H Metadata:true" in imds_call
    assert (
        "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01"
        f"&resource=https://management.azure.com/&client_id={CLIENT_ID}"
    ) in imds_call
    assert f"https://{ACR}/oauth2/exchange" in exchange_call
    body = (sandbox.state / "exchange-body").read_text()
    assert body == f"grant_type=access_token&service={ACR}&access_token={AAD_TOKEN}"
    # as the admin user, who runs the docker-runtime jobs, into that user's own docker configuration
    assert sandbox.calls("runuser") == [
        f"runuser -u hpcadmin -- env DOCKER_CONFIG=/home/hpcadmin/.docker docker login {ACR} "
        "--username 00000000-0000-0000-0000-000000000000 --password-stdin"
    ]
    assert sandbox.calls("docker") == [
        f"docker login {ACR} --username 00000000-0000-0000-0000-000000000000 --password-stdin"
    ]
    assert (sandbox.state / "docker-password").read_text() == ACR_REFRESH_TOKEN
    # Neither token in any command line, nor in anything the script printed.
    for secret in (AAD_TOKEN, ACR_REFRESH_TOKEN):
        assert secret not in sandbox.log.read_text()
        assert secret not in result.stdout + result.stderr


def test_acr_login_backs_off_and_gives_up_when_its_time_is_spent(sandbox: Sandbox) -> None:
    result = sandbox.run(acr_login_in(sandbox, imds_fails=True), argv=["4"])
    assert result.returncode == 1
    # at 0 s, 1 s and 3 s; the next (4 s later) would pass the 4 s allowed. On a loaded machine the
    # attempts themselves take seconds: two, never a fourth
    assert 2 <= len(sandbox.calls("curl")) <= 3
    assert not sandbox.calls("docker")
    assert "retrying in 1s" in result.stderr and "within 4s" in result.stderr


def test_at_every_later_boot_slurmd_waits_for_a_registry_login_of_two_minutes_at_most(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    """A resumed node logs in again before slurmd registers, so that no job pulls with the login that
    expired while the node was deallocated; a registry that does not answer holds slurmd for minutes
    only, well within ResumeTimeout."""
    units = tmp_path / "units"
    units.mkdir()
    units_at_a_later_boot(units, node_doc())
    assert (units / "timers.target.wants" / "acr-login.timer").exists()
    boot_login = (units / "multi-user.target.wants" / "acr-login-boot.service").read_text()
    assert "Before=slurmd.service" in boot_login.splitlines()
    unit = files_of(node_doc())["/etc/systemd/system/acr-login-boot.service"]["content"]
    program, within = re.search(r"^ExecStart=(\S+) (\d+)$", unit, re.MULTILINE).groups()
    timeout_min = int(re.search(r"^TimeoutStartSec=(\d+)min$", unit, re.MULTILINE)[1])
    assert program == "/usr/local/sbin/acr-login" and int(within) <= 120 and timeout_min * 60 < RESUME_TIMEOUT_S
    # the argument bounds the attempts: 0 s, one attempt, against an IMDS that does not answer
    result = sandbox.run(acr_login_in(sandbox, imds_fails=True), argv=["0"])
    assert result.returncode == 1 and len(sandbox.calls("curl")) == 1
    assert "within 0s" in result.stderr


AZURE_CHECKS = "/usr/local/sbin/azure-health-checks"
# Our own stand-in for the lines of Azure's conf/nd96isr_h100_v5.conf that matter here: an image whose
# copy predates Azure's fix passes the NDv5 topology file to the NCCL all-reduce check.
AZURE_CONF = """\
 * || check_hw_ib 400 mlx5_ib0:1
 * || check_gpu_count 8
 * || check_nccl_allreduce 460.0 1 16G $AZ_NHC_ROOT/topofiles/ndv5-topo.xml
 * || check_ib_bw_gdr 380
"""
AZURE_FAILURE = "check_ib_bw_gdr: IB=mlx5_ib3, IB BW (expected > 380 Gbps, but measured 191 Gbps). FaultCode: NHC2003"


def azure_checks_in(sandbox: Sandbox, runner_body: str, conf: str | None = "nd96isr_h100_v5") -> tuple[str, dict, Path]:
    """The rendered program of the ND H100 v5 node, a stand-in for Azure's checks (its entry point records
    its arguments, its NCCL_TOPO_FILE and the configuration it was given, then runs runner_body), and
    the environment that points the program at them; the verdict's path."""
    azure = sandbox.root / "azurehpc-health-checks"
    (azure / "conf").mkdir(parents=True)
    if conf:
        (azure / "conf" / f"{conf}.conf").write_text(AZURE_CONF)
    runner = azure / "run-health-checks.sh"
    runner.write_text(
        '#!/bin/bash\necho "run-health-checks.sh $*" >>"$STUB_LOG"\n'
        'echo "${NCCL_TOPO_FILE-unset}" >"$STUB_STATE/topo"\n'
        "while getopts c:o: opt; do case $opt in c) conf=$OPTARG ;; o) out=$OPTARG ;; esac; done\n"
        f'cp "$conf" "$STUB_STATE/conf"\n{runner_body}\n'
    )
    runner.chmod(0o755)
    sandbox.stub("docker")
    verdict = sandbox.root / "run" / "result"
    env = {
        "AZURE_CHECKS_DIR": str(azure),
        "AZURE_CHECKS_RESULT": str(verdict),
        "AZURE_CHECKS_LOG": str(sandbox.root / "health.log"),
        "NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml",  # the jobs' (/etc/nccl.conf), in a login shell
    }
    return script_of(node_doc("Standard_ND96isr_H100_v5"), AZURE_CHECKS), env, verdict


def test_azures_checks_run_with_the_sizes_configuration_and_without_a_topology_file(sandbox: Sandbox) -> None:
    """The ND H100 v5 node runs azurehpc-health-checks' entry point with conf/nd96isr_h100_v5.conf, as
    Azure's fix for ND H100/H200 v5 has it: the NCCL all-reduce check without ndv5-topo.xml (its
    argument dropped from the copy run, which older copies of the checks pass on as NCCL_TOPO_FILE), and
    the node's own NCCL_TOPO_FILE (for jobs) unset."""
    script, env, verdict = azure_checks_in(sandbox, 'echo "Health checks completed with exit code: 0." >>"$out"')
    result = sandbox.run(script, env)
    assert result.returncode == 0, result.stderr
    assert verdict.read_text() == "ok\n"
    (call,) = sandbox.calls("run-health-checks.sh")
    assert call == f"run-health-checks.sh -c {verdict.parent}/nd96isr_h100_v5.conf -o {sandbox.root}/health.log"
    assert (sandbox.state / "topo").read_text() == "unset\n"
    ran = (sandbox.state / "conf").read_text().splitlines()
    assert ran == [" * || check_hw_ib 400 mlx5_ib0:1", " * || check_gpu_count 8",
                   "* || check_nccl_allreduce 460.0 1 16G", " * || check_ib_bw_gdr 380"]  # fmt: skip


def test_a_failed_azure_check_is_recorded_with_what_it_measured(sandbox: Sandbox) -> None:
    nhc = f'echo "ERROR:  nhc:  Health check failed:  {AZURE_FAILURE}" >>"$out"; exit 1'
    script, env, verdict = azure_checks_in(sandbox, nhc)
    result = sandbox.run(script, env)
    assert result.returncode == 1  # the unit shows failed too
    assert verdict.read_text() == f"failed: {AZURE_FAILURE}\n"
    assert f"azure-health-checks: failed: {AZURE_FAILURE}" in result.stderr


def test_azure_checks_that_do_not_finish_are_a_failure_and_their_container_goes(sandbox: Sandbox) -> None:
    script, env, verdict = azure_checks_in(sandbox, "sleep 30")
    result = sandbox.run(with_value(script, "TIMEOUT_S", 1), env)
    assert result.returncode == 1
    assert verdict.read_text() == "failed: azurehpc-health-checks did not finish within 1s\n"
    assert sandbox.calls("docker") == ["docker rm -f aznhc"]


@pytest.mark.parametrize(
    ("conf", "present", "why"),
    [
        (None, True, "this azurehpc-health-checks has no conf/nd96isr_h100_v5.conf"),
        ("nd96isr_h100_v5", False, "no azurehpc-health-checks in {azure}"),
    ],
)
def test_where_the_image_has_no_azure_checks_for_the_size_they_are_skipped(
    sandbox: Sandbox, conf: str | None, present: bool, why: str
) -> None:
    script, env, verdict = azure_checks_in(sandbox, "exit 1", conf=conf)
    if not present:
        (Path(env["AZURE_CHECKS_DIR"]) / "run-health-checks.sh").unlink()
    result = sandbox.run(script, env)
    assert result.returncode == 0, result.stderr
    assert verdict.read_text() == f"skipped: {why.format(azure=env['AZURE_CHECKS_DIR'])}\n"
    assert sandbox.calls("run-health-checks.sh") == []


def test_at_every_later_boot_azures_checks_run_before_slurmd_starts(tmp_path: Path) -> None:
    """At the first boot node-setup runs them (their step before slurmd's: test_boot_steps.py); enabled,
    their unit runs at every later boot before slurmd, whatever Azure's hardware was, and slurmd starts
    after it whether they passed or not (the health check drains the node)."""
    units_at_a_later_boot(tmp_path, node_doc())
    unit = (tmp_path / "multi-user.target.wants" / "azure-health-checks.service").read_text()
    assert "Before=slurmd.service" in unit.splitlines()
    assert "After=" in unit and "docker.service" in unit and "nvidia-fabricmanager.service" in unit
    assert "ExecStart=/bin/true" in unit  # runnable(): the program, /usr/local/sbin/azure-health-checks
    source = files_of(node_doc())["/etc/systemd/system/azure-health-checks.service"]["content"]
    assert f"ExecStart={AZURE_CHECKS}" in source.splitlines()
    assert "Requires" not in source and "RequiredBy" not in source
    setup = script_of(node_doc(), "/usr/local/sbin/node-setup")
    assert setup.index("step azure-checks azure_checks\n") < setup.index("step slurmd slurmd-setup\n")


def test_node_setup_is_a_unit_that_runs_at_every_boot_until_it_has_succeeded() -> None:
    """cloud-init only enables and starts node-setup.service (its runcmd runs once per instance); the unit
    runs node-setup again 30 minutes after a failure and at every boot, until node-setup marks it done."""
    document = node_doc()
    files = files_of(document)
    assert yaml.safe_load(document)["runcmd"] == [
        ["systemctl", "try-reload-or-restart", "ssh"],  # sshd takes the people's keys (dtrain-users)
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "--no-block", "node-setup.service"],
    ]
    unit = files["/etc/systemd/system/node-setup.service"]["content"]
    setup = files["/usr/local/sbin/node-setup"]["content"]
    for line in ("ExecStart=/usr/local/sbin/node-setup", "Restart=on-failure", "RestartSec=30min"):
        assert line in unit.splitlines()
    assert f"ConditionPathExists=!{shell_value(setup, 'DONE_FILE')}" in unit
    assert "WantedBy=multi-user.target" in unit and "After=network-online.target" in unit.splitlines()
    referenced = set(re.findall(r"/usr/local/(?:sbin|etc)/[\w.-]+", setup + json.dumps(files)))
    assert referenced <= set(files), referenced - set(files)
    for unit_name in re.findall(r"([\w-]+\.(?:service|timer))", setup):
        assert f"/etc/systemd/system/{unit_name}" in files
    for program in ("nfs-mount", "slurmd-setup"):  # run by name: systemd's PATH has /usr/local/sbin
        assert f"/usr/local/sbin/{program}" in files
    timer = files["/etc/systemd/system/acr-login.timer"]["content"]
    # ACR refresh tokens last about 3 hours: renew hourly.
    assert "OnUnitActiveSec=1h" in timer


@pytest.mark.parametrize("sku", SKUS)
def test_nccl_settings_for_every_sku_keep_infiniband(sku: str) -> None:
    env = dict(GPU_SKUS[sku].nccl_env)
    assert "NCCL_IB_DISABLE" not in env
    assert env["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["UCX_TLS"] == "rc"
    assert env["UCX_IB_PCI_RELAXED_ORDERING"] == "on"
    assert env["NCCL_DEBUG"] == "WARN"
    topology = {"v5": "/opt/microsoft/ndv5-topo.xml", "v4": "/opt/microsoft/ndv4-topo.xml"}
    assert env["NCCL_TOPO_FILE"] == topology[sku[-2:]]

    document = node_doc(sku)
    assert "NCCL_IB_DISABLE" not in document
    files = files_of(document)
    assert files["/usr/local/etc/nccl.conf"]["content"].splitlines() == [f"{k}={v}" for k, v in env.items()]
    profile = files["/etc/profile.d/nccl.sh"]["content"]
    assert [line for line in profile.splitlines() if line.startswith("export ")] == [
        f"export {k}={v}" for k, v in env.items()
    ]
    nccl_conf_unit = files["/etc/systemd/system/nccl-conf.service"]["content"]
    assert "After=sku-customizations.service" in nccl_conf_unit
    assert "/usr/local/etc/nccl.conf /etc/nccl.conf" in nccl_conf_unit


def test_sku_table_nccl_settings_are_read_only_and_checked_when_the_table_is_built() -> None:
    with pytest.raises(TypeError):
        GPU_SKUS["Standard_ND96asr_v4"].nccl_env["NCCL_DEBUG"] = "INFO"  # type: ignore[index]
    assert GPU_SKUS["Standard_ND96asr_v4"].nccl_env["NCCL_DEBUG"] == "WARN"
    with pytest.raises(ValueError, match="NCCL_IB_DISABLE"):
        GpuSku(8, "V100", 40, 672, encryption_at_host=True, nccl_env={"NCCL_IB_DISABLE": "1"}, quota_family="x")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"NCCL_IB_DISABLE": "1"}, "NCCL_IB_DISABLE"),
        ({"NCCL_IB_DISABLE": "0"}, "NCCL_IB_DISABLE"),
        ({"NCCL_NET": "Socket"}, "NCCL_NET"),
        ({"NCCL_DEBUG": "INFO WARN"}, "NCCL_DEBUG"),
        ({"nccl_debug": "INFO"}, "nccl_debug"),
    ],
)
def test_node_refuses_nccl_settings_that_leave_infiniband_or_break_the_files(
    extra: dict[str, str], message: str
) -> None:
    env = {**GPU_SKUS["Standard_ND96isr_H100_v5"].nccl_env, **extra}
    with pytest.raises(ValueError, match=message):
        node_doc(nccl_env=env)
    with pytest.raises(ValueError, match=message):
        check_nccl_env(env)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"shared": NfsShare("nfs.internal", "/export")}, "nfs_server_ip"),
        ({"shared": NfsShare(NFS_IP, "/export data")}, "nfs_export_path"),
        ({"shared": LustreShare("10.0.3.5@tcp")}, "lustre_mgs_address"),
        ({"shared": "10.0.1.4:/export"}, "shared"),
        ({"mount_path": "shared"}, "mount_path"),
        ({"acr_login_server": "https://trainacr.azurecr.io"}, "acr_login_server"),
        (
            {"identity_client_id": "/subscriptions/x/resourceGroups/rg/providers/Microsoft.ManagedIdentity/x"},
            "identity_client_id",
        ),
        ({"expected_gpus": 0}, "expected_gpus"),
        ({"slurmctld_address": "hvd-head"}, "slurmctld_address"),
        ({"key_vault_uri": "https://evil.example.com/"}, "key_vault_uri"),
        ({"key_vault_uri": "https://kv.vault.azure.net/secrets/x"}, "key_vault_uri"),
    ],
)
def test_node_rejects_bad_input(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        node_doc(**overrides)
