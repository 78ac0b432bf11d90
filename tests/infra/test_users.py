"""The stack config's users list, under Pulumi mocks: it seeds the list the head node keeps (public keys
only), and every host (head, GPU nodes, NFS server, jumpbox) applies the list with the one script the local
cluster runs (dtrain/remote/boot/apply_users.py), at boot and from a timer well within a minute."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.cloud_init.users import APPLY_USERS_PATH, ARGS_PATH, SEED_PATH, SSHD_DROP_IN
from infra.config import ConfigError, parse_config
from infra.users import JUMPBOX_LIST, KEYS_DIR, LIMIT_WORDS, AccountLimits, UserLimits
from tests.infra.conftest import VALID_CONFIG, Deployment, deploy
from tests.infra.documents import decode_custom_data, files_of, script_of
from tests.infra.ssh_keys import ED25519
from tests.infra.test_stack import by_name, head_document, node_document

REPO = Path(__file__).resolve().parents[2]
APPLY_USERS = "dtrain/remote/boot/apply_users.py"
ALICE_KEY = ED25519.replace("ops@example.com", "alice@laptop")
USERS = [
    {"name": "alice", "sshPublicKey": ALICE_KEY, "account": "vision", "limits": {"maxGpus": 16, "gpuHours": 2000}},
    {"name": "bob", "sshPublicKey": ED25519, "account": "nlp", "uid": 20000},
]


@pytest.fixture(scope="module")
def team() -> Deployment:
    return deploy({**VALID_CONFIG, "users": USERS})


def documents(deployment: Deployment) -> dict[str, str]:
    """Every host's cloud-config, by role."""
    vm = {
        role: decode_custom_data(by_name(deployment, ":VirtualMachine", role).inputs["osProfile"]["customData"])
        for role in ("nfs", "jumpbox")
    }
    return {"head": head_document(deployment), "node": node_document(deployment), **vm}


def arguments(document: str) -> list[str]:
    (line,) = script_of(document, ARGS_PATH).splitlines()
    return shlex.split(line.removeprefix("APPLY_USERS_ARGS="))


def test_the_head_node_is_seeded_with_the_stack_configs_people_and_nothing_private(team: Deployment) -> None:
    seed = json.loads(script_of(head_document(team), SEED_PATH))
    # uids: bob's own, alice the first free one; limits and accounts for Slurm's accounting
    assert seed == {
        "users": [
            {"name": "alice", "uid": 20001, "ssh_public_key": ALICE_KEY, "account": "vision",
             "limits": {"max_gpus": 16, "gpu_hours": 2000.0}},
            {"name": "bob", "uid": 20000, "ssh_public_key": ED25519, "account": "nlp", "limits": {}},
        ]
    }  # fmt: skip
    assert json.loads(script_of(documents(team)["jumpbox"], JUMPBOX_LIST)) == seed  # its own copy
    for role, document in documents(team).items():
        assert "PRIVATE KEY" not in document, role
    # head-setup puts the seed on the shared file system only where no list is there yet: `dtrain users`
    # changes the head node's list after that, and a new head node keeps it
    setup = script_of(head_document(team), "/usr/local/sbin/head-setup")
    assert '[[ -e $SHARED_MOUNT/$USERS_DIR/$USERS_LIST ]] ||\n      install -m 0644 "$USERS_SEED"' in setup


def test_a_stack_without_people_seeds_an_empty_list(deployment: Deployment) -> None:
    assert json.loads(script_of(head_document(deployment), SEED_PATH)) == {"users": []}


def test_every_host_applies_the_list_with_the_local_clusters_script_within_a_minute(team: Deployment) -> None:
    script = (REPO / APPLY_USERS).read_text()
    for role, document in documents(team).items():
        files = files_of(document)
        assert files[APPLY_USERS_PATH]["content"] == script, role
        timer = files["/etc/systemd/system/dtrain-users.timer"]["content"]
        assert int(re.search(r"^OnUnitActiveSec=(\d+)s$", timer, re.M)[1]) <= 30, role  # type: ignore[index]
        service = files["/etc/systemd/system/dtrain-users.service"]["content"]
        assert "Before=slurmd.service" in service and f"EnvironmentFile={ARGS_PATH}" in service
        # sshd reads a person's key from root's file, which goes with the account
        assert files[SSHD_DROP_IN]["content"] == f"AuthorizedKeysFile .ssh/authorized_keys {KEYS_DIR}/%u\n", role
    args = {role: arguments(document) for role, document in documents(team).items()}
    assert args["head"][:6] == ["--list", "/shared/.users/users.json", "--home-root", "/shared/home", "--report-dir",
                                "/shared/.users/applied"]  # fmt: skip
    assert {"--make-homes", "--team-dir=/shared/runs", "--team-dir=/shared/data"} <= set(args["head"])
    assert args["node"][:4] == args["head"][:4] and "--make-homes" not in args["node"]
    assert args["nfs"][:4] == ["--list", "/export/.users/users.json", "--home-root", "/export/home"]
    assert args["jumpbox"][:2] == ["--list", JUMPBOX_LIST] and args["jumpbox"][-2:] == ["--shell", "/usr/sbin/nologin"]


