"""`launch --resume-from RUN`: the newest checkpoint a run kept in the results container, for a new run.

Every attempt of a run uploads its newest checkpoint with its results (job.sh, upload_results.py
--with-newest-checkpoint), under RUN/checkpoints/ in the results container, which outlives the cluster
(Azure: a resource group that `pulumi destroy` keeps; locally: `local up --storage-dir`). A new run on
any cluster starts from it: `launch` reads the newest one with the operator's access to the container
and ships it into the new run's checkpoint directory with the job's other files, where the job's own
resume finds it (and checks that it fits the model).
"""

from __future__ import annotations

import re

from azure.core.exceptions import AzureError

from dtrain.cluster.blobs import container_client
from dtrain.cluster.description import ClusterDescription
from dtrain.errors import ExitCode, OperatorError

CHECKPOINTS = "checkpoints"
# ckpt-<step>.ckpt (data parallel) or step-<step>/<file> (model parallel, torch.distributed.checkpoint)
_KEPT = re.compile(r"^checkpoints/(?:ckpt-(\d{10})\.ckpt|step-(\d{10})/[^/]+)$")


def newest_kept_checkpoint(desc: ClusterDescription, run_id: str) -> dict[str, bytes]:
    """{path in the run directory: content} of the newest checkpoint run_id kept; refused when it kept none."""
    container = container_client(desc.results)
    prefix = f"{run_id}/"
    try:
        steps: dict[int, list[str]] = {}
        for blob in container.list_blobs(name_starts_with=f"{prefix}{CHECKPOINTS}/"):
            match = _KEPT.match(blob.name[len(prefix) :])
            if match:
                steps.setdefault(int(match.group(1) or match.group(2)), []).append(blob.name)
        if not steps:
            raise OperatorError(
                f"--resume-from {run_id}: the results container ({desc.results.url}) holds no checkpoint of that run"
            )
        newest = steps[max(steps)]
        return {name[len(prefix) :]: container.download_blob(name).readall() for name in newest}
    except AzureError as exc:
        raise OperatorError(
            f"--resume-from {run_id}: reading {desc.results.url} failed: {str(exc).splitlines()[0]}", ExitCode.NOT_READY
        ) from None
