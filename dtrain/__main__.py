# PYTHON_ARGCOMPLETE_OK  (argcomplete: this script answers completions itself)
"""The operator's one command: `dtrain <command>` once installed, or `python -m dtrain <command>`
(`--help` lists them, `<command> --help` teaches each). Every command module adds its parser in
`configure(commands)` and sets `handler`; errors take one path to the terminal (dtrain.cli_entry.run_cli)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dtrain.cli import (
    cluster,
    cost,
    demo,
    doctor,
    drain,
    images,
    interactive,
    jobs,
    launch,
    local,
    results,
    stage,
    users,
    watch,
)
from dtrain.cli_entry import CLIParser, add_cluster_option, end_on_termination, run_cli

# In the order a user meets them: a cluster and its people, data and images on it, jobs and what they leave, then the
# local cluster.
CONSOLE_SCRIPT = "dtrain"  # pyproject.toml's [project.scripts]
COMMAND_MODULES = (
    cluster,
    users,
    stage,
    images,
    launch,
    jobs,
    drain,
    watch,
    interactive,
    results,
    cost,
    doctor,
    local,
    demo,
)

DESCRIPTION = """\
Distributed training on a Slurm GPU cluster: the Azure stack (`pulumi up`), or the embedded local
cluster (`local up`). Every command reads the cluster description (--cluster).

typical session:
  python -m dtrain local up                          # or: cluster from-stack --stack dev ...
  python -m dtrain stage generate /tmp/imagenet-mini  # or your own ImageNet-layout directory
  python -m dtrain stage all /tmp/imagenet-mini --dataset mini
  python -m dtrain launch --framework pytorch --nodes 2 -- --data synthetic --steps 50
  python -m dtrain jobs                               # the queue and recent runs
  python -m dtrain top                                # live: each job's step, loss, speed; each GPU's use
  python -m dtrain logs JOB -f                        # JOB: a Slurm job id or a run id
  python -m dtrain cancel JOB
  python -m dtrain status                             # nodes, drain reasons, health, slow ranks, queue
  python -m dtrain drain NODE --requeue               # a slow node out, its jobs restarted elsewhere
  python -m dtrain results RUN                        # the run's model, curves, cost and logs, to runs/RUN
"""


def build_parser() -> CLIParser:
    installed = Path(sys.argv[0]).name == CONSOLE_SCRIPT
    parser = CLIParser(
        prog=CONSOLE_SCRIPT if installed else "python -m dtrain",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_option(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CLIParser)
    for module in COMMAND_MODULES:
        module.configure(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (docs/operator.md): answer, and exit
        import argcomplete

        argcomplete.autocomplete(parser)
    end_on_termination()
    return run_cli(parser, lambda args: args.handler(args), argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
