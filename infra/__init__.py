"""Pulumi components for the InfiniBand GPU training cluster; `infra.stack.build_stack` wires them."""
