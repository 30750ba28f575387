"""src/attnfast/__init__.pyi (shipped in the wheel with py.typed) matches the runtime API:
every public name, every parameter's name, kind and default, for functions and KVCache."""
import ast
import inspect
import os

import numpy as np
import pytest

import attnfast

STUB = os.path.join(os.path.dirname(attnfast.__file__), "__init__.pyi")
KINDS = {"posonly": inspect.Parameter.POSITIONAL_ONLY, "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "vararg": inspect.Parameter.VAR_POSITIONAL, "kwonly": inspect.Parameter.KEYWORD_ONLY,
         "kwarg": inspect.Parameter.VAR_KEYWORD}
NO_DEFAULT = object()
ANY_DEFAULT = object()  # `= ...` in the stub: some default, checked only for presence


def _stub_tree():
    with open(STUB, encoding="utf-8") as f:
        return ast.parse(f.read(), STUB)


def _default(node):
    if node is None:
        return NO_DEFAULT
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return ANY_DEFAULT
    return eval(compile(ast.Expression(node), STUB, "eval"), {"np": np})


def _stub_params(fn: ast.FunctionDef):
    """[(name, kind, default)] of a stub def, in order."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = "posonly" if i < len(a.posonlyargs) else "args"
        out.append((arg.arg, KINDS[kind], _default(d)))
    if a.vararg:
        out.append((a.vararg.arg, KINDS["vararg"], NO_DEFAULT))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, KINDS["kwonly"], _default(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, KINDS["kwarg"], NO_DEFAULT))
    return out


def _is_overload(fn: ast.FunctionDef) -> bool:
    return any(getattr(d, "id", getattr(d, "attr", None)) == "overload" for d in fn.decorator_list)


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(getattr(d, "id", None) == "property" for d in fn.decorator_list)


def _defs(body):
    """{name: [FunctionDef, ...]} (several for @overload)."""
    found = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            found.setdefault(node.name, []).append(node)
    return found


def _assert_matches(where, runtime, stub_defs, skip_self=False):
    params = list(inspect.signature(runtime).parameters.values())
    expected = [(p.name, p.kind, NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
                for p in params]
    if skip_self:
        expected = [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, NO_DEFAULT)] + expected
    overloaded = len(stub_defs) > 1 or _is_overload(stub_defs[0])
    for fn in stub_defs:
        got = _stub_params(fn)
        assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in expected], (
            f"{where} (stub line {fn.lineno}): parameters {[(n, k.name) for n, k, _ in got]} != "
            f"runtime {[(n, k.name) for n, k, _ in expected]}")
        for (name, _, sd), (_, _, rd) in zip(got, expected):
            if sd is ANY_DEFAULT:
                assert rd is not NO_DEFAULT, f"{where}: stub gives {name} a default, runtime has none"
            elif sd is NO_DEFAULT:
                # An overload may require an argument the implementation defaults (Literal[True]).
                assert overloaded or rd is NO_DEFAULT, f"{where}: runtime gives {name} a default, stub has none"
            else:
                assert rd is not NO_DEFAULT and (sd is rd or sd == rd), (
                    f"{where}: default of {name} is {rd!r} at runtime, {sd!r} in the stub")
    if overloaded:  # the last overload is the general one: it must carry the real defaults
        last = _stub_params(stub_defs[-1])
        assert all(sd is not ANY_DEFAULT for _, _, sd in last), f"{where}: last overload uses `...`"


TREE = _stub_tree()
MODULE_DEFS = _defs(TREE.body)
CLASSES = {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}
# isroutine: some entry points are Cython functions (attnfast._transaction), not FunctionType
FUNCTIONS = [name for name in attnfast.__all__ if inspect.isroutine(getattr(attnfast, name))]


def test_stub_is_shipped_with_py_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(STUB), "py.typed"))


def test_stub_names_match_all():
    stub_names = set(MODULE_DEFS) | set(CLASSES) | {
        t.id for n in TREE.body if isinstance(n, ast.AnnAssign) for t in [n.target]}
    public_stub = {n for n in stub_names if not n.startswith("_") or n in ("__version__", "__all__")}
    assert set(attnfast.__all__) | {"__all__"} == public_stub


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_signature(name):
    _assert_matches(name, getattr(attnfast, name), MODULE_DEFS[name])


@pytest.mark.parametrize("cls_name", ["KVCache", "PagedKVCache"])
def test_cache_class_members(cls_name):
    runtime_cls = getattr(attnfast, cls_name)
    defs = _defs(CLASSES[cls_name].body)
    runtime_public = {n for n in dir(runtime_cls) if not n.startswith("_")}
    assert set(n for n in defs if not n.startswith("_")) == runtime_public
    for name, fns in defs.items():
        member = inspect.getattr_static(runtime_cls, name)
        if isinstance(member, property):
            assert all(_is_property(fn) for fn in fns), f"{cls_name}.{name} is a property at runtime"
            continue
        assert not any(_is_property(fn) for fn in fns), f"{cls_name}.{name} is not a property at runtime"
        _assert_matches(f"{cls_name}.{name}", getattr(runtime_cls(1, 1, 1, 1), name), fns,
                        skip_self=True)
