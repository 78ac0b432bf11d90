"""Keras models shared by the TensorFlow and Keras jobs: the same architectures as
:mod:`training.torch.models` (ResNet-50 v1.5, not ``keras.applications``' v1), so the three
frameworks' numbers compare like with like.

Models take uint8 NHWC images and normalize them in float32 on the device; the layers after
that follow the global mixed-precision policy, and the logits are float32 again.
"""

from __future__ import annotations

import tensorflow as tf

from training.data.imagenet import MEAN, STD

layers = tf.keras.layers


def _conv(filters: int, kernel: int, stride: int = 1, bias: bool = False) -> layers.Layer:
    return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=bias, kernel_initializer="he_normal")


def _bn(zero_gamma: bool = False) -> layers.Layer:
    # Zero gamma on a residual branch's last BN: blocks start as identity (Goyal et al., 2017).
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5, gamma_initializer="zeros" if zero_gamma else "ones")


def _shortcut(x: tf.Tensor, channels: int, stride: int) -> tf.Tensor:
    if stride == 1 and x.shape[-1] == channels:
        return x
    return _bn()(_conv(channels, 1, stride)(x))


def _bottleneck(x: tf.Tensor, width: int, stride: int) -> tf.Tensor:
    """ResNet v1.5: the stride sits on the 3x3 convolution."""
    y = layers.ReLU()(_bn()(_conv(width, 1)(x)))
    y = layers.ReLU()(_bn()(_conv(width, 3, stride)(y)))
    y = _bn(zero_gamma=True)(_conv(width * 4, 1)(y))
    return layers.ReLU()(layers.Add()([y, _shortcut(x, width * 4, stride)]))


def _basic(x: tf.Tensor, width: int, stride: int) -> tf.Tensor:
    y = layers.ReLU()(_bn()(_conv(width, 3, stride)(x)))
    y = _bn(zero_gamma=True)(_conv(width, 3)(y))
    return layers.ReLU()(layers.Add()([y, _shortcut(x, width, stride)]))


def _inputs(image_size: int) -> tuple[tf.Tensor, tf.Tensor]:
    images = layers.Input((image_size, image_size, 3), dtype=tf.uint8)
    x = layers.Normalization(mean=MEAN, variance=[s * s for s in STD], dtype="float32")(tf.cast(images, tf.float32))
    return images, x


def _head(x: tf.Tensor, num_classes: int) -> tf.Tensor:
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(num_classes, dtype="float32")(x)  # float32 logits for a stable loss


def resnet50(num_classes: int, image_size: int) -> tf.keras.Model:
    images, x = _inputs(image_size)
    x = layers.ReLU()(_bn()(_conv(64, 7, 2)(x)))
    x = layers.MaxPooling2D(3, 2, padding="same")(x)
    for stage, (depth, width) in enumerate(zip([3, 4, 6, 3], [64, 128, 256, 512], strict=True)):
        for i in range(depth):
            x = _bottleneck(x, width, 2 if stage > 0 and i == 0 else 1)
    return tf.keras.Model(images, _head(x, num_classes), name="resnet50")


def resnet_tiny(num_classes: int, image_size: int) -> tf.keras.Model:
    images, x = _inputs(image_size)
    x = layers.ReLU()(_bn()(_conv(16, 3)(x)))
    for stage, width in enumerate([16, 32, 64]):
        x = _basic(x, width, 2 if stage > 0 else 1)
    return tf.keras.Model(images, _head(x, num_classes), name="resnet_tiny")


def simple_cnn(num_classes: int, image_size: int) -> tf.keras.Model:
    """No batch norm, so N workers x batch B and one worker x batch N*B train identically."""
    images, x = _inputs(image_size)
    x = layers.ReLU()(_conv(16, 3, 2, bias=True)(x))
    x = layers.ReLU()(_conv(32, 3, 2, bias=True)(x))
    return tf.keras.Model(images, _head(x, num_classes), name="simple_cnn")


MODELS = {"resnet50": resnet50, "resnet_tiny": resnet_tiny, "simple_cnn": simple_cnn}


def build_model(name: str, num_classes: int, image_size: int) -> tf.keras.Model:
    return MODELS[name](num_classes, image_size)