def test_the_list_is_applied_from_the_first_boot_on(team: Deployment) -> None:
    """The nodes before slurmd takes jobs (node-setup's step after the shared mount), the head node once it
    has seeded the list, the NFS server and the jumpbox from their runcmd."""
    enable = ["systemctl", "enable", "--now", "dtrain-users.timer", "dtrain-users.service"]
    node_setup = script_of(node_document(team), "/usr/local/sbin/node-setup")
    steps = re.search(r"readonly STEPS=\((.*)\)", node_setup)[1].split()  # type: ignore[index]
    assert re.search(r"^MOUNT_STEP=(\S+)$", node_setup, re.MULTILINE)[1] == "nfs-mount"  # type: ignore[index]
    assert steps.index('"$MOUNT_STEP"') < steps.index("users") < steps.index("slurmd")
    assert f"step users {' '.join(enable)}" in node_setup
    assert " ".join(enable) in script_of(head_document(team), "/usr/local/sbin/head-setup")
    for role in ("nfs", "jumpbox"):
        runcmd: list[Any] = yaml.safe_load(documents(team)[role])["runcmd"]
        assert runcmd[-1] == enable and ["systemctl", "try-reload-or-restart", "ssh"] in runcmd


def test_every_limit_is_in_words_and_an_accounts_are_a_persons() -> None:
    assert list(LIMIT_WORDS) == ["max_jobs", "max_nodes", "max_gpus", "gpu_hours"]  # the flags' order too
    assert set(LIMIT_WORDS) == set(UserLimits.model_fields) >= set(AccountLimits.model_fields)


def test_the_accounts_limits_seed_the_list_beside_its_people() -> None:
    accounts = {"vision": {"maxGpus": 32, "gpuHours": 5000}, "nlp": {"gpuHours": 0}}
    seed = json.loads(
        script_of(head_document(deploy({**VALID_CONFIG, "users": USERS, "accounts": accounts})), SEED_PATH)
    )
    assert seed["accounts"] == {"vision": {"max_gpus": 32, "gpu_hours": 5000.0}, "nlp": {"gpu_hours": 0.0}}
    assert [user["name"] for user in seed["users"]] == ["alice", "bob"]


@pytest.mark.parametrize(
    ("accounts", "expected"),
    [
        ({"Vision": {"maxGpus": 1}}, "'Vision' is not a Slurm account name"),
        ({"vision": {"maxGpus": 0}}, "accounts.vision.maxGpus: got 0;"),
        ({"vision": {"maxJobs": 2}}, "accounts.vision.maxJobs"),  # a person's limit, not an account's
        ({"vision": {"gpuHours": 0.001}}, "0.001 GPU-hours is less than a GPU-minute, Slurm's unit"),
        ({"visoin": {"maxGpus": 8}}, "accounts.visoin: got 'visoin'; no one in users is in this account"),
    ],
)
def test_a_wrong_account_limit_is_named_before_anything_is_declared(accounts: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({**VALID_CONFIG, "users": USERS, "accounts": accounts})
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("users", "expected"),
    [
        ([{"name": "hpcadmin", "sshPublicKey": ED25519, "account": "a"}], "; 'hpcadmin' is the admin user"),
        ([{"name": "root", "sshPublicKey": ED25519, "account": "a"}], "users[0].name: got 'root'; 'root' is an"),
        ([USERS[1], {**USERS[1], "name": "carol"}], "the uid 20000 is given to more than one user"),
        ([USERS[0], USERS[0]], "the name alice is given to more than one user"),
        ([{**USERS[0], "sshPublicKey": "-----BEGIN OPENSSH PRIVATE KEY-----"}], "users[0].sshPublicKey: got"),
        ([{**USERS[0], "account": "Vision"}], "users[0].account: got 'Vision'; 'Vision' is not a Slurm account"),
        ([{**USERS[0], "limits": {"maxGpus": 0}}], "users[0].limits.maxGpus: got 0;"),
        ([{**USERS[0], "limits": {"gpuHours": -1}}], "users[0].limits.gpuHours: got -1;"),
        ([{**USERS[0], "limits": {"gpuHours": 0.001}}], "0.001 GPU-hours is less than a GPU-minute, Slurm's unit"),
        ([{**USERS[0], "limits": {"gpuHours": "lots"}}], "users[0].limits.gpuHours: got 'lots';"),
    ],
)
def test_a_wrong_user_is_named_before_anything_is_declared(users: list[dict[str, Any]], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({**VALID_CONFIG, "users": users})
    assert expected in str(caught.value)
