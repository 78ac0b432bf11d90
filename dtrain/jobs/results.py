"""`results RUN`: download what a run left in the results container (the trained model, TensorBoard events,
summary.png, run.json with its cost, logs, metrics) to a local directory.

  python -m dtrain results 20261124T101500Z-pytorch-1a2b --dest runs/

The job uploads its run directory itself when it ends (dtrain/remote/job/upload_results.py); this reads it
back with the operator's results credential. A file already here with the blob's MD5 is not fetched
again, so an interrupted download resumes; each file lands under its final name only once complete.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from azure.core.exceptions import AzureError
from azure.storage.blob import BlobProperties, ContainerClient
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dtrain.cli_common import add_cluster_option, arg_type, non_empty
from dtrain.cluster import blobs
from dtrain.cluster.description import ClusterDescription, load
from dtrain.errors import OperatorError
from dtrain.fileio import file_md5
from dtrain.jobs.submit import check_run_id
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


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "results",
        help="download a run's model, curves, cost and logs from the results container",
        description=__doc__.split("\n\n")[0],
        epilog="examples: python -m dtrain results RUN_ID; python -m dtrain results RUN_ID --dest /tmp/runs\n"
        "then: tensorboard --logdir runs/RUN_ID/tensorboard; "
        "python -m training.predict --model runs/RUN_ID/model IMAGE.jpg",
    )
    add_cluster_option(parser)
    parser.add_argument("run_id", type=arg_type(check_run_id), metavar="RUN", help="the run id (see `jobs`)")
    parser.add_argument("--dest", type=non_empty, default=DEFAULT_DEST, help="download into DEST/RUN (default: runs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    got = download_run(load(args.cluster), args.run_id, args.dest, show_progress=not args.no_progress)
    console.print(
        f"{len(got.files)} files in {got.directory} ({len(got.fetched)} downloaded, {got.bytes_fetched} bytes; "
        f"{len(got.unchanged)} already there)"
    )
    for name, hint in (
        ("model/model.json", f"python -m training.predict --model {got.directory / 'model'} IMAGE"),
        ("summary.png", str(got.directory / "summary.png")),
        ("tensorboard", f"tensorboard --logdir {got.directory / 'tensorboard'}"),
    ):
        if any(f == name or f.startswith(f"{name}/") for f in got.files):
            console.print(f"  {hint}")
    return 0
