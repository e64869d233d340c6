"""DeepSeek-V4's KV compressors against transformers' ``DeepseekV4HCACompressor`` (non-overlapping windows)
and ``DeepseekV4CSACompressor`` (overlapping windows; its indexer left aside), stateless (no cache), with the
same weights: the compressed entries, their gradients, and the causal bias of the heavily compressed one."""

from __future__ import annotations

import pytest
import torch

from megacann.layers.compressed_indexer import CompressedIndexer, chosen_entries_bias
from megacann.layers.rotary import RotaryEmbedding
from megacann.layers.window_compressor import WindowCompressor, compressed_causal_bias

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

HIDDEN, HEAD_DIM, ROPE_DIM, RATE, THETA = 16, 8, 4, 4, 160000.0


def _pair(overlap: bool) -> tuple[torch.nn.Module, WindowCompressor]:
    config = transformers.DeepseekV4Config(
        hidden_size=HIDDEN, head_dim=HEAD_DIM, qk_rope_head_dim=ROPE_DIM, num_hidden_layers=2,
        compress_rope_theta=THETA, q_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
        compress_rates={"compressed_sparse_attention": RATE, "heavily_compressed_attention": RATE},
    )  # fmt: skip
    reference = (hf.DeepseekV4CSACompressor if overlap else hf.DeepseekV4HCACompressor)(config).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    ours = WindowCompressor(HIDDEN, HEAD_DIM, RATE, overlap=overlap)
    weights = {k: v for k, v in reference.state_dict().items() if not k.startswith("indexer.")}
    ours.load_state_dict(weights)  # copied by name
    return reference, ours


@pytest.mark.parametrize("overlap", [False, True], ids=["heavily_compressed", "compressed_sparse"])
def test_matches_transformers_entries_and_gradients(overlap):
    reference, ours = _pair(overlap)
    rotary = RotaryEmbedding(ROPE_DIM, theta=THETA, interleaved=True)
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(1))  # 2 windows and 3 tokens left
    position_ids = torch.arange(11).unsqueeze(0)
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    q_residual = torch.randn(2, 11, 8, generator=torch.Generator().manual_seed(4))  # read by the indexer only
    entries_ref, bias_ref = reference(x_ref, q_residual, position_ids.expand(2, -1), None, 0)
    entries = ours(x_ours, rotary)
    assert entries.shape == (2, 2, HEAD_DIM) and ours(x[:, :3], rotary).shape == (2, 0, HEAD_DIM)
    torch.testing.assert_close(entries, entries_ref.squeeze(1), rtol=1e-5, atol=1e-6)
    if not overlap:
        assert torch.equal(compressed_causal_bias(position_ids.expand(2, -1), 2, RATE), bias_ref)
    else:  # the compressed sparse one's bias opens the entries its indexer picked
        indexer = CompressedIndexer(HIDDEN, 8, 2, 8, RATE, topk=4)
        indexer.load_state_dict({k[8:]: v for k, v in reference.state_dict().items() if k.startswith("indexer.")})
        chosen = indexer(x, q_residual, position_ids.expand(2, -1), rotary)
        assert torch.equal(chosen_entries_bias(chosen, 2), bias_ref)
        assert bias_ref.isinf().any() and (bias_ref == 0).any()
    probe = torch.randn(entries.shape, generator=torch.Generator().manual_seed(2))
    (entries_ref.squeeze(1) * probe).sum().backward()
    (entries * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_causal_bias_exact_and_bad_rate_refused():
    bias = compressed_causal_bias(torch.arange(9).unsqueeze(0), 2, 4)[0, 0]
    readable = [[int(v == 0) for v in row] for row in bias.tolist()]
    assert readable == [[0, 0]] * 3 + [[1, 0]] * 4 + [[1, 1]] * 2  # window w readable from token 4w + 3 on
    with pytest.raises(ValueError, match="compress_rate must be >= 1, got 0"):
        WindowCompressor(HIDDEN, HEAD_DIM, 0)


def test_indexer_matches_transformers_scores_and_choices():
    config = transformers.DeepseekV4Config(
        hidden_size=HIDDEN, head_dim=HEAD_DIM, qk_rope_head_dim=ROPE_DIM, num_hidden_layers=2,
        compress_rope_theta=THETA, q_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3,
        compress_rates={"compressed_sparse_attention": RATE, "heavily_compressed_attention": RATE},
    )  # fmt: skip
    reference = hf.DeepseekV4Indexer(config).float()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    ours = CompressedIndexer(HIDDEN, 8, 8, 8, RATE, topk=3)
    ours.load_state_dict(reference.state_dict())  # copied by name
    captured = {}
    scorer = reference.scorer.forward
    reference.scorer.forward = lambda *args: captured.setdefault("scores", scorer(*args))
    x, q_residual = torch.randn(2, 23, HIDDEN, generator=gen), torch.randn(2, 23, 8, generator=gen)
    position_ids = torch.arange(23).unsqueeze(0).expand(2, -1)
    rotary = RotaryEmbedding(ROPE_DIM, theta=THETA, interleaved=True)
    with torch.no_grad():
        chosen_ref = reference(x, q_residual, position_ids, None, 0)
        scores, chosen = (
            ours.index_scores(x, q_residual, position_ids, rotary),
            ours(x, q_residual, position_ids, rotary),
        )
    readable = scores.isfinite()
    assert readable.sum() == 2 * sum(min((t + 1) // RATE, 5) for t in range(23))  # 5 entries from 23 tokens
    torch.testing.assert_close(scores[readable], captured["scores"][readable], rtol=1e-5, atol=1e-6)
    assert torch.equal(chosen.sort(-1).values, chosen_ref.sort(-1).values)
    assert (chosen == -1).any() and (chosen >= 0).any()  # both kinds of pick occur
