"""Image builds: `az acr build` cannot run here, so check the exact commands it would run."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from dtrain.cluster import description as cluster
from dtrain.cluster import images as build_images
from dtrain.errors import OperatorError

from .conftest import FIXTURES, REPO, run_module


@pytest.fixture
def context(tmp_path):
    docker = tmp_path / "training" / "docker"
    docker.mkdir(parents=True)
    (docker / "Dockerfile.pytorch").write_text("FROM scratch\n")
    (docker / "Dockerfile.tensorflow").write_text("FROM scratch\n")
    return tmp_path


def test_commands_tag_with_the_revision_and_latest(context):
    commands = build_images.build_commands(
        "hvddevacr.azurecr.io", ["pytorch", "keras", "tensorflow"], "abc123", context
    )
    assert [image for image, _ in commands] == [
        "hvddevacr.azurecr.io/hvd-pytorch:abc123",
        "hvddevacr.azurecr.io/hvd-tensorflow:abc123",  # keras runs in the tensorflow image: built once
    ]
    assert commands[0][1] == [
        "az", "acr", "build", "--registry", "hvddevacr", "--image", "hvd-pytorch:abc123", "--image",
        "hvd-pytorch:latest", "--file", "training/docker/Dockerfile.pytorch", "--platform", "linux/amd64", ".",
    ]  # fmt: skip
    assert "training/docker/Dockerfile.tensorflow" in commands[1][1]


@pytest.fixture(scope="module")
def dockerignore_matcher(tmp_path_factory):
    """A bare git repository whose only ignore file is our .dockerignore: git's matcher means what
    Docker's does for the patterns we use (anchored at the top, or under **/)."""
    root = tmp_path_factory.mktemp("context")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text((REPO / ".dockerignore").read_text())
    return lambda path: subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=root).returncode == 0


@pytest.mark.parametrize(
    "path",
    ["cluster-dev.json", "deploy/cluster-prod.json", ".local-cluster/logs/azurite.log", "runs/r1/out.log",
     "id_ed25519", "keys/id_rsa.pub", "certs/op.pem", "Pulumi.dev.yaml", ".env", ".venv-train/bin/python"],
)  # fmt: skip
def test_no_secret_or_local_state_in_the_build_context(dockerignore_matcher, path):
    """`az acr build .` uploads what .dockerignore keeps."""
    assert dockerignore_matcher(path), f"{path} would be uploaded by `images`"
    assert not dockerignore_matcher("training/docker/Dockerfile.pytorch")


def test_cluster_descriptions_are_not_committed():
    assert subprocess.run(["git", "check-ignore", "--no-index", "-q", "cluster-dev.json"], cwd=REPO).returncode == 0


def test_missing_dockerfile_and_bad_registry(tmp_path, context):
    with pytest.raises(OperatorError, match=r"no Dockerfile for pytorch: expected training/docker/Dockerfile\.pytorch"):
        build_images.build_commands("acr", ["pytorch"], "t", tmp_path / "elsewhere")
    with pytest.raises(OperatorError, match="invalid registry"):
        build_images.build_commands("not a registry", ["pytorch"], "t", context)


def test_git_revision():
    rev = build_images.git_revision(REPO)
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", rev)


def test_cli_dry_run_and_missing_az(context, tmp_path):
    proc = run_module(
        "dtrain", "images", "--registry", "myacr", "--tag", "t1", "--context", str(context), "--dry-run",
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["myacr.azurecr.io/hvd-pytorch:t1", "myacr.azurecr.io/hvd-tensorflow:t1"]
    assert "would run" in proc.stderr and "az acr build --registry myacr --image hvd-pytorch:t1" in proc.stderr
    nodir = run_module(
        "dtrain", "images", "--registry", "myacr", "--tag", "t1", "--context", str(context),
        env={"PATH": str(tmp_path)}, timeout=60,
    )  # fmt: skip
    assert nodir.returncode == 3 and "az is not installed or not on PATH: install the Azure CLI" in nodir.stderr


def test_repository_ships_a_dockerfile_for_every_image():
    commands = build_images.build_commands("acr", ["pytorch", "tensorflow", "keras"], "t", REPO)
    assert [image for image, _ in commands] == ["acr.azurecr.io/hvd-pytorch:t", "acr.azurecr.io/hvd-tensorflow:t"]


def test_registry_from_the_cluster_description(context, tmp_path):
    outputs = json.loads((FIXTURES / "stack_outputs.json").read_text())
    desc = cluster.from_stack_outputs(outputs, "dev", ssh_key="k").save(tmp_path / "cluster.json")
    dry = ("--tag", "t1", "--context", str(context), "--dry-run")
    proc = run_module("dtrain", "--cluster", str(desc), "images", *dry, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        f"{outputs['acr_login_server']}/hvd-pytorch:t1",
        f"{outputs['acr_login_server']}/hvd-tensorflow:t1",
    ]
    # the same from $CLUSTER_DESCRIPTION; and a registry named twice is refused
    env = run_module("dtrain", "images", *dry, env={"CLUSTER_DESCRIPTION": str(desc)}, timeout=60)
    assert env.returncode == 0 and env.stdout == proc.stdout
    both = run_module("dtrain", "images", "--registry", "acr", "--cluster", str(desc), *dry, timeout=60)
    assert both.returncode == 2 and "error: pass one of --registry, --stack or --cluster" in both.stderr
