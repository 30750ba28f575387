"""Command-line values shared by ``attnfast bench`` and bench/compare_peers.py."""
from __future__ import annotations

import argparse

import numpy as np

from .._formats import FORMATS

__all__ = ["KV_DTYPES", "parse_int_list", "parse_heads", "parse_dtype", "parse_dtypes"]

KV_DTYPES = tuple(FORMATS)  # every KV-cache storage format (attnfast._formats)
# KV-cache-only storage formats (queries and new tokens are float32 for them)
CACHE_ONLY_DTYPES = tuple(name for name, fmt in FORMATS.items() if fmt.quantized)


class CacheFormat(str):
    """A KV-cache format that is not a NumPy dtype ("int4"), standing where the bench code
    passes dtypes: ``KVCache(dtype=...)`` takes it as its name, and ``.name`` is that name."""

    @property
    def name(self) -> str:
        return str(self)


def parse_int_list(text: str, name: str) -> list[int]:
    """A comma list of positive integers with an optional k suffix (k = 1024).

    Examples
    --------
    >>> parse_int_list("1k,4k,16384", "--decode-L")
    [1024, 4096, 16384]
    """
    values = []
    for raw in str(text).split(","):
        item = raw.strip().lower()
        if not item:
            continue
        mult = 1
        if item.endswith("k"):
            mult, item = 1024, item[:-1]
        try:
            value = int(item) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {raw!r} is not an integer (1k = 1024)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}: values must be >= 1, got {value}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"{name}: give at least one value")
    return values


def parse_heads(text: str) -> tuple[int, int]:
    """Query and KV heads from ``H/Hkv`` (``32/8`` -> (32, 8)) or ``H`` (``8`` -> (8, 8))."""
    try:
        if "/" in text:
            h, hkv = (int(p) for p in text.split("/"))
        else:
            h = hkv = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads: expected H or H/Hkv like 32/8, got {text!r}") from None
    if h < 1 or hkv < 1 or h % hkv:
        raise argparse.ArgumentTypeError(f"heads: need H % Hkv == 0 and both >= 1, got {text!r}")
    return h, hkv


def parse_dtype(text: str) -> "np.dtype | CacheFormat":
    """A NumPy dtype from its name: a KV format's storage dtype (attnfast._formats: bfloat16
    and float8 are ml_dtypes'), a packed format's name (``int4``) a CacheFormat."""
    fmt = FORMATS.get(text)
    if fmt is not None:
        return CacheFormat(fmt.name) if fmt.packed else fmt.storage
    try:
        return np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"dtype: unknown {text!r}") from None


def parse_dtypes(text: str, allowed=KV_DTYPES) -> list[np.dtype]:
    """A comma list of dtype names from ``allowed``, in the order given, without repeats."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part not in allowed:
            raise argparse.ArgumentTypeError(f"dtype: unknown {part!r}; choose from "
                                             f"{', '.join(allowed)}")
        dt = parse_dtype(part)
        if dt not in out:
            out.append(dt)
    if not out:
        raise argparse.ArgumentTypeError("dtype: empty list")
    return out
