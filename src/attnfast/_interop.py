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
from ._ext import array_as_tensor, converting, register_torch, tensor_args, tensor_view

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
    A torch ``out=`` comes back as itself. The signature is unchanged (functools.wraps)."""
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    skip_self = names[:1] == ["self"]

    first = 1 if skip_self else 0
    out_index = names.index("out") if "out" in names else None

    def _out_arg(args):
        return args[out_index] if out_index is not None and out_index < len(args) else None

    def wrapper(*args, **kwargs):
        # One pass: NumPy arrays, None and plain options stay as they are (the common case
        # converts nothing and copies nothing); a plain dense CPU tensor becomes a NumPy view
        # in one C call (attnfast._ext.tensor_view); anything else goes through _convert,
        # which converts or raises naming the argument.
        given_out = converted_out = None
        common = tensor_args(args, first)   # positional arguments: the common case, in C
        if common is not None:
            new_args, template = common
            if template is not None and out_index is not None and out_index < len(args) \
                    and new_args[out_index] is not args[out_index]:
                given_out, converted_out = args[out_index], new_args[out_index]
        else:
            new_args, template = list(args), None
            for i in range(first, len(args)):
                a = args[i]
                if type(a) in _PLAIN:
                    continue
                new_args[i], t = _convert(a, names[i] if i < len(names) else f"argument {i}")
                if template is None:
                    template = t
                if i == out_index:
                    given_out, converted_out = a, new_args[i]
        for name, a in kwargs.items():
            if type(a) in _PLAIN:
                continue
            view = tensor_view(a)
            if view is not None:
                kwargs[name], t = view, a
            else:
                kwargs[name], t = _convert(a, name)
            if template is None:
                template = t
            if name == "out":
                given_out, converted_out = a, kwargs[name]
        result = fn(*new_args, **kwargs)
        if template is None:
            return result
        if given_out is None:   # a NumPy out= (not converted) comes back as itself too
            given_out = converted_out = kwargs.get("out", _out_arg(args))
        # `out=` comes back as the object the caller passed (tensor or array), written in place
        if type(result) is tuple:  # (out, lse): each converted once (out not at all if given)
            return tuple([given_out if given_out is not None and r is converted_out
                          else _as_tensor(r, template) for r in result])
        if isinstance(result, tuple):
            first_out = given_out if given_out is not None and result[0] is converted_out else None
            wrapped = wrap_like(result, template)
            return wrapped if first_out is None else (first_out,) + wrapped[1:]
        if given_out is not None and result is converted_out:
            return given_out
        tensor = array_as_tensor(result)  # wrap_like's common case, in C
        return tensor if tensor is not None else wrap_like(result, template)

    # NumPy arguments only (the common case): fn is called directly, in C
    return functools.update_wrapper(converting(fn, wrapper, first), fn)


def _as_tensor(result, template):
    """wrap_like(result, template), its common case (an array) in C."""
    tensor = array_as_tensor(result)
    return tensor if tensor is not None else wrap_like(result, template)


_SCALARS = frozenset((bool, int, float, str))  # types _convert passes through as is
_PLAIN = _SCALARS | {np.ndarray, type(None)}


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
