"""Thread count and build facts. The only Python module that talks to the OpenMP side."""
from __future__ import annotations

import operator
import os
import warnings

from . import _ext

__all__ = ["get_num_threads", "set_num_threads", "show_config", "config"]

_user_threads: int | None = None  # set_num_threads() value; None = follow the environment
_env_note = ""  # why ATTNFAST_NUM_THREADS was ignored, for show_config()

# Processors this process may run on (affinity-aware, from the OpenMP runtime): no call
# starts more threads than this, whatever it is asked for. More threads than cores only
# slow compute-bound kernels down, and thousands of them can exhaust the OS's limit.
_PROCESSORS = max(1, _ext.processors())


def _positive_int(value, name: str) -> int:
    """An int >= 1 (any size: thread counts are clamped to the processors afterwards)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 1, got bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return n


def _clamp(n: int) -> int:
    return min(n, _PROCESSORS)


def _read_env_threads() -> int | None:
    """ATTNFAST_NUM_THREADS, read once at import. An invalid value is ignored with a
    warning (import and show_config() keep working, and say why)."""
    global _env_note
    raw = os.environ.get("ATTNFAST_NUM_THREADS")
    if raw is None or raw.strip() == "":
        return None
    try:
        return _clamp(_positive_int(int(raw.strip()), "ATTNFAST_NUM_THREADS"))
    except (TypeError, ValueError):
        _env_note = (f"ATTNFAST_NUM_THREADS={raw!r} ignored: it must be an integer >= 1; "
                     "using the OpenMP default")
        warnings.warn(_env_note, RuntimeWarning, stacklevel=3)
        return None


_env_threads = _read_env_threads()
_ext.set_default_threads(_env_threads)  # (the C tails resolve a call's threads: call_threads)


def get_num_threads() -> int:
    """Threads a call uses when it is not given ``num_threads``.

    In order: the value of :func:`set_num_threads`; ``ATTNFAST_NUM_THREADS``; otherwise the
    OpenMP runtime's limit (``OMP_NUM_THREADS``, or what threadpoolctl set), 1 without OpenMP.
    Never more than the processors this process may run on (a larger request is clamped).
    """
    return _ext.call_threads(None)


def set_num_threads(n: int | None) -> None:
    """Set the default thread count for later calls (``None`` goes back to the environment).

    ``n`` is an int >= 1; more than the processors this process may run on is clamped to
    that number (the kernels never start more threads than cores).
    """
    global _user_threads
    _user_threads = None if n is None else _clamp(_positive_int(n, "n"))
    _ext.set_default_threads(_user_threads if _user_threads is not None else _env_threads)


def resolve_threads(num_threads) -> int:
    """The thread count for one call: ``num_threads`` (an int >= 1, clamped to the
    processors) if given, else :func:`get_num_threads`."""
    if num_threads is None:
        return get_num_threads()
    return _clamp(_positive_int(num_threads, "num_threads"))


def config() -> dict:
    """Version, kernel tier and threading facts as a dict."""
    from . import __version__

    info = _ext.runtime_info()
    info["version"] = __version__
    info["num_threads"] = get_num_threads()
    info["processors"] = _PROCESSORS
    info["threads_note"] = _env_note
    return info


def show_config() -> dict:
    """Print (and return) the version, kernel tier chosen, threads, OpenMP runtime, and the
    instructions the 16-bit and int8 paths of that tier use."""
    info = config()
    lines = [
        f"attnfast {info['version']}",
        f"  kernel tier (ISA): {info['isa']}  (available: {', '.join(info['isa_available'])};"
        f" built: {', '.join(info['isa_compiled'])})",
        f"  threads: {info['num_threads']} (at most {info['processors']}: the processors "
        "this process may run on)",
        f"  OpenMP: {info['openmp_runtime']}",
        f"  16-bit / int8: {info['lowp_instructions']}",
    ]
    if info["threads_note"]:
        lines.append(f"  note: {info['threads_note']}")
    if info["isa_error"]:
        lines.append(f"  note: {info['isa_error']}")
    print("\n".join(lines))
    return info


def _check_forced_isa() -> None:
    """At import: a tier forced through ATTNFAST_ISA that cannot run is an error."""
    err = _ext.runtime_info()["isa_error"]
    if err and os.environ.get("ATTNFAST_ISA"):
        raise RuntimeError(err)
