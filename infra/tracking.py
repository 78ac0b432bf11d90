"""The identity of the head node's MLflow server: it writes the runs' models to the `results` container.

An identity of its own, with Storage Blob Data Contributor on that one container and nothing else: the
head node's power identity gets no storage right, and the nodes' identity (AcrPull, the munge key) stays
off the head node. The server (infra/cloud_init/mlflow.py) takes its tokens from IMDS with this client id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import authorization

from infra.identity import STORAGE_BLOB_DATA_CONTRIBUTOR, grant, role_definition_id, user_assigned_identity


@dataclass
class TrackingIdentityArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    results_container_id: pulumi.Input[str]
    tags: Mapping[str, str]


class TrackingIdentity(pulumi.ComponentResource):
    def __init__(self, name: str, args: TrackingIdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:TrackingIdentity", name, None, opts)
        self.identity = user_assigned_identity(name, args.resource_group_name, args.location, args.tags, self)
        subscription_id = authorization.get_client_config_output().subscription_id
        self.role_assignment = grant(
            f"{name}-results-writer",
            self.identity.principal_id,
            role_definition_id(subscription_id, STORAGE_BLOB_DATA_CONTRIBUTOR),
            args.results_container_id,
            self,
            "ServicePrincipal",  # without it, a brand-new identity can fail on directory replication lag
        )
        self.register_outputs({"id": self.identity.id, "client_id": self.identity.client_id})
