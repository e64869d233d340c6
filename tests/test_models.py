"""Models: Hugging Face LLaMA logits parity both ways, plain one-rank forward, sizes and FLOPs."""

import pytest
import torch

from megacann.config import ModelConfig
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf
from megacann.layers import initialize_weights
from megacann.models import GPT, LLAMA, LlamaModel

transformers = pytest.importorskip("transformers")

HF_CASES = {
    "gqa_untied_theta": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0),
    "tied": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    "mqa_llama3_scaling": dict(
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def hf_model(**kw):
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=300,  # not a multiple of 128: megacann pads, and must not show it
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **kw,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to ones; randomise them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_logits_parity_both_ways(tmp_path, case):
    reference = hf_model(**HF_CASES[case])
    reference.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    ours = from_pretrained_hf(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = ours(input_ids=ids)
    assert logits.shape == (2, 24, 300)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, atol=1e-4, rtol=0)
    for name, p in reference.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


def test_forward_on_one_rank_without_trainer_and_loss_matches_torch():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, vocab_size=50, ffn_hidden_size=64)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    ids = torch.randint(0, 50, (3, 10))
    logits = model(input_ids=ids)
    assert logits.shape == (3, 10, 50)
    labels = torch.randint(0, 50, (3, 10))
    labels[0, :4] = -100
    per_token = model(input_ids=ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(per_token.reshape(-1), expected, atol=1e-5, rtol=1e-5)


def test_named_initialisation_is_deterministic_and_per_name():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, vocab_size=50, ffn_hidden_size=64)
    a, b = LlamaModel(cfg), LlamaModel(cfg)
    initialize_weights(a, seed=3)
    initialize_weights(b, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    # a model holding only layer 1 gets exactly the full model's layer 1
    part = LlamaModel(cfg, layer_ids=[1], pre_process=False)
    initialize_weights(part, seed=3)
    full = dict(a.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name
    assert not torch.equal(full["layers.0.mlp.down_proj.weight"], full["layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("kind,kw", [("llama", {"num_key_value_heads": 2}), ("gpt", {"tie_word_embeddings": True})])
def test_parameter_count_matches_model(kind, kw):
    from megacann.models import GPTModel

    cfg = ModelConfig(type=kind, hidden_size=32, num_layers=3, num_attention_heads=4, vocab_size=128, **kw)
    model = (LlamaModel if kind == "llama" else GPTModel)(cfg)
    spec = LLAMA if kind == "llama" else GPT
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters(model.config)


def test_flops_per_token_palm_formula():
    cfg = ModelConfig(
        hidden_size=2048,
        num_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        ffn_hidden_size=5632,
        vocab_size=32000,
    )
    d, L, kv = 2048, 22, 4 * 64
    n = L * (2 * d * d + 2 * d * kv + 3 * d * 5632) + d * 32000
    assert LLAMA.flops_per_token(cfg, 2048) == 6 * n + 12 * L * d * 2048
