"""Image bytes opened with Pillow, whose refusal of a non-image names its buffer
(`cannot identify image file <_io.BytesIO object at 0x...>`): here it says what is wrong, and the
caller, who knows the file, names it. Standard library and Pillow only (the operator's tools use it)."""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

NOT_AN_IMAGE = "not an image file (no format Pillow reads: JPEG, PNG, WebP, ...)"


def open_image(data: bytes) -> Image.Image:
    """Image.open on the bytes; an UnidentifiedImageError (an OSError) that reads well."""
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(NOT_AN_IMAGE) from None
