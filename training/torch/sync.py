"""How often the PyTorch data-parallel job's replicas agree: every step, or every H steps.

``--sync every-step`` is plain data parallelism: DDP allreduces the gradients in every backward.
The periodic modes let each replica take local steps and average the *parameters* now and then,
which is what pays off where the link between nodes is slow (Lin et al. 2020, "Don't use large
mini-batches, use local SGD"; Douillard et al. 2023, DiLoCo):

* ``local-sgd``: no gradient allreduce at all after the warm-up; every H steps the parameters are
  averaged over every rank (``PeriodicModelAverager``);
* ``hierarchical``: the gradients are allreduced inside each node in every backward, the parameters
  over every rank every H steps (``PeriodicModelAverager`` again). Inside a node the link is fast;
  across nodes it is used only every H steps. The processes of a node stay one replica.

Both run the first ``--sync-warmup-steps`` steps fully synchronous: the post-local-SGD DDP
communication hook allreduces the gradients over every rank until then, and afterwards over the
node's ranks (hierarchical) or not at all (local-sgd). Both can replace the plain average with
DiLoCo's outer step (``--outer-optimizer nesterov``): the averaged change since the last global
average is an outer gradient for Nesterov SGD on a copy of the weights (the anchor) that every
rank keeps identical.

These are torch's own building blocks (torch.distributed.algorithms); what is ours is the wiring:
the averager counts the steps *done*, so that averaging follows every H-th step, and the state a
resumed run needs (each replica's weights and optimizer, the step count, the anchor) is saved.

Why not ``HierarchicalModelAverager`` for the node level: it averages the *parameters* inside the
node after each step, which cannot overlap the backward pass and copies the model into one flat
buffer each time; measured with bench.cpu.local_sgd_worker (4 ranks, one node, 64 steps) it took 1.8x
the time of DDP's overlapped gradient allreduce (4.3 s against 2.4 s), for the same weights (SGD
with momentum is linear, so the mean of the replicas' updates is the update of the mean gradient).
The hook's node-level gradient allreduce is DDP's own bucketed, overlapped allreduce.

The modes' names, defaults and typed settings are framework-free, in training/config/sync.py (the parser
reads them without torch); this module is what they do to a DDP model.

Only the DDP backend has them. Horovod's ``DistributedOptimizer`` allreduces in every step and
Horovod 0.28 has no averager; the job refuses ``--sync`` other than every-step with Horovod.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from training.config.sync import HIERARCHICAL, NESTEROV, SyncSettings
from training.errors import BadInput

if TYPE_CHECKING:
    import torch
    from torch import nn


class OuterNesterov:
    """DiLoCo's outer step: anchor <- Nesterov SGD on (anchor - global average); weights <- anchor."""

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float) -> None:
        import torch

        self.params = params
        self.anchor = [p.detach().clone() for p in params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def reset(self) -> None:
        """The weights (equal on every rank) become the anchor: the start of local training."""
        for anchor, param in zip(self.anchor, self.params, strict=True):
            anchor.copy_(param.detach())

    def step(self) -> None:
        """After the parameters were averaged over every rank."""
        for anchor, param in zip(self.anchor, self.params, strict=True):
            anchor.grad = anchor - param.detach()
        self.optimizer.step()
        for anchor, param in zip(self.anchor, self.params, strict=True):
            param.data.copy_(anchor)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.cpu() for a in self.anchor], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError(f"the anchor has {len(state['anchor'])} tensors, this model {len(self.anchor)}")
        for anchor, saved in zip(self.anchor, state["anchor"], strict=True):
            anchor.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])


