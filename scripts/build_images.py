"""Build the framework images in the registry with `az acr build` (no local Docker), tagged with the git revision.

  python -m scripts.build_images --stack dev                    # registry from the stack's outputs
  python -m scripts.build_images --registry myacr.azurecr.io --framework pytorch --dry-run

Each image gets two tags: the git revision (`git rev-parse --short=12 HEAD`, plus `-dirty` when the
tree has uncommitted changes) and `latest`. Launch a pinned build with
`python -m scripts.cluster from-stack --stack dev --image-tag <revision>`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from scripts.cluster import IMAGE_REPOSITORIES, REPO_ROOT, load, pulumi_stack_outputs
from scripts.errors import OperatorError, run_cli
from scripts.ui import make_console

console = make_console()


def dockerfile_for(framework: str, root: Path = REPO_ROOT) -> Path:
    path = root / "training" / "docker" / f"Dockerfile.{framework}"
    if not path.is_file():
        raise OperatorError(f"no Dockerfile for {framework}: expected {path.relative_to(root)}")
    return path


def git_revision(root: Path = REPO_ROOT) -> str:
    proc = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OperatorError(f"cannot read the git revision of {root} (no commit yet?); pass --tag")
    rev = proc.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    return f"{rev}-dirty" if dirty.stdout.strip() else rev


def registry_name(registry: str) -> str:
    """`az acr build --registry` takes the registry's name: myacr.azurecr.io -> myacr."""
    name = registry.split(".", 1)[0].strip()
    if not name.isalnum():
        raise OperatorError(f"invalid registry {registry!r}: expected NAME or NAME.azurecr.io")
    return name


def build_commands(
    registry: str, frameworks: Sequence[str], tag: str, root: Path = REPO_ROOT
) -> list[tuple[str, list[str]]]:
    """(image reference, az argv) per image to build. Keras needs no image of its own."""
    wanted = []
    for fw in frameworks:
        if fw not in IMAGE_REPOSITORIES:
            raise OperatorError(f"unknown framework {fw!r} (pytorch, tensorflow, keras)")
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
    if not dry_run and shutil.which("az") is None:
        raise OperatorError(
            "the Azure CLI (az) is not installed: https://learn.microsoft.com/cli/azure/install-azure-cli"
        )
    for image, argv in commands:
        console.print(f"{'would run' if dry_run else 'building'} {image}: {' '.join(argv)}")
        if dry_run:
            continue
        if subprocess.run(argv, cwd=root).returncode != 0:
            raise OperatorError(f"az acr build failed for {image}")
    return [image for image, _ in commands]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.build_images", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--registry", help="registry name or login server (NAME.azurecr.io)")
    source.add_argument("--stack", help="read acr_login_server from this Pulumi stack's outputs")
    source.add_argument("--cluster", help="read the registry from a cluster description's images")
    parser.add_argument("--framework", action="append", choices=("pytorch", "tensorflow", "keras"))
    parser.add_argument("--tag", help="image tag (default: the git revision)")
    parser.add_argument("--dry-run", action="store_true", help="print the az commands without running them")
    parser.add_argument("--context", default=str(REPO_ROOT), help="build context: the repository (default)")
    args = parser.parse_args(argv)

    def body() -> int:
        if args.stack:
            outputs = pulumi_stack_outputs(args.stack)
            if not outputs.get("acr_login_server"):
                raise OperatorError(f"stack {args.stack!r} has no acr_login_server output")
            registry = str(outputs["acr_login_server"])
        elif args.cluster:
            images = load(args.cluster).runtime.images
            if not images:
                raise OperatorError("the cluster description has no images (host runtime?)")
            registry = next(iter(images.values())).split("/", 1)[0]
        else:
            registry = args.registry
        frameworks = args.framework or ["pytorch", "tensorflow"]
        images = build(registry, frameworks, args.tag, args.dry_run, Path(args.context).resolve())
        for image in images:
            print(image)
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
