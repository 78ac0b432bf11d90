"""Suite-wide: tests marked ``gpu`` skip, with the reason printed, where there is no CUDA device."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    import torch  # only where a GPU test was collected: the operator environment has no torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_tests:
        item.add_marker(skip)
