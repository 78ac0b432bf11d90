"""`dtrain doctor` against Azure's endpoints served for real on loopback: Resource Manager over HTTPS
(a certificate from a throwaway CA that the command trusts through SSL_CERT_FILE, as it would a
corporate proxy's) and the token from azure-identity's own managed-identity path (App Service's
IDENTITY_ENDPOINT and IDENTITY_HEADER, a plain loopback endpoint there too), so the command signs in
and reads exactly as it does against Azure; only the endpoints' addresses differ.

The token path: azure-identity cannot be pointed at a local Entra ID without HTTPS, instance
discovery and OpenID metadata, and the Azure CLI is not installed here; App Service's managed
identity is a documented, plain-HTTP token endpoint that DefaultAzureCredential takes as it is."""

from __future__ import annotations

import ast
import base64
import http.server
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from dtrain.arm import ARM_ENDPOINT_ENV
from dtrain.json_documents import DoctorDocument
from dtrain.prerequisites import (
    CONTRIBUTOR,
    OWNER,
    PROVIDER_OF_MODULE,
    PROVIDERS,
    USER_ACCESS_ADMINISTRATOR,
    quota_needs,
)
from dtrain.pricing import read_stack_config
from tests.boot.tls import make_ca
from tests.local_http import reply_json, serving

from .conftest import REPO

SUB = "00000000-0000-0000-0000-0000000000aa"
OTHER_SUB = "00000000-0000-0000-0000-0000000000bb"
OID = "11111111-2222-3333-4444-555555555555"
USER = "alice@example.com"
IDENTITY_HEADER = "the-identity-header"
SCOPE = f"/subscriptions/{SUB}"
RG_SCOPE = f"{SCOPE}/resourceGroups/someone-elses"
MANAGEMENT_GROUP = "/providers/Microsoft.Management/managementGroups/root-group"
DEV_STACK = REPO / "Pulumi.dev.yaml"
# ARM's and the command's per-request timeout (dtrain/arm.py: 30 s) bounds a run, with margin for a
# loaded machine; the no-credential case also probes IMDS (1 s) and may start an installed az.
RUN_TIMEOUT_S = 120


@dataclass
class Subscription:
    """What the emulated Resource Manager knows of the one subscription, as a fresh one that is ready."""

    providers: dict[str, str] = field(default_factory=lambda: dict.fromkeys(PROVIDERS, "Registered"))
    feature: str = "Registered"
    roles: list[tuple[str, str]] = field(
        default_factory=lambda: [(CONTRIBUTOR, SCOPE), (USER_ACCESS_ADMINISTRATOR, MANAGEMENT_GROUP)]
    )
    usages: dict[str, tuple[int, int]] = field(  # name -> (used, limit)
        default_factory=lambda: {
            "cores": (0, 350),
            "standardNDSH100v5Family": (0, 192),
            "standardDSv5Family": (4, 100),
            "standardBSFamily": (0, 10),
            "lowPriorityCores": (0, 0),
        }
    )
    tokens: dict[str, str] = field(default_factory=dict)  # token -> the audience it was issued for
    requests: list[str] = field(default_factory=list)


def jwt(claims: dict) -> str:
    """An access token as Entra ID shapes one (header.claims.signature); Resource Manager here checks
    that it is the one issued, not its signature."""

    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.c2lnbmF0dXJl"


