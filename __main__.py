"""Pulumi entry point: validate the config, declare the deployment, export what the launcher needs."""

import pulumi

from infra.config import ConfigError, load_config
from infra.stack import build_stack

try:
    config = load_config()
except ConfigError as error:
    # RunError prints the message alone: the user needs the list of bad keys, not a traceback.
    raise pulumi.RunError(str(error)) from None

for name, value in build_stack(config, pulumi.get_project(), pulumi.get_stack()).items():
    pulumi.export(name, value)
