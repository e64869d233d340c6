"""Dense single-process references for the layer tests, written with plain torch ops on full weights,
plus helpers that reassemble full weights and gradients from the TP shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacann import parallel_state as ps
from megacann.layers.sharding import get_sharding, unshard_tensors


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-2) -> float:
    """||a - e|| / max(||e||, floor). The floor makes gradients that are zero in exact arithmetic (a key
    bias: softmax ignores a shift of a whole row of scores) compare by absolute error instead of noise."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return (actual - expected).norm().item() / max(expected.norm().item(), floor)


def _gather_tp(t: torch.Tensor) -> list[torch.Tensor]:
    group = ps.get_tensor_model_parallel_group()
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def full_param(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a TP-sharded parameter, cut to its logical size (vocabulary padding dropped)."""
    sharding = get_sharding(p)
    full = unshard_tensors(_gather_tp(p.detach()), sharding) if sharding.tp_dim is not None else p.detach().clone()
    if sharding.logical_size is not None:
        full = full.narrow(sharding.tp_dim, 0, sharding.logical_size)
    return full


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The whole gradient: shards reassembled, partial gradients summed over TP."""
    sharding = get_sharding(p)
    grad = p.grad.detach().clone()
    if sharding.tp_partial_grad and ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    if sharding.tp_dim is not None:
        grad = unshard_tensors(_gather_tp(grad), sharding)
        if sharding.logical_size is not None:
            grad = grad.narrow(sharding.tp_dim, 0, sharding.logical_size)
    return grad


def parameter_errors(layer: torch.nn.Module, one: torch.nn.Module) -> dict[str, float]:
    """Per parameter of a TP ``layer`` against the one-process ``one`` (same names): ``init.<name>`` 1 unless
    the whole tensors are equal, ``grad.<name>`` the gradients' relative error (1 where only one of them has
    a gradient, 0 where neither has)."""
    theirs, errs = dict(one.named_parameters()), {}
    for name, param in layer.named_parameters():
        errs[f"init.{name}"] = float(not torch.equal(full_param(param), theirs[name].detach()))
        if theirs[name].grad is None or param.grad is None:
            errs[f"grad.{name}"] = float((theirs[name].grad is None) != (param.grad is None))
        else:
            errs[f"grad.{name}"] = rel_err(full_grad(param), theirs[name].grad)
    return errs


def gather_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(_gather_tp(t.detach()), dim=dim)


def split_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return t.chunk(world, dim=dim)[rank]


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_param(p) for name, p in module.named_parameters()}


def full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_grad(p) for name, p in module.named_parameters()}


# -- dense references ----------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def dense_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face LLaMA's rotation, on [b, heads, s, d] with cos/sin [b, s, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def dense_attention(x, w, heads, kv_heads, head_dim, cos=None, sin=None, segment_ids=None, prefix="") -> torch.Tensor:
    """Causal GQA attention with full weights ``w`` (q/k/v/o or fused qkv)."""
    b, s, _ = x.shape
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if prefix + "qkv_proj.weight" in w:
        wq, wk, wv = w[prefix + "qkv_proj.weight"].split(sizes)
        bias = w.get(prefix + "qkv_proj.bias")
        bq, bk, bv = bias.split(sizes) if bias is not None else (None, None, None)
    else:
        wq, wk, wv = (w[prefix + f"{n}_proj.weight"] for n in "qkv")
        bq, bk, bv = (w.get(prefix + f"{n}_proj.bias") for n in "qkv")
    q = F.linear(x, wq, bq).view(b, s, heads, head_dim).transpose(1, 2)
    k = F.linear(x, wk, bk).view(b, s, kv_heads, head_dim).transpose(1, 2)
    v = F.linear(x, wv, bv).view(b, s, kv_heads, head_dim).transpose(1, 2)
    if cos is not None:
        q, k = dense_rope(q, cos, sin), dense_rope(k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / head_dim**0.5
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, heads * head_dim)
    return F.linear(out, w[prefix + "o_proj.weight"], w.get(prefix + "o_proj.bias"))


def dense_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def dense_norm(x, w, name, eps, kind):
    if kind == "rmsnorm":
        return dense_rmsnorm(x, w[name + ".weight"], eps)
    return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w.get(name + ".bias"), eps)


def dense_mlp(x, w, activation, prefix="mlp.") -> torch.Tensor:
    if activation == "swiglu":
        if prefix + "gate_up_proj.weight" in w:
            gate_w, up_w = w[prefix + "gate_up_proj.weight"].chunk(2, dim=0)
        else:
            gate_w, up_w = w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]
        hidden = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)
    else:
        approx = "tanh" if activation == "gelu_tanh" else "none"
        hidden = F.gelu(F.linear(x, w[prefix + "up_proj.weight"], w.get(prefix + "up_proj.bias")), approximate=approx)
    return F.linear(hidden, w[prefix + "down_proj.weight"], w.get(prefix + "down_proj.bias"))


def dense_block(x, w, cfg, cos=None, sin=None, segment_ids=None) -> torch.Tensor:
    """Pre-norm residual block (no dropout) from full weights, mirroring TransformerBlockConfig ``cfg``."""
    d = cfg.attention_head_dim
    h = x + dense_attention(
        dense_norm(x, w, "input_layernorm", cfg.norm_eps, cfg.normalization),
        w,
        cfg.num_attention_heads,
        cfg.kv_heads,
        d,
        cos,
        sin,
        segment_ids,
        prefix="self_attn.",
    )
    return h + dense_mlp(
        dense_norm(h, w, "post_attention_layernorm", cfg.norm_eps, cfg.normalization), w, cfg.activation
    )
