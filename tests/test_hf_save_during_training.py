"""``logging.hf_save_interval``: a run at tensor parallel 2 x pipeline parallel 2 (and a Qwen3-MoE run at
tensor parallel 2 x expert parallel 2) writes Hugging Face directories at the expected steps; transformers loads the last one as it is, with the logits of the
checkpoint of the same step loaded on one process, and AutoTokenizer loads its tokenizer. A LoRA run's
directory holds its adapters merged. A family without a Hugging Face adapter is refused up front."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_on_ranks
from training_helpers import synthetic_data_factory, tiny_config

from megacann.config import ConfigError

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

TP2_PP2 = ["distributed.tensor_parallel_size=2", "distributed.pipeline_parallel_size=2"]
RUNS = {
    "full": TP2_PP2,
    # adapters on a frozen base drawn from the seed; the HF directory holds them merged
    "lora": [*TP2_PP2, "lora=true", "lora_rank=4", "lora_target_modules=[q_proj,v_proj,down_proj]", "optim.lr=5e-2"],
    # Qwen3-MoE at tp 2 x ep 2 (dp 2): each expert-parallel rank holds half of the experts
    "moe_ep2": [
        "model.type=qwen3_moe",
        "model.num_experts=4",
        "model.moe_ffn_hidden_size=32",
        "distributed.tensor_parallel_size=2",
        "distributed.expert_parallel_size=2",
        "optim.grad_accum_steps=1",
    ],
}


def _train(root: str) -> dict:
    """Every run on 4 ranks with hf_save_interval 3 over 4 steps; what each rank held."""
    from megacann import parallel_state as ps
    from megacann.data.tokenizer import load_tokenizer
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    held = {}
    for name, overrides in RUNS.items():
        ps.destroy_model_parallel()
        cfg = tiny_config(
            [
                *overrides,
                f"experiment.output_dir={root}/{name}",
                "model.vocab_size=260",  # the byte tokenizer's 259 ids fit; padded to 272 (tp rows)
                "optim.max_steps=4",
                "logging.hf_save_interval=3",
                "logging.log_interval=4",
            ],
            world_size=4,
        )
        trainer = Trainer(
            cfg, setup_runtime(cfg), tokenizer=load_tokenizer("byte"), data_factory=synthetic_data_factory(cfg)
        )
        trainer.fit()
        chunk = trainer.model_chunks[0]
        q = next(p for n, p in chunk.named_parameters() if n.endswith("q_proj.weight"))
        held[name] = {
            "sizes": (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()),
            "layers": sorted({n.split(".")[1] for n, _ in chunk.named_parameters() if n.startswith("layers.")}),
            "experts": sorted({n.split(".")[4] for n, _ in chunk.named_parameters() if ".experts." in n}),
            "q_rows": q.shape[0],
        }
    return held


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_save"))
    return root, run_on_ranks(_train, 4, args=(root,), timeout=240)


def test_the_layout_is_really_split(trained):
    _, held = trained
    for name in ("full", "lora"):
        stages = [held[rank][name]["layers"] for rank in range(4)]
        assert stages[0] == stages[1] == ["0", "1"] and stages[2] == stages[3] == ["2", "3"]
        assert {held[rank][name]["sizes"] for rank in range(4)} == {(2, 2)}
        assert held[0][name]["q_rows"] == 64 // 2  # each tensor-parallel rank holds half of q's rows
    experts = [held[rank]["moe_ep2"]["experts"] for rank in range(4)]
    assert experts[0] == experts[1] == ["0", "1"] and experts[2] == experts[3] == ["2", "3"]
    assert held[0]["moe_ep2"]["q_rows"] == 64 // 2


@pytest.mark.parametrize("name", sorted(RUNS))
def test_hf_directories_load_in_transformers_with_the_checkpoint_logits(trained, name):
    transformers = pytest.importorskip("transformers")
    from megacann.interop.lora_export import build_full_model

    root, _ = trained
    out = os.path.join(root, name)
    assert sorted(d for d in os.listdir(out) if d.startswith("hf_")) == ["hf_3", "hf_4"]  # every 3, and the last
    hf_dir = os.path.join(out, "hf_4")
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(hf_dir, file)), file
    from safetensors.torch import load_file

    stored = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert not [k for k in stored if "lora" in k or "adapter" in k]  # a LoRA run's adapters are merged
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ours = build_full_model(os.path.join(out, "checkpoint_4"), precision="fp32").eval()  # LoRA: merged here too
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, ours(input_ids=ids)
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)  # both 260 wide: padding dropped
    earlier = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf_3")).eval()
    with torch.no_grad():
        assert not torch.allclose(earlier(ids).logits, theirs)  # step 3's weights, not step 4's

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer("hi").input_ids[-2:] == [ord("h"), ord("i")]


def test_a_family_without_hf_adapter_is_refused():
    tiny_config(["model.type=gpt"])  # off by default
    with pytest.raises(ConfigError, match="logging.hf_save_interval: model family 'gpt' has no Hugging Face adapter"):
        tiny_config(["model.type=gpt", "logging.hf_save_interval=2"])
    with pytest.raises(ConfigError, match=r"logging.hf_save_interval must be >= 0"):
        tiny_config(["logging.hf_save_interval=-1"])
    moe = ["model.type=moe", "model.num_experts=4", "logging.hf_save_interval=2"]
    tiny_config(moe)  # Mixtral can hold it
    with pytest.raises(
        ConfigError, match=r"logging.hf_save_interval: model.moe_shared_experts 1 cannot be written as Mixtral"
    ):
        tiny_config([*moe, "model.moe_shared_experts=1"])  # refused when prepared, not at the first write
