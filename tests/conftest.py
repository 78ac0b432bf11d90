"""Test-suite-wide hooks: tests marked ``gpu`` are skipped, with the reason, where CUDA is absent."""

from __future__ import annotations

import pytest

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    import torch  # only now: the operator environment's suites have no torch

    if torch.cuda.is_available():
        return
    for item in gpu_tests:
        item.add_marker(pytest.mark.skip(reason=NO_CUDA))
