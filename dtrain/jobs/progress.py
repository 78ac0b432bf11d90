"""A running job's progress as `dtrain top` shows it: the newest step line its rank 0 logged (training/run/loop.py
writes `step 120/900 epoch 2 loss 3.4567 lr 0.10000 images/s 812.5`), and the time left at the pace so far.
Runs on the operator's machine; the lines come from the run's output.log on the shared file system."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) epoch \d+ loss (\S+) lr \S+(?: images/s ([0-9.]+))?")
# the shell filter that finds those lines in a log (grep -E), kept beside the pattern it must agree with
STEP_LINE_GREP = r"step [0-9]+/[0-9]+ epoch "


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int
    loss: float
    images_per_s: float | None

    def eta_s(self, elapsed_s: int | None) -> float | None:
        """Seconds left at the pace so far (the job's elapsed time over the steps done); None before a step."""
        if elapsed_s is None or self.step <= 0:
            return None
        return elapsed_s * (self.total_steps - self.step) / self.step


def parse_progress(log_text: str) -> Progress | None:
    """The last step line in log_text, or None when there is none (not started, or not a bundled job)."""
    matches = list(STEP_LINE.finditer(log_text))
    if not matches:
        return None
    found = matches[-1]
    step, total, loss, rate = found.groups()
    try:
        value = float(loss)
    except ValueError:
        value = math.nan
    return Progress(int(step), int(total), value, float(rate) if rate else None)
