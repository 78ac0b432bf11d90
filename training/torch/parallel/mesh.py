"""The job's one DeviceMesh, built from its layout (training/config/layout.py says how ranks are split).

Runs on the nodes, in every rank of a mesh layout. Imports PyTorch.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from training.config.layout import MESH_DIMS, Layout


def build_mesh(layout: Layout, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """The job's one DeviceMesh (after ``init_process_group``); every rank must call it.

    ``timeout``: of every collective on the mesh's groups. DeviceMesh creates them with torch's
    default (30 minutes on gloo, 10 on NCCL), not the default group's; a peer that stops answering
    must fail the job as quickly whatever group it was meant to talk on (training.world.distributed).
    """
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    if timeout is not None:
        for name in MESH_DIMS:
            _set_pg_timeout(timeout, mesh.get_group(name))
    return mesh
