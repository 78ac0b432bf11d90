"""The `images` command: build the framework images in the registry with `az acr build` (no local
Docker), tagged with the git revision and `latest`."""

from __future__ import annotations

import argparse
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from dtrain.cli_common import add_cluster_option, arg_type, non_empty, require_tool
from dtrain.cluster.description import IMAGE_REPOSITORIES, REPO_ROOT, check_image_tag, load, pulumi_stack_outputs
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


# --- the `images` command ----------------------------------------------------------------------
IMAGES_DESCRIPTION = """\
Build the framework images (hvd-pytorch, and hvd-tensorflow, which the Keras job shares) in the
stack's Azure Container Registry with `az acr build`: the build runs in Azure, no local Docker is
needed. Each image gets two tags: the git revision (`git rev-parse --short=12 HEAD`, with `-dirty`
when tracked files have uncommitted changes) and `latest`. The registry is --registry, else the
stack's (--stack), else the one the cluster description's images name."""
IMAGES_EXAMPLES = """\
examples:
  python -m dtrain images --stack dev                      # prints the images it built
  python -m dtrain images --registry myacr --framework pytorch --dry-run
  python -m dtrain cluster from-stack --stack dev --image-tag 0123456789ab   # pin jobs to that build
"""


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "images",
        help="build the framework images in the registry (az acr build)",
        description=IMAGES_DESCRIPTION,
        epilog=IMAGES_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--registry",
        type=arg_type(check_registry),
        metavar="NAME",
        help="registry name or login server (NAME.azurecr.io)",
    )
    source.add_argument(
        "--stack", type=non_empty, metavar="NAME", help="read acr_login_server from this Pulumi stack's outputs"
    )
    add_cluster_option(parser)
    parser.add_argument(
        "--framework",
        action="append",
        choices=FRAMEWORKS,
        help="build only this framework's image (repeatable; default: all)",
    )
    parser.add_argument(
        "--tag", type=arg_type(check_image_tag), metavar="TAG", help="image tag (default: the git revision)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the az commands without running them")
    parser.add_argument(
        "--context",
        type=non_empty,
        default=str(REPO_ROOT),
        metavar="DIR",
        help="build context: the repository (default)",
    )
    parser.set_defaults(handler=run)


def _registry(args: argparse.Namespace) -> str:
    if args.registry or args.stack:
        if args.cluster:
            raise OperatorError("pass one of --registry, --stack or --cluster: they name the registry each")
        return args.registry or _stack_registry(args.stack)
    try:
        images = load(args.cluster).runtime.images
    except OperatorError as exc:
        raise OperatorError(f"{exc} (or name the registry: --registry NAME or --stack NAME)", exc.exit_code) from None
    if not images:
        raise OperatorError("the cluster description has no images (host runtime?): pass --registry or --stack")
    return check_registry(next(iter(images.values())).split("/", 1)[0])


def _stack_registry(stack: str) -> str:
    outputs = pulumi_stack_outputs(stack)
    if not outputs.get("acr_login_server"):
        raise OperatorError(f"stack {stack!r} has no acr_login_server output")
    return check_registry(str(outputs["acr_login_server"]))


def run(args: argparse.Namespace) -> int:
    root = check_context(args.context)
    frameworks = args.framework or ["pytorch", "tensorflow"]
    for image in build(_registry(args), frameworks, args.tag, args.dry_run, root):
        print(image)
    return 0