class PeriodicSync:
    """The periodic modes on a DDP model: the hook, the averager and the outer optimizer.

    Every rank builds one after DDP wrapped the model (which made the replicas equal) and calls
    :meth:`after_step` after each optimizer step."""

    def __init__(self, settings: SyncSettings, ddp: nn.Module, local_size: int, start_step: int) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        self.settings = settings
        self.average = average_parameters
        self.world = dist.group.WORLD
        self.params = list(ddp.parameters())
        # torch's averaging makes every weight a contiguous view of one flat buffer; DDP built its
        # buckets for the weights' layout (channels-last), which the gradients keep following.
        self.layouts = [_memory_format(p) for p in self.params]
        # DDP would broadcast rank 0's buffers (batch-norm statistics) over every rank before each
        # forward: a wait on the slow link in every step. They are averaged with the weights instead.
        # (A property in torch 2.13, forward_sync_buffers's old name; a plain attribute in 2.11.)
        ddp.broadcast_buffers = False
        self.buffers = [b for b in ddp.module.buffers() if b.is_floating_point()]
        hierarchical = settings.mode == HIERARCHICAL
        # Ranks of a node are contiguous (torchrun's numbering), so new_subgroups(local_size) is per
        # node; every rank must call it, in the same order.
        node_group = dist.new_subgroups(group_size=local_size)[0] if hierarchical else None
        # Gradients over every rank while iter < warm-up; then over the node, or not at all.
        self.hook_state = post_local.PostLocalSGDState(
            process_group=None,
            subgroup=node_group,
            start_localSGD_iter=settings.warmup_steps,
            post_local_gradient_allreduce=hierarchical,
        )
        self.hook_state.iter = min(start_step, settings.warmup_steps)
        ddp.register_comm_hook(self.hook_state, post_local.post_localSGD_hook)
        with warnings.catch_warnings():  # H = 1 is allowed on purpose: it must equal every-step
            warnings.filterwarnings("ignore", message=".*no need to use model averaging.*")
            self.averager = averagers.PeriodicModelAverager(settings.every, settings.warmup_steps)
        self.outer = (
            OuterNesterov(self.params, settings.outer_lr, settings.outer_momentum)
            if settings.outer == NESTEROV
            else None
        )

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Backward passes that are no training step (``--decode auto``'s probe of the model). The hook
        counts every backward towards the end of the warm-up (``PostLocalSGDState.iter``), so its count
        is put back after them: each communicates as the next training step will, and the switch to
        local steps still comes after ``--sync-warmup-steps`` training steps."""
        count = self.hook_state.iter
        try:
            yield
        finally:
            self.hook_state.iter = count

    def after_step(self, step: int, *, publish: bool = False) -> None:
        """After the optimizer step of 0-based ``step``: average where due, then the outer step.
        ``publish``: the model leaves the run after this step (the last step, an epoch's export), so
        the replicas become one model even off the period: an export is the average, not rank 0's
        replica, and a period longer than the run still ends averaged."""
        done = step + 1
        due = self.settings.global_average_due(done)
        self.averager.step = done  # torch's averagers count calls; ours count steps done (resume-proof)
        if publish and not due:
            self.average(iter(self.params), self.world)  # the averager's period would skip this step
        else:
            self.averager.average_parameters(self.params)
        for param, layout in zip(self.params, self.layouts, strict=True):
            if not param.is_contiguous(memory_format=layout):
                param.data = param.data.contiguous(memory_format=layout)
        # Batch-norm statistics differ between ranks even in the warm-up (they are never broadcast).
        if self.buffers and (due or publish):
            self.average(iter(self.buffers), self.world)
        if self.outer is None:
            return
        if done == self.settings.warmup_steps:
            self.outer.reset()
        elif done > self.settings.warmup_steps and (due or publish):
            self.outer.step()

    def checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, done: int) -> dict[str, Any] | None:
        """What a checkpoint adds, on rank 0 (None elsewhere): every replica's weights and optimizer
        (they differ between averages) and the averaging state. A collective: every rank calls it."""
        replicas = gather_replicas(replica_state(model, optimizer))
        if replicas is None:
            return None
        outer = None if self.outer is None else self.outer.state_dict()
        return {"sync": {"steps_done": done, "outer": outer}, "replicas": replicas}

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], rank: int) -> None:
        """This rank's own replica and the averaging state, from a checkpoint's ``state``. A checkpoint
        of an every-step run has neither: its replicas are equal, and the anchor is its weights."""
        import torch.distributed as dist

        replicas, sync = state.get("replicas"), state.get("sync")
        if replicas is None or sync is None:
            return
        if len(replicas) != dist.get_world_size():
            raise ValueError(f"it holds {len(replicas)} replicas; resume with that many processes")
        if sync["steps_done"] != state["step"]:
            raise ValueError(
                f"its averaging state is of step {sync['steps_done']}, its weights of step {state['step']}"
            )
        if (sync["outer"] is None) != (self.outer is None):
            raise ValueError("it was written with another --outer-optimizer")
        model.load_state_dict(replicas[rank]["model"])
        optimizer.load_state_dict(replicas[rank]["optimizer"])
        if self.outer is not None:
            self.outer.load_state_dict(sync["outer"])


def refuse_replicas(state: dict[str, Any]) -> None:
    """An every-step run cannot continue a checkpoint of the periodic modes: its replicas differ."""
    if "replicas" in state:
        raise ValueError(f"it was written by --sync local-sgd or hierarchical ({len(state['replicas'])} replicas)")


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    import torch

    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def replica_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's own weights and optimizer state, on the CPU (replicas differ between averages)."""
    import torch

    def cpu(value: Any) -> Any:
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value

    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = {
        index: {key: cpu(value) for key, value in entry.items()} for index, entry in optimizer_state["state"].items()
    }
    return {"model": {name: cpu(t) for name, t in model.state_dict().items()}, "optimizer": optimizer_state}


def gather_replicas(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's :func:`replica_state` on rank 0 (None elsewhere): a collective of every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def check_layout(local_sizes: list[int]) -> None:
    """Hierarchical averaging groups ranks by node: every node must run as many processes.
    ``local_sizes``: every rank's (the same list on every rank, so every rank refuses alike)."""
    if len(set(local_sizes)) > 1:
        raise BadInput(
            f"--sync hierarchical needs the same number of processes on every node, got {sorted(set(local_sizes))}: "
            "use torchrun --nproc-per-node N on every node",
            every_rank=True,
        )
