"""`results RUN`: download what a run left in the results container (the trained model, TensorBoard events,
summary.png, run.json with its cost, logs, metrics) to a local directory.

  python -m dtrain results 20261124T101500Z-pytorch-1a2b --dest runs/

The download itself is dtrain/jobs/results.py's; this module is the verb's parser and what it prints.
"""

from __future__ import annotations

import argparse

from dtrain.cli_entry import add_cluster_option, arg_type, non_empty
from dtrain.cluster.description import load
from dtrain.jobs.results import DEFAULT_DEST, download_run
from dtrain.jobs.run_ids import check_run_id
from dtrain.ui import make_console

console = make_console()


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
