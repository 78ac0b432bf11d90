"""Learning-rate schedule of Goyal et al. (2017): linear scaling, gradual warmup, step decay."""

from __future__ import annotations

from collections.abc import Sequence


def learning_rate(
    step: int,
    steps_per_epoch: int,
    base_lr: float,
    world_size: int,
    warmup_epochs: float,
    decay_epochs: Sequence[float] = (30.0, 60.0, 80.0),
    decay_factor: float = 0.1,
) -> float:
    """LR for the optimizer step with 0-based index ``step``.

    ``base_lr`` is the LR for one worker's batch. The target LR is ``base_lr * world_size``
    (linear scaling rule); during the first ``warmup_epochs`` the LR rises linearly from
    ``base_lr`` to that target, because the scaled LR diverges on random weights. After that
    it is multiplied by ``decay_factor`` at each epoch in ``decay_epochs``.
    """
    if steps_per_epoch <= 0 or world_size <= 0:
        raise ValueError("steps_per_epoch and world_size must be positive")
    epoch = step / steps_per_epoch
    target = base_lr * world_size
    if epoch < warmup_epochs:
        return base_lr + (target - base_lr) * epoch / warmup_epochs
    return target * decay_factor ** sum(1 for boundary in decay_epochs if epoch >= boundary)
