"""Which backend a data-parallel job runs: the one its launcher speaks.

horovodrun starts processes that Horovod numbers (``HOROVOD_RANK``; ``OMPI_COMM_WORLD_RANK`` or
``PMI_RANK`` under mpirun). torchrun, or any launcher that sets torch.distributed's ``RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR``, starts processes that torch.distributed numbers. A job started
by torchrun with Horovod does not fail: each process sees a world of one, trains a copy of its own
and writes its outputs as rank 0, over the others'. So ``--backend auto`` (the default) follows the
launcher, and Horovod named under torchrun is refused before anything starts. (DDP named outside
torchrun is refused when it starts: it finds no ``RANK``.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

AUTO, HOROVOD, DDP = "auto", "horovod", "ddp"
BACKENDS = (AUTO, HOROVOD, DDP)
_TORCH_RANKS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_HOROVOD_RANKS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


class BackendRefused(ValueError):
    """The backend cannot run under this launcher; the message says what to change."""


def torch_launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun (or another launcher of torch.distributed's) started this process; horovodrun's
    ranks win over torch's variables inherited from an outer environment."""
    if "TORCHELASTIC_RUN_ID" in env:
        return True
    return all(name in env for name in _TORCH_RANKS) and not any(name in env for name in _HOROVOD_RANKS)


def choose_backend(framework: str, requested: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The backend for ``framework``: ``requested`` is PyTorch's ``--backend``, None for the jobs
    without the flag (TensorFlow, Keras), which run Horovod. Raises :class:`BackendRefused`."""
    under_torchrun = torch_launched(env)
    backend = HOROVOD if requested is None else requested
    if requested == AUTO:
        backend = DDP if under_torchrun else HOROVOD
    world = int(env.get("WORLD_SIZE", "1")) if under_torchrun else 1
    if backend == HOROVOD and world > 1:
        fix = (
            "use --backend ddp (or auto, the default), or start the job with horovodrun"
            if requested is not None
            else "start it with horovodrun"
        )
        raise BackendRefused(
            f"training.{framework} with Horovod under torchrun: Horovod does not see torchrun's {world} "
            f"processes, so each would train alone; {fix}"
        )
    return backend
