"""Thread count and build facts. The only Python module that talks to the OpenMP side."""
from __future__ import annotations

import operator
import os

from . import _ext

__all__ = ["get_num_threads", "set_num_threads", "show_config", "config"]

_user_threads: int | None = None  # set_num_threads() value; None = follow the environment


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 1, got bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return n


def _env_threads() -> int | None:
    raw = os.environ.get("ATTNFAST_NUM_THREADS")
    if raw is None or raw.strip() == "":
        return None
    try:
        return _positive_int(int(raw), "ATTNFAST_NUM_THREADS")
    except ValueError:
        raise ValueError(f"ATTNFAST_NUM_THREADS must be an integer >= 1, got {raw!r}") from None


def get_num_threads() -> int:
    """Threads a call uses when it is not given ``num_threads``.

    In order: the value of :func:`set_num_threads`; ``ATTNFAST_NUM_THREADS``; otherwise the
    OpenMP runtime's limit (``OMP_NUM_THREADS``, or what threadpoolctl set), 1 without OpenMP.
    """
    if _user_threads is not None:
        return _user_threads
    env = _env_threads()
    if env is not None:
        return env
    return max(1, _ext.openmp_threads())


def set_num_threads(n: int | None) -> None:
    """Set the default thread count for later calls (``None`` goes back to the environment)."""
    global _user_threads
    _user_threads = None if n is None else _positive_int(n, "n")


def resolve_threads(num_threads) -> int:
    """The thread count for one call: ``num_threads`` if given, else :func:`get_num_threads`."""
    if num_threads is None:
        return get_num_threads()
    return _positive_int(num_threads, "num_threads")


def config() -> dict:
    """Version, kernel tier and threading facts as a dict."""
    from . import __version__

    info = _ext.runtime_info()
    info["version"] = __version__
    info["num_threads"] = get_num_threads()
    return info


def show_config() -> dict:
    """Print (and return) the version, kernel tier chosen, threads and OpenMP runtime."""
    info = config()
    lines = [
        f"attnfast {info['version']}",
        f"  kernel tier (ISA): {info['isa']}  (available: {', '.join(info['isa_available'])};"
        f" built: {', '.join(info['isa_compiled'])})",
        f"  threads: {info['num_threads']}",
        f"  OpenMP: {info['openmp_runtime']}",
    ]
    if info["isa_error"]:
        lines.append(f"  note: {info['isa_error']}")
    print("\n".join(lines))
    return info


def _check_forced_isa() -> None:
    """At import: a tier forced through ATTNFAST_ISA that cannot run is an error."""
    err = _ext.runtime_info()["isa_error"]
    if err and os.environ.get("ATTNFAST_ISA"):
        raise RuntimeError(err)
