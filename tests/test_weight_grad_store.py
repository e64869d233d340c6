"""Deferred weight gradients (megacann.ops.weight_grad) in one process: B computes the input gradient only and
leaves closures, W runs them and accumulates as a fused backward does (into existing .grad, through views,
post-accumulate hooks once per parameter), checkpointed layers recompute in B only (extended: the first
non-reentrant checkpoint of a process imports torch._dynamo, seconds), and without a split nothing is
deferred."""

import pytest
import torch
import torch.nn.functional as F

from megacann.ops import weight_grad
from megacann.pipeline.split_backward import backward_input, backward_weight


def _model(seed: int = 0, deferrable: bool = True):
    """The parameters, marked deferrable (as a split backward's chunks are) unless ``deferrable`` is False."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.nn.Parameter(torch.randn(12, 8, generator=g))
    b1 = torch.nn.Parameter(torch.randn(12, generator=g))
    w2 = torch.nn.Parameter(torch.randn(8, 6, generator=g))
    norm = torch.nn.Parameter(torch.rand(8, generator=g) + 0.5)
    table = torch.nn.Parameter(torch.randn(20, 8, generator=g))
    params = [w1, b1, w2, norm, table]
    for p in params if deferrable else ():
        weight_grad.mark_deferrable(p)
    return params


def _forward(params, x, ids, counter=None, checkpointed: bool = False):
    w1, b1, w2, norm, table = params

    def block(h):
        if counter is not None:
            counter.append(1)
        h = weight_grad.linear(h, w1, b1)  # [.., 12]
        h = torch.tanh(h[..., :6]) * h[..., 6:]
        h = weight_grad.linear(h, w2, None)  # w2 [8, 6]
        h = weight_grad.linear(h[..., :6], w2[:4], None)  # a view of the same weight, used twice
        return h

    h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    h = h * norm[:4] + weight_grad.embedding(ids, table)[..., :4]
    return (h.float() ** 2).sum()


def _grads(params):
    out = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return out


def _b_then_w(checkpointed: bool):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 5, 8, generator=g)
    ids = torch.randint(0, 20, (2, 5), generator=g)
    params, unmarked = _model(), _model(deferrable=False)

    x = x0.clone().requires_grad_()
    _forward(unmarked, x, ids, checkpointed=checkpointed).backward()
    plain, plain_dx = _grads(unmarked), x.grad

    x = x0.clone().requires_grad_()
    _forward(params, x, ids, checkpointed=checkpointed).backward()
    fused, fused_dx = _grads(params), x.grad

    hooks = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hooks.append(i))
    before = weight_grad.weight_grad_stats()
    calls: list = []
    x = x0.clone().requires_grad_()
    loss = _forward(params, x, ids, counter=calls, checkpointed=checkpointed)
    (dx,) = backward_input([loss], [None], [x])
    assert all(p.grad is None for p in params) and not hooks and x.grad is None  # B leaves the weights alone
    recomputes = 1 if checkpointed else 0
    assert len(calls) == 1 + recomputes  # a checkpointed block ran forward, then recomputed once in B
    mid = weight_grad.weight_grad_stats()
    assert mid["deferred"] - before["deferred"] == 4 and mid["run"] == before["run"]  # 3 linears + embedding
    backward_weight([loss], [None], params)
    assert len(calls) == 1 + recomputes  # W recomputes nothing
    assert weight_grad.weight_grad_stats()["run"] - mid["run"] == 4
    assert sorted(hooks) == [0, 1, 2, 3, 4]  # every parameter once, w2 used twice included
    split = _grads(params)

    assert torch.equal(dx, fused_dx)
    for f, s in zip(fused, split):
        assert torch.equal(f, s)
    # the deferrable products against plain F.linear / F.embedding (torch.allclose: assert_close imports sympy)
    assert torch.allclose(fused_dx, plain_dx, rtol=1e-6, atol=1e-6)
    for f, p in zip(fused, plain):
        assert torch.allclose(f, p, rtol=1e-6, atol=1e-6)


def test_b_then_w_equals_the_fused_backward_and_plain_autograd():
    _b_then_w(checkpointed=False)


@pytest.mark.extended
def test_b_then_w_under_activation_checkpointing_recomputes_in_b_only():
    _b_then_w(checkpointed=True)


def test_w_accumulates_into_existing_gradients_and_defers_nothing_outside_b():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(3, 8, generator=g)
    ids = torch.randint(0, 20, (3,), generator=g)
    params = _model(3)
    x = x0.clone().requires_grad_()
    before = weight_grad.weight_grad_stats()
    _forward(params, x, ids).backward()
    assert weight_grad.weight_grad_stats() == before  # a fused backward defers nothing
    x = x0.clone().requires_grad_()
    _forward(params, x, ids).backward()
    twice = _grads(params)

    x = x0.clone().requires_grad_()
    _forward(params, x, ids).backward()
    x = x0.clone().requires_grad_()
    loss = _forward(params, x, ids)
    backward_input([loss], [None], [x])
    backward_weight([loss], [None], params)
    for a, b in zip(twice, _grads(params)):
        assert torch.equal(a, b)


def _product_kind(y: torch.Tensor) -> str:
    return "deferrable" if "Deferrable" in type(y.grad_fn).__name__ else "plain"


def test_the_weight_decides_the_product():
    """Marked weights (and views or layouts of them) build deferrable products; unmarked or frozen ones, ones
    computed otherwise, or any weight without autograd, the plain F.linear, which B leaves nothing of."""
    x = torch.randn(4, 8, requires_grad=True)
    trained, frozen = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    assert _product_kind(weight_grad.linear(x, trained)) == "plain"  # not marked
    weight_grad.mark_deferrable(trained)
    weight_grad.mark_deferrable(frozen)
    laid_out = torch.cat([trained[:1], trained.new_zeros(2, 8)]).float()  # as LoRA's B is: rows, zeros, a cast
    scaled = trained * torch.rand(3, 8)  # MulBackward saves the factor, which B frees: W could not run
    kinds = [_product_kind(weight_grad.linear(x, w)) for w in (trained, trained[:2], laid_out, scaled, frozen)]
    assert kinds == ["deferrable", "deferrable", "deferrable", "plain", "plain"]
    with torch.no_grad():
        assert weight_grad.linear(x, trained).grad_fn is None
    y = weight_grad.linear(x, frozen, None)
    store = weight_grad.WeightGradStore()
    with weight_grad.collecting(store):
        (dx,) = torch.autograd.grad(y.sum(), [x])
    assert len(store) == 0
    assert torch.equal(dx, F.linear(torch.ones(4, 3), frozen.t()))


def test_prepared_chunks_mark_their_trainable_weights_at_each_forward():
    """A chunk prepared for a split backward builds deferrable products (an adapter attached after the call
    included, a frozen weight excepted); an unprepared one, built alike, plain ones."""
    from megacann.layers import ColumnParallelLinear
    from megacann.pipeline.split_backward import prepare_split_backward

    prepared, plain = ColumnParallelLinear(8, 4, bias=False), ColumnParallelLinear(8, 4, bias=False)
    prepare_split_backward([prepared, prepared])  # twice: one hook
    seen: list = []

    class Adapter(torch.nn.Module):  # attached after preparing; the layer calls adapter(x, rows)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))

        def forward(self, x, rows):
            seen.append(_product_kind(weight_grad.linear(x, self.weight)))

    prepared.adapter = Adapter()
    x = torch.randn(2, 8, requires_grad=True)
    assert [_product_kind(prepared(x)), seen, _product_kind(plain(x))] == ["deferrable", ["deferrable"], "plain"]
    assert len(prepared._forward_pre_hooks) == 1


def test_build_model_chunks_prepares_the_chunks_of_a_splitting_schedule_only():
    from megacann.config import MegacannConfig
    from megacann.pipeline import build_model_chunks

    for schedule, defer in (("zb1p", True), ("1f1b", False), (None, False)):
        cfg = MegacannConfig()
        cfg.model.precision, cfg.distributed.pipeline_schedule = "fp32", schedule
        cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size = 1, 16, 32
        cfg.model.num_attention_heads, cfg.model.vocab_size = 2, 64
        (chunk,) = build_model_chunks(cfg, device="cpu")
        o_proj = next(m for name, m in chunk.named_modules() if name.endswith("o_proj"))
        seen: list = []
        o_proj.register_forward_hook(lambda module, args, out, seen=seen: seen.append(_product_kind(out)))
        chunk(torch.randint(0, 64, (1, 4)))
        assert seen == ["deferrable" if defer else "plain"], schedule


def _split_equals_fused(loss_fn, params, inputs, closures: int) -> None:
    """B (to ``inputs``) then W gives every gradient the fused backward gives, bit for bit; B computed none of
    the weights' and deferred ``closures`` closures."""
    loss_fn(params, inputs).backward()
    fused, fused_inputs = _grads(params), [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    before = weight_grad.weight_grad_stats()
    out = loss_fn(params, inputs)
    (grad_inputs,) = [backward_input([out], [None], inputs)]
    assert all(p.grad is None for p in params)  # B left the weights alone
    backward_weight([out], [None], params)
    after = weight_grad.weight_grad_stats()
    assert after["deferred"] - before["deferred"] == after["run"] - before["run"] == closures
    assert all(torch.equal(a, b) for a, b in zip(_grads(params), fused))
    assert all(torch.equal(a, b) for a, b in zip(grad_inputs, fused_inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_defers_its_weight_gradient(dtype):
    """The fused head loss in B computes the hidden states' gradient only; W recomputes the logits chunk by
    chunk for the weight's (vocabulary padding, ignored targets and several chunks included)."""
    from megacann.ops.head_loss import head_loss

    g = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g).to(dtype))  # 24 padded rows, 21 real
    hidden = torch.randn(2, 7, 16, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, 21, (2, 7), generator=g)
    target[0, 2] = -100

    def loss_fn(params, inputs):
        return head_loss(inputs[0] * 1.0, params[0], target, vocab_size=21, chunk_size=5).sum()

    _split_equals_fused(loss_fn, [weight], [hidden], closures=1)

    # a weight freed before W (ZeRO-3 marks the weights it gathers and frees): its gradient comes with B
    weight_grad.mark_released_after_backward(weight)
    _split_equals_fused(loss_fn, [weight], [hidden], closures=0)


def _experts_split_equal_fused(grouped_matmul, seed: int):
    """Three experts (one with no tokens) through ``grouped_matmul(x, weights, sizes)``: the split backward
    equals the fused one (one deferred closure); returns (experts, x, loss_fn) as that check left them."""
    g = torch.Generator().manual_seed(seed)
    experts = [torch.nn.Parameter(torch.randn(8, 16, generator=g)) for _ in range(3)]
    x = torch.randn(10, 16, generator=g).requires_grad_()
    sizes = [4, 0, 6]

    def loss_fn(params, inputs):
        return (grouped_matmul(inputs[0] * 1.0, list(params), sizes) ** 2).sum()

    _split_equals_fused(loss_fn, experts, [x], closures=1)
    return experts, x, loss_fn


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this torch")
def test_grouped_mm_experts_defer_their_weight_gradients():
    """torch._grouped_mm's experts (CUDA's grouped matmul; on CPU when pinned): B the tokens' gradient, W
    the experts', equal to the fused backward and to autograd's own _grouped_mm backward, bit for bit."""
    from megacann.ops.moe import _grouped_matmul_torch

    experts, x, loss_fn = _experts_split_equal_fused(_grouped_matmul_torch, seed=4)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    y = torch._grouped_mm(x, torch.stack(experts).transpose(1, 2), offs=offsets)
    autograd = torch.autograd.grad((y**2).sum(), [x, *experts])
    (loss_fn(experts, [x])).backward()
    assert torch.equal(x.grad, autograd[0]) and all(torch.equal(e.grad, a) for e, a in zip(experts, autograd[1:]))


@pytest.mark.parametrize("name", ["gather", "cpp"])
def test_grouped_matmul_experts_defer_their_weight_gradients(name):
    """The CPU grouped matmuls (``gather``: a torch.mm per expert; ``cpp``: the experts' products in one C++
    call): B the tokens' gradient, W the experts', equal to the fused backward bit for bit."""
    from megacann.ops import cpp, moe_gather

    if name == "cpp" and not cpp.available():
        pytest.skip("the C++ kernels are not built")
    impl = cpp.grouped_matmul if name == "cpp" else moe_gather._grouped_matmul_gather
    _experts_split_equal_fused(impl, seed=5)
