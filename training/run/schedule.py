"""Learning-rate schedule of Goyal et al. (2017): linear scaling, gradual warmup, step decay.

With a scale of 1, no warmup and no decay epochs (AdamW's defaults) it is a constant LR.
"""

from __future__ import annotations

from collections.abc import Sequence


def learning_rate(
    step: int,
    steps_per_epoch: int,
    lr: float,
    scale: int,
    warmup_epochs: float,
    decay_epochs: Sequence[float] = (30.0, 60.0, 80.0),
    decay_factor: float = 0.1,
) -> float:
    """LR for the optimizer step with 0-based index ``step``.

    ``lr`` is the LR for one data-parallel replica's batch. The target LR is ``lr * scale`` (the
    linear scaling rule, ``scale`` the replicas, for SGD; 1 for AdamW: training.config.settings'
    ``OptimizerSettings.lr_scale``); during the first ``warmup_epochs`` the LR rises linearly from
    ``lr`` to that target, because the scaled LR diverges on random weights. After that it is
    multiplied by ``decay_factor`` at each epoch in ``decay_epochs``.
    """
    if steps_per_epoch <= 0 or scale <= 0:
        raise ValueError("steps_per_epoch and scale must be positive")
    epoch = step / steps_per_epoch
    target = lr * scale
    if epoch < warmup_epochs:
        return lr + (target - lr) * epoch / warmup_epochs
    return target * decay_factor ** sum(1 for boundary in decay_epochs if epoch >= boundary)
