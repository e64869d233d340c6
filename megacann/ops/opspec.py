"""One declared signature per op: :class:`OpSpec`, the check that an implementation fits it, and the
public function generated from it.

An op is declared once, as a stub whose signature and docstring are the op's contract (see
:mod:`megacann.ops.signatures`). Every implementation a device module registers is checked against that
signature when it registers, so a drifted parameter fails at import, not in a run on the one device
that uses it. The public function (``megacann.ops.rms_norm`` etc.) is generated from the signature, as
:mod:`dataclasses` generates ``__init__``: a plain function with the declared parameters and defaults
that resolves the implementation by the device type of its first argument and calls it with every
argument spelled out (positional parameters by position, keyword-only ones by keyword). Implementations
therefore never need the defaults, and may collect the keyword-only parameters they only hand on in
``**kwargs``. Generated code (not a ``*args`` wrapper) keeps the call cheap and traceable by
``torch.compile``.
"""

from __future__ import annotations

import inspect
import linecache
from dataclasses import dataclass
from typing import Any, Callable, Optional

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_EMPTY = inspect.Parameter.empty


@dataclass(frozen=True)
class OpSpec:
    """An op's name, declared signature and docstring. ``prepare`` (optional) checks and normalises the
    arguments before dispatch: it takes them as the implementations do and returns all of them, in
    declaration order. ``fp32_result``: the op returns fp32 whatever its inputs (a loss), so
    ``precision.fp32_ops`` never casts its result back."""

    name: str
    signature: inspect.Signature
    doc: str
    prepare: Optional[Callable[..., tuple]] = None
    fp32_result: bool = False

    @classmethod
    def from_stub(cls, stub: Callable, **options: Any) -> OpSpec:
        signature = inspect.signature(stub)
        params = list(signature.parameters.values())
        if not params or params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise TypeError(f"op {stub.__name__!r}: the first parameter must be the tensor that picks the device")
        odd = [p.name for p in params if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if odd:
            raise TypeError(f"op {stub.__name__!r}: declare plain or keyword-only parameters, not {odd}")
        return cls(stub.__name__, signature, inspect.cleandoc(stub.__doc__ or ""), **options)

    @property
    def positional(self) -> list[str]:
        return [p.name for p in self.signature.parameters.values() if p.kind in _POSITIONAL]

    @property
    def keyword_only(self) -> list[str]:
        return [p.name for p in self.signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]

    def call_text(self) -> str:
        """How the generated function passes the arguments on: ``x, weight, eps`` / ``q, k, v, causal=causal``."""
        return ", ".join(self.positional + [f"{k}={k}" for k in self.keyword_only])


def mismatches(spec: OpSpec, fn: Callable) -> list[str]:
    """What keeps ``fn`` from serving as an implementation of ``spec`` (empty: it fits). ``fn`` receives
    every declared argument, positional ones by position and keyword-only ones by keyword, so it must take
    the positional parameters under the same names in the same order, and each keyword-only parameter by
    name or through ``**kwargs``; extra keyword-only parameters need a default; a default it repeats must
    equal the declared one."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        return [f"its signature cannot be read ({err})"]
    problems = []
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        problems.append("it takes *args (name the declared positional parameters instead)")
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    if positional != spec.positional:
        problems.append(f"positional parameters ({', '.join(positional)}) differ from ({', '.join(spec.positional)})")
    declared = spec.signature.parameters
    keyword = {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}
    for name, param in keyword.items():
        if name not in spec.keyword_only and param.default is _EMPTY:
            problems.append(f"keyword-only parameter {name!r} is not declared and has no default")
    missing = [k for k in spec.keyword_only if k not in keyword]
    if missing and not any(p.kind is p.VAR_KEYWORD for p in params):
        problems.append(f"it does not take {', '.join(missing)} (name them or add **kwargs)")
    for param in params:
        want = declared.get(param.name)
        if want is not None and param.default is not _EMPTY and not _same(param.default, want.default):
            problems.append(f"default {param.name}={param.default!r}, declared {param.name}={want.default!r}")
    return problems


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a value whose == is not a bool (a tensor): different unless identical
        return False


def make_function(spec: OpSpec, resolve: Callable[[str, str], Callable], module: str) -> Callable:
    """The public function of ``spec``: the declared parameters and defaults; it runs ``spec.prepare``
    (if any), then ``resolve(name, <first argument>.device.type)`` with every argument passed on."""
    namespace: dict[str, Any] = {"_resolve": resolve, "_prepare": spec.prepare}
    params, saw_keyword_only = [], False
    for param in spec.signature.parameters.values():
        if param.kind is inspect.Parameter.KEYWORD_ONLY and not saw_keyword_only:
            params.append("*")
            saw_keyword_only = True
        text = param.name
        if param.default is not _EMPTY:
            namespace[f"_default_{param.name}"] = param.default
            text += f"=_default_{param.name}"
        params.append(text)
    call, first = spec.call_text(), spec.positional[0]
    lines = [f"def {spec.name}({', '.join(params)}):"]
    if spec.prepare is not None:
        lines.append(f"    {', '.join(spec.signature.parameters)}, = _prepare({call})")
    lines.append(f"    return _resolve({spec.name!r}, {first}.device.type)({call})")
    source = "\n".join(lines) + "\n"
    filename = f"<megacann.ops {spec.name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # readable tracebacks
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (generated from a declared signature)
    fn = namespace[spec.name]
    fn.__doc__ = spec.doc
    fn.__module__ = module
    fn.__signature__ = spec.signature
    fn.spec = spec
    return fn
