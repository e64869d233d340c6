"""One declared signature per op: implementations that do not fit it are refused when they register, and
the public functions are generated from it (same parameters, defaults and docstring)."""

from __future__ import annotations

import inspect

import pytest
import torch

from megacann import ops
from megacann.ops import opspec, reference, registry, signatures

DECLARED = (
    "adamw_step_",
    "apply_rotary",
    "attention_block",
    "attention_block_backward",
    "cross_entropy",
    "decode_attention",
    "fp8_linear",
    "gated_delta_rule",
    "grouped_matmul",
    "linear",
    "moe_permute",
    "moe_unpermute",
    "rms_norm",
    "scaled_dot_product_attention",
    "swiglu",
    "vocab_parallel_head_loss",
)


@pytest.fixture
def demo():
    """A declared op ``demo(x, scale=2.0, *, bias=0.0, label="d")`` with a reference implementation."""

    def demo(x: torch.Tensor, scale: float = 2.0, *, bias: float = 0.0, label: str = "d") -> torch.Tensor:
        """Scale and shift ``x``."""

    public = registry.declare(demo)
    registry.register("demo", "reference")(lambda x, scale, *, bias, label: x * scale + bias)
    yield public
    registry._SPECS.pop("demo", None)
    registry._IMPLS.pop("demo", None)
    registry._CACHE.clear()


def test_every_op_is_declared_once_and_public():
    assert ops.ops() == sorted(DECLARED)
    for name in DECLARED:
        public = getattr(ops, name)
        assert public is getattr(signatures, name) and public.spec is registry._SPECS[name]
        assert inspect.signature(public) == public.spec.signature and public.__doc__ == public.spec.doc
        assert public.__doc__, name
        for impl in registry._IMPLS[name].values():  # all fitted at import; the check still says so
            assert opspec.mismatches(public.spec, impl.fn) == [], (name, impl.name)


@pytest.mark.parametrize(
    "impl, problem",
    [
        (lambda x, factor, *, bias, label: x, r"positional parameters \(x, factor\) differ from \(x, scale\)"),
        (lambda x, *, bias, label: x, r"positional parameters \(x\) differ"),
        (lambda x, scale, *, bias: x, "it does not take label"),
        (lambda x, scale, *, bias, label, extra: x, "'extra' is not declared and has no default"),
        (lambda x, scale=3.0, *, bias, label: x, "default scale=3.0, declared scale=2.0"),
        (lambda *args, **kwargs: None, r"it takes \*args"),
    ],
)
def test_an_implementation_that_does_not_fit_is_refused_at_registration(demo, impl, problem):
    with pytest.raises(TypeError, match=r"implementation 'bad' of op 'demo' does not fit .*" + problem):
        registry.register("demo", "bad", priority=5)(impl)
    assert registry.implementations("demo") == ["reference"]  # nothing registered


def test_what_fits(demo):
    registry.register("demo", "kwargs", priority=1)(lambda x, scale, **options: x * scale + options["bias"])
    registry.register("demo", "extra", priority=2)(lambda x, scale=2.0, *, bias, label, chunk=4: x * scale + bias)
    assert registry.implementations("demo") == ["extra", "kwargs", "reference"]


def test_undeclared_ops_and_double_declarations_are_refused(demo):
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        registry.register("nope", "reference")(lambda x: x)

    def rms_norm(x, weight, eps):
        """Again."""

    with pytest.raises(ValueError, match="op 'rms_norm' is declared twice"):
        registry.declare(rms_norm)


def test_the_public_function_passes_every_argument_with_the_declared_defaults(demo):
    seen = []
    registry.register("demo", "spy", priority=9, device_types=("cpu",))(
        lambda x, scale, *, bias, label: seen.append((scale, bias, label)) or x
    )
    x = torch.ones(2)
    demo(x)
    demo(x, 3.0, label="e")
    demo(x=x, scale=4.0, bias=1.0)
    assert seen == [(2.0, 0.0, "d"), (3.0, 0.0, "e"), (4.0, 1.0, "d")]
    with pytest.raises(TypeError):
        demo(x, 1.0, 2.0)  # bias is keyword-only, as declared
    assert demo.__name__ == "demo" and demo.__doc__ == "Scale and shift ``x``."


def test_the_public_functions_dispatch_and_prepare():
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    assert torch.equal(ops.rms_norm(x, w, 1e-6), registry.resolve("rms_norm", "cpu")(x, w, 1e-6))
    assert torch.equal(ops.swiglu(x), reference.swiglu(x)) or ops.selected("swiglu", "cpu") != "reference"
    with pytest.raises(ValueError, match="2 weights but 1 group sizes"):
        ops.grouped_matmul(x, [torch.randn(4, 8)] * 2, [3])
    with pytest.raises(ValueError, match="group sizes add up to 2, x has 3 rows"):
        ops.grouped_matmul(x, [torch.randn(4, 8)], [2])
    out = ops.grouped_matmul(x, (torch.randn(4, 8), torch.randn(4, 8)), torch.tensor([1, 2]))  # normalised
    assert out.shape == (3, 4)
