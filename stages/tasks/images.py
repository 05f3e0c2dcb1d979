"""Images inside task tables: PNG bytes in a parquet column, checked before any compute.

A vision family stores each image as lossless PNG bytes (`pl.Binary`), so a split is one
self-contained parquet file that DVC versions like any other table. `decode_image` is the one
way back to pixels: a truncated or corrupt file, a wrong size or a wrong mode raises
`ImageValidationError` naming the file, the row and what was expected, before a stage trains or
evaluates on it (the great-expectations suite checks the table's columns; it cannot look inside
a PNG).
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any, Iterable

from stages.core.checks import DataValidationError

if TYPE_CHECKING:
    import numpy as np


class ImageValidationError(DataValidationError):
    """A malformed image at a stage boundary; the message names the source, row and rule."""


def encode_png(pixels: "np.ndarray") -> bytes:
    """(H, W, 3) or (H, W) uint8 -> PNG bytes (deterministic: no timestamp chunk)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def pixel_sha(pixels: "np.ndarray") -> str:
    """SHA-256 of the raw pixels (shape included): the identity of an image across splits."""
    h = hashlib.sha256(str(pixels.shape).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()


def decode_image(data: Any, *, size: tuple[int, int], mode: str, where: str) -> "np.ndarray":
    """PNG bytes -> uint8 array of `size` (width, height) in `mode` ('RGB' or 'L').

    `where` names the image in errors (`<file>: row <id>`). Raises ImageValidationError for
    anything that is not a readable PNG of exactly that size and mode.
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ImageValidationError(
            f"{where}: column 'image': rule 'png bytes' failed: got "
            f"{type(data).__name__} of length {len(data) if hasattr(data, '__len__') else '?'}",
            source=where, column="image", rule="png bytes")
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            if img.format != "PNG":
                raise ImageValidationError(
                    f"{where}: column 'image': rule 'png bytes' failed: format {img.format}",
                    source=where, column="image", rule="png bytes")
            img.load()  # decodes every byte: a truncated file fails here, not later
            got_size, got_mode = img.size, img.mode
            pixels = np.asarray(img, dtype=np.uint8).copy()
    except ImageValidationError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageValidationError(
            f"{where}: column 'image': rule 'readable png' failed: truncated or corrupt "
            f"({type(exc).__name__}: {exc})", source=where, column="image",
            rule="readable png") from None
    if tuple(got_size) != tuple(size):
        raise ImageValidationError(
            f"{where}: column 'image': rule 'image size' failed: {got_size[0]}x{got_size[1]}, "
            f"expected {size[0]}x{size[1]} (width x height)", source=where, column="image",
            rule="image size")
    if got_mode != mode:
        raise ImageValidationError(
            f"{where}: column 'image': rule 'image mode' failed: mode {got_mode}, expected "
            f"{mode}", source=where, column="image", rule="image mode")
    return pixels


def decode_all(images: Iterable[Any], ids: Iterable[str], *, size: tuple[int, int] | None,
               mode: str, source: str) -> list["np.ndarray"]:
    """Decode every image of a split up front, so one bad row stops the stage before compute.
    `size` None: every image must have the first one's size."""
    out: list["np.ndarray"] = []
    for data, row_id in zip(images, ids):
        where = f"{source}: row {row_id}"
        if size is None and not out:
            first = decode_image(data, size=_png_size(data, where), mode=mode, where=where)
            size = (first.shape[1], first.shape[0])
            out.append(first)
            continue
        out.append(decode_image(data, size=size, mode=mode, where=where))
    return out


def _png_size(data: Any, where: str) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            return img.size
    except Exception as exc:
        raise ImageValidationError(
            f"{where}: column 'image': rule 'readable png' failed ({type(exc).__name__}: {exc})",
            source=where, column="image", rule="readable png") from None
