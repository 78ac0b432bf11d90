"""`python -m training.horovodrun ARGS`: horovodrun ARGS, exiting with the first failed worker's status
and no launcher traceback (training/world/launcher_exit.py)."""

import sys

from training.world.launcher_exit import run_horovodrun

if __name__ == "__main__":
    sys.exit(run_horovodrun(sys.argv[1:]))
