"""No custom data carries a secret, by Checkov's secrets scanner (its own environment, .venv-checkov, made by
`make setup`): every cloud-config the Pulumi program renders, as tests/infra/documents.py renders each role
and as the deployment under mocks declares it (the default stack, the MySQL accounting option, Lustre).
A control plants real secrets into a document and sees each flagged, so a scanner that reads nothing, or
reads these documents wrong, cannot pass."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.infra.conftest import LUSTRE_CONFIG, VALID_CONFIG, deploy
from tests.infra.documents import DOCUMENTS
from tests.infra.test_accounting import MYSQL_CONFIG
from tests.infra.test_stack import custom_data

CHECKOV = Path(__file__).resolve().parents[2] / ".venv-checkov" / "bin" / "checkov"
# Secrets only, as JSON; --skip-download (and no update check, below): offline and the same on every
# machine, with no Prisma Cloud policies or PyPI version look-up.
CHECKOV_ARGS = ["--framework", "secrets", "--output", "json", "--quiet", "--compact", "--skip-download"]
# A hang guard only: a run takes about 10 s on an idle machine, several times that at load 10.
CHECKOV_TIMEOUT_S = 600
STORAGE_KEY_CHECK = "CKV_SECRET_3"  # Azure Storage Account access key
PRIVATE_KEY_CHECK = "CKV_SECRET_13"  # Private Key


def secrets_found(documents: dict[str, str], directory: Path) -> set[tuple[str, str]]:
    """(document, check) for each secret Checkov finds in the documents, written as NAME.yaml (the
    extensions its secrets scanner reads) and scanned in one run."""
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run `make setup` (requirements-checkov.txt)", pytrace=False)
    for name, document in documents.items():
        (directory / f"{name}.yaml").write_text(document)
    run = subprocess.run(
        [CHECKOV, *CHECKOV_ARGS, "--directory", directory],
        capture_output=True,
        text=True,
        env={**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"},
        timeout=CHECKOV_TIMEOUT_S,
        check=False,
    )
    assert run.returncode in (0, 1), run.stderr  # 1: secrets found; anything else, Checkov failed
    report = json.loads(run.stdout)
    # With nothing found Checkov prints its summary alone; with findings, the results around it.
    summary = report.get("summary", report)
    failed = report.get("results", {}).get("failed_checks", [])
    assert summary["parsing_errors"] == 0 and summary["failed"] == len(failed), run.stdout
    assert run.returncode == (1 if failed else 0), run.stdout
    return {(Path(check["file_path"]).stem, check["check_id"]) for check in failed}


@pytest.fixture(scope="module")
def deployed() -> dict[str, str]:
    """The custom data of each stack shape as Azure would receive it, by stack and resource."""
    stacks = {"default": VALID_CONFIG, "mysql": MYSQL_CONFIG, "lustre": LUSTRE_CONFIG}
    return {
        f"{stack}-{resource}": document
        for stack, config in stacks.items()
        for resource, document in custom_data(deploy(config)).items()
    }


def test_checkov_finds_no_secret_in_any_custom_data(deployed: dict[str, str], tmp_path: Path) -> None:
    assert {"mysql-hvd-head-vm", "mysql-hvd-gpu-vmss", "lustre-hvd-head-vm"} <= deployed.keys()
    assert secrets_found({**DOCUMENTS, **deployed}, tmp_path) == set()


def with_file(document: str, path: str, content: str) -> str:
    """The cloud-config with one more write_files entry, as the renderer writes its entries."""
    indented = "".join(f"    {line}\n" for line in content.splitlines())
    planted = document.replace("write_files:\n", f"write_files:\n- path: {path}\n  content: |\n{indented}", 1)
    assert {"path": path, "content": content} in yaml.safe_load(planted)["write_files"]
    return planted


def test_checkov_flags_secrets_planted_in_custom_data(tmp_path: Path) -> None:
    """The control: a real storage account key (64 random bytes, as Azure makes them) and a real SSH
    private key, each in a copy of the MySQL head node's document; made here so that the repository
    holds neither."""
    account_key = base64.b64encode(secrets.token_bytes(64)).decode()
    connection = (
        f"DefaultEndpointsProtocol=https;AccountName=hvdsa;AccountKey={account_key};EndpointSuffix=core.windows.net"
    )
    key_file = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key_file], check=True)
    scanned = tmp_path / "scanned"
    scanned.mkdir()
    head = DOCUMENTS["head-mysql"]
    planted = {
        "storage-key": with_file(head, "/etc/dtrain/results.env", f"AZURE_STORAGE_CONNECTION_STRING={connection}\n"),
        "private-key": with_file(head, "/root/.ssh/id_ed25519", key_file.read_text()),
    }
    assert secrets_found(planted, scanned) == {("storage-key", STORAGE_KEY_CHECK), ("private-key", PRIVATE_KEY_CHECK)}
