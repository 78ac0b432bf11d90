"""The embedded local cluster: the Azure topology emulated on one machine, for demos and tests.

The cluster itself (``cluster.py``: what `dtrain local up|down|status|link-rate` does; its verb is
dtrain/cli/local.py), Slurm's files and configuration (``slurm_conf.py``) and its start (``slurm.py``), the
daemons' readiness and Azurite (``daemons.py``, ``cluster.py``), the nodes' daemons (``nodes.py``), power
saving (``power.py``), the instance metadata service (``metadata.py``), the network namespaces
(``network.py``), the link speed (``link.py``), emulated GPUs (``gpus.py``) and what it recorded
(``state.py``).

Runs on the operator's machine, as root. May import everything of ``dtrain`` but ``cli`` (the ``main``
of its own programs uses ``cli_entry``, as a verb does); nothing on the Azure path (``dtrain.cluster``,
``dtrain.jobs``) imports it.
"""
