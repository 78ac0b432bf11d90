"""NoCloud seeds for the boot test's VMs, and the package repository they install from (host side).

A seed is an ISO 9660 image labelled `cidata` that cloud-init's NoCloud data source reads:
- user-data: the custom data Azure would receive, as the Pulumi program rendered it (tests/boot/custom_data.py);
- meta-data: the instance id and the hostname, spelled as Azure spells it;
- network-config: the VM's fixed address (Azure hands it out by DHCP);
- vendor-data: what Azure's platform does that custom data does not: the admin user and its SSH key
  (osProfile), name resolution of the endpoints and of the other VMs (Azure's DNS), trust in the test
  CA (Azure's endpoints carry public certificates), and the package repository. cloud-init merges
  vendor-data under user-data; the keys used here are ones the custom data does not use.

The package source is the one place that decides where the VMs' apt looks (`package_sources`):
today a local flat repository, empty, because the image already carries what custom data installs.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

REPO_PORT = 8080


def package_sources(host_address: str) -> str:
    """/etc/apt/sources.list of the VMs: the local repository, and nothing the VMs cannot reach."""
    return f"deb [trusted=yes] http://{host_address}:{REPO_PORT}/ ./\n"


def make_flat_repository(directory: Path, debs: Sequence[Path] = ()) -> Path:
    """A flat apt repository of debs (none today) with a Release file, as `apt-get update` wants it."""
    directory.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        (directory / deb.name).write_bytes(deb.read_bytes())
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=directory, capture_output=True, check=True
    ).stdout
    (directory / "Packages").write_bytes(packages)
    digest = hashlib.sha256(packages).hexdigest()
    (directory / "Release").write_text(
        f"Origin: boot-test\nLabel: boot-test\nSuite: boot-test\nCodename: boot-test\n"
        f"Architectures: amd64 all\nSHA256:\n {digest} {len(packages)} Packages\n"
    )
    return directory


def vendor_data(
    *,
    admin_user: str,
    ssh_public_key: str,
    ca_certificate: str,
    hosts: Mapping[str, str],
    sources: str,
    absent_services: Sequence[str] = (),
) -> str:
    """absent_services: services of the image that this VM's Azure image does not run (the head's and
    the NFS server's plain Ubuntu has no docker), stopped before they cost the emulated CPU."""
    lines = "".join(f"{address} {names}\\n" for address, names in hosts.items())
    services_off = [["systemctl", "disable", "--now", "--no-block", *absent_services]] if absent_services else []
    document = {
        "users": [
            {
                "name": admin_user,
                "shell": "/bin/bash",
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "lock_passwd": True,
                "ssh_authorized_keys": [ssh_public_key],
            }
        ],
        # Only the test CA: the VMs reach nothing else, and rehashing Debian's ~140 certificates one
        # openssl run at a time takes minutes in software emulation.
        "ca_certs": {"remove_defaults": True, "trusted": [ca_certificate]},
        # Azure's DNS: before anything of the custom data runs, and once per instance.
        "bootcmd": [
            ["sh", "-c", f"grep -q '# boot-test' /etc/hosts || printf '# boot-test\\n{lines}' >>/etc/hosts"],
            *services_off,
        ],
        # Debian's image has no locales package: cloud-init's locale module would only fail, slowly.
        "locale": False,
        "apt": {"preserve_sources_list": False, "sources_list": sources},
    }
    return "#cloud-config\n" + yaml.safe_dump(document, sort_keys=False, width=4096)


def network_config(*, mac: str, address: str, prefixlen: int, gateway: str) -> str:
    document = {
        "version": 1,
        "config": [
            {
                "type": "physical",
                "name": "eth0",
                "mac_address": mac,
                "subnets": [{"type": "static", "address": f"{address}/{prefixlen}", "gateway": gateway}],
            }
        ],
    }
    return yaml.safe_dump(document, sort_keys=False)


def make_seed(path: Path, *, instance_id: str, hostname: str, user_data: str, vendor: str, network: str) -> Path:
    staging = path.with_suffix(".d")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "meta-data").write_text(f"instance-id: {instance_id}\nlocal-hostname: {hostname}\n")
    (staging / "user-data").write_text(user_data)
    (staging / "vendor-data").write_text(vendor)
    (staging / "network-config").write_text(network)
    subprocess.run(
        ["genisoimage", "-quiet", "-output", str(path), "-volid", "cidata", "-joliet", "-rock",
         *(str(staging / name) for name in ("meta-data", "user-data", "vendor-data", "network-config"))],
        check=True,
    )  # fmt: skip
    return path
