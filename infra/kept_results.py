"""Results in a storage account kept by an earlier stack (`keptResultsAccount`): the network path to it.

`pulumi destroy` keeps the data's account (infra/storage.py) but not what reached it: its firewall
admits only the deleted cluster's subnets, and the role assignments went with the cluster. A new
stack cannot change that account's firewall (it manages nothing outside its own groups), so its
nodes reach the account through a private endpoint in the cluster subnet, which the account's
firewall does not filter, with the private DNS zone that makes the account's usual name resolve to
it inside the VNet. The roles (the nodes' identity and the operator on the kept `results`
container) are granted by the stack beside the others (infra/identity.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from infra.config import KeptResultsApproval
from infra.private_link import private_link
from infra.storage import RESULTS_CONTAINER

# Azure's zone for the blob service's private endpoints (public cloud): a storage account that has
# one resolves through it, every other account as before.
BLOB_PRIVATE_ZONE = "privatelink.blob.core.windows.net"
BLOB_SUFFIX = "blob.core.windows.net"
# Azure's limit on the message that comes with a manual connection request.
REQUEST_MESSAGE_MAX = 140


def results_container_id(account_id: str) -> str:
    """The ARM id of the kept account's `results` container: the scope of its role assignments."""
    return f"{account_id}/blobServices/default/containers/{RESULTS_CONTAINER}"


def blob_endpoint(account_id: str) -> str:
    return f"https://{account_id.rsplit('/', 1)[1]}.{BLOB_SUFFIX}/"


def approval_request(stack: str, owner: str) -> str:
    """What the kept account's owner reads with a manual connection request: who asks, and for what."""
    request = f"Pulumi stack {stack} (owner {owner}): its cluster's nodes write results to `{RESULTS_CONTAINER}`"
    return request[:REQUEST_MESSAGE_MAX]


@dataclass
class KeptResultsArgs:
    account_id: str  # the kept storage account's ARM id (validated by infra/config.py)
    approval: KeptResultsApproval
    request_message: str  # what the account's owner reads with a manual request (approval_request)
    resource_group_name: pulumi.Input[str]  # the cluster's group: the endpoint goes with the cluster
    location: str
    vnet_id: pulumi.Input[str]
    subnet_id: pulumi.Input[str]  # the cluster subnet, where the nodes are
    tags: Mapping[str, str]


class KeptResults(pulumi.ComponentResource):
    """A private endpoint from the cluster subnet to the kept account's blob service, and the private DNS
    zone, linked to the VNet, that holds its address.

    With approval auto the endpoint asks to be approved at once, which Azure grants only to a deployer
    holding Microsoft.Storage/storageAccounts/privateEndpointConnectionsApproval/action on that account
    (Contributor there) and otherwise refuses (LinkedAuthorizationFailed: `pulumi up` fails). With manual
    it is a request that stays Pending, unreached, until the account's owner approves it; the deploy does
    not wait (docs/deploy.md, "Results in an account an earlier stack kept").
    """

    def __init__(self, name: str, args: KeptResultsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:KeptResults", name, None, opts)
        reached = private_link(
            name, args, zone=BLOB_PRIVATE_ZONE, zone_config="blob", connections=_connections(args), parent=self
        )
        self.endpoint = reached.endpoint
        self.blob_endpoint = blob_endpoint(args.account_id)
        self.register_outputs({"blob_endpoint": self.blob_endpoint, "private_endpoint_id": self.endpoint.id})


def _connections(args: KeptResultsArgs) -> dict[str, list[network.PrivateLinkServiceConnectionArgs]]:
    """The endpoint's connection to the account's blob service: approved at once, or requested."""
    if args.approval == "auto":
        return {"private_link_service_connections": [_blob_connection(args.account_id)]}
    return {"manual_private_link_service_connections": [_blob_connection(args.account_id, args.request_message)]}


def _blob_connection(account_id: str, request_message: str | None = None) -> network.PrivateLinkServiceConnectionArgs:
    return network.PrivateLinkServiceConnectionArgs(
        name="kept-results-blob",
        private_link_service_id=account_id,
        group_ids=["blob"],
        request_message=request_message,
    )
