"""Torch tensors and other array objects in, the caller's type out: one thin layer.

Every public function is wrapped by :func:`accepts_arrays`. Before the function runs, each
argument that is a torch tensor (or another object with ``__dlpack__``) becomes a NumPy view
of the same memory (no copy; bfloat16 travels as int16 and is reinterpreted as
ml_dtypes.bfloat16). Other objects (NumPy arrays, lists, objects with ``__array__``) pass
through unchanged: argument checking stays in the checks (attnfast._attention_checks, ...).
When any argument was a torch tensor, NumPy results come back as torch tensors sharing their
memory (and ``out=`` given as a tensor comes back as that very tensor, written in place).

torch is never imported by attnfast itself: only when an argument's type comes from torch,
by which time the caller has imported it.
"""
from __future__ import annotations

import functools
import inspect
import sys

import ml_dtypes
import numpy as np

from ._written import read_only_copy
from ._ext import Converting, array_as_tensor, converting, register_torch, tensor_view

__all__ = ["accepts_arrays", "to_numpy", "wrap_like", "is_torch"]


_IS_TORCH: dict = {}
_TORCH_BFLOAT16 = [None]   # torch.bfloat16, once a tensor type has been seen


def is_torch(x) -> bool:
    """A torch.Tensor (or subclass), recognised without importing torch (cached per type)."""
    t = type(x)
    known = _IS_TORCH.get(t)
    if known is None:
        known = _IS_TORCH[t] = any(c.__module__.split(".", 1)[0] == "torch" and
                                   c.__name__ in ("Tensor", "Parameter") for c in t.__mro__)
        if known:
            torch = sys.modules["torch"]
            _TORCH_BFLOAT16[0] = torch.bfloat16
            # attnfast._ext.tensor_view / array_as_tensor convert through these
            register_torch(torch.Tensor, torch.strided, torch.from_numpy)
    return known


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _bfloat16():
    return _BFLOAT16


def to_numpy(x, name: str):
    """x as a NumPy array sharing its memory when x is a torch tensor or has ``__dlpack__``;
    anything else (ndarray, list, ``__array__`` objects, scalars, None) is returned as is.

    A torch tensor's array holds the tensor's storage, not the tensor (another thread's
    ``x.set_()`` cannot free what a call reads). A tensor whose values exist only as a copy
    (the negative or conjugate bit) becomes a read-only copy that says so
    (attnfast._written.read_only_copy): it can be read, and an argument that is written is
    refused by name (check_written) rather than written into the copy."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        view = tensor_view(x)  # a plain dense CPU tensor: one C call (else None)
        if view is not None:
            return view
        import torch
        # The common case first: x.numpy() itself refuses tensors on another device, sparse
        # tensors, conjugate or negative bits and dtypes NumPy lacks; the checks below then
        # say which it was. (Under no_grad it takes a tensor that requires grad: not here.)
        # (x.numpy()'s base is a tensor of its own sharing x's storage: it holds the storage.)
        if not x.requires_grad and x.dtype != torch.bfloat16:
            try:
                return x.numpy()
            except (TypeError, RuntimeError):
                pass
        if not x.is_cpu:  # (x.device.type costs five times as much)
            raise ValueError(f"{name} is a torch tensor on device {x.device}; attnfast computes "
                             f"on the CPU: pass {name}.cpu()")
        if x.requires_grad:
            raise ValueError(f"{name} requires grad; attnfast computes no gradients: pass "
                             f"{name}.detach() (or call under torch.no_grad())")
        if x.layout != torch.strided:  # sparse (COO, CSR, ...) included
            raise TypeError(f"{name} is a torch tensor with layout {x.layout}; attnfast needs a "
                            "strided (dense) tensor")
        copied = None
        if x.is_conj() or x.is_neg():  # values only a copy holds: read-only, saying so
            copied = ("a torch tensor with the conjugate bit set (as z.conj() gives)"
                      if x.is_conj() else
                      "a torch tensor with the negative bit set (as z.conj().imag gives)")
            x = x.resolve_conj().resolve_neg()
        if x.dtype == torch.bfloat16:
            array = x.view(torch.int16).numpy().view(_bfloat16())
        else:
            try:
                array = x.numpy()
            except TypeError as e:  # a dtype NumPy has no equivalent of
                raise TypeError(f"{name} has torch dtype {x.dtype}, which attnfast does not "
                                f"take ({e})") from None
        return array if copied is None else read_only_copy(array, copied)
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError) as e:
            raise TypeError(f"{name}: cannot import {type(x).__name__} through DLPack ({e}); "
                            "pass a CPU array") from None
    return x


def wrap_like(result, template):
    """Turn NumPy results into torch tensors sharing their memory when ``template`` (the
    first torch argument of the call) is a torch tensor; tuples element-wise."""
    if template is None:
        return result
    if isinstance(result, tuple):
        return tuple(wrap_like(r, template) for r in result)
    tensor = array_as_tensor(result)  # the common case, in C
    if tensor is not None:
        return tensor
    if not isinstance(result, np.ndarray):
        return result
    torch = sys.modules["torch"]  # imported: `template` is a tensor
    if result.dtype == _BFLOAT16:
        return torch.from_numpy(_writable(result.view(np.int16))).view(torch.bfloat16)
    return torch.from_numpy(_writable(result))


def _writable(a: np.ndarray) -> np.ndarray:
    # torch.from_numpy warns on read-only arrays; attnfast's results are fresh, so this copies
    # only in the unusual case of a read-only view.
    return a if a.flags.writeable else a.copy()


def accepts_arrays(fn):
    """Decorate a public function (or method): convert its arguments with :func:`to_numpy`
    (sequences too, for merge_attention_states), and its result with :func:`wrap_like`.
    A torch ``out=`` comes back as itself. The signature is unchanged (functools.wraps).
    The wrapper is attnfast._ext.converting (in C: plain dense CPU tensors become NumPy
    views in one C call each; NumPy arrays, None and plain options stay as they are)."""
    return functools.update_wrapper(converting(conversions(fn)), fn)


def conversions(fn) -> Converting:
    """accepts_arrays' conversions around `fn`, as attnfast._ext runs them (also within a
    transaction: attnfast._transaction.transaction(arrays=True))."""
    names = tuple(inspect.signature(fn).parameters)
    first = 1 if names[:1] == ("self",) else 0
    out_index = names.index("out") if "out" in names else -1
    return Converting(fn, names, first, out_index, _convert, wrap_like)


def _convert(a, name):
    """(converted argument, the first torch tensor in it or None)."""
    if is_torch(a):
        view = tensor_view(a)  # to_numpy's common case, inline (one call per tensor less)
        return (view if view is not None else to_numpy(a, name)), a
    if a is None or isinstance(a, (np.ndarray, bool, int, float, str)):
        return a, None
    if isinstance(a, (list, tuple)) and any(is_torch(x) or hasattr(x, "__dlpack__") for x in a):
        first = next((x for x in a if is_torch(x)), None)
        return type(a)(to_numpy(x, f"{name}[{i}]") for i, x in enumerate(a)), first
    return to_numpy(a, name), None
