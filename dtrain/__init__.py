"""dtrain: the operator's package and its one command, `dtrain <command>` (or `python -m dtrain <command>`).

Grouped by where the code runs:

- ``cli/``: the verbs, one module each (``__main__.py`` lists them); operator's machine.
- ``cluster/``: the cluster description, SSH, the Slurm client, blobs; operator's machine.
- ``jobs/``: a job's spec, batch script, allocation, preflight, workdir, runs, follow, results;
  operator's machine.
- ``local/``: the embedded local cluster, the emulated Azure (namespaces, Slurm, Azurite, metadata);
  operator's machine, as root. The Azure path (``cluster/``, ``jobs/``) never imports it.
- ``remote/``: what is installed on the cluster's hosts (standard library only; imports nothing of
  ``dtrain`` outside it).

The modules here (errors, checks, fileio, processes, ui) are what every part of the operator side
shares; cli_entry is the verbs' own (their parser and error path: nothing but ``cli/``, ``__main__.py``
and the local cluster's programs imports it). May import: ``infra.contract``-style stdlib modules of
``infra/``, the framework-free modules of ``training/`` (exit status, backend names, transcode) and the
operator environment's packages (pydantic, azure-storage-blob, rich); never PyTorch or TensorFlow.
"""
