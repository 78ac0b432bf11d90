"""The head node's reaper (`slurm-power reap`, dtrain/remote/slurm/slurm_power.py) against the local
cluster's real slurmctld and slurmd: nodes that came up outside Slurm, as every instance of a new
scale set does, are powered down through Slurm at once; a node Slurm started for a job keeps its
autostop time. (Nodes that never register: tests/infra/test_slurm.py, against a fake Azure.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from infra.cloud_init.head_node import POWER_CONFIG_PATH, POWER_PROGRAM_PATH
from tests.infra.documents import head_doc, script_of

from .conftest import local_state_dir, own_cluster
from .conftest import slurm_command as slurm

NOWHERE = "http://127.0.0.1:9"  # no Azure: the reaper has no reason to call it here


def states(desc) -> dict[str, str]:
    text = slurm(desc, "sinfo", "--noheader", "--Node", "--format=%N %T").stdout
    return dict(line.split() for line in text.splitlines())


def test_idle_nodes_that_came_up_outside_slurm_are_powered_down_at_once(tmp_path: Path) -> None:
    # autostop an hour away: whatever powers a node down within the test is the reaper
    with own_cluster(tmp_path, "u", autostop_seconds=3600) as desc:
        assert states(desc) == {"node-0": "idle", "node-1": "idle"}  # `up` started them, as Azure does
        # node-1 as Slurm's resume leaves a node it started for a job
        slurm(desc, "scontrol", "update", "nodename=node-1", "comment=started-by-slurm")
        config = json.loads(script_of(head_doc(), POWER_CONFIG_PATH))
        log = tmp_path / "power.log"
        config.update(arm_endpoint=NOWHERE, imds_endpoint=NOWHERE, retry_seconds=0, log_file=str(log))
        (tmp_path / "azure-power.json").write_text(json.dumps(config))
        program = tmp_path / "slurm-power"
        program.write_text(script_of(head_doc(), POWER_PROGRAM_PATH))
        env = {**os.environ, "SLURM_POWER_CONFIG": str(tmp_path / "azure-power.json"), "SLURM_CONF": desc.slurm.conf}
        reaped = subprocess.run([sys.executable, str(program), "reap"], env=env, capture_output=True, text=True)
        assert reaped.returncode == 0, reaped.stderr + log.read_text()
        assert "node-0 came up outside Slurm and no job waits: powering down" in log.read_text()
        deadline = time.monotonic() + 60
        while states(desc)["node-0"] != "idle~" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert states(desc) == {"node-0": "idle~", "node-1": "idle"}
        # Slurm's own SuspendProgram switched it off (the local stand-in for deallocating it)
        assert "suspend node-0: done" in (local_state_dir(desc) / "logs" / "power.log").read_text()