def arm_handler(azure: Subscription) -> type[http.server.BaseHTTPRequestHandler]:
    routes = {
        SCOPE: lambda: {"subscriptionId": SUB, "displayName": "dtrain test", "state": "Enabled"},
        **{
            f"{SCOPE}/providers/{ns}": (lambda ns=ns: {"namespace": ns, "registrationState": azure.providers[ns]})
            for ns in PROVIDERS
        },
        f"{SCOPE}/providers/Microsoft.Features/providers/Microsoft.Compute/features/EncryptionAtHost": lambda: {
            "name": "Microsoft.Compute/EncryptionAtHost",
            "properties": {"state": azure.feature},
        },
        f"{SCOPE}/providers/Microsoft.Compute/locations/eastus/usages": lambda: {
            "value": [
                {"name": {"value": name, "localizedValue": name}, "currentValue": used, "limit": limit, "unit": "Count"}
                for name, (used, limit) in azure.usages.items()
            ]
        },
    }

    class ResourceManager(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            azure.requests.append(url.path)
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if azure.tokens.get(token) != f"https://{self.headers['Host']}":  # issued, and for this audience
                return self._error(401, "InvalidAuthenticationToken", "The access token is invalid.")
            if not query.get("api-version"):
                return self._error(400, "MissingApiVersionParameter", "The api-version query parameter is required.")
            if url.path == f"{SCOPE}/providers/Microsoft.Authorization/roleAssignments":
                return self._role_assignments(query)
            if url.path in routes:
                return reply_json(self, 200, routes[url.path]())
            if url.path.startswith("/subscriptions/") and not url.path.startswith(SCOPE):
                return self._error(404, "SubscriptionNotFound", "The subscription could not be found.")
            return self._error(404, "NotFound", f"no route {url.path}")

        def _role_assignments(self, query: dict[str, list[str]]) -> None:
            """Two a page, as ARM pages long lists: the command must follow nextLink."""
            assert query["$filter"] == [f"assignedTo('{OID}')"], query
            page = int(query.get("page", ["0"])[0])
            rows = [
                {"properties": {"roleDefinitionId": f"{SCOPE}/providers/Microsoft.Authorization/roleDefinitions/{role}",
                                "principalId": OID, "scope": scope}}
                for role, scope in azure.roles[2 * page : 2 * page + 2]
            ]  # fmt: skip
            more = len(azure.roles) > 2 * page + 2
            host = f"https://{self.headers['Host']}"
            next_link = f"{host}{urlsplit(self.path).path}?api-version=2022-04-01&$filter=assignedTo('{OID}')"
            reply_json(self, 200, {"value": rows, **({"nextLink": f"{next_link}&page={page + 1}"} if more else {})})

        def _error(self, status: int, code: str, message: str) -> None:
            reply_json(self, status, {"error": {"code": code, "message": message}})

        def log_message(self, *args: object) -> None:
            pass

    return ResourceManager


def token_handler(azure: Subscription) -> type[http.server.BaseHTTPRequestHandler]:
    """App Service's managed-identity endpoint: a token for the resource asked, to whoever shows the header."""

    class TokenEndpoint(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            resource = parse_qs(urlsplit(self.path).query).get("resource", [""])[0]
            if self.headers.get("X-IDENTITY-HEADER") != IDENTITY_HEADER or not resource:
                return reply_json(self, 400, {"error": "invalid_request", "error_description": "no header or resource"})
            token = jwt({"oid": OID, "upn": USER, "aud": resource, "iat": int(time.time())})
            azure.tokens[token] = resource
            reply_json(self, 200, {"access_token": token, "expires_on": str(int(time.time()) + 3600),
                                   "resource": resource, "token_type": "Bearer"})  # fmt: skip

        def log_message(self, *args: object) -> None:
            pass

    return TokenEndpoint


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory):
    return make_ca(tmp_path_factory.mktemp("ca"), addresses=("127.0.0.1",))


@pytest.fixture
def azure() -> Subscription:
    return Subscription()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home with the Azure CLI's profile naming SUB as the default subscription (`az account set`),
    and no other login of anyone's (no token cache, no az login)."""
    profile = {"subscriptions": [{"id": OTHER_SUB, "isDefault": False}, {"id": SUB, "isDefault": True}]}
    (tmp_path / ".azure").mkdir()
    (tmp_path / ".azure" / "azureProfile.json").write_text(json.dumps(profile), encoding="utf-8-sig")
    return tmp_path


def clean_env(home: Path) -> dict[str, str]:
    """Nothing of the machine's own Azure logins, proxies or endpoints."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "AZURE_CONFIG_DIR": str(home / ".azure"),
            "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}  # fmt: skip


@pytest.fixture
def signed_in(azure: Subscription, ca, home: Path) -> Iterator[dict[str, str]]:
    """The environment of an operator signed in, with Resource Manager at a local address."""
    with serving(arm_handler(azure), tls=ca.server) as arm_url, serving(token_handler(azure)) as tokens:
        yield clean_env(home) | {
            ARM_ENDPOINT_ENV: arm_url,
            "SSL_CERT_FILE": str(ca.directory / "ca.pem"),
            "IDENTITY_ENDPOINT": f"{tokens}/msi/token",
            "IDENTITY_HEADER": IDENTITY_HEADER,
        }


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dtrain", "doctor", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


def lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """check name -> its line (`ok       NAME: ...`, `MISSING  NAME: ...`), in the order printed."""
    return {m[1]: m[0] for m in re.finditer(r"^(?:ok|MISSING) +([^:]+): .*$", proc.stdout, re.MULTILINE)}


def missing(proc: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"^MISSING .*$", proc.stdout, re.MULTILINE)


def test_a_ready_subscription_passes_every_check(signed_in, azure):
    azure.roles.append((OWNER, RG_SCOPE))  # a third role, on a resource group only: a second page
    proc = doctor(signed_in)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert missing(proc) == [] and proc.stderr == ""
    assert list(found) == [
        "credential", f"subscription {SUB}", *(f"provider {ns}" for ns in PROVIDERS),
        "feature Microsoft.Compute/EncryptionAtHost", f"role on {SCOPE}",
        "quota standardNDSH100v5Family in eastus", "quota standardDSv5Family in eastus",
        "quota standardBSFamily in eastus", "quota cores in eastus",
    ]  # fmt: skip
    assert found["credential"].endswith(f"signed in as {USER}")
    assert "from az account show" in found[f"subscription {SUB}"]  # the Azure CLI's default
    assert "has Contributor, User Access Administrator" in found[f"role on {SCOPE}"]  # the latter inherited
    quota = found["quota standardNDSH100v5Family in eastus"]
    assert "192 vCPUs needed (2 x Standard_ND96isr_H100_v5), 192 free (limit 192, 0 used)" in quota
    others = found["quota standardDSv5Family in eastus"]
    assert "20 vCPUs needed (Standard_D4s_v5 + Standard_D16s_v5), 96 free" in others
    assert "214 vCPUs needed" in found["quota cores in eastus"]
    assert proc.stdout.rstrip().endswith("all 15 prerequisites are met: pulumi up can run")
    assert azure.requests.count(f"{SCOPE}/providers/Microsoft.Authorization/roleAssignments") == 2  # both pages

    document = DoctorDocument.model_validate_json(doctor(signed_in, "--json").stdout, strict=True)
    assert document.ok and document.subscription == SUB and document.principal == USER
    assert [check.fix for check in document.checks] == [None] * 15


@pytest.mark.parametrize(
    ("case", "line"),
    [
        (
            "provider",
            "MISSING  provider Microsoft.KeyVault: NotRegistered; "
            "fix: az provider register --namespace Microsoft.KeyVault --wait",
        ),
        (
            "feature",
            "MISSING  feature Microsoft.Compute/EncryptionAtHost: NotRegistered; fix: az feature register "
            "--namespace Microsoft.Compute --name EncryptionAtHost, and once it shows Registered: "
            "az provider register --namespace Microsoft.Compute",
        ),
        (
            "feature-pending",
            "MISSING  feature Microsoft.Compute/EncryptionAtHost: Pending; fix: wait until `az feature show "
            "--namespace Microsoft.Compute --name EncryptionAtHost --query properties.state -o tsv` prints "
            "Registered, then az provider register --namespace Microsoft.Compute",
        ),
        (
            "role",
            f"MISSING  role on {SCOPE}: {USER} has Contributor, 1 other role; needs Owner, or Contributor and User "
            f"Access Administrator; fix: an Owner of the subscription runs: az role assignment create --assignee "
            f'{OID} --scope {SCOPE} --role "User Access Administrator"',
        ),
        (
            "quota",
            "MISSING  quota standardNDSH100v5Family in eastus: 192 vCPUs needed (2 x Standard_ND96isr_H100_v5), "
            "100 free (limit 124, 24 used); fix: az quota update --resource-name standardNDSH100v5Family "
            "--resource-type dedicated --limit-object value=216 "
            f"--scope {SCOPE}/providers/Microsoft.Compute/locations/eastus",
        ),
    ],
)
def test_each_missing_prerequisite_is_one_line_with_its_fix(signed_in, azure, case, line):
    if case == "provider":
        azure.providers["Microsoft.KeyVault"] = "NotRegistered"
    elif case == "feature":
        azure.feature = "NotRegistered"
    elif case == "feature-pending":  # registered already, not yet granted
        azure.feature = "Pending"
    elif case == "role":  # an Owner of a resource group and UAA there are not enough for the subscription
        azure.roles = [(OWNER, RG_SCOPE), (CONTRIBUTOR, SCOPE), (USER_ACCESS_ADMINISTRATOR, RG_SCOPE)]
        azure.roles.append(("a-custom-role", SCOPE))
    else:
        azure.usages["standardNDSH100v5Family"] = (24, 124)
    proc = doctor(signed_in)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert missing(proc) == [line]
    assert proc.stdout.rstrip().endswith("1 missing: run each fix, then `dtrain doctor` again")


def test_spot_nodes_need_low_priority_vcpus_and_the_stack_file_names_the_subscription(signed_in, azure, tmp_path):
    """A stack file with Spot nodes and its own azure-native:subscriptionId, which wins over az's default."""
    stack = DEV_STACK.read_text().replace('spotNodeCount: "0"', 'spotNodeCount: "1"')
    stack = stack.replace("config:\n", f"config:\n  azure-native:subscriptionId: {SUB}\n", 1)
    (tmp_path / "Pulumi.spot.yaml").write_text(stack)
    profile = json.dumps({"subscriptions": [{"id": OTHER_SUB, "isDefault": True}]})
    (Path(signed_in["AZURE_CONFIG_DIR"]) / "azureProfile.json").write_text(profile)
    proc = doctor(signed_in, "--stack-file", str(tmp_path / "Pulumi.spot.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"from azure-native:subscriptionId in {tmp_path / 'Pulumi.spot.yaml'}" in proc.stdout
    assert missing(proc) == [
        "MISSING  quota lowPriorityCores in eastus: 96 vCPUs needed (1 Spot x Standard_ND96isr_H100_v5), 0 free "
        "(limit 0, 0 used); fix: az quota update --resource-name lowPriorityCores --resource-type lowPriority "
        f"--limit-object value=96 --scope {SCOPE}/providers/Microsoft.Compute/locations/eastus"
    ]


def test_the_lustre_provider_is_needed_by_a_lustre_stack_only(signed_in, azure, tmp_path):
    """Microsoft.StorageCache unregistered: nothing missing for the NFS stack, one line for a Lustre one."""
    azure.providers["Microsoft.StorageCache"] = "NotRegistered"
    proc = doctor(signed_in)
    assert proc.returncode == 0 and missing(proc) == [], proc.stdout + proc.stderr
    assert "not needed (no sharedStorage: lustre)" in lines(proc)["provider Microsoft.StorageCache"]
    stack = "".join(line for line in DEV_STACK.read_text().splitlines(keepends=True) if "azure-horovod:nfs" not in line)
    lustre = '  azure-horovod:sharedStorage: lustre\n  azure-horovod:lustreCapacityTib: "16"\n'
    (tmp_path / "Pulumi.lustre.yaml").write_text(stack.replace("config:\n", "config:\n" + lustre, 1))
    proc = doctor(signed_in, "--stack-file", str(tmp_path / "Pulumi.lustre.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert missing(proc) == [
        "MISSING  provider Microsoft.StorageCache: NotRegistered; "
        "fix: az provider register --namespace Microsoft.StorageCache --wait"
    ]


def test_a_subscription_this_login_cannot_see_stops_the_checks(signed_in):
    proc = doctor(signed_in, "--subscription", OTHER_SUB)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert missing(proc) == [
        f"MISSING  subscription {OTHER_SUB}: from --subscription: not found, or not visible to this login "
        "(SubscriptionNotFound (HTTP 404)); fix: az account list -o table, then az account set --subscription <id> "
        "(or --subscription)"
    ]
    assert list(lines(proc)) == ["credential", f"subscription {OTHER_SUB}"]


def test_without_a_login_it_says_az_login_in_one_line(home):
    proc = doctor(clean_env(home))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "MISSING  credential: no Azure login found (az login, a service principal in the environment, or a "
        "managed identity) (--debug: why each way of signing in failed); fix: az login"
    ]
    assert proc.stderr == ""
    document = DoctorDocument.model_validate_json(doctor(clean_env(home), "--json").stdout, strict=True)
    assert not document.ok and [c.fix for c in document.checks] == ["az login"] and document.principal is None


def test_bad_input_and_an_unreachable_resource_manager(signed_in, home):
    bad = doctor(clean_env(home), "--subscription", "not-a-guid")
    assert bad.returncode == 2 and "error: argument --subscription: 'not-a-guid' is not a subscription id" in bad.stderr
    malformed = doctor(clean_env(home) | {"ARM_SUBSCRIPTION_ID": "nope"})  # refused before signing in
    assert malformed.returncode == 2
    assert "error: ARM_SUBSCRIPTION_ID: 'nope' is not a subscription id" in malformed.stderr
    plain = doctor(clean_env(home) | {ARM_ENDPOINT_ENV: "http://127.0.0.1:1"})
    assert plain.returncode == 2 and "is not an https:// URL (the token is a bearer token)" in plain.stderr
    closed = doctor(signed_in | {ARM_ENDPOINT_ENV: "https://127.0.0.1:1"})  # signs in, then nothing answers
    assert closed.returncode == 3, closed.stdout + closed.stderr
    assert closed.stderr.startswith("error: cannot reach Azure Resource Manager at https://127.0.0.1:1")


def test_the_quota_docs_give_is_what_doctor_checks_for_the_dev_stack():
    """docs/deploy.md's quota rows for Pulumi.dev.yaml are the needs doctor computes."""
    needs = {need.name: need.vcpus for need in quota_needs(read_stack_config(DEV_STACK))}
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert needs == {"standardNDSH100v5Family": 192, "standardDSv5Family": 20, "standardBSFamily": 2, "cores": 214}
    assert "**214**: 192 GPU + 16 NFS server (D16s_v5) + 4 head node (D4s_v5) + 2 jumpbox (B2s)" in deploy
    assert "`standardDSv5Family` 20 (head node and NFS server), `standardBSFamily` 2 (jumpbox)" in deploy


def test_the_providers_checked_are_those_of_every_resource_the_program_declares():
    """Every pulumi-azure-native module infra/ imports has its resource provider in the check."""
    modules = {
        alias.name
        for path in (REPO / "infra").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "pulumi_azure_native"
        for alias in node.names
    }
    assert modules == set(PROVIDER_OF_MODULE)
    assert "Microsoft.KeyVault" in PROVIDERS and "Microsoft.Authorization" not in PROVIDERS
