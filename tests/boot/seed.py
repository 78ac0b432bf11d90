"""NoCloud seeds for the boot test's hosts, and the package repositories they install from (host side).

A seed is what cloud-init's NoCloud data source reads: a directory bound where it looks (a system
container) or an ISO 9660 image labelled `cidata` (a VM), holding
- user-data: the custom data Azure would receive, gzipped as the Pulumi program sends it
  (tests/boot/custom_data.py); cloud-init unpacks it itself;
- meta-data: the instance id and the hostname, spelled as Azure spells it;
- network-config: the host's fixed address (Azure hands it out by DHCP);
- vendor-data: what Azure's platform does that custom data does not: the admin user and its SSH key
  (osProfile), trust in the test CA (Azure's endpoints carry public certificates), the package
  sources, and, in a `#cloud-boothook` part that runs at every boot before the custom data, name
  resolution of the endpoints and of the other hosts (Azure's DNS), the services this role's Azure
  image does not run, and pip's index (PyPI, for the MLflow server's environment). cloud-init merges
  vendor-data under user-data key by key, so nothing the custom data has a key for (bootcmd,
  write_files) can go in the cloud-config part: the custom data's own would replace it.

The package sources stand in for the two places Azure's hosts install from: the distribution's
archive (a flat repository of the packages the custom data names, tools/build_boot_image.sh) and
Microsoft's Slurm repository at its own URL (`make_slurm_repository`: SchedMD's packages, signed by a
key made for the run and placed where the image keeps Microsoft's).
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Mapping, Sequence
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from urllib.parse import urlsplit

import yaml

REPO_PORT = 8080
ARCHIVE_PATH = "archive"  # the distribution's packages, under the hub's HTTP server
WHEELS_PATH = "wheels"  # PyPI's stand-in: the MLflow server's wheels, a find-links page
MICROSOFT_KEYRING = "/etc/apt/trusted.gpg.d/microsoft-prod.gpg"  # where the ubuntu-hpc image keeps it


def package_sources(host_address: str) -> str:
    """/etc/apt/sources.list of the hosts: the archive's stand-in, and nothing the hosts cannot reach."""
    return f"deb [trusted=yes] http://{host_address}:{REPO_PORT}/{ARCHIVE_PATH}/ ./\n"


def make_flat_repository(directory: Path, debs: Sequence[Path] = ()) -> Path:
    """A flat apt repository of the debs in directory (and debs, copied in) with a Release file."""
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


def make_signing_key(directory: Path) -> Path:
    """A signing key made for the run (never cached); returns the GnuPG home that holds it."""
    home = directory / "gnupg"
    home.mkdir(parents=True, mode=0o700)
    subprocess.run(["gpg", "--homedir", str(home), "--batch", "--passphrase", "", "--quick-gen-key",
                    "boot test repository <boot-test@invalid>", "ed25519", "sign", "1d"],
                   check=True, capture_output=True)  # fmt: skip
    return home


def stop_gpg_agent(gnupg_home: Path) -> None:
    """gpg leaves an agent running for its home: the test leaves nothing running."""
    subprocess.run(["gpgconf", "--homedir", str(gnupg_home), "--kill", "gpg-agent"], check=False, capture_output=True)


def public_keyring(gnupg_home: Path) -> bytes:
    """The key's public half as a binary keyring, the format of the image's microsoft-prod.gpg."""
    return subprocess.run(["gpg", "--homedir", str(gnupg_home), "--export"], check=True, capture_output=True).stdout


