"""The first-boot programs (node-setup, head-setup) as rendered, run here against stub commands: each
step is independent, a failed one is reported (the boot report on the shared file system, which
`dtrain status` shows) and tried again by the next run, and slurmd starts whatever became of the
optional steps."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.infra.documents import files_of, head_doc, node_doc, script_of
from tests.infra.sandbox import Sandbox, shell_value, with_value

# a stub body that fails the first time, saying why on stderr as the real step would, and succeeds after
FAILS_ONCE = (
    'if [ ! -f "$STUB_STATE/{name}-failed" ]; then touch "$STUB_STATE/{name}-failed"; echo "{reason}" >&2; exit 1; fi'
)
NVME_REASON = "nvme-raid: found 0 local NVMe disks (), expected 8 (0: one or more)"
ACR_REASON = "acr-login: could not log in to trainacr.azurecr.io within 2700s"


def setup_in(sandbox: Sandbox, document: str, program: str) -> tuple[str, Path, Path]:
    """The program with its state under the sandbox, the shared mount mounted, and the host named as
    Azure names a scale set's 11th instance (upper-case base-36 digit)."""
    script = script_of(document, program)
    shared = sandbox.root / "shared"
    shared.mkdir()
    steps, done = sandbox.root / "run", sandbox.root / "lib" / "done"
    script = with_value(script, "SHARED_MOUNT", str(shared))
    script = with_value(script, "STEPS_DIR", str(steps))
    script = with_value(script, "DONE_FILE", str(done))
    sandbox.stub("hostname", "echo HVD-GPU-00000A")
    sandbox.stub("mountpoint", "exit 0")
    sandbox.stub("dpkg-query", "echo installed")  # every package there, unless a test says otherwise
    return script, shared, done


def report(shared: Path, node: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (shared / ".boot" / node).read_text().splitlines())


def test_a_failed_nvme_and_registry_login_do_not_keep_slurmd_from_starting_and_are_retried(sandbox: Sandbox) -> None:
    script, shared, done = setup_in(sandbox, node_doc(), "/usr/local/sbin/node-setup")
    for name in ("nfs-mount", "slurmd-setup", "usermod"):
        sandbox.stub(name)
    # the NVMe volume and the registry login fail on the first run, and succeed on the next
    sandbox.stub(
        "systemctl",
        'case "$*" in\n'
        f'  "enable --now nvme-raid.service") {FAILS_ONCE.format(name="nvme", reason=NVME_REASON)} ;;\n'
        f'  "start acr-login.service") {FAILS_ONCE.format(name="acr", reason=ACR_REASON)} ;;\n'
        "esac",
    )

    first = sandbox.run(script)
    assert first.returncode == 1, first.stderr
    assert sandbox.calls("slurmd-setup") == ["slurmd-setup "]
    assert "systemctl enable --now spot-agent.service" in sandbox.calls("systemctl")
    # the admin user may run docker before slurmd starts its jobs
    assert sandbox.calls("usermod") == ["usermod -aG docker hpcadmin"]
    # the operator's side: the node's Slurm name (lower case), and each step with its reason
    assert report(shared, "hvd-gpu-00000a") == {
        "packages": "ok",
        "nfs-mount": "ok",
        "users": "ok",
        "nccl-conf": "ok",
        "nvme-raid": f"failed: {NVME_REASON}",
        "docker-group": "ok",
        "registry-login": f"failed: {ACR_REASON}",
        "azure-checks": "ok",
        "slurmd": "ok",
        "spot-agent": "ok",
        "gpu-metrics": "ok",
        "ok": "0",
        "updated_at": report(shared, "hvd-gpu-00000a")["updated_at"],
    }
    assert "failed: nvme-raid registry-login" in first.stderr
    assert not done.exists()  # node-setup.service runs it again

    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert sandbox.calls("slurmd-setup") == ["slurmd-setup "]  # done in this boot: not restarted
    assert sandbox.calls("systemctl").count("systemctl enable --now nvme-raid.service") == 2
    assert report(shared, "hvd-gpu-00000a")["ok"] == "1" and done.exists()


def test_the_registry_login_is_renewed_from_the_first_boot_on_and_made_again_at_every_boot(sandbox: Sandbox) -> None:
    """The timer runs from the first boot on (enabled only, the login expired after 3 hours of it), and
    the login at boot is enabled for every later one (a resumed node's has expired)."""
    script, _, _ = setup_in(sandbox, node_doc(), "/usr/local/sbin/node-setup")
    for name in ("nfs-mount", "slurmd-setup", "usermod", "systemctl"):
        sandbox.stub(name)
    assert sandbox.run(script).returncode == 0
    registry = [call for call in sandbox.calls("systemctl") if "acr-login" in call]
    assert registry == [
        "systemctl enable acr-login-boot.service",
        "systemctl enable --now acr-login.timer",
        "systemctl start acr-login.service",
    ]


