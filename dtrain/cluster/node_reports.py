"""The nodes' own reports on the shared file system, read through the login node (on the operator's
machine): each node's last health check (`<shared>/.health/<node>`) and its boot report
(`<shared>/.boot/<node>`, written by node-setup's steps, dtrain/remote/boot/boot-steps.sh, even when
slurmd could not start). `status` shows both; `launch --follow` shows the boot step of a job's nodes
while they start.
"""

from __future__ import annotations

import posixpath

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import q
from infra.contract import BOOT_REPORT_DIR, HEALTH_REPORT_DIR

# each kind in its folder: <folder>/<node>, key=value lines
REPORT_DIRS = {"health": HEALTH_REPORT_DIR, "boot": BOOT_REPORT_DIR}
REPORT_KEYS = ("ok", "updated_at")  # a boot report's keys that are not steps
# a health report's checks, in the order the health check runs them (dtrain/remote/slurm/slurm-health-check.sh)
HEALTH_CHECKS = ("gpus", "infiniband", "azure_checks", "shared", "disk")


def read_reports(desc: ClusterDescription, slurm: Slurm) -> dict[str, dict[str, dict[str, str]]]:
    """kind (REPORT_DIRS) -> node -> its last report of that kind (key=value lines), for the nodes that
    wrote one; in one round trip."""
    loops = [
        f"for f in {q(posixpath.join(desc.shared_mount_path, folder))}/*; "
        f'do [ -f "$f" ] && {{ echo "@@ {kind} ${{f##*/}}"; cat "$f"; }}; done'
        for kind, folder in REPORT_DIRS.items()
    ]
    reports: dict[str, dict[str, dict[str, str]]] = {kind: {} for kind in REPORT_DIRS}
    current: dict[str, str] | None = None
    for line in slurm.run_unchecked("; ".join([*loops, "true"])).stdout.splitlines():
        if line.startswith("@@ "):
            kind, node = line[3:].split(" ", 1)
            current = reports[kind].setdefault(node, {})
        elif current is not None and "=" in line:
            key, value = line.split("=", 1)
            current[key] = value
    return reports


def boot_verdict(report: dict[str, str], markup: bool = True) -> str:
    """What a node's boot report says: each failed setup step with its reason, ok, or the step it is in
    (in rich's markup, colours and all, or plain)."""
    failed = [
        f"{step}: {value.removeprefix('failed: ')}" for step, value in report.items() if value.startswith("failed")
    ]
    if failed:
        return ("[red]failed[/red] " if markup else "failed ") + "; ".join(failed)
    if not report:
        return ""
    if report.get("ok") == "1":
        return "[green]ok[/green]" if markup else "ok"
    return boot_step(report)


def boot_step(report: dict[str, str]) -> str:
    """Where a boot is: 'step 3 of 7, slurmd (running since <time>); 2 done', from the steps' own results
    in the order the boot runs them."""
    steps = [(name, value) for name, value in report.items() if name not in REPORT_KEYS]
    done = sum(value == "ok" for _, value in steps)
    for number, (name, value) in enumerate(steps, 1):
        if value.startswith("running"):
            return f"step {number} of {len(steps)}, {name} ({value}); {done} done"
    return f"in progress: {done} of {len(steps)} steps done"
