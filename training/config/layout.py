"""How the world's ranks are split between the parallelisms, checked before any process group starts.

The four degrees multiply to the world size and form one DeviceMesh with the dimensions
``("pp", "dp_replicate", "dp_shard", "tp")``, outermost first, as in torchtitan: tensor-parallel
ranks are neighbours (on one node, where the all-reduce of every layer is cheapest), then the
FSDP group, then replicas, and pipeline stages are furthest apart (they exchange only
activations, once per microbatch). A rank's coordinates are its index in that row-major order.

The mesh itself is built from a layout by training/torch/parallel/mesh.py. Runs wherever a job runs; standard
library only (the parser checks a layout before torch is imported).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from training.config.models import RESNETS
from training.errors import BadInput

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model: each takes its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (the mesh is the ranks in row-major order)."""
        coords = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.shape, strict=True))):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica ``rank`` belongs to: its slice of the global batch."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, self.shape, strict=True))

    @classmethod
    def from_flags(cls, world_size: int, tp: int = 1, pp: int = 1, dp_shard: int = -1) -> Layout:
        """The layout ``--tp``, ``--pp`` and ``--dp-shard`` ask for (``-1``: every rank left), the
        remaining factor replicating; :class:`BadInput` unless they divide ``world_size``."""
        if tp < 1 or pp < 1 or (dp_shard < 1 and dp_shard != -1):
            raise BadInput(
                f"--tp {tp}, --pp {pp}, --dp-shard {dp_shard}: degrees are positive (--dp-shard -1: the rest)"
            )
        asked = f"--tp {tp} x --pp {pp}" + (f" x --dp-shard {dp_shard}" if dp_shard != -1 else "")
        product = tp * pp * max(dp_shard, 1)
        if world_size % product:
            raise BadInput(
                f"{asked} = {product} does not divide the world size {world_size} "
                "(torchrun's --nnodes x --nproc-per-node): choose degrees whose product divides it"
            )
        rest = world_size // (tp * pp)
        shard = rest if dp_shard == -1 else dp_shard
        return cls(dp_replicate=rest // shard, dp_shard=shard, tp=tp, pp=pp)


def check_model(
    layout: Layout,
    model_name: str,
    n_units: int,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    stages_per_rank: int = 1,
) -> None:
    """:class:`BadInput` if ``model_name`` cannot take ``layout``: tensor parallelism for a ResNet,
    more pipeline stages (``pp`` x ``stages_per_rank``, 2 for interleaved-1f1b) than ``n_units``
    (transformer layers or residual blocks), or a TP degree that does not divide the attention
    heads (each rank must run whole heads)."""
    if layout.tp > 1 and model_name in RESNETS:
        raise BadInput(
            f"--tp {layout.tp}: tensor parallelism splits attention and MLP layers, which {model_name} "
            "does not have: use --tp 1 with --dp-shard and --pp for ResNets"
        )
    stages = layout.pp * stages_per_rank
    if layout.pp > 1 and stages > n_units:
        unit = "residual blocks" if model_name in RESNETS else "layers"
        per_rank = f" ({stages_per_rank} per rank)" if stages_per_rank > 1 else ""
        raise BadInput(
            f"--pp {layout.pp} needs {stages} pipeline stages{per_rank} but {model_name} has only {n_units} "
            f"{unit}: each stage needs at least one; lower --pp"
        )
    for what, count in (("attention heads", n_heads), ("key/value heads", n_kv_heads)):
        if count is not None and count % layout.tp:
            raise BadInput(
                f"--tp {layout.tp} does not divide {model_name}'s {count} {what}: "
                "each tensor-parallel rank runs whole heads; choose a divisor"
            )
