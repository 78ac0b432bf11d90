"""The head node's MLflow tracking server on Azure (infra/cloud_init/mlflow.py, infra/tracking.py), under
Pulumi mocks: installed pinned and started by systemd, listening on the head's private address only, its
artifacts in the `results` container through an identity whose only role is there, no port opened."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest
import yaml

from infra.cloud_init.mlflow import REQUIREMENTS, UNITS, server_env
from infra.config import parse_config
from infra.contract import MLFLOW_PORT
from infra.identity import STORAGE_BLOB_DATA_CONTRIBUTOR
from infra.network import DENY_ALL_PRIORITY
from tests.infra.conftest import VALID_CONFIG, Deployment
from tests.infra.documents import setup_packages
from tests.infra.sandbox import systemd_verify
from tests.infra.test_stack import HEAD_IP, _rules, by_name, head_document

CLIENT_ID = "33333333-3333-3333-3333-333333333333"


def head_files(deployment: Deployment) -> dict[str, str]:
    return {entry["path"]: entry["content"] for entry in yaml.safe_load(head_document(deployment))["write_files"]}


def env_file(deployment: Deployment) -> dict[str, str]:
    text = head_files(deployment)["/etc/mlflow/server.env"]
    return dict(line.split("=", 1) for line in text.splitlines())


def test_head_installs_the_pinned_server_and_starts_it_under_systemd(deployment: Deployment) -> None:
    files, document = head_files(deployment), yaml.safe_load(head_document(deployment))
    requirements = files["/etc/mlflow/requirements.txt"]
    assert requirements == REQUIREMENTS.read_text()
    assert re.search(r"^mlflow==\d+\.\d+\.\d+\s", requirements, re.M)  # an exact version
    assert all("==" in line for line in requirements.splitlines() if line and not line.startswith("#"))
    assert "python3-venv" in setup_packages(head_document(deployment))
    for unit in UNITS:
        assert f"/etc/systemd/system/{unit}" in files
    assert ["systemctl", "enable", "--now", "--no-block", *UNITS] in document["runcmd"]
    service = files["/etc/systemd/system/mlflow.service"]
    assert re.search(r"^User=mlflow$", service, re.M)  # not root
    assert "--host ${MLFLOW_HOST} --port ${MLFLOW_PORT}" in service
    assert "--backend-store-uri sqlite:////var/lib/mlflow/mlflow.db" in service  # the head's own disk


def test_server_listens_on_the_private_address_and_writes_results_with_its_own_identity(
    deployment: Deployment,
) -> None:
    env = env_file(deployment)
    assert (env["MLFLOW_HOST"], env["MLFLOW_PORT"]) == (HEAD_IP, str(MLFLOW_PORT))
    account = by_name(deployment, ":StorageAccount", "").outputs["name"]
    assert env["MLFLOW_ARTIFACTS"] == f"wasbs://results@{account}.blob.core.windows.net/mlflow"
    identity = by_name(deployment, ":UserAssignedIdentity", "-mlflow-")
    assert env["AZURE_CLIENT_ID"] == identity.outputs["clientId"]
    vm = by_name(deployment, ":VirtualMachine", "head")
    assert identity.id in vm.inputs["identity"]["userAssignedIdentities"]
    grants = [
        (r.inputs["roleDefinitionId"].rsplit("/", 1)[-1], r.inputs["scope"])
        for r in deployment.mocks.of_type(":RoleAssignment")
        if r.inputs["principalId"] == identity.outputs["principalId"]
    ]
    results = next(r.id for r in deployment.mocks.of_type(":BlobContainer") if r.inputs["containerName"] == "results")
    assert grants == [(STORAGE_BLOB_DATA_CONTRIBUTOR, results)]
    # nothing secret in the custom data: no key, no SAS, no connection string
    assert not re.search(r"(?i)AccountKey|sig=|CONNECTION_STRING|SharedAccessSignature", head_document(deployment))


def test_no_rule_admits_the_tracking_port_from_beyond_the_cluster_subnet(deployment: Deployment) -> None:
    cluster = ipaddress.ip_network(parse_config(VALID_CONFIG).subnets["cluster"])
    for role in ("cluster", "nfs", "jumpbox"):
        for rule in _rules(deployment, role):
            if rule["access"] != "Allow" or rule["priority"] >= DENY_ALL_PRIORITY:
                continue
            ports = rule.get("destinationPortRanges") or [rule.get("destinationPortRange")]
            opens = any(_covers(text, MLFLOW_PORT) for text in ports)
            if opens:
                source = ipaddress.ip_network(rule["sourceAddressPrefix"])
                assert role == "cluster" and source.subnet_of(cluster), rule
    nics = [nic for nic in deployment.mocks.of_type(":NetworkInterface") if "head" in nic.name]
    assert all("publicIPAddress" not in c for nic in nics for c in nic.inputs["ipConfigurations"])


def _covers(ports: str, port: int) -> bool:
    if ports == "*":
        return True
    low, _, high = ports.partition("-")
    return int(low) <= port <= int(high or low)


@pytest.mark.parametrize("address", ["0.0.0.0", "20.1.2.3", "not-an-ip"])
def test_the_server_never_listens_beyond_a_private_address(address: str) -> None:
    with pytest.raises(ValueError):
        server_env(address, "https://acct.blob.core.windows.net/", "results", CLIENT_ID)


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    from infra.cloud_init._common import read_unit

    for unit in UNITS:
        text = re.sub(r"^ExecStart=/.*(\n  .*)*$", "ExecStart=/bin/true", read_unit(unit), flags=re.M)
        (tmp_path / unit).write_text(text.replace("EnvironmentFile=/etc/mlflow/server.env\n", ""))
    result = systemd_verify(tmp_path, UNITS)
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if "mlflow" in line], result.stderr
