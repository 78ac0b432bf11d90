"""A job's input: ImageNet folders (``imagenet``), the decode step on the CPU (``decode``) and on the GPU
(``gpu_decode``, ``side_stream``, ``decode_choice``), images (``images``), the staging-time
``transcode`` and token batches for the transformer (``text``).

Runs on the nodes (``transcode`` also on the operator's machine, at staging). Framework-neutral
modules import neither PyTorch nor TensorFlow; the GPU modules import PyTorch.
"""
