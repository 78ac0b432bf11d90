"""What the TensorFlow and Keras jobs share (``common``: Horovod and GPU setup, precision, input
pipelines, model/optimizer state) and their models (``models``).

Runs on the nodes. Imports TensorFlow (``import tensorflow as tf`` is the framework, never this package).
"""
