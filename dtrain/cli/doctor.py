"""The `doctor` command: what the Azure subscription still lacks for a stack's first `pulumi up`, one
line per prerequisite with the `az` command that fixes it (the checks: dtrain/prerequisites.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dtrain.arm import ARM_ENDPOINT_ENV, DEFAULT_ARM_ENDPOINT, arm_endpoint
from dtrain.cli.cost import add_stack_file_option
from dtrain.cli_entry import arg_type, debugging
from dtrain.errors import ExitCode
from dtrain.json_documents import DoctorCheck, DoctorDocument
from dtrain.prerequisites import PROVIDERS, Report, run_checks, subscription_id
from dtrain.pricing import read_stack_config

DESCRIPTION = f"""\
Check, before the first `pulumi up`, what the stack file's deployment needs of the Azure subscription
(docs/deploy.md, Prerequisites), through Azure Resource Manager with your Azure login:
  - a credential: az login (or a service principal in the environment, or a managed identity)
  - the resource providers registered: {", ".join(PROVIDERS[:3])},
    {", ".join(PROVIDERS[3:])}
  - the feature Microsoft.Compute/EncryptionAtHost registered (unless encryptionAtHost: false)
  - your role on the subscription: Owner, or Contributor and User Access Administrator
  - the vCPU quota in the stack's region: the GPU size's family (nodeCount x its vCPUs), the other
    sizes' families, the regional total, and lowPriorityCores for Spot nodes
One line each: ok, or MISSING with what was found and the command that fixes it; the exit status is 1
when anything is missing. Nothing is changed.
The subscription is the one `pulumi up` would use: the stack file's azure-native:subscriptionId, else
ARM_SUBSCRIPTION_ID, else the Azure CLI's default (az account show). A stack that is already up
counts its own VMs as used quota.
{ARM_ENDPOINT_ENV} replaces {DEFAULT_ARM_ENDPOINT} (a sovereign cloud's Resource Manager; tests)."""
EXAMPLES = """\
examples:
  python -m dtrain doctor                                  # Pulumi.dev.yaml, the az CLI's subscription
  python -m dtrain doctor --stack-file Pulumi.prod.yaml --subscription 00000000-0000-0000-0000-000000000000
  python -m dtrain doctor --json | jq -r '.checks[] | select(.ok | not) | .fix'
"""


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor",
        help="what the Azure subscription lacks for `pulumi up`, and the az command that fixes each",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_stack_file_option(parser, ": its region, sizes and node counts")
    parser.add_argument(
        "--subscription",
        type=arg_type(subscription_id),
        metavar="ID",
        help="the subscription to check (default: the one `pulumi up` would use, as above)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: every check with ok, detail and fix (an error document on failure)",
    )
    parser.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    stack_file = Path(args.stack_file).expanduser()
    cfg = read_stack_config(stack_file)  # bad input is refused before anything is asked of Azure
    endpoint = arm_endpoint()
    report = run_checks(cfg, stack_file, args.subscription, endpoint, debugging(args))
    if args.json:
        _as_document(report, stack_file, cfg.location).print()
    else:
        _print_lines(report)
    return int(ExitCode.OK if report.ok else ExitCode.FAILED)


def _print_lines(report: Report) -> None:
    for check in report.checks:
        if check.ok:
            print(f"ok       {check.name}: {check.detail}")
        else:
            print(f"MISSING  {check.name}: {check.detail}; fix: {check.fix}")
    missing = sum(not check.ok for check in report.checks)
    if len(report.checks) == 1:
        return  # signing in failed: its line says what to do, and nothing else could be checked
    if missing:
        print(f"{missing} missing: run each fix, then `dtrain doctor` again")
    else:
        print(f"all {len(report.checks)} prerequisites are met: pulumi up can run")


def _as_document(report: Report, stack_file: Path, region: str) -> DoctorDocument:
    return DoctorDocument(
        stack_file=str(stack_file),
        region=region,
        subscription=report.subscription.id if report.subscription else None,
        subscription_source=report.subscription.source if report.subscription else None,
        principal=report.principal,
        ok=report.ok,
        checks=[DoctorCheck(name=c.name, ok=c.ok, detail=c.detail, fix=c.fix) for c in report.checks],
    )
