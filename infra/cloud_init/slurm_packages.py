"""Where the Azure cluster's Slurm comes from: Microsoft's Slurm repository, one version on every host.

The ubuntu-hpc 22.04 image pins every `slurm*` package of Ubuntu's archive to priority -1 and
Microsoft's `slurm-smd*` packages to 990 (azhpc-images `components/slurm-repo/slurm-u.pin`), so
Ubuntu's `slurmd` cannot be installed there. Azure's own Slurm stacks (cyclecloud-slurm's
`azure-slurm-install/ubuntu.sh`) install SchedMD's packaging of Slurm from packages.microsoft.com,
each package at one version and held: so do the head node and the GPU nodes here (held by an apt
pin on the version), from the same
image (the repository's key ships with it). SchedMD's packages create no accounts: the `slurm` and
`munge` users are made first, with the same ids on every host, as cyclecloud-slurm does.

Pure values and functions, read by the renderers (cluster_node.py, head_node.py), by the config
check (infra/config.py) and by the tests that replay the image's apt configuration.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from infra.cloud_init._common import write_file

# What Azure's stacks install today (cyclecloud-slurm, CCWS); slurmVersion in the stack config.
DEFAULT_SLURM_VERSION = "25.11.5"
# Releases whose slurm.conf, gres.conf and cgroup.conf keys the renderer's output holds to: 23.11
# made cloud nodes' addresses and visibility the default (no cloud_reg_addrs, no PrivateData=cloud),
# and tests/infra/data/slurm-25.11-keys.json holds the newest tables checked.
SUPPORTED_SLURM_RELEASES = ("23.11", "24.05", "24.11", "25.05", "25.11")
# A Slurm release and maintenance number, with the package's revision if not the first.
_VERSION = re.compile(r"(?P<release>\d{2}\.\d{2})\.(?P<maintenance>\d+)(?:-(?P<revision>\d+))?")

# Microsoft's Slurm repository for Ubuntu 22.04: the stable channel, as cyclecloud-slurm's default
# (the image's own list names the insiders channel; ours replaces it, under the same file name).
SLURM_REPOSITORY_HOST = "packages.microsoft.com"
SLURM_REPOSITORY_URL = f"https://{SLURM_REPOSITORY_HOST}/repos/slurm-ubuntu-jammy/"
SLURM_REPOSITORY_SUITE = "stable"
SLURM_REPOSITORY_COMPONENT = "main"
SLURM_SOURCES_LIST_PATH = "/etc/apt/sources.list.d/slurm.list"
# Holds Slurm at its version: read before the image's slurm-repository-pin-990 (apt reads the
# preferences parts in name order), it outranks any other version of Microsoft's packages, so no
# upgrade (unattended or by hand) moves Slurm on one host and not on the others.
SLURM_PIN_PATH = "/etc/apt/preferences.d/dtrain-slurm-version"
SLURM_PIN_PRIORITY = 1001
# Microsoft's signing key, installed on the ubuntu-hpc image by its packages-microsoft-prod package.
MICROSOFT_KEYRING = "/etc/apt/trusted.gpg.d/microsoft-prod.gpg"

# SchedMD's Debian packaging of Slurm, as Microsoft's repository serves it. slurm-smd-client:
# sbatch, scontrol and the other commands (the health check and the login node use them).
SLURM_COMMON_PACKAGES = ("slurm-smd", "slurm-smd-client")
SLURMD_PACKAGES = (*SLURM_COMMON_PACKAGES, "slurm-smd-slurmd")
# The head node's: slurmctld, and slurmdbd beside it (Slurm's accounting; the same version, as Slurm asks
# slurmdbd to be at least as new as slurmctld).
SLURMCTLD_PACKAGES = (*SLURM_COMMON_PACKAGES, "slurm-smd-slurmctld", "slurm-smd-slurmdbd")
# munge: from Ubuntu's archive (the image's pin leaves it there), as cyclecloud-slurm installs it.
MUNGE_PACKAGE = "munge"

# The accounts, with fixed ids (cyclecloud-slurm's): the same on the head node and every node.
SLURM_USER = "slurm"
SLURM_UID = 11100
MUNGE_USER = "munge"
MUNGE_UID = 11101
# No home, as Debian's packages make these accounts (munge's postinst keeps an existing account so).
ACCOUNT_HOME = "/nonexistent"


def check_slurm_version(value: str) -> str:
    """value ('25.11.5', or with its package revision '25.11.5-2') if it names a supported release."""
    match = _VERSION.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a Slurm version such as {DEFAULT_SLURM_VERSION!r}")
    if match["release"] not in SUPPORTED_SLURM_RELEASES:
        raise ValueError(
            f"{value!r}: Slurm {match['release']} is not one this deployment renders its configuration for "
            f"({', '.join(SUPPORTED_SLURM_RELEASES)})"
        )
    return value


def package_version(slurm_version: str) -> str:
    """The Debian versions of Microsoft's packages of slurm_version, as apt matches them in a pin and in
    `apt-get install name=version`: '25.11.5' is any package revision ('25.11.5-*', the newest wins),
    since Microsoft ships rebuilds as new revisions (-2) and cyclecloud-slurm installs `=<version>*`;
    '25.11.5-2' is that revision only."""
    version = check_slurm_version(slurm_version)
    return version if "-" in version else f"{version}-*"


def sources_list() -> str:
    """The apt source line of Microsoft's Slurm repository (stable channel), signed by Microsoft's key."""
    return (
        f"deb [arch=amd64 signed-by={MICROSOFT_KEYRING}] {SLURM_REPOSITORY_URL} "
        f"{SLURM_REPOSITORY_SUITE} {SLURM_REPOSITORY_COMPONENT}\n"
    )


def version_pin(slurm_version: str) -> str:
    """apt preferences that keep every slurm-smd package at slurm_version's package versions (apt pins
    match a version with a glob)."""
    return (
        "Explanation: one Slurm on the head node and every node (infra/cloud_init/slurm_packages.py)\n"
        "Package: slurm-smd*\n"
        f"Pin: version {package_version(slurm_version)}\n"
        f"Pin-Priority: {SLURM_PIN_PRIORITY}\n"
    )


def apt_files(slurm_version: str) -> list[dict[str, Any]]:
    """write_files entries of the repository's source list and the version pin: both in place before
    the setup program's first step installs the packages."""
    return [
        write_file(SLURM_SOURCES_LIST_PATH, sources_list(), "0644"),
        write_file(SLURM_PIN_PATH, version_pin(slurm_version), "0644"),
    ]


def versioned(packages: Sequence[str], slurm_version: str) -> list[str]:
    """apt-get install arguments name=version of packages at slurm_version (the setup programs' PACKAGES)."""
    version = package_version(slurm_version)
    return [f"{package}={version}" for package in packages]


def account_commands() -> list[list[str]]:
    """bootcmd entries that create the slurm and munge accounts (groups of the same id) unless present:
    they run before the setup programs install the packages, at every boot, and change nothing once made."""
    commands = []
    for user, uid in ((SLURM_USER, SLURM_UID), (MUNGE_USER, MUNGE_UID)):
        commands.append(
            [
                "sh",
                "-c",
                f"getent group {user} >/dev/null || groupadd --system --gid {uid} {user}; "
                f"getent passwd {user} >/dev/null || useradd --system --uid {uid} --gid {user} "
                f"--home-dir {ACCOUNT_HOME} --no-create-home --shell /usr/sbin/nologin {user}",
            ]
        )
    return commands
