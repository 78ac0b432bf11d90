"""Where the Azure cluster's Slurm comes from, and which Slurm its files are written for.

- The ubuntu-hpc image's own apt preferences (tests/infra/data/slurm-u.pin, vendored) replayed with a
  real apt against the packages that the nodes' and the head node's setup programs install: they resolve,
  to Microsoft's packages at slurmVersion; today's Ubuntu packages do not (issue 29, finding 1).
- The head node and the nodes take Slurm from one repository at one version (finding 2).
- Every key of the rendered slurm.conf, gres.conf, cgroup.conf and slurmdbd.conf is one that Slurm 25.11
  reads, and none is defunct there (tests/infra/data/slurm-25.11-keys.json, extracted from SchedMD's parsers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.cloud_init import render_cgroup_conf, render_gres_conf
from infra.cloud_init.accounting import render_slurmdbd_conf
from infra.cloud_init.slurm import NodeSet
from infra.cloud_init.slurm_packages import (
    DEFAULT_SLURM_VERSION,
    SLURM_PIN_PATH,
    SLURM_SOURCES_LIST_PATH,
    SLURMCTLD_PACKAGES,
    SLURMD_PACKAGES,
    account_commands,
)
from tests.infra.apt_replay import Apt, Package, Repository, installed, mirror
from tests.infra.conftest import VALID_CONFIG, Deployment, deploy
from tests.infra.documents import accounting, files_of, head_doc, node_doc, power, setup_packages, slurm_conf
from tests.infra.sandbox import Sandbox
from tests.infra.test_stack import head_document, node_document  # the documents the stack sends to Azure

DATA = Path(__file__).parent / "data"
IMAGE_PIN = (DATA / "slurm-u.pin").read_text()
KEYS = json.loads((DATA / "slurm-25.11-keys.json").read_text())

# The image's apt configuration, as its build leaves it (azhpc-images components/install_pmix.sh):
# Ubuntu's archive, Microsoft's Slurm repository (insiders channel) and the pin file.
IMAGE_APT = {
    "/etc/apt/sources.list": "deb http://azure.archive.ubuntu.com/ubuntu/ jammy main\n",
    "/etc/apt/sources.list.d/slurm.list": "deb [arch=amd64 signed-by=/etc/apt/trusted.gpg.d/microsoft-prod.gpg] "
    "https://packages.microsoft.com/repos/slurm-ubuntu-jammy/ insiders main\n",
    "/etc/apt/preferences.d/slurm-repository-pin-990": IMAGE_PIN,
}
# What the nodes and the head node installed before this change: Ubuntu 22.04's Slurm 21.08.
TODAY_NODE_PACKAGES = ["nfs-common", "munge", "slurmd", "slurm-client", "mdadm", "xfsprogs"]
TODAY_HEAD_PACKAGES = ["nfs-common", "munge", "slurmctld", "slurm-client"]

UBUNTU_SLURM = "21.08.5-2ubuntu1"
UBUNTU = Repository(
    "azure.archive.ubuntu.com",
    "/ubuntu/",
    "jammy",
    [
        Package("nfs-common", "1:2.6.1-1ubuntu1.2"),
        Package("libmunge2", "0.5.14-6"),
        Package("munge", "0.5.14-6", depends="libmunge2"),
        Package("mdadm", "4.2-0ubuntu1"),
        Package("xfsprogs", "5.13.0-1ubuntu2"),
        Package("bash-completion", "1:2.11-5ubuntu1"),
        # the telemetry and the MLflow server's environment (infra/cloud_init/prometheus.py, mlflow.py)
        Package("prometheus", "2.31.2+ds1-1ubuntu1.22.04.2"),
        Package("prometheus-node-exporter", "1.3.1-1ubuntu0.22.04.2"),
        Package("python3-venv", "3.10.6-1~22.04.1"),
        Package("mariadb-server", "1:10.6.22-0ubuntu0.22.04.1"),  # the accounting database (head node)
        Package("slurm-wlm-basic-plugins", UBUNTU_SLURM),
        *(
            Package(name, UBUNTU_SLURM, depends=f"slurm-wlm-basic-plugins (= {UBUNTU_SLURM}), munge")
            for name in ("slurmd", "slurmctld", "slurm-client")
        ),
    ],
)


def microsoft_slurm(suite: str, versions: list[str]) -> Repository:
    """Microsoft's repository of SchedMD's packaging (debian/control at slurm-25-11-5-1: each daemon
    depends on slurm-smd of its own version and on munge, and conflicts with Ubuntu's package)."""
    packages = []
    for version in versions:
        packages += [
            Package("slurm-smd", version, depends="munge", conflicts="slurm-wlm-basic-plugins"),
            Package(
                "slurm-smd-client",
                version,
                depends=f"slurm-smd (= {version}), munge, bash-completion",
                conflicts="slurm-client",
            ),
            *(
                Package(f"slurm-smd-{daemon}", version, depends=f"slurm-smd (= {version}), munge", conflicts=daemon)
                for daemon in ("slurmd", "slurmctld", "slurmdbd")
            ),
        ]
    return Repository("packages.microsoft.com", "/repos/slurm-ubuntu-jammy/", suite, packages)


# Stable has older and newer releases than ours (the version pin must choose), a rebuild of ours (its
# package revision -2, as Microsoft ships them), and insiders a candidate.
REPOSITORIES = [
    UBUNTU,
    microsoft_slurm("stable", ["25.11.4-1", "25.11.5-1", "25.11.5-2", "25.11.7-1"]),
    microsoft_slurm("insiders", ["26.05.0-0rc1"]),
]


@pytest.fixture
def proxy() -> Any:
    with mirror(REPOSITORIES) as endpoint:
        yield endpoint


def apt_for(tmp_path: Path, proxy: str, document: str | None) -> Apt:
    """apt on the image, with what the document writes under /etc/apt/ before its packages are installed."""
    etc = dict(IMAGE_APT)
    if document is not None:
        for path, entry in files_of(document).items():
            if path.startswith("/etc/apt/") and not entry.get("defer"):
                etc[path] = str(entry["content"])
    return Apt(tmp_path / "apt", proxy, etc)


needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")

ROLES = {
    "node": (node_doc, SLURMD_PACKAGES, TODAY_NODE_PACKAGES),
    "head": (head_doc, SLURMCTLD_PACKAGES, TODAY_HEAD_PACKAGES),
}


@needs_apt
@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_images_pin_admits_what_the_setup_installs(tmp_path: Path, proxy: str, role: str) -> None:
    render, slurm_packages, _ = ROLES[role]
    document = render()
    result = apt_for(tmp_path, proxy, document).install(setup_packages(document))
    assert result.returncode == 0, result.stdout + result.stderr
    versions = installed(result.stdout)
    # the newest revision of slurmVersion, as cyclecloud-slurm's `=<version>*` takes it
    assert {name: versions[name] for name in slurm_packages} == dict.fromkeys(slurm_packages, "25.11.5-2")
    assert versions["munge"] == "0.5.14-6"  # Ubuntu's: the pin leaves munge to the archive
    assert not [name for name in versions if name.startswith(("slurmd", "slurmctld", "slurm-client", "slurm-wlm"))]


@needs_apt
@pytest.mark.parametrize("role", sorted(ROLES))
def test_todays_ubuntu_slurm_packages_cannot_be_installed_on_the_image(tmp_path: Path, proxy: str, role: str) -> None:
    """Finding 1: every slurm* package of Ubuntu's archive is pinned to -1; the one apt transaction
    fails, munge with it."""
    result = apt_for(tmp_path, proxy, None).install(ROLES[role][2])
    assert result.returncode != 0
    assert "has no installation candidate" in result.stdout + result.stderr
    assert installed(result.stdout) == {}


@needs_apt
def test_the_version_pin_holds_slurm_against_newer_releases(tmp_path: Path, proxy: str) -> None:
    """Without a version, as an upgrade or a hand-typed install would ask: still slurmVersion."""
    apt = apt_for(tmp_path, proxy, node_doc())
    result = apt.install(["slurm-smd-slurmd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert installed(result.stdout)["slurm-smd-slurmd"] == "25.11.5-2"
    policy = apt.run("policy", "slurm-smd-slurmd", tool="apt-cache").stdout
    assert "Candidate: 25.11.5-2" in policy, policy


@needs_apt
def test_a_package_revision_in_the_config_is_the_one_installed(tmp_path: Path, proxy: str) -> None:
    """slurmVersion 25.11.5-1: that revision, though a newer one of the version is there."""
    document = node_doc(slurm_version="25.11.5-1")
    result = apt_for(tmp_path, proxy, document).install(setup_packages(document))
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name: installed(result.stdout)[name] for name in SLURMD_PACKAGES} == dict.fromkeys(
        SLURMD_PACKAGES, "25.11.5-1"
    )


# --- one source, one version ----------------------------------------------------------------------


def slurm_install(document: str) -> dict[str, Any]:
    """What a cloud-config says about Slurm's source and version."""
    parsed = yaml.safe_load(document)
    files = files_of(document)
    return {
        "sources": files[SLURM_SOURCES_LIST_PATH]["content"],
        "pin": files[SLURM_PIN_PATH]["content"],
        "versions": {package.split("=")[1] for package in setup_packages(document) if "=" in package},
        "accounts": parsed["bootcmd"],
    }


def test_head_and_nodes_get_slurm_from_one_source_at_one_version(deployment: Deployment) -> None:
    head, node = slurm_install(head_document(deployment)), slurm_install(node_document(deployment))
    assert head == node
    assert node["versions"] == {f"{DEFAULT_SLURM_VERSION}-*"}
    assert node["sources"] == (
        "deb [arch=amd64 signed-by=/etc/apt/trusted.gpg.d/microsoft-prod.gpg] "
        "https://packages.microsoft.com/repos/slurm-ubuntu-jammy/ stable main\n"
    )
    # the accounts SchedMD's packages do not create, with the same ids on every host
    assert [command[-1].split("--uid ")[1].split()[0] for command in node["accounts"]] == ["11100", "11101"]


ACCOUNTS = (("slurm", 11100), ("munge", 11101))  # cyclecloud-slurm's ids


@pytest.mark.parametrize("present", [False, True])
def test_accounts_are_made_once_with_fixed_ids(sandbox: Sandbox, present: bool) -> None:
    """Before the packages (bootcmd), at every boot: made when missing, left alone when there."""
    for name in ("groupadd", "useradd"):
        sandbox.stub(name)
    sandbox.stub("getent", "exit 0" if present else "exit 2")
    for command in account_commands():
        assert command[:2] == ["sh", "-c"]
        assert sandbox.run(command[2], interpreter="sh").returncode == 0
    made = sandbox.calls("groupadd") + sandbox.calls("useradd")
    expected = [
        *(f"groupadd --system --gid {uid} {user}" for user, uid in ACCOUNTS),
        *(
            f"useradd --system --uid {uid} --gid {user} --home-dir /nonexistent --no-create-home "
            f"--shell /usr/sbin/nologin {user}"
            for user, uid in ACCOUNTS
        ),
    ]
    assert made == ([] if present else expected)


def test_slurm_version_reaches_both_documents() -> None:
    deployment = deploy({**VALID_CONFIG, "slurmVersion": "24.11.6"})
    for document in (head_document(deployment), node_document(deployment)):
        assert slurm_install(document)["versions"] == {"24.11.6-*"}
        assert "Pin: version 24.11.6-*\n" in slurm_install(document)["pin"]


# --- the rendered files against Slurm 25.11's tables ----------------------------------------------


def keys_of(text: str) -> list[list[str]]:
    """Each line's keys, in order (the first names the line: NodeName=, PartitionName=, Name=)."""
    return [
        [word.split("=", 1)[0] for word in line.split()]
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def unknown_keys(text: str, table: str, line_tables: dict[str, str]) -> list[str]:
    """Keys Slurm 25.11 would not read, or calls defunct; a line named in line_tables is checked
    against that table after its first key."""
    known = {key.lower() for key in KEYS["tables"][table]["keys"]}
    defunct = {key.lower() for key in KEYS["tables"][table]["defunct"]}
    faults = []
    for keys in keys_of(text):
        first, rest = keys[0], keys[1:]
        if first.lower() not in known or first.lower() in defunct:
            faults.append(f"{table}: {first}")
        if first in line_tables:
            sub = line_tables[first]
            sub_known = {key.lower() for key in KEYS["tables"][sub]["keys"]}
            faults += [f"{sub}: {key}" for key in rest if key.lower() not in sub_known]
        elif rest:
            faults.append(f"{table}: {first} line has more keys: {rest}")
    return faults


SLURM_CONF_LINES = {"NodeName": "slurm.conf NodeName", "PartitionName": "slurm.conf PartitionName"}
HUNDRED = [f"hvd-gpu-{i:06x}" for i in range(100)]
SPOT_HUNDRED = [f"hvd-spot-{i:06x}" for i in range(100)]


@pytest.mark.parametrize("autostop_s", [1800, None])
def test_rendered_files_hold_to_slurm_25_11s_keys(autostop_s: int | None) -> None:
    conf = slurm_conf(
        nodes=NodeSet(names=HUNDRED, cpus=96, real_memory_mb=1_751_040, gpus=8),
        spot_nodes=NodeSet(names=SPOT_HUNDRED, cpus=96, real_memory_mb=1_751_040, gpus=8),
        power=power(suspend_time_s=autostop_s),
    )
    assert unknown_keys(conf, "slurm.conf", SLURM_CONF_LINES) == []
    assert unknown_keys(render_gres_conf(8), "gres.conf", {"Name": "gres.conf Name"}) == []
    assert unknown_keys(render_cgroup_conf(), "cgroup.conf", {}) == []
    for mysql in (False, True):
        dbd = render_slurmdbd_conf(
            dbd_host="hvd-head", dbd_address="10.0.0.254", database=accounting(mysql=mysql).database
        )
        assert unknown_keys(dbd, "slurmdbd.conf", {}) == []
    # values that 25.11 refuses or ignores
    settings = dict(line.split("=", 1) for line in conf.splitlines() if "=" in line and not line.startswith("#"))
    assert not set(settings["SlurmctldParameters"].split(",")) & set(KEYS["values"]["SlurmctldParameters"]["defunct"])
    assert "PrivateData" not in settings


@pytest.mark.parametrize(
    ("line", "fault"),
    [
        ("SlurmctldParameters=enable_configless,cloud_reg_addrs", None),  # a value: see the test above
        ("CgroupAutomount=yes", "cgroup.conf: CgroupAutomount"),
        ("GetEnvTimeout=2", "slurm.conf: GetEnvTimeout"),
        ("NodeName=n1 CPUs=2 Procs=2 Sockts=1", "slurm.conf NodeName: Sockts"),
        ("SchedulerRootFilter=1", "slurm.conf: SchedulerRootFilter"),
    ],
)
def test_the_key_check_finds_defunct_and_unknown_keys(line: str, fault: str | None) -> None:
    table = "cgroup.conf" if line.startswith("Cgroup") else "slurm.conf"
    assert unknown_keys(line + "\n", table, SLURM_CONF_LINES) == ([fault] if fault else [])
