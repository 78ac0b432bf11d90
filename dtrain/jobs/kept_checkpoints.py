"""`launch --resume-from RUN`, operator side: whether RUN kept a checkpoint in the results container.

A job's $CHECKPOINT_DIR is mirrored to RUN/checkpoints/ in the results container while it runs
(dtrain/remote/job/checkpoint_mirror.py), which outlives the cluster (Azure: a resource group that
`pulumi destroy` keeps; locally: `local up --storage-dir`). A new run on any cluster fetches it on the
cluster side (dtrain/remote/job/fetch_checkpoint.py, a step of its job.sh), into its own checkpoint
directory, where the job's resume finds it: the operator only lists the blobs, to refuse a run that
kept none before anything is submitted, and never holds a byte of the checkpoint.
"""

from __future__ import annotations

from itertools import chain

from azure.core.exceptions import AzureError

from dtrain.cluster.blobs import container_client
from dtrain.cluster.description import ClusterDescription
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.checkpoint_sync import CHECKPOINTS, OUR_CHECKPOINT


def require_kept_checkpoint(desc: ClusterDescription, run_id: str, ours: bool = False) -> None:
    """Refused when run_id kept no checkpoint file in the results container (names only are read), or,
    ours: none of our jobs' checkpoints (a bundled job resumes from those alone; another code's files
    would be fetched, then training would start from step 0 without a word)."""
    container = container_client(desc.results)
    prefix = f"{run_id}/{CHECKPOINTS}/"
    try:
        names = (blob.name[len(prefix) :] for blob in container.list_blobs(name_starts_with=prefix))
        kept = next(names, None)
        readable = kept is not None and (not ours or any(OUR_CHECKPOINT.match(name) for name in chain([kept], names)))
    except AzureError as exc:
        raise OperatorError(
            f"--resume-from {run_id}: reading {desc.results.url} failed: {str(exc).splitlines()[0]}", ExitCode.NOT_READY
        ) from None
    if kept is None:
        raise OperatorError(
            f"--resume-from {run_id}: the results container ({desc.results.url}) holds no checkpoint of that run"
        )
    if not readable:
        raise OperatorError(
            f"--resume-from {run_id}: its checkpoints are not our training's (ckpt-<step>.ckpt or step-<step>/, "
            f"e.g. {kept}): this job would fetch them and start from step 0; resume that run's own code "
            "(--workdir or --entrypoint), or pick a run of our training"
        )
