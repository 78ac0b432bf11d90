"""A test-only entry point for tests/training/test_training_hangs.py: the PyTorch job, with its first
checkpoint file written SLOW_SAVE_SECONDS late, as on a shared file system slower than the peer timeout."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import training.checkpoint.files
from training import pytorch
from training.checkpoint.files import Fingerprint

_write = training.checkpoint.files.write_checkpoint
_slowed: list[int] = []


def slow_write(directory: Path, step: int, fingerprint: Fingerprint, payload: bytes) -> Path:
    if not _slowed:
        _slowed.append(step)
        time.sleep(float(os.environ["SLOW_SAVE_SECONDS"]))
    return _write(directory, step, fingerprint, payload)


if __name__ == "__main__":
    training.checkpoint.files.write_checkpoint = slow_write
    pytorch.main(sys.argv[1:])
