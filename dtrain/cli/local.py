"""`local up|down|status|link-rate|preempt`: the embedded local cluster.

The verb's parser and handlers live with the cluster they start, in dtrain/local/cluster.py; this module
is its entry in the list of verbs (and the only way the verbs reach dtrain/local/, with `demo`).
"""

from dtrain.local.cluster import configure

__all__ = ["configure"]
