"""Datasets on their way to the cluster, on the operator's machine: a synthetic one generated, a local
one transcoded and uploaded to the `data` blob container, then pulled onto the NFS server over SSH
(`dtrain/cli/stage.py` is the command over it). May import `dtrain.cluster` and `training.data`."""