def make_slurm_repository(directory: Path, debs: Path, gnupg_home: Path, *, suite: str, component: str) -> Path:
    """Microsoft's Slurm repository's layout (dists/<suite>/InRelease, pool/) over the debs in debs,
    signed with gnupg_home's key: apt checks it against the keyring the sources line names."""
    pool = directory / "pool" / component
    pool.mkdir(parents=True)
    for deb in sorted(debs.glob("*.deb")):
        (pool / deb.name).symlink_to(deb)
    index = directory / "dists" / suite / component / "binary-amd64"
    index.mkdir(parents=True)
    packages = subprocess.run(["apt-ftparchive", "packages", f"pool/{component}"], cwd=directory,
                              check=True, capture_output=True).stdout  # fmt: skip
    (index / "Packages").write_bytes(packages)
    release = subprocess.run(
        ["apt-ftparchive", "-o", f"APT::FTPArchive::Release::Suite={suite}", "-o",
         f"APT::FTPArchive::Release::Components={component}", "-o", "APT::FTPArchive::Release::Architectures=amd64",
         "release", "."], cwd=directory / "dists" / suite, check=True, capture_output=True,
    ).stdout  # fmt: skip
    (directory / "dists" / suite / "Release").write_bytes(release)
    subprocess.run(["gpg", "--homedir", str(gnupg_home), "--batch", "--yes", "--clearsign", "-o", "InRelease",
                    "Release"], cwd=directory / "dists" / suite, check=True, capture_output=True)  # fmt: skip
    return directory


def vendor_data(
    *,
    admin_user: str,
    ssh_public_key: str,
    ca_certificate: str,
    hosts: Mapping[str, str],
    sources: str,
    pip_find_links: str,
    absent_services: Sequence[str] = (),
) -> str:
    """A MIME multipart document: the boothook (every boot, before the custom data) and the cloud-config.
    absent_services: services of the image that this role's Azure image does not run (the head's plain
    Ubuntu has no docker), stopped before they cost the emulated CPU."""
    # printf's escapes: each \\n below is printf's newline, written on one line of the script
    hosts_lines = "".join(f"{address} {names}\\n" for address, names in hosts.items())
    pip_conf = f"[global]\\nno-index = true\\nfind-links = {pip_find_links}\\n"
    pip_conf += f"trusted-host = {urlsplit(pip_find_links).hostname}\\n"
    services_off = f"systemctl disable --now --no-block {' '.join(absent_services)}\n" if absent_services else ""
    boothook = (
        "#cloud-boothook\n#!/bin/sh\n"
        "# Azure's DNS: the endpoints and the other hosts by name.\n"
        f"grep -q '# boot-test' /etc/hosts || printf '# boot-test\\n{hosts_lines}' >>/etc/hosts\n"
        "# PyPI's stand-in, for pip (the MLflow server's environment).\n"
        f"printf '{pip_conf}' >/etc/pip.conf\n"
        f"{services_off}"
    )
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
        # Only the test CA: the hosts reach nothing else.
        "ca_certs": {"remove_defaults": True, "trusted": [ca_certificate]},
        # Debian's image has no locales package: cloud-init's locale module would only fail, slowly.
        "locale": False,
        "apt": {"preserve_sources_list": False, "sources_list": sources},
    }
    config = "#cloud-config\n" + yaml.safe_dump(document, sort_keys=False, width=4096)
    message = MIMEMultipart()
    message.attach(MIMEText(boothook, "cloud-boothook"))
    message.attach(MIMEText(config, "cloud-config"))
    return message.as_string()


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


SEED_FILES = ("meta-data", "user-data", "vendor-data", "network-config")


def write_seed(
    directory: Path, *, instance_id: str, hostname: str, user_data: bytes, vendor: str, network: str
) -> Path:
    """The seed as a directory (a container binds it where NoCloud looks)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta-data").write_text(f"instance-id: {instance_id}\nlocal-hostname: {hostname}\n")
    (directory / "user-data").write_bytes(user_data)
    (directory / "vendor-data").write_text(vendor)
    (directory / "network-config").write_text(network)
    return directory


def make_seed(path: Path, *, instance_id: str, hostname: str, user_data: bytes, vendor: str, network: str) -> Path:
    """The seed as an ISO image labelled cidata (a VM's second disk)."""
    staging = write_seed(path.with_suffix(".d"), instance_id=instance_id, hostname=hostname, user_data=user_data,
                         vendor=vendor, network=network)  # fmt: skip
    subprocess.run(
        ["genisoimage", "-quiet", "-output", str(path), "-volid", "cidata", "-joliet", "-rock",
         *(str(staging / name) for name in SEED_FILES)],
        check=True,
    )  # fmt: skip
    return path
