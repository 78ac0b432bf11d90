"""Download what a run left in the results container (the trained model, TensorBoard events, summary.png,
run.json with its cost, logs, metrics) to a local directory: `dtrain results` (dtrain/cli/results.py).
Runs on the operator's machine.

The job uploads its run directory itself when it ends (dtrain/remote/job/upload_results.py); this reads it
back with the operator's results credential. A file already here with the blob's MD5 is not fetched
again, so an interrupted download resumes; each file lands under its final name only once complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from azure.core.exceptions import AzureError
from azure.storage.blob import BlobProperties, ContainerClient
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dtrain.cluster import blobs
from dtrain.cluster.description import ClusterDescription
from dtrain.errors import OperatorError
from dtrain.fileio import file_md5
from dtrain.jobs.run_ids import check_run_id
from dtrain.ui import make_console

console = make_console()
DEFAULT_DEST = "runs"


@dataclass
class Downloaded:
    directory: Path
    fetched: list[str] = field(default_factory=list)  # paths relative to directory
    unchanged: list[str] = field(default_factory=list)
    bytes_fetched: int = 0

    @property
    def files(self) -> list[str]:
        return sorted(self.fetched + self.unchanged)


def download_run(desc: ClusterDescription, run_id: str, dest: str | Path, show_progress: bool = True) -> Downloaded:
    """Every blob under `<run_id>/` in the results container, to `dest/<run_id>/`."""
    client = blobs.container_client(desc.results)
    prefix = f"{check_run_id(run_id)}/"
    try:
        found = list(client.list_blobs(name_starts_with=prefix))
    except AzureError as exc:
        raise blobs.explain(exc, f"listing {desc.results.url}/{prefix}") from None
    if not found:
        raise OperatorError(
            f"no results for run {run_id} in {desc.results.url}/ (has the job ended? see `dtrain jobs`)"
        )
    result = Downloaded(Path(dest) / run_id)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=console, disable=not show_progress,
    )  # fmt: skip
    with progress:
        task = progress.add_task(f"run {run_id}", total=sum(blob.size for blob in found))
        for blob in found:
            relative = _local_path(blob.name, prefix)
            if _fetch(client, blob, result.directory / relative):
                result.fetched.append(str(relative))
                result.bytes_fetched += blob.size
            else:
                result.unchanged.append(str(relative))
            progress.advance(task, blob.size)
    return result


def _local_path(name: str, prefix: str) -> PurePosixPath:
    """A blob's path below the run, refused if it would leave the download directory."""
    relative = PurePosixPath(name[len(prefix) :])
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise OperatorError(f"refusing blob {name!r}: its name would leave the download directory")
    return relative


def _fetch(client: ContainerClient, blob: BlobProperties, target: Path) -> bool:
    """Download one blob to target (via a temporary name); False when target already has its content."""
    expected = blobs.b64(blob.content_settings.content_md5)
    if target.is_file() and target.stat().st_size == blob.size and expected == blobs.b64(file_md5(target)):
        return False
    partial = target.with_name(f".{target.name}.part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as handle:
            client.download_blob(blob.name).readinto(handle)
        os.replace(partial, target)
    except AzureError as exc:
        raise blobs.explain(exc, f"downloading {blob.name}") from None
    except OSError as exc:
        raise OperatorError(f"cannot write {target}: {exc.strerror or exc}") from None
    return True
