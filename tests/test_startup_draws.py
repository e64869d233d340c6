"""Start-up draws only what a rank keeps, and nothing for weights that will be loaded.

- World 4, tp 2 x ep 2 (MoE with a shared expert, sequence parallel): each rank draws at most the values it
  keeps plus one block per parameter (and less than half of the one-process model), and its TP-joined
  weights equal the one-process model's bit for bit;
- one process: a fresh build draws every value exactly once (no second draw at construction); with
  ``model.init_from`` (a Hugging Face directory) the trainer draws nothing, loads the directory's weights
  and reads its config.json once; a trainer about to resume a checkpoint draws nothing;
- the safetensors reader that loads without a memory map reads every dtype as safetensors itself does.
"""

from __future__ import annotations

import builtins
import math
import os

import pytest
import torch
from dist_harness import run_on_ranks
from tiny_recipes import TINY_MOE
from training_helpers import SyntheticData, tiny_config

from megacann.layers.block_draw import block_dim, block_extent, count_drawn_values
from megacann.layers.sharding import get_sharding

MOE = [*TINY_MOE, "model.hidden_size=64", "model.moe_ffn_hidden_size=128", "model.ffn_hidden_size=256",
       "model.vocab_size=512", "model.moe_shared_experts=1", "model.make_vocab_size_divisible_by=128"]  # fmt: skip
TP2_EP2 = [
    "distributed.tensor_parallel_size=2",
    "distributed.expert_parallel_size=2",
    "distributed.sequence_parallel=true",
]


def _build(overrides: list[str], world_size: int) -> dict:
    """This rank's chunks built as the trainer builds them: values drawn, the bound, the whole tensors."""
    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict
    from megacann.models import get_model_spec
    from megacann.training.rank_model import build_rank_chunks
    from megacann.training.runtime import setup_runtime

    cfg = tiny_config(overrides, world_size)
    setup_runtime(cfg)
    with count_drawn_values() as drawn:
        chunks = build_rank_chunks(cfg, get_model_spec(cfg.model.type), "cpu")
    kept = one_block = 0
    for chunk in chunks:
        for param in chunk.parameters():
            sharding = get_sharding(param)
            logical = sharding.logical_shape
            extent = block_extent(logical, block_dim(param, sharding))
            kept += param.numel() * math.prod(logical) // math.prod(sharding.full_shape)  # padding not drawn
            one_block += math.prod(logical) // logical[block_dim(param, sharding)] * extent
    result = {"drawn": drawn[0], "kept": kept, "one_block": one_block, "weights": full_state_dict(chunks)}
    result["tp_rank"], result["ep_rank"] = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    ps.destroy_model_parallel()
    return result


@pytest.fixture(scope="module")
def tp2_ep2():
    return run_on_ranks(_build, world_size=4, args=(MOE + TP2_EP2, 4), timeout=300), _build(MOE, 1)


def test_a_tp2_ep2_rank_draws_its_shard_plus_at_most_one_block_per_parameter(tp2_ep2):
    ranks, whole = tp2_ep2
    assert whole["drawn"] == whole["kept"]  # one process: every value once
    for rank in ranks:
        assert rank["kept"] <= rank["drawn"] <= rank["kept"] + rank["one_block"], rank["drawn"]
        assert rank["drawn"] < 0.5 * whole["drawn"], (rank["drawn"], whole["drawn"])


def test_one_process_weights_equal_the_tp2_shards_joined_bit_for_bit(tp2_ep2):
    ranks, whole = tp2_ep2
    expected = whole["weights"]
    seen = set()
    for rank in ranks:
        for name, tensor in rank["weights"].items():
            assert torch.equal(tensor, expected[name]), f"tp {rank['tp_rank']} ep {rank['ep_rank']}: {name}"
            seen.add(name)
    assert seen == set(expected)  # the ep ranks together hold every expert
    assert any(".experts.2." in name for name in ranks[-1]["weights"]) and not any(
        ".experts.2." in name for name in ranks[0]["weights"]
    )


def _tiny_hf_llama(path: str) -> str:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_init_from_draws_nothing_and_reads_config_json_once(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from megacann.training.trainer import Trainer

    source = _tiny_hf_llama(str(tmp_path / "hf"))
    config_reads = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.basename(os.fspath(file)) == "config.json":
            config_reads.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    cfg = tiny_config([f"model.init_from={source}"])
    with count_drawn_values() as drawn:
        trainer = Trainer(cfg, data=SyntheticData(cfg, 0, 1))
    assert drawn[0] == 0
    assert len(config_reads) == 1, config_reads
    hf = load_file(os.path.join(source, "model.safetensors"))
    model = trainer.model_chunks[0]
    assert torch.equal(model.layers["1"].mlp.down_proj.weight, hf["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.embed_tokens.weight[:200], hf["model.embed_tokens.weight"])


def test_a_fresh_trainer_draws_each_value_once():
    from megacann.training.trainer import Trainer

    cfg = tiny_config()
    with count_drawn_values() as drawn:
        trainer = Trainer(cfg, data=SyntheticData(cfg, 0, 1))
    values = sum(math.prod(get_sharding(p).logical_shape) for p in trainer.model_chunks[0].parameters())
    assert drawn[0] == values


def test_a_trainer_about_to_resume_draws_nothing_and_resumes_the_saved_weights(tmp_path):
    from megacann.interop.full_state import full_state_dict
    from megacann.training.trainer import Trainer

    cfg = tiny_config([f"experiment.output_dir={tmp_path}"])
    first = Trainer(cfg, data=SyntheticData(cfg, 0, 1))
    first.train_step()
    path = first.save_checkpoint()
    with count_drawn_values() as drawn:
        second = Trainer(cfg, data=SyntheticData(cfg, 0, 1), checkpoint_follows=True)
    assert drawn[0] == 0
    assert second.resume(path) == path
    saved, resumed = full_state_dict(first.model_chunks), full_state_dict(second.model_chunks)
    assert all(torch.equal(resumed[name], saved[name]) for name in saved)


def test_safetensors_file_reads_every_dtype_as_safetensors_does(tmp_path):
    from safetensors.torch import load_file, save_file

    from megacann.interop.safetensors_file import SafetensorsFile

    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, generator=g),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "i64": torch.arange(6).view(2, 3),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    file = str(tmp_path / "t.safetensors")
    save_file(tensors, file, metadata={"format": "pt"})
    reference, ours = load_file(file), SafetensorsFile(file)
    assert sorted(ours.keys()) == sorted(tensors)
    for name, expected in reference.items():
        got = ours.get_tensor(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


def test_loaded_weights_leave_no_garbage_in_the_vocabulary_padding(monkeypatch):
    """Weights about to be loaded are allocated, not drawn, and the loader writes only the logical rows: the
    vocabulary's padding rows must still be zeros (as a draw leaves them), whatever the allocator hands back
    (garbage there turned into NaN gradient norms after init_from and resumes)."""
    from megacann.layers import VocabParallelEmbedding, deferred_initialization

    real_empty = torch.empty

    def garbage(*args, **kwargs):  # memory as a reused heap may hand it out
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", garbage)
    with deferred_initialization(weights_loaded=True):
        embedding = VocabParallelEmbedding(250, 16, make_vocab_size_divisible_by=16, device="cpu")
    weight = embedding.weight.detach()
    assert weight.shape == (256, 16)
    assert torch.all(weight[250:] == 0)  # the padding: zeros
    assert torch.isnan(weight[:250]).all()  # the logical rows: left for the loader
