"""Container registry for the framework images; pulls only through managed identities."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import containerregistry

from infra.contract import REGISTRY_SKU


@dataclass
class RegistryArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    tags: Mapping[str, str]


class Registry(pulumi.ComponentResource):
    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:Registry", name, None, opts)
        self.registry = containerregistry.Registry(
            f"{name}acr",  # auto-named with a random suffix: registry names are global
            resource_group_name=args.resource_group_name,
            location=args.location,
            # Standard carries the storage and throughput for multi-GB framework images.
            sku=containerregistry.SkuArgs(name=REGISTRY_SKU),
            admin_user_enabled=False,
            anonymous_pull_enabled=False,
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"login_server": self.registry.login_server, "id": self.registry.id})
