"""`cluster from-stack|show`: write the cluster description from a Pulumi stack, or print it.

The verb's parser and handlers live beside the description they write, in dtrain/cluster/description.py
(the seam every command reads); this module is its entry in the list of verbs.
"""

from dtrain.cluster.description import configure

__all__ = ["configure"]
