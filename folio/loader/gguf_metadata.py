"""Reading a GGUF file's metadata: opening it with one clear error for any damage, and typed field access."""

from __future__ import annotations

import os
from typing import Any

from gguf import GGUFReader


def check_exists(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")


def open_gguf(path: str) -> GGUFReader:
    """A reader over the file, turning the many ways GGUFReader fails on bad input into one clear error."""
    check_exists(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError, IndexError, KeyError... on damaged files
        raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt): {type(e).__name__}: {e}") from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > os.path.getsize(path):
        raise ValueError(f"{path} is truncated or corrupt: its tensors need {end} bytes, the file has fewer")
    return reader


def get_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def need_field(reader: GGUFReader, key: str) -> Any:
    value = get_field(reader, key)
    if value is None:
        raise ValueError(f"the GGUF file's metadata has no {key!r}")
    return value