APT_REASON = "E: Failed to fetch https://packages.microsoft.com/repos/slurm-ubuntu-jammy/dists/stable/InRelease  503"


def test_a_repository_that_failed_leaves_nothing_missing_for_good(sandbox: Sandbox) -> None:
    """The packages are a step: one that failed (the repository down at first boot) is tried again by
    the next run, which installs what is missing, Slurm's at its version; once all are there, apt is not
    asked again."""
    script, shared, done = setup_in(sandbox, node_doc(), "/usr/local/sbin/node-setup")
    for name in ("nfs-mount", "slurmd-setup", "usermod", "systemctl"):
        sandbox.stub(name)
    # dpkg as the image leaves it (munge there), and as apt-get's installs change it
    (sandbox.state / "installed").write_text("munge\n")
    sandbox.stub("dpkg-query", 'grep -qx "${!#}" "$STUB_STATE/installed" && echo installed')
    sandbox.stub(
        "apt-get",
        'case " $* " in *" install "*)\n'
        f"  {FAILS_ONCE.format(name='apt', reason=APT_REASON)}\n"
        '  for arg in "$@"; do\n'
        '    case $arg in -* | install) ;; *) echo "${arg%%=*}" >>"$STUB_STATE/installed" ;; esac\n'
        "  done ;;\n"
        "esac",
    )

    first = sandbox.run(script)
    assert first.returncode == 1 and not done.exists()
    assert report(shared, "hvd-gpu-00000a")["packages"] == f"failed: {APT_REASON}"
    assert sandbox.calls("slurmd-setup") == ["slurmd-setup "]  # the steps are independent all the same

    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    first_install, second_install = [call for call in sandbox.calls("apt-get") if " install " in call]
    assert first_install == second_install
    assert second_install.endswith(
        " install nfs-common mdadm xfsprogs prometheus-node-exporter "
        "slurm-smd=25.11.5-* slurm-smd-client=25.11.5-* slurm-smd-slurmd=25.11.5-*"
    )
    assert "--option=Dpkg::Options::=--force-confold" in second_install  # the files cloud-init wrote stay
    assert report(shared, "hvd-gpu-00000a")["packages"] == "ok"

    asked = len(sandbox.calls("apt-get"))
    shutil.rmtree(sandbox.root / "run")  # a new boot
    assert sandbox.run(script).returncode == 0
    assert len(sandbox.calls("apt-get")) == asked


AZURE_VERDICT = (
    "check_ib_bw_gdr: IB=mlx5_ib3, IB BW (expected > 380 Gbps, but measured 191.35 Gbps). FaultCode: NHC2003"
)


def test_azures_checks_run_before_slurmd_and_a_failure_is_reported_with_their_verdict(sandbox: Sandbox) -> None:
    """At the first boot node-setup runs Azure's checks (their unit, enabled for every later boot) before
    slurmd, whose health check then drains the node; slurmd starts all the same, and the boot report
    says which check failed and what it measured, not systemctl's words."""
    script, shared, done = setup_in(sandbox, node_doc(), "/usr/local/sbin/node-setup")
    verdict = sandbox.root / "azure-health-checks" / "result"
    verdict.parent.mkdir()
    script = with_value(script, "AZURE_CHECKS_RESULT", str(verdict))
    for name in ("nfs-mount", "usermod", "slurmd-setup"):
        sandbox.stub(name)
    failing = f'echo "failed: {AZURE_VERDICT}" >"{verdict}"; echo "Job for azure-health-checks failed." >&2; exit 1'
    sandbox.stub("systemctl", f'case "$*" in\n  "start azure-health-checks.service") {failing} ;;\nesac')

    assert sandbox.run(script).returncode == 1 and not done.exists()
    calls = [line for line in sandbox.log.read_text().splitlines() if line.startswith(("systemctl", "slurmd-setup"))]
    checks = calls.index("systemctl start azure-health-checks.service")
    # (the registry login's calls, in the background, may come between)
    assert calls.index("systemctl enable azure-health-checks.service") < checks < calls.index("slurmd-setup ")
    assert report(shared, "hvd-gpu-00000a")["azure-checks"] == f"failed: azure-health-checks: {AZURE_VERDICT}"
    assert report(shared, "hvd-gpu-00000a")["slurmd"] == "ok"


def test_the_report_names_the_step_that_is_running_while_it_runs(sandbox: Sandbox) -> None:
    """Boot progress for `status` and `launch --follow`: a step's report says `running since` before it ends."""
    script, shared, _ = setup_in(sandbox, node_doc(), "/usr/local/sbin/node-setup")
    for name in ("nfs-mount", "usermod", "systemctl"):
        sandbox.stub(name)
    during = sandbox.root / "during"
    sandbox.stub("slurmd-setup", f'cp "{shared}/.boot/hvd-gpu-00000a" "{during}"')
    assert sandbox.run(script).returncode == 0
    seen = dict(line.split("=", 1) for line in during.read_text().splitlines())
    assert seen["slurmd"].startswith("running since 20") and seen["ok"] == "0"
    assert (seen["nfs-mount"], seen["spot-agent"]) == ("ok", "pending")
    assert report(shared, "hvd-gpu-00000a")["slurmd"] == "ok"


