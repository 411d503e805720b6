"""A few metadata values of a GGUF file, read from its header without converting the model.

Converting a GGUF through transformers takes 30-90 s here, mostly building its tokenizer, and
``gguf.GGUFReader`` parses every field and tensor entry (5 s for SmolLM2-135M, 20 s for Gemma 3
270M). Checking that a draft's vocabulary fits the target's needs only the length of its token list,
which this module reads from the header in milliseconds: it stops at that key.

The layout (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, a uint32 version, uint64
counts of tensors and of key-value pairs, then the pairs: a string key, a uint32 value type and
the value. A string is a uint64 byte count and the bytes; an array is a uint32 element type, a
uint64 count and the elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

TOKENS_KEY = "tokenizer.ggml.tokens"

_STRING, _ARRAY = 8, 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Byte width of each fixed-size value type (uint8 .. float32, bool, uint64, int64, float64)."""


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


def _read(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFFormatError("the file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _skip_string(f: BinaryIO) -> None:
    f.seek(_read(f, "<Q"), 1)


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        _skip_string(f)
    elif kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        elif item == _STRING:
            for _ in range(count):
                _skip_string(f)
        else:
            raise GGUFFormatError(f"an array of value type {item}")
    else:
        raise GGUFFormatError(f"unknown value type {kind}")


def array_length(path: str | Path, key: str) -> int | None:
    """The number of elements of the array ``key`` in the GGUF file's metadata, or None when the
    file has no such key (or it is not an array). Raises :class:`GGUFFormatError` (or ``OSError``)
    when the file cannot be read as GGUF."""
    with open(path, "rb") as f:
        if _seek(f, key) != _ARRAY:
            return None
        _read(f, "<I")  # element type
        return _read(f, "<Q")


def string_value(path: str | Path, key: str) -> str | None:
    """The string ``key`` in the GGUF file's metadata (``general.architecture``: ``llama``), or None
    when the file has no such string or cannot be read as GGUF."""
    try:
        with open(path, "rb") as f:
            if _seek(f, key) != _STRING:
                return None
            return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")
    except (GGUFFormatError, OSError):
        return None


def _seek(f: BinaryIO, key: str) -> int | None:
    """Move ``f`` (a GGUF file from its start) to the value of the metadata ``key`` and return its
    value type; None, wherever the file then stands, when it has no such key."""
    if f.read(4) != b"GGUF":
        raise GGUFFormatError(f"{getattr(f, 'name', 'the file')} is not a GGUF file")
    version = _read(f, "<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
    _read(f, "<Q")  # tensors
    for _ in range(_read(f, "<Q")):
        name = f.read(_read(f, "<Q")).decode("utf-8", errors="replace")
        kind = _read(f, "<I")
        if name == key:
            return kind
        _skip_value(f, kind)
    return None


def vocab_size(path: str | Path) -> int | None:
    """Tokens in the GGUF file's tokenizer (``tokenizer.ggml.tokens``), or None when it has no
    token list or cannot be read as GGUF."""
    try:
        return array_length(path, TOKENS_KEY)
    except (GGUFFormatError, OSError):
        return None
