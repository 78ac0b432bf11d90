"""PyTorch's parts of the jobs: models (``models``, ``transformer``), replica sync (``sync``), profiling
and the model-parallel layouts (``parallel/``). The trainers themselves are ``training.pytorch`` and
``training.model_parallel``.

Runs on the nodes. Imports PyTorch (absolute imports: ``import torch`` is the framework, never this
package).
"""
