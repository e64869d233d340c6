"""DeepSeek-V4's attention block (:class:`CompressedSparseAttention`) against transformers'
``DeepseekV4Attention`` with the same weights, for its three layer types (outputs, input and parameter
gradients, fp32, relative error of the whole tensor), over a sequence longer than the sliding window and
than several compression windows; under tensor parallelism 2 (with and without sequence parallelism) equal
to one process; refusals (ring context parallelism among them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import parameter_errors, rel_err
from test_planner import SavedTensorTracker

from megacann import parallel_state as ps
from megacann.layers import CompressedSparseAttention

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, ROPE_DIM, Q_RANK, GROUPS, O_RANK, WINDOW = 16, 4, 8, 4, 12, 2, 6, 5
RATES = {"compressed_sparse_attention": 3, "heavily_compressed_attention": 4}
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4, "beta_slow": 1}
SEQ, TOL = 19, 1e-5  # 19 tokens: past the window of 5, six CSA windows and four HCA ones, tokens left over


def _config() -> transformers.DeepseekV4Config:
    config = transformers.DeepseekV4Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, qk_rope_head_dim=ROPE_DIM,
        q_lora_rank=Q_RANK, o_groups=GROUPS, o_lora_rank=O_RANK, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=LAYER_TYPES, compress_rates=RATES, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters=dict(YARN), index_n_heads=2, index_head_dim=8, index_topk=2, rms_norm_eps=1e-6,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def _ours(config: transformers.DeepseekV4Config, layer_type: str, **kwargs) -> CompressedSparseAttention:
    """The block built from the config's keys, as the DeepSeek-V4 family builds it."""
    return CompressedSparseAttention(
        config.hidden_size, config.num_attention_heads, config.head_dim, layer_type=layer_type,
        q_lora_rank=config.q_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim, o_groups=config.o_groups,
        o_lora_rank=config.o_lora_rank, sliding_window=config.sliding_window,
        rope_theta=config.rope_parameters["main"]["rope_theta"],
        compress_rope_theta=config.rope_parameters["compress"]["rope_theta"],
        rope_scaling=config.rope_parameters["compress"], compress_rate=config.compress_rates.get(layer_type),
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        norm_eps=config.rms_norm_eps, **kwargs,
    )  # fmt: skip


