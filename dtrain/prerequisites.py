"""What a subscription must have before a stack's first `pulumi up` (docs/deploy.md, Prerequisites),
checked through Resource Manager: the subscription, the resource providers, the EncryptionAtHost
feature, the signed-in principal's role, and the vCPU quota the stack's sizes and node counts take
in its region. Each check says what it found and, when something is missing, the `az` command that
fixes it. Runs on the operator's machine; `dtrain doctor` (dtrain/cli/doctor.py) prints it.

The subscription is the one `pulumi up` would deploy to: the stack file's
`azure-native:subscriptionId`, else ARM_SUBSCRIPTION_ID, else the Azure CLI's default (`az account
show`); `--subscription` overrides them.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dtrain.arm import Arm, ArmError, NoCredential, Principal
from dtrain.checks import read_text_file
from dtrain.errors import OperatorError
from infra.azure_limits import VM_SIZES
from infra.config import StackConfig

# The pulumi-azure-native modules infra/ declares resources of, and the resource provider each needs.
PROVIDER_OF_MODULE = {
    "compute": "Microsoft.Compute",
    "network": "Microsoft.Network",
    "privatedns": "Microsoft.Network",
    "storage": "Microsoft.Storage",
    "keyvault": "Microsoft.KeyVault",
    "containerregistry": "Microsoft.ContainerRegistry",
    "managedidentity": "Microsoft.ManagedIdentity",
    "authorization": "Microsoft.Authorization",
    "resources": "Microsoft.Resources",
    "storagecache": "Microsoft.StorageCache",
}
ALWAYS_REGISTERED = frozenset({"Microsoft.Authorization", "Microsoft.Resources"})
PROVIDERS = tuple(dict.fromkeys(ns for ns in PROVIDER_OF_MODULE.values() if ns not in ALWAYS_REGISTERED))
# Providers of resources only some stacks declare: checked where the stack file asks for them, so that a
# stack without them needs no registration it will not use.
ONLY_FOR: dict[str, tuple[str, Callable[[StackConfig], bool]]] = {
    "Microsoft.StorageCache": ("sharedStorage: lustre", lambda cfg: cfg.shared_storage == "lustre"),
}
FEATURE_NAMESPACE, FEATURE = "Microsoft.Compute", "EncryptionAtHost"

# Built-in role definitions: their ids are the same in every tenant.
OWNER = "8e3af657-a8ff-443c-a75c-2fe8c4bcb635"
CONTRIBUTOR = "b24988ac-6180-42a0-ab88-20f7382dd24c"
USER_ACCESS_ADMINISTRATOR = "18d7d88d-d35e-4fb5-a5c3-7773c20a72d9"
ROLE_NAMES = {OWNER: "Owner", CONTRIBUTOR: "Contributor", USER_ACCESS_ADMINISTRATOR: "User Access Administrator"}

# Resource Manager API versions (each documented, stable).
SUBSCRIPTIONS_API = "2022-12-01"
PROVIDERS_API = "2021-04-01"
FEATURES_API = "2021-07-01"
ROLE_ASSIGNMENTS_API = "2022-04-01"
USAGES_API = "2024-07-01"

REGIONAL_QUOTA, SPOT_QUOTA = "cores", "lowPriorityCores"
SUBSCRIPTION_ID = re.compile(r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")
ARM_SUBSCRIPTION_ENV = "ARM_SUBSCRIPTION_ID"  # what Pulumi's azure-native provider reads
AZ_LOGIN = "az login, then az account set --subscription <id>"


@dataclass(frozen=True)
class Check:
    """One prerequisite: what was found, and the command that fixes it when it is missing."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Subscription:
    id: str
    source: str  # where it was chosen from, as the user would look it up


@dataclass(frozen=True)
class QuotaNeed:
    """vCPUs a stack takes of one regional quota (a usage of `az vm list-usage`)."""

    name: str
    vcpus: int
    what: str  # what takes them, e.g. "2 x Standard_ND96isr_H100_v5"
    resource_type: str  # `az quota update --resource-type`: dedicated or lowPriority


@dataclass(frozen=True)
class Report:
    checks: list[Check]
    subscription: Subscription | None
    principal: str | None

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


