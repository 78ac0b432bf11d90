"""A running job's progress as `dtrain top` shows it: the newest step line its rank 0 logged (training/run/loop.py
writes `step 120/900 epoch 2 loss 3.4567 lr 0.10000 images/s 812.5`), and the time left at the pace so far.
A job that logs no such line (the user's own code) shows what it logged to its MLflow run instead: the step
and the loss of the run's latest metrics (MLflow's runs/get). Runs on the operator's machine; the lines come
from the run's output.log on the shared file system, the run from the cluster's MLflow."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) epoch \d+ loss (\S+) lr \S+(?: images/s ([0-9.]+))?")
# the shell filter that finds those lines in a log (grep -E), kept beside the pattern it must agree with
STEP_LINE_GREP = r"step [0-9]+/[0-9]+ epoch "
# a metric whose name's last part is one of these is the run's loss (train/loss, loss, train_loss...)
LOSS_NAMES = ("loss", "train_loss", "training_loss")
SYSTEM_PREFIX = "system/"  # the run's system metrics (dtrain/remote/job/system_metrics.py): not progress


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int | None  # None: unknown (a run's MLflow metrics do not say)
    loss: float | None
    images_per_s: float | None

    def eta_s(self, elapsed_s: int | None) -> float | None:
        """Seconds left at the pace so far (the job's elapsed time over the steps done); None before a step."""
        if elapsed_s is None or self.step <= 0 or self.total_steps is None:
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


def progress_from_mlflow(answer: str) -> Progress | None:
    """The step and loss of a run's latest metrics, from MLflow's runs/get answer (JSON); None when the run
    has logged no metric of its own (system metrics aside) or the answer is not one."""
    try:
        latest = json.loads(answer)["run"]["data"].get("metrics", [])
        own = [m for m in latest if not str(m["key"]).startswith(SYSTEM_PREFIX)]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not own:
        return None
    losses = [m for m in own if str(m["key"]).rsplit("/", 1)[-1].lower() in LOSS_NAMES]
    loss = float(losses[0]["value"]) if losses else None
    return Progress(max(int(m.get("step", 0)) for m in own), None, loss, None)
