"""`python -m training.torchrun ARGS`: torchrun ARGS, exiting with the first failed worker's status and
no launcher traceback (training/world/launcher_exit.py)."""

import sys

from training.world.launcher_exit import run_torchrun

if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