def quota_needs(cfg: StackConfig) -> list[QuotaNeed]:
    """The GPU size's family, each other family the jumpbox, head node and NFS server use, every
    on-demand vCPU of the region together, and the Spot nodes' low-priority vCPUs."""
    sku = cfg.sku
    gpu = QuotaNeed(sku.quota_family, cfg.node_count * sku.vcpus, f"{cfg.node_count} x {cfg.gpu_sku}", "dedicated")
    others: dict[str, list[str]] = defaultdict(list)
    for size in (cfg.head_vm_size, cfg.nfs_vm_size, cfg.jumpbox_vm_size):
        others[VM_SIZES[size].quota_family].append(size)
    families = [
        QuotaNeed(family, sum(VM_SIZES[size].vcpus for size in sizes), " + ".join(sizes), "dedicated")
        for family, sizes in others.items()
    ]
    regional = QuotaNeed(
        REGIONAL_QUOTA, sum(need.vcpus for need in (gpu, *families)), "every on-demand VM of the stack", "dedicated"
    )
    needs = [gpu, *families, regional]
    if cfg.spot_node_count:
        spot = f"{cfg.spot_node_count} Spot x {cfg.gpu_sku}"
        needs.append(QuotaNeed(SPOT_QUOTA, cfg.spot_node_count * sku.vcpus, spot, "lowPriority"))
    return needs


# --- which subscription -------------------------------------------------------------------------
def choose_subscription(given: str | None, stack_file: Path) -> Subscription | None:
    """The subscription `pulumi up` would use (the module's docstring says in which order), or None."""
    stack_config = (yaml.safe_load(read_text_file(stack_file, "stack file")) or {}).get("config") or {}
    candidates = [
        (given, "--subscription"),
        (stack_config.get("azure-native:subscriptionId"), f"azure-native:subscriptionId in {stack_file}"),
        (os.environ.get(ARM_SUBSCRIPTION_ENV), ARM_SUBSCRIPTION_ENV),
        (_az_default_subscription(), "az account show"),
    ]
    for value, source in candidates:
        if value:
            if not SUBSCRIPTION_ID.match(str(value).strip()):
                raise OperatorError(f"{source}: {value!r} is not a subscription id (a GUID: az account list -o table)")
            return Subscription(str(value).strip().lower(), source)
    return None


def subscription_id(text: str) -> str:
    """--subscription's check."""
    if not SUBSCRIPTION_ID.match(text.strip()):
        raise OperatorError(f"{text!r} is not a subscription id (a GUID: az account list -o table)")
    return text.strip()


