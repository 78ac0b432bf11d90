"""The cluster's munge key: how slurmctld, slurmd and the Slurm commands authenticate each other."""

from __future__ import annotations

import pulumi
import pulumi_random as random

# mungekey's default length; munged accepts 32 bytes and more.
MUNGE_KEY_BYTES = 1024


class MungeKey(pulumi.ComponentResource):
    """Random bytes made once, at the first `pulumi up`, and kept in the stack's state (encrypted,
    as a secret) so that later updates hand every machine the same key. Nothing to configure."""

    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:MungeKey", name, None, opts)
        key = random.RandomBytes(f"{name}-bytes", length=MUNGE_KEY_BYTES, opts=pulumi.ResourceOptions(parent=self))
        # The provider marks it secret; said again here so that no code path (mocks included) can lose that.
        self.key_base64: pulumi.Output[str] = pulumi.Output.secret(key.base64)
        self.register_outputs({})