def head_setup_in(sandbox: Sandbox) -> tuple[str, Path, Path]:
    """head-setup with its programs (the database disk's, the munge key's, slurmdbd's, the NFS mount) stubbed."""
    script, shared, done = setup_in(sandbox, head_doc(), "/usr/local/sbin/head-setup")
    assert shell_value(script, "MOUNT_PROGRAM") == "/usr/local/sbin/nfs-mount"
    assert "/usr/local/sbin/nfs-mount" in files_of(head_doc())
    for name, program in (("MOUNT_PROGRAM", "nfs-mount"), ("MUNGE_KEY", "munge-key"),
                          ("SLURMDBD_SETUP", "slurmdbd-setup"), ("DATABASE_DISK", "database-disk")):  # fmt: skip
        script = with_value(script, name, str(sandbox.bin / program))
    for command in ("install", "systemctl", "munge-key", "database-disk"):
        sandbox.stub(command)
    return script, shared, done


def test_a_late_shared_file_system_does_not_keep_slurmctld_from_starting(sandbox: Sandbox) -> None:
    script, shared, done = head_setup_in(sandbox)
    sandbox.stub("slurmdbd-setup")
    sandbox.stub("nfs-mount", FAILS_ONCE.format(name="nfs", reason="nfs-mount: 10.0.1.4:/export did not answer"))

    first = sandbox.run(script)
    assert first.returncode == 1 and not done.exists()
    calls = [
        line for line in sandbox.log.read_text().splitlines() if not line.startswith(("mountpoint ", "dpkg-query "))
    ]
    assert calls == [
        "hostname -s",
        "database-disk ",  # MariaDB's disk, before its package makes its data directory
        "munge-key ",  # the cluster's key, from Key Vault, before munged restarts with it
        "systemctl restart munge",
        "install -d -o slurm -g slurm -m 0750 /var/spool/slurmctld /var/log/slurm",
        "slurmdbd-setup ",  # slurmdbd and the associations, before slurmctld (which refuses to start without)
        "install -d -o slurm -g slurm -m 0750 /var/spool/slurmctld /var/log/slurm",
        "systemctl enable slurmctld",
        "systemctl restart slurmctld",
        "nfs-mount ",
    ]
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    # runs/ on the shared file system is the admin user's, who submits the jobs: not world-writable
    # (until the users list names someone); the stack config's list seeds the one the head node keeps
    assert sandbox.calls("install")[-3:] == [
        f"install -d -o hpcadmin -m 0755 {shared}/runs",
        f"install -d -m 0755 {shared}/.users",
        f"install -m 0644 /var/lib/dtrain-users/seed.json {shared}/.users/users.json",
    ]
    assert sandbox.calls("systemctl")[-1] == "systemctl enable --now dtrain-users.timer dtrain-users.service"
    assert sandbox.calls("munge-key") == ["munge-key "]  # slurmctld is up: left alone
    assert report(shared, "hvd-gpu-00000a") | {"updated_at": ""} == {
        "database-disk": "ok",
        "packages": "ok",
        "munge": "ok",
        "slurmdbd": "ok",
        "slurmctld": "ok",
        "shared-runs": "ok",
        "ok": "1",
        "updated_at": "",
    }
    assert done.exists()


def test_slurmctld_waits_for_slurmdbd_and_starts_once_it_runs(sandbox: Sandbox) -> None:
    """slurmctld refuses to start before slurmdbd answers with the cluster's associations: its step says what
    it waits for, and both run at the next try."""
    script, shared, _ = head_setup_in(sandbox)
    sandbox.stub("nfs-mount")
    reason = "slurmdbd-setup: could not read secret slurmdbd-database-password from the vault within 2700s"
    sandbox.stub("slurmdbd-setup", FAILS_ONCE.format(name="dbd", reason=reason))
    assert sandbox.run(script).returncode == 1
    first = report(shared, "hvd-gpu-00000a")
    assert (first["slurmdbd"], first["slurmctld"]) == (
        f"failed: {reason}",
        "failed: head-setup: waits for step slurmdbd",
    )
    assert first["shared-runs"] == "ok" and "systemctl restart slurmctld" not in sandbox.calls("systemctl")
    assert sandbox.run(script).returncode == 0
    assert report(shared, "hvd-gpu-00000a")["slurmctld"] == "ok"
    assert sandbox.calls("systemctl")[-1] == "systemctl restart slurmctld"
