"""A run's id, and where runs live on the cluster's shared file system. Runs on the operator's machine.

Submitting a run (submit.py) names it; listing, following and fetching runs (runs.py, top.py, results.py)
find it by that name.
"""

from __future__ import annotations

import posixpath
import re
import secrets
from datetime import UTC, datetime

from dtrain.cluster.description import ClusterDescription
from dtrain.errors import OperatorError
from infra.contract import RUNS_DIR

# A run id names a directory on the share, a Slurm job and a blob prefix: one plain path component.
# Its first character is a letter or digit: `-x` would be read as a flag by the tools it is passed to
# (upload, `logs`, `cancel`), and `.x` is hidden, like the share's own `.workdirs` and `.dtrain-setup`.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def new_run_id(prefix: str) -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{prefix}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise OperatorError(
            f"invalid run id {run_id!r}: use up to 100 letters, digits, '-', '_' and '.', starting with a letter "
            "or digit (no '/')"
        )
    return run_id


def runs_dir(desc: ClusterDescription) -> str:
    return posixpath.join(desc.shared_mount_path, RUNS_DIR)
