"""The `images` command: its flags, and where the registry comes from (--registry, --stack or the
cluster description), over dtrain/cluster/images.py, which builds."""

from __future__ import annotations

import argparse

from dtrain.cli_entry import add_cluster_option, arg_type, non_empty
from dtrain.cluster.description import REPO_ROOT, check_image_tag, load, pulumi_stack_outputs
from dtrain.cluster.images import build, check_context, check_registry
from dtrain.errors import OperatorError
from infra.contract import FRAMEWORKS

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
