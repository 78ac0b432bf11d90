"""The `stage` command (`generate`, `upload`, `pull`, `all`): its flags and its output, over
dtrain/datasets/staging.py, which does the work."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from dataclasses import asdict

from pydantic import SecretStr
from rich.table import Table

from dtrain.cli_entry import add_cluster_option, arg_type, int_between, non_empty, positive_number
from dtrain.cluster.description import BlobCredential, ClusterDescription, load
from dtrain.datasets.staging import (
    DEFAULT_QUALITY,
    QUALITY,
    SHORT_SIDE,
    PullSummary,
    UploadSummary,
    check_dataset_name,
    dataset_path,
    generate_synthetic_imagenet,
    pull,
    upload,
)
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console

console = make_console()


RAW = argparse.RawDescriptionHelpFormatter
STAGE_DESCRIPTION = """\
Stage a dataset for training. A local directory in ImageNet layout (train/<class>/*.JPEG, and
optionally val/) goes to the `data` blob container (resumable, MD5-checked), then the NFS server
(on a Lustre stack, the head node) pulls it onto the shared file system with the read-only SAS, where
every node finds it at <data_path>/<dataset> (`cluster show` prints data_path). Where Lustre imported
the container at its creation, what it imported is checked in place and only the rest is copied.
--short-side PX transcodes the images once before upload: faster decoding every epoch, but --image-size
is then limited to about PX * 0.875."""
STAGE_EXAMPLES = """\
examples:
  python -m dtrain stage generate /tmp/imagenet-mini         # a small synthetic dataset
  python -m dtrain stage all /tmp/imagenet-mini --dataset mini
  python -m dtrain stage all /data/imagenet --dataset imagenet --shard-size-mb 256
  python -m dtrain stage all /data/imagenet --dataset imagenet-160 --short-side 160
"""
SUBCOMMANDS = {
    "generate": (
        "write a small synthetic JPEG dataset in ImageNet layout",
        "Write JPEGs as DIR/{train,val}/<wnid>/<wnid>_NNNNN.JPEG, each class with its own colour and stripes "
        "plus noise, so that a model can learn it. The same seed gives the same bytes.",
        (
            "python -m dtrain stage generate /tmp/imagenet-mini",
            "python -m dtrain stage generate /tmp/tiny --classes 2 --train-per-class 8 --image-size 32",
        ),
    ),
    "upload": (
        "upload a local directory to the data container (resumable)",
        "Upload SOURCE to <dataset>/ in the `data` container, in parallel, each blob with its Content-MD5. A file "
        "is sent only when no blob of its name has the same MD5: rerun the same command to resume.",
        (
            "python -m dtrain stage upload /tmp/imagenet-mini --dataset mini",
            "python -m dtrain stage upload /data/imagenet --dataset imagenet --shard-size-mb 256 --workers 16",
            "python -m dtrain stage upload /data/imagenet --dataset imagenet-256 --short-side 256 --quality 90",
        ),
    ),
    "pull": (
        "pull a staged dataset onto the shared file system with the read-only SAS",
        "Run blob-pull on the NFS server, or on a Lustre stack the head node (over SSH, through the jump host), "
        "into <data_path>/<dataset>, with the read-only SAS on its stdin, then check that every blob arrived. Files "
        "already in place with the same MD5 are kept (on Lustre, those its import of the container brought).",
        ("python -m dtrain stage pull --dataset mini",),
    ),
    "all": (
        "upload, then pull (the usual way)",
        "Upload SOURCE to the `data` container, then pull it onto the shared file system, checking the pulled "
        "counts against the uploaded ones.",
        (
            "python -m dtrain stage all /tmp/imagenet-mini --dataset mini",
            "python -m dtrain --cluster cluster-dev.json stage all /data/imagenet --dataset imagenet",
        ),
    ),
}


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "stage",
        help="stage a dataset: local directory -> blob container -> shared file system",
        description=STAGE_DESCRIPTION,
        epilog=STAGE_EXAMPLES,
        formatter_class=RAW,
    )
    sub = parser.add_subparsers(required=True)
    for name, (help_text, description, examples) in SUBCOMMANDS.items():
        command = sub.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(description, 100),
            epilog="examples:\n" + "".join(f"  {line}\n" for line in examples),
            formatter_class=RAW,
        )
        if name == "generate":
            _generate_arguments(command)
            command.set_defaults(handler=_generate)
            continue
        add_cluster_option(command)
        if name in ("upload", "all"):
            command.add_argument("source", metavar="SOURCE", type=non_empty, help="local dataset directory")
        command.add_argument(
            "--dataset",
            required=True,
            metavar="NAME",
            type=arg_type(check_dataset_name),
            help="the dataset's name: its blob prefix and its directory under data_path",
        )
        if name in ("upload", "all"):
            _upload_arguments(command)
        if name in ("pull", "all"):
            command.add_argument(
                "--pull-workers",
                type=int_between(1, 256),
                default=16,
                metavar="N",
                help="parallel downloads (default: 16)",
            )
        command.set_defaults(handler=_stage, upload=name != "pull", pull=name != "upload")


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="DIR", type=non_empty, help="directory to write (created if missing)")
    parser.add_argument("--classes", type=int_between(1), default=4, metavar="N", help="default: 4")
    parser.add_argument("--train-per-class", type=int_between(1), default=16, metavar="N", help="default: 16")
    parser.add_argument("--val-per-class", type=int_between(0), default=4, metavar="N", help="default: 4")
    parser.add_argument(
        "--image-size", type=int_between(8, 4096), default=64, metavar="PX", help="pixels per side (default: 64)"
    )
    parser.add_argument("--seed", type=int_between(0), default=0, metavar="N", help="default: 0")


def _upload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shard-size-mb",
        type=positive_number,
        metavar="MB",
        help="pack files into tar shards of this size first (many small files)",
    )
    parser.add_argument(
        "--shard-dir",
        type=non_empty,
        metavar="DIR",
        help="where shards are built (default: ~/.cache/hvd-stage/shards/DATASET)",
    )
    parser.add_argument(
        "--short-side",
        type=int_between(*SHORT_SIDE),
        metavar="PX",
        help="transcode the images once (cached in ~/.cache/hvd-stage/transcoded/) to this short side before "
        "uploading: smaller, faster-to-decode JPEGs, but --image-size is then limited to about PX * 0.875",
    )
    parser.add_argument(
        "--quality",
        type=int_between(*QUALITY),
        metavar="Q",
        help=f"JPEG quality of the transcoded copy (default: {DEFAULT_QUALITY}; only with --short-side)",
    )
    parser.add_argument(
        "--workers", type=int_between(1, 256), default=8, metavar="N", help="parallel uploads (default: 8)"
    )
    parser.add_argument(
        "--sas-env",
        type=non_empty,
        metavar="VAR",
        help="upload with a SAS (create + write) from this environment variable instead of the description's "
        "staging credential",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary table still shows)")


def _generate(args: argparse.Namespace) -> int:
    counts = generate_synthetic_imagenet(
        args.out, args.classes, args.train_per_class, args.val_per_class, args.image_size, args.seed
    )
    console.print(f"wrote {counts['train']} train and {counts['val']} val JPEGs under {args.out}")
    return 0


def _upload(args: argparse.Namespace, desc: ClusterDescription) -> UploadSummary:
    summary = upload(
        desc.data,
        credential_from_env(args.sas_env) or desc.staging_credential,
        args.source,
        args.dataset,
        shard_size_mb=args.shard_size_mb,
        shard_dir=args.shard_dir,
        workers=args.workers,
        show_progress=not args.no_progress,
        short_side=args.short_side,
        quality=args.quality or DEFAULT_QUALITY,
    )
    print_upload_summary(summary)
    print(json.dumps({"upload": asdict(summary)}))
    if summary.failed:
        raise OperatorError(f"{summary.failed} files failed to upload; rerun to resume", ExitCode.FAILED)
    return summary


def _stage(args: argparse.Namespace) -> int:
    if args.upload and args.quality is not None and args.short_side is None:
        raise OperatorError("--quality applies to the transcoded copy: give --short-side too", ExitCode.BAD_INPUT)
    desc = load(args.cluster)
    dataset_path(desc, args.dataset)  # a name the shared file system cannot take is refused before the upload
    expected = objects = None
    if args.upload:
        summary = _upload(args, desc)
        expected, objects = summary.source_files, summary.objects
    if args.pull:
        result = pull(desc, args.dataset, expected_files=expected, expected_objects=objects, workers=args.pull_workers)
        print_pull_summary(result)
        print(json.dumps({"pull": asdict(result)}))
    return 0


def print_upload_summary(summary: UploadSummary) -> None:
    table = Table(title="staging upload")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("destination", f"{summary.container_url}/{summary.prefix}"),
        ("source files", str(summary.source_files)),
        ("objects (shards)" if summary.sharded else "objects", str(summary.objects)),
        ("uploaded", str(summary.uploaded)),
        ("already present (same MD5)", str(summary.skipped)),
        ("failed", str(summary.failed)),
        ("bytes uploaded", f"{summary.bytes_uploaded:,}"),
        ("time", f"{summary.seconds:.1f} s"),
        ("throughput", f"{summary.mb_per_s:.1f} MB/s"),
    ]
    if summary.extra_remote:
        rows.append(("blobs under the prefix not in the source", str(summary.extra_remote)))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for err in summary.errors[:10]:
        console.print(str(err), style="red", markup=False)


def print_pull_summary(result: PullSummary) -> None:
    table = Table(title=f"pull onto the {result.host}")
    table.add_column("")
    table.add_column("value", justify="right")
    for key, value in (
        ("path on the nodes", result.dest_on_nodes),
        ("blobs listed", result.listed),
        ("downloaded", result.downloaded),
        ("already present (same MD5)", result.skipped),
        ("failed", result.failed),
        ("files in place", result.files_in_dest),
        ("expected files", "-" if result.expected_files is None else result.expected_files),
        ("time", f"{result.seconds:.1f} s"),
    ):
        table.add_row(key, str(value))
    console.print(table)


def credential_from_env(var: str | None) -> BlobCredential | None:
    if not var:
        return None
    value = os.environ.get(var, "").strip()
    if not value:
        raise OperatorError(f"environment variable {var} is empty or unset")
    return BlobCredential(kind="sas", secret=SecretStr(value.lstrip("?")))