def _reference_forward(reference: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4Attention`` run as ``DeepseekV4Model`` runs it: both rotaries' tables, and the sliding
    window's additive causal mask (every query sees its last ``sliding_window`` tokens)."""
    b, s, _ = x.shape
    position_ids = torch.arange(s).expand(b, s)
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    tables = {kind: rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    query, key = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    allowed = (key <= query) & (key > query - config.sliding_window)
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf")).expand(b, 1, s, s)
    return reference(x, tables, position_ids, mask)[0]


def _pair(layer_type: str) -> tuple[torch.nn.Module, CompressedSparseAttention, transformers.DeepseekV4Config]:
    config = _config()
    reference = hf.DeepseekV4Attention(config, LAYER_TYPES.index(layer_type)).float()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    ours = _ours(config, layer_type)
    ours.load_state_dict(reference.state_dict())  # copied by name: every name is transformers'
    return reference, ours, config


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_matches_transformers_outputs_and_gradients(layer_type):
    reference, ours, config = _pair(layer_type)
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out = _reference_forward(reference, config, x_ref), ours(x_ours)
    assert rel_err(out, out_ref) <= TOL
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out_ref * probe).sum().backward()
    (out * probe).sum().backward()
    assert rel_err(x_ours.grad, x_ref.grad) <= TOL
    theirs = dict(reference.named_parameters())
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(theirs)
    for name, param in ours.named_parameters():
        if theirs[name].grad is None:  # the indexer's picks are not differentiable
            assert param.grad is None and ".indexer." in name, name
        else:
            assert rel_err(param.grad, theirs[name].grad) <= TOL, name
    if layer_type != "sliding_attention":  # the compressed entries were read, and rotated with YaRN
        assert ours.compressor is not None and ours.rotary.scaling["rope_type"] == "yarn"
        assert ours.compressor.kv_proj.weight.grad.abs().sum() > 0


def test_the_indexer_saves_nothing_and_nothing_outlives_a_step():
    """The indexer's picks are indices (no gradient reaches its scores), so a compressed sparse layer's
    forward and backward under saved-tensor hooks that hold what they pack (as activation offloading does)
    leave nothing behind, and the indexer's parameters get no gradient; its picks still steer the output."""
    _, ours, config = _pair("compressed_sparse_attention")
    x = torch.randn(2, 19, config.hidden_size)
    tracker = SavedTensorTracker({p.untyped_storage().data_ptr() for p in ours.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        out = ours(x)
        out.sum().backward()
    del out
    assert tracker.peak > 0 and tracker.live == 0, (tracker.peak, tracker.live)
    indexer = ours.compressor.indexer
    assert all(p.grad is None for p in indexer.parameters())
    assert any(p.grad is not None for n, p in ours.compressor.named_parameters() if not n.startswith("indexer."))
    with torch.no_grad():  # other index keys, other picks: the sparse path ran
        before = ours(x)
        for param in indexer.parameters():
            param.normal_(0.0, 1.0)
        assert not torch.allclose(ours(x), before)


def test_bad_arguments_refused_by_name():
    config = _config()
    with pytest.raises(ValueError, match="layer_type 'full_attention' is not one of"):
        _ours(config, "full_attention")
    with pytest.raises(ValueError, match=r"\['compress_rate'\] must be given"):
        CompressedSparseAttention(
            HIDDEN, HEADS, HEAD_DIM, layer_type="heavily_compressed_attention", q_lora_rank=Q_RANK,
            qk_rope_head_dim=ROPE_DIM, o_groups=GROUPS, o_lora_rank=O_RANK, sliding_window=WINDOW,
        )  # fmt: skip
    with pytest.raises(ValueError, match="qk_rope_head_dim must be an even number in \\[2, head_dim 8\\], got 3"):
        CompressedSparseAttention(
            HIDDEN, HEADS, HEAD_DIM, layer_type="sliding_attention", q_lora_rank=Q_RANK, qk_rope_head_dim=3,
            o_groups=GROUPS, o_lora_rank=O_RANK, sliding_window=WINDOW,
        )  # fmt: skip
    layer = _ours(config, "compressed_sparse_attention")
    with pytest.raises(ValueError, match=r"\(compressed_sparse_attention\): packed documents \(segment_ids\)"):
        layer(torch.zeros(1, 6, HIDDEN), segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))


def test_sliding_layer_packed_documents_equal_one_by_one():
    _, ours, _ = _pair("sliding_attention")
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randn(1, 7, HIDDEN, generator=gen), torch.randn(1, 9, HIDDEN, generator=gen)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    segments = torch.tensor([[0] * 7 + [1] * 9])
    packed = ours(torch.cat([first, second], dim=1), positions, segment_ids=segments)
    alone = torch.cat([ours(first), ours(second)], dim=1)
    assert rel_err(packed, alone) <= TOL


def _tp2_checks() -> tuple[dict[str, dict[str, float]], str]:
    config = _config()
    x = torch.randn(2, 20, HIDDEN, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, 20, HIDDEN, generator=torch.Generator().manual_seed(5))
    results = {}
    for layer_type in LAYER_TYPES:
        torch.manual_seed(11)
        one = _ours(config, layer_type)  # one process
        x_one = x.clone().requires_grad_(True)
        (one(x_one) * probe).sum().backward()
        out_one = one(x).detach()
        for sequence_parallel in (False, True):
            ps.initialize_model_parallel(tensor_model_parallel_size=2)
            tp_rank = ps.get_tensor_model_parallel_rank()
            torch.manual_seed(11)
            layer = _ours(config, layer_type, sequence_parallel=sequence_parallel)
            x_mine, out_expected, probe_mine, dx_expected = x, out_one, probe, x_one.grad
            if sequence_parallel:  # this rank's part of the sequence, in and out
                x_mine, out_expected, probe_mine, dx_expected = (
                    t.chunk(2, dim=1)[tp_rank] for t in (x, out_one, probe, x_one.grad)
                )
            x_mine = x_mine.clone().requires_grad_(True)
            out = layer(x_mine)
            (out * probe_mine).sum().backward()
            errs = {"out": rel_err(out, out_expected), "dx": rel_err(x_mine.grad, dx_expected)}
            errs.update(parameter_errors(layer, one))  # the indexer's parameters: no gradient on either side
            # the heads were split: half of them (and their sinks, q_b_proj rows) on this rank
            errs["sharded"] = float(
                layer.local_heads != HEADS // 2
                or layer.sinks.shape != (HEADS // 2,)
                or layer.q_b_proj.weight.shape != (HEADS // 2 * HEAD_DIM, Q_RANK)
            )
            results[f"{layer_type} sp={sequence_parallel}"] = errs
            ps.destroy_model_parallel()
            dist.barrier()
    return results, _context_parallel_refusal(config)


def _context_parallel_refusal(config) -> str:
    """What the layer says when run under ring context parallelism 2 (it must refuse: all-gather only)."""
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        _ours(config, "heavily_compressed_attention", context_parallel_algo="ring")(torch.zeros(1, 8, HIDDEN))
        return "ran"
    except ValueError as error:
        return str(error)
    finally:
        ps.destroy_model_parallel()


def test_tp2_equals_one_process_and_context_parallel_refused():
    for rank, (per_rank, cp_refusal) in enumerate(run_on_ranks(_tp2_checks, world_size=2, timeout=300)):
        assert cp_refusal == (
            "CompressedSparseAttention (heavily_compressed_attention): DeepSeek-V4 attention runs under context "
            "parallelism with context_parallel_algo 'allgather' only (its compressors pool windows of the whole "
            "sequence), got 'ring'"
        )
        assert len(per_rank) == 6
        for layout, errs in per_rank.items():
            assert "grad.sinks" in errs and "grad.kv_proj.weight" in errs and "sharded" in errs
            if not layout.startswith("sliding"):
                assert "grad.compressor.kv_proj.weight" in errs
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"{layout}, rank {rank}: {bad}"
