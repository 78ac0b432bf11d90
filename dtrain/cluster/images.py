"""The cluster's framework images, built in its registry with `az acr build` (no local Docker), tagged
with the git revision and `latest`. On the operator's machine; `dtrain/cli/images.py` is the command."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from dtrain.checks import require_tool
from dtrain.cluster.description import IMAGE_REPOSITORIES, REPO_ROOT, check_image_tag
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console
from infra.contract import FRAMEWORKS

console = make_console()
REGISTRY = re.compile(r"[A-Za-z0-9]+(\.[A-Za-z0-9-]+)*")  # NAME or NAME.azurecr.io


def dockerfile_for(framework: str, root: Path = REPO_ROOT) -> Path:
    path = root / "training" / "docker" / f"Dockerfile.{framework}"
    if not path.is_file():
        raise OperatorError(f"no Dockerfile for {framework}: expected {path.relative_to(root)}")
    return path


def check_context(context: str | Path) -> Path:
    """The build context: the repository root, which holds training/docker/Dockerfile.<framework>."""
    root = Path(context).expanduser()
    if not root.is_dir():
        state = "is not a directory" if root.exists() else "does not exist"
        raise OperatorError(f"build context {root} {state}: pass the repository root as --context")
    return root.resolve()


def git_revision(root: Path = REPO_ROOT) -> str:
    require_tool("git", "install git, or pass --tag")
    proc = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OperatorError(
            f"cannot read the git revision of {root} (not a git checkout, or no commit yet); pass --tag"
        )
    rev = proc.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    return f"{rev}-dirty" if dirty.stdout.strip() else rev


def check_registry(registry: str) -> str:
    if not REGISTRY.fullmatch(registry.strip()):
        raise OperatorError(f"invalid registry {registry!r}: expected NAME or NAME.azurecr.io")
    return registry.strip()


def registry_name(registry: str) -> str:
    """`az acr build --registry` takes the registry's name: myacr.azurecr.io -> myacr."""
    return check_registry(registry).split(".", 1)[0]


def build_commands(
    registry: str, frameworks: Sequence[str], tag: str, root: Path = REPO_ROOT
) -> list[tuple[str, list[str]]]:
    """(image reference, az argv) per image to build. Keras needs no image of its own."""
    check_image_tag(tag)
    wanted = []
    for fw in frameworks:
        if fw not in IMAGE_REPOSITORIES:
            raise OperatorError(f"unknown framework {fw!r} ({', '.join(FRAMEWORKS)})")
        base = "tensorflow" if fw == "keras" else fw  # Keras runs in the TensorFlow image
        if base not in wanted:
            wanted.append(base)
    out = []
    for base in wanted:
        repo = IMAGE_REPOSITORIES[base]
        dockerfile = dockerfile_for(base, root)
        argv = [
            "az", "acr", "build",
            "--registry", registry_name(registry),
            "--image", f"{repo}:{tag}",
            "--image", f"{repo}:latest",
            "--file", str(dockerfile.relative_to(root)),
            "--platform", "linux/amd64",
            ".",
        ]  # fmt: skip
        login = registry if "." in registry else f"{registry}.azurecr.io"
        out.append((f"{login}/{repo}:{tag}", argv))
    return out


def build(
    registry: str,
    frameworks: Sequence[str],
    tag: str | None = None,
    dry_run: bool = False,
    root: Path = REPO_ROOT,
) -> list[str]:
    tag = tag or git_revision(root)
    commands = build_commands(registry, frameworks, tag, root)
    if not (root / ".dockerignore").exists():
        console.print("[yellow]no .dockerignore: az acr build would upload the virtual environments too[/yellow]")
    if not dry_run:
        require_tool("az", "install the Azure CLI (https://learn.microsoft.com/cli/azure/install-azure-cli)")
    for image, argv in commands:
        console.print(f"{'would run' if dry_run else 'building'} {image}: {' '.join(argv)}")
        if dry_run:
            continue
        if subprocess.run(argv, cwd=root).returncode != 0:
            raise OperatorError(f"az acr build failed for {image} (its output is above)", ExitCode.FAILED)
    return [image for image, _ in commands]
