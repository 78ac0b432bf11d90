"""Builds the Pulumi program under mocks, once per test module that asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.config import parse_config
from infra.stack import build_stack
from tests.infra.azure_mocks import AzureMocks, DependencyRecordingMonitor, Resolved, resolve
from tests.infra.sandbox import Sandbox
from tests.infra.ssh_keys import ED25519

PROJECT = "azure-horovod"
STACK = "test"
SSH_KEY = ED25519
VALID_CONFIG: dict[str, Any] = {
    "location": "eastus",
    "owner": "ml-platform@example.com",
    "sshPublicKey": SSH_KEY,
    "allowedSshCidr": "203.0.113.0/24",
    "gpuSku": "Standard_ND96isr_H100_v5",
    "nodeCount": "4",
    "nfsDiskCount": "4",
    "sasExpiry": "P30D",
    "tags": {"costCenter": "ml-research"},
}
# sharedStorage lustre at the smallest size of the default tier (125 MB/s per TiB: 16 TiB); the NFS keys
# are refused with it.
LUSTRE_CONFIG: dict[str, Any] = {
    **{key: value for key, value in VALID_CONFIG.items() if key != "nfsDiskCount"},
    "sharedStorage": "lustre",
    "lustreCapacityTib": "16",
}
# A storage account that an earlier stack's `pulumi destroy` kept (keptResultsAccount).
KEPT_ACCOUNT_ID = (
    "/subscriptions/00000000-0000-0000-0000-0000000000aa/resourceGroups/hvd-data-rg5e6f7a8b"
    "/providers/Microsoft.Storage/storageAccounts/hvdsa5e6f7a8b"
)


@dataclass
class Deployment:
    mocks: AzureMocks
    outputs: dict[str, Resolved]


def deploy(raw: dict[str, Any], mocks: AzureMocks | None = None) -> Deployment:
    """Set the mocks first (resources built before them never resolve), then build and wait."""
    mocks = mocks or AzureMocks()
    monitor = DependencyRecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=STACK, preview=False, monitor=monitor)
    captured: dict[str, Resolved] = {}

    @pulumi.runtime.test
    def run():
        return resolve(build_stack(parse_config(raw), PROJECT, STACK)).apply(captured.update)

    run()
    assert captured, "the stack outputs never resolved: the assertions below would be empty"
    return Deployment(mocks, captured)


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    return deploy(VALID_CONFIG)


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)
