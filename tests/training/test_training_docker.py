"""Static checks of the framework images (they cannot be built here: no Docker engine, no GPU)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.training.jobs import REPO

DOCKER = REPO / "training" / "docker"
BUILT = ("pytorch", "tensorflow")  # Dockerfile.keras is the TensorFlow image under another name


def image_pins(framework: str) -> dict[str, str]:
    """``name -> version`` of an image's requirements; fails on any requirement that is not ``==``."""
    found = {}
    for line in (DOCKER / f"requirements-{framework}.txt").read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[a-z-]+\])?==([0-9.]+)", requirement)
            assert match, f"requirements-{framework}.txt: not an exact pin: {line!r}"
            found[match.group(1).lower()] = match.group(3)
    return found


# simplejpeg and opencv-python-headless: the ImageNet loader's decode; tensorboard and matplotlib: a
# run's curves; azure-storage-blob: predict from the results container.
SHARED_PINS = (
    "numpy",
    "pillow",
    "simplejpeg",
    "opencv-python-headless",
    "cmake",
    "tensorboard",
    "matplotlib",
    "azure-storage-blob",
)


def train_env_pins() -> dict[str, str]:
    """Exact pins of requirements-train.txt, the set the tests run with."""
    found = {}
    for line in (REPO / "requirements-train.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([0-9.]+)", line)
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


@pytest.mark.parametrize(
    ("framework", "package", "tested_as"),
    [("pytorch", "torch", "torch"), ("tensorflow", "tensorflow", "tensorflow-cpu")],
)
def test_image_pins_every_version_and_agrees_with_the_tested_set(framework: str, package: str, tested_as: str) -> None:
    image, tested = image_pins(framework), train_env_pins()
    assert image[package] == tested[tested_as]
    for shared in SHARED_PINS:
        assert image[shared] == tested[shared], shared


def test_the_pytorch_image_pins_the_torchvision_release_made_for_its_torch() -> None:
    # torchvision 0.28.0 requires torch==2.13.0 (its wheel's metadata); pip would otherwise replace
    # the pinned torch, or refuse. training/data/gpu_decode.py says why torchvision is in the image only.
    image = image_pins("pytorch")
    assert (image["torch"], image["torchvision"]) == ("2.13.0", "0.28.0")
    assert "torchvision" not in train_env_pins()


@pytest.mark.parametrize("framework", BUILT)
def test_dockerfile_builds_horovod_with_nccl_and_serves_ssh(framework: str) -> None:
    text = (DOCKER / f"Dockerfile.{framework}").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    assert bases, "no FROM"
    for base in bases:
        assert ":" in base and not base.endswith(":latest"), f"unpinned base image {base}"
    assert f"requirements-{framework}.txt" in text
    assert "install_horovod.sh" in text and "setup_node_image.sh" in text
    assert "COPY training /workspace/training" in text
    assert "EXPOSE 12345" in text
    assert re.search(r"HOROVOD_BUILD_CUDA_CC_LIST=[0-9,]+", text)


def test_shared_build_scripts() -> None:
    horovod = (DOCKER / "install_horovod.sh").read_text()
    assert "version=0.28.1" in horovod
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in horovod
    assert "CMAKE_CXX_STANDARD 17" in horovod
    assert "grep -q '\\[X\\] NCCL'" in horovod  # the build fails unless NCCL operations are in
    setup = (DOCKER / "setup_node_image.sh").read_text()
    for package in ("openssh-server", "rdma-core", "ibverbs-providers", "libibverbs1", "librdmacm1"):
        assert package in setup
    assert "Port 12345" in setup
    assert "PasswordAuthentication no" in setup
    for script in ("install_horovod.sh", "setup_node_image.sh"):
        subprocess.run(["bash", "-n", str(DOCKER / script)], check=True)


def test_keras_image_is_the_tensorflow_image() -> None:
    text = (DOCKER / "Dockerfile.keras").read_text()
    assert re.search(r"^FROM \$\{TENSORFLOW_IMAGE\}$", text, flags=re.MULTILINE)