def _az_default_subscription() -> str | None:
    """The Azure CLI's default subscription, from its profile (what `az account show` prints)."""
    directory = Path(os.environ.get("AZURE_CONFIG_DIR") or Path.home() / ".azure")
    try:
        profile = json.loads((directory / "azureProfile.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    subscriptions = profile.get("subscriptions") if isinstance(profile, dict) else None
    default = next((s for s in subscriptions or [] if isinstance(s, dict) and s.get("isDefault")), None)
    return str(default["id"]) if default and default.get("id") else None


# --- the checks ---------------------------------------------------------------------------------
def run_checks(
    cfg: StackConfig, stack_file: Path, given_subscription: str | None, endpoint: str, debug: bool = False
) -> Report:
    """Choose the subscription (a malformed id is refused before anything is asked of Azure), sign in,
    then every check; stops after the first two when they fail, since nothing else can be read without
    them. debug: the no-credential line says why each way of signing in failed."""
    subscription = choose_subscription(given_subscription, stack_file)
    try:
        arm = Arm.sign_in(endpoint)
    except NoCredential as exc:
        return Report([_no_credential(str(exc), debug)], subscription, None)
    principal = arm.principal
    signed_in = Check("credential", True, f"signed in as {principal.name}")
    if subscription is None:
        nowhere = "none chosen: no --subscription, azure-native:subscriptionId, ARM_SUBSCRIPTION_ID or az default"
        missing = Check("subscription", False, nowhere, AZ_LOGIN)
        return Report([signed_in, missing], None, principal.name)
    try:
        found = check_subscription(arm, subscription)
    except ArmError as exc:
        if exc.status != 401:
            raise
        refused = Check("credential", False, f"Resource Manager refused the token of {principal.name}: {exc}", AZ_LOGIN)
        return Report([refused], subscription, principal.name)
    checks = [signed_in, found]
    if found.ok:
        checks += check_providers(arm, subscription.id, cfg)
        checks.append(check_feature(arm, subscription.id, cfg.encryption_at_host))
        checks.append(check_role(arm, subscription.id, principal))
        checks += check_quotas(arm, subscription.id, cfg)
    return Report(checks, subscription, principal.name)


def _no_credential(why: str, debug: bool) -> Check:
    detail = "no Azure login found (az login, a service principal in the environment, or a managed identity)"
    why = f": {' '.join(why.split())}" if debug else " (--debug: why each way of signing in failed)"
    return Check("credential", False, detail + why, "az login")


def check_subscription(arm: Arm, subscription: Subscription) -> Check:
    name = f"subscription {subscription.id}"
    fix = "az account list -o table, then az account set --subscription <id> (or --subscription)"
    try:
        found = arm.get(f"/subscriptions/{subscription.id}", SUBSCRIPTIONS_API)
    except ArmError as exc:
        if exc.status == 401:
            raise
        return Check(name, False, f"from {subscription.source}: not found, or not visible to this login ({exc})", fix)
    state, title = found.get("state"), found.get("displayName") or "unnamed"
    if state != "Enabled":
        return Check(name, False, f"{title!r} is {state}: no resource can be created", "the portal's Subscriptions")
    return Check(name, True, f"{title!r}, from {subscription.source}")


def check_providers(arm: Arm, subscription: str, cfg: StackConfig) -> list[Check]:
    def one(namespace: str) -> Check:
        if namespace in ONLY_FOR and not ONLY_FOR[namespace][1](cfg):
            return Check(f"provider {namespace}", True, f"not needed (no {ONLY_FOR[namespace][0]})")
        fix = f"az provider register --namespace {namespace} --wait"
        found = _read(arm, f"/subscriptions/{subscription}/providers/{namespace}", PROVIDERS_API)
        if isinstance(found, ArmError):
            return Check(f"provider {namespace}", False, f"cannot read it: {_said(found)}", fix)
        state = found.get("registrationState") or "unknown"
        return Check(f"provider {namespace}", state == "Registered", state, None if state == "Registered" else fix)

    return [one(namespace) for namespace in PROVIDERS]


def check_feature(arm: Arm, subscription: str, needed: bool) -> Check:
    name = f"feature {FEATURE_NAMESPACE}/{FEATURE}"
    if not needed:
        return Check(name, True, "not needed (encryptionAtHost: false)")
    fix = (
        f"az feature register --namespace {FEATURE_NAMESPACE} --name {FEATURE}, and once it shows Registered: "
        f"az provider register --namespace {FEATURE_NAMESPACE}"
    )
    features = f"/subscriptions/{subscription}/providers/Microsoft.Features/providers/{FEATURE_NAMESPACE}/features"
    found = _read(arm, f"{features}/{FEATURE}", FEATURES_API)
    if isinstance(found, ArmError):
        return Check(name, False, f"cannot read it: {_said(found)}", fix)
    state = (found.get("properties") or {}).get("state") or "unknown"
    if state in ("Pending", "Registering"):  # asked for already: Azure takes minutes to hours
        show = f"az feature show --namespace {FEATURE_NAMESPACE} --name {FEATURE} --query properties.state -o tsv"
        fix = f"wait until `{show}` prints Registered, then az provider register --namespace {FEATURE_NAMESPACE}"
    return Check(name, state == "Registered", state, None if state == "Registered" else fix)


def check_role(arm: Arm, subscription: str, principal: Principal) -> Check:
    """Owner, or Contributor and User Access Administrator, on the subscription (or above it: a
    management group, the root), directly or through a group."""
    scope = f"/subscriptions/{subscription}"
    name = f"role on {scope}"
    need = "needs Owner, or Contributor and User Access Administrator"
    if principal.object_id is None:
        fix = f"az role assignment list --assignee <you> --scope {scope} --include-inherited --include-groups"
        return Check(name, False, f"cannot tell who {principal.name} is from the token's claims; {need}", fix)
    path = f"{scope}/providers/Microsoft.Authorization/roleAssignments"
    assigned_to = {"$filter": f"assignedTo('{principal.object_id}')"}  # directly, or through a group
    found = _read(arm, path, ROLE_ASSIGNMENTS_API, all_pages=True, **assigned_to)
    held: set[str] = set()
    if isinstance(found, ArmError):
        detail = f"{principal.name} may not read role assignments there ({_said(found)}); {need}"
    else:
        held = {
            props["roleDefinitionId"].rstrip("/").rsplit("/", 1)[-1].lower()
            for props in (item.get("properties") or {} for item in found)
            if isinstance(props.get("roleDefinitionId"), str) and _covers(props.get("scope"), scope)
        }
        shown = sorted(ROLE_NAMES[role] for role in held if role in ROLE_NAMES)
        others = len(held - ROLE_NAMES.keys())
        has = ", ".join(shown + ([f"{others} other role{'s' * (others > 1)}"] if others else [])) or "no role"
        detail = f"{principal.name} has {has}"
        if OWNER in held or {CONTRIBUTOR, USER_ACCESS_ADMINISTRATOR} <= held:
            return Check(name, True, detail)
        detail += f"; {need}"
    roles = [ROLE_NAMES[role] for role in (CONTRIBUTOR, USER_ACCESS_ADMINISTRATOR) if role not in held]
    assign = f"az role assignment create --assignee {principal.object_id} --scope {scope} --role"
    fix = " && ".join(f'{assign} "{role}"' for role in roles)
    return Check(name, False, detail, f"an Owner of the subscription runs: {fix}")


def _covers(assignment_scope: object, scope: str) -> bool:
    """Whether a role assigned at assignment_scope applies to the whole subscription at scope: assigned
    there, at the root, or on a management group (ARM lists only those above the subscription)."""
    if not isinstance(assignment_scope, str):
        return False
    assigned = assignment_scope.rstrip("/").lower()
    return assigned in ("", scope.lower()) or assigned.startswith("/providers/microsoft.management/managementgroups/")


def check_quotas(arm: Arm, subscription: str, cfg: StackConfig) -> list[Check]:
    location_scope = f"/subscriptions/{subscription}/providers/Microsoft.Compute/locations/{cfg.location}"
    found = _read(arm, f"{location_scope}/usages", USAGES_API, all_pages=True)
    usages: dict[str, dict[str, Any]] = {}
    if not isinstance(found, ArmError):
        usages = {str((item.get("name") or {}).get("value", "")).lower(): item for item in found}

    def one(need: QuotaNeed) -> Check:
        name = f"quota {need.name} in {cfg.location}"
        wanted = f"{need.vcpus} vCPUs needed ({need.what})"
        usage = usages.get(need.name.lower())
        used = int(usage.get("currentValue") or 0) if usage else 0
        fix = (
            f"az quota update --resource-name {need.name} --resource-type {need.resource_type} "
            f"--limit-object value={used + need.vcpus} --scope {location_scope}"
        )
        if isinstance(found, ArmError):
            return Check(name, False, f"{wanted}; cannot read the usages: {_said(found)}", fix)
        if usage is None:
            return Check(name, False, f"{wanted}; {cfg.location} lists no such quota for this subscription", fix)
        limit = int(usage.get("limit") or 0)
        free = limit - used
        detail = f"{wanted}, {free} free (limit {limit}, {used} used)"
        return Check(name, free >= need.vcpus, detail, None if free >= need.vcpus else fix)

    return [one(need) for need in quota_needs(cfg)]


def _read(arm: Arm, path: str, api_version: str, all_pages: bool = False, **query: str) -> Any:
    """The answer, or the ArmError a check reports as what it could not read."""
    read: Callable[..., Any] = arm.get_all if all_pages else arm.get
    try:
        return read(path, api_version, **query)
    except ArmError as exc:
        return exc


def _said(error: ArmError) -> str:
    return f"{error}: {error.message}" if error.message else str(error)
