"""Azure's node health checks at a GPU node's boot: the program that runs them
(dtrain/remote/boot/azure-health-checks.sh, started by azure-health-checks.service before slurmd) and
where it leaves its verdict, which the node's health check (slurm.render_health_check) reads.

The checks are Azure's own (Azure/azurehpc-health-checks on the ubuntu-hpc image), with the size's
configuration from the one thresholds table, infra/health_thresholds.py.
"""

from __future__ import annotations

import re

from infra.cloud_init._common import render_script
from infra.health_thresholds import NodeHealth

AZURE_CHECKS_PATH = "/usr/local/sbin/azure-health-checks"
AZURE_CHECKS_UNIT = "azure-health-checks.service"
# The verdict of this boot's run (under /run: a new boot has none until the checks ran again).
AZURE_CHECKS_RESULT = "/run/azure-health-checks/result"
# The whole suite's bound (Azure bounds each check at 500 s): minutes on an ND H100 v5, and slurmd
# waits for it, within ResumeTimeout (infra/head.py).
AZURE_CHECKS_TIMEOUT_S = 15 * 60
_CONF_NAME = re.compile(r"[a-z0-9_-]+")


def check_conf_name(health: NodeHealth) -> str:
    """The size's configuration name in Azure's checks (conf/<name>.conf), or "" where it has none."""
    name = health.azure_checks_conf
    if name is None:
        return ""
    if not isinstance(name, str) or not _CONF_NAME.fullmatch(name):
        raise ValueError(f"azure_checks_conf: {name!r} is not a configuration name such as nd96isr_h100_v5")
    return name


def render_azure_checks(health: NodeHealth) -> str:
    """The program that runs Azure's checks with the size's configuration and records their verdict."""
    return render_script(
        "boot/azure-health-checks.sh",
        {
            "AZURE_CHECKS_CONF": check_conf_name(health),
            "AZURE_CHECKS_TIMEOUT_S": AZURE_CHECKS_TIMEOUT_S,
            "AZURE_CHECKS_RESULT": AZURE_CHECKS_RESULT,
        },
    )
