"""The training environment's Horovod was built with both frameworks and the gloo controller."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HOROVODRUN = Path(sys.executable).with_name("horovodrun")


def test_check_build_lists_pytorch_tensorflow_and_gloo() -> None:
    # it starts TensorFlow and torch: seconds here, minutes on a loaded machine
    result = subprocess.run([HOROVODRUN, "--check-build"], capture_output=True, text=True, timeout=300, check=True)
    checked = set(re.findall(r"\[X\] (\w+)", result.stdout))
    assert {"PyTorch", "TensorFlow", "Gloo"} <= checked, result.stdout
    assert "Horovod v0.28.1" in result.stdout
