"""LoRA on the families of late 2026 (qwen3_5, qwen3_5_moe, qwen3_next, gpt_oss, deepseek_v32, deepseek_v4),
fp32: adapters on each family's projections (Gated DeltaNet's, gated attention's, the MLPs', latent
attention's, the lightning indexer's, DeepSeek-V4's compressed attention's) of megacann's model of a
transformers checkpoint, exported with ``save_peft_adapter``, load with ``peft.PeftModel.from_pretrained`` on
transformers' model of that checkpoint and give megacann's logits (within 1e-5 of the largest logit), with
every ``B`` nonzero so a wrong row or name would show; Qwen3-Next's ``B`` rows regrouped per key head as its
fused weights' rows are. Targets PEFT cannot hold are refused by name at start-up (gpt-oss's and
DeepSeek-V4's stacked experts, the MoE families' MLPs, both projections of one Qwen3-Next fused module,
DeepSeek-V4's grouped ``o_a_proj``) and on export. Tensor parallel 2 with sequence parallelism trains the
adapters as one process does (README tier: Qwen3.5, one spawn of one rank and one of two; extended tier:
DeepSeek-V3.2 with its indexer's adapters, Qwen3-Next, DeepSeek-V4), and adapters whole on every TP rank
(the indexer's) keep complete gradients that are not summed over TP."""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_v4_helpers import tiny_hf_v4
from gpt_oss_helpers import tiny_hf_gpt_oss
from qwen3_5_helpers import hf_classes, tiny_hf_qwen3_5
from qwen3_next_helpers import tiny_hf_qwen3_next
from test_deepseek_v4 import IDS as V4_IDS
from test_deepseek_v32_models import IDS as V32_IDS
from test_deepseek_v32_models import tiny_hf_deepseek_v32

from megacann.interop.hf import from_pretrained_hf
from megacann.interop.peft import ADAPTER_CONFIG, PeftFormatError, load_peft_adapter, save_peft_adapter
from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(1))
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _qwen3_5(path, moe=False):
    return tiny_hf_qwen3_5(path, moe=moe), hf_classes(moe)[1], IDS


# family: (tiny checkpoint maker -> (dir, transformers class, ids), megacann targets, modules in adapter_config)
CASES = {
    "qwen3_5": (_qwen3_5, (*DELTANET, *ATTENTION, "gate_up_proj", "down_proj"),
                [*ATTENTION, "gate_proj", "up_proj", "down_proj", *sorted(DELTANET)]),
    "qwen3_5_moe": (lambda p: _qwen3_5(p, moe=True), (*DELTANET, "q_proj", "o_proj"),
                    ["q_proj", "o_proj", *sorted(DELTANET)]),
    "qwen3_next_qkv_b": (lambda p: (tiny_hf_qwen3_next(p), transformers.Qwen3NextForCausalLM, IDS),
                         ("in_proj_qkv", "in_proj_b", "out_proj", "v_proj"), ["v_proj", "in_proj_ba", "in_proj_qkvz", "out_proj"]),
    "qwen3_next_z_a": (lambda p: (tiny_hf_qwen3_next(p), transformers.Qwen3NextForCausalLM, IDS),
                       ("in_proj_z", "in_proj_a", "k_proj"), ["k_proj", "in_proj_ba", "in_proj_qkvz"]),
    "gpt_oss": (lambda p: (tiny_hf_gpt_oss(p), transformers.GptOssForCausalLM, IDS), ATTENTION, list(ATTENTION)),
    "deepseek_v32": (lambda p: (tiny_hf_deepseek_v32(p), transformers.DeepseekV32ForCausalLM, V32_IDS),
                     (*LATENT, "wq_b", "wk", "weights_proj"),
                     ["o_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "weights_proj", "wk", "wq_b"]),
    # PEFT matches leaf names, so it also puts a LoRA (B zero: no tensors for it) on the compressors' kv_proj
    # and the indexer's q_b_proj, which megacann does not adapt
    "deepseek_v4": (lambda p: (tiny_hf_v4(p), transformers.DeepseekV4ForCausalLM, V4_IDS),
                    ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"), ["kv_proj", "o_b_proj", "q_a_proj", "q_b_proj"]),
}  # fmt: skip


def _adapted(hf_dir: str, targets) -> tuple[torch.nn.Module, LoRAConfig]:
    """megacann's model of ``hf_dir`` with LoRAs on ``targets``, every factor drawn at random (B too)."""
    model = from_pretrained_hf(hf_dir).eval()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    attach_lora(model, lora)
    with torch.no_grad():
        for i, (_, param) in enumerate(lora_parameters(model)):
            param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(i))
    return model, lora


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_exported_adapters_with_megacann_logits(tmp_path, case):
    make, targets, hf_targets = CASES[case]
    hf_dir, hf_class, ids = make(str(tmp_path / "hf"))
    model, lora = _adapted(hf_dir, targets)
    with torch.no_grad():
        ours = model(input_ids=ids)
    save_peft_adapter([model], str(tmp_path / "adapter"), lora, base_model_name_or_path=hf_dir)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == hf_targets

    base = hf_class.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = base(ids).logits
    assert (ours - base_logits).abs().max() > 0.05  # the adapters act
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    adapted = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(hf_targets)  # PEFT put a LoRA on every module the config names
    with torch.no_grad():
        theirs = peft_model(ids).logits
    # relative to the largest logit: the chunked delta rule rounds apart from transformers' by ~1e-5 absolute
    error = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert error < 1e-5, error

    # and back into megacann: the same logits, except where the rows were regrouped (written only)
    back = from_pretrained_hf(hf_dir).eval()
    if case.startswith("qwen3_next"):
        with pytest.raises(PeftFormatError, match="reading PEFT adapters of model family 'qwen3_next' is not"):
            load_peft_adapter(back, str(tmp_path / "adapter"))
        return
    assert load_peft_adapter(back, str(tmp_path / "adapter")).target_modules == tuple(hf_targets)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids), ours, atol=1e-6, rtol=0)


# -- targets PEFT cannot hold: refused at start-up (the recipe check) and on export ------------------------

REFUSED = {  # case: (family, checkpoint maker, targets, message)
    "gpt_oss_experts": ("gpt_oss", tiny_hf_gpt_oss, ["q_proj", "gate_up_proj", "down_proj"],
                        r"\['gate_up_proj', 'down_proj'\] are refused for gpt_oss: its experts are stacked tensors"),
    "qwen3_next_qkv_and_z": ("qwen3_next", tiny_hf_qwen3_next, ["in_proj_qkv", "in_proj_z", "in_proj_b"],
                             r"in_proj_qkv \+ in_proj_z are refused for qwen3_next: transformers fuses each pair"),
    "qwen3_next_experts": ("qwen3_next", tiny_hf_qwen3_next, ["in_proj_qkv", "down_proj"],
                           r"\['down_proj'\] are refused for qwen3_5_moe and qwen3_next: they reach every routed"),
    "qwen3_5_moe_experts": ("qwen3_5_moe", lambda p: tiny_hf_qwen3_5(p, moe=True), ["gate_proj"],
                            r"\['gate_proj'\] are refused for qwen3_5_moe and qwen3_next"),
    "deepseek_v4_experts": ("deepseek_v4", tiny_hf_v4, ["q_a_proj", "down_proj"],
                            r"\['down_proj'\] are refused for deepseek_v4: they reach every routed expert"),
    "deepseek_v4_grouped_output": ("deepseek_v4", tiny_hf_v4, ["kv_proj", "o_a_proj"],
                                   r"\['o_a_proj'\] is refused for deepseek_v4: transformers' o_a_proj is a grouped"),
}  # fmt: skip
NOT_ADAPTED = {"deepseek_v4_grouped_output"}  # megacann's grouped o_a_proj carries no LoRA either


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_targets_peft_cannot_hold_are_refused_at_start_up_and_on_export(tmp_path, case):
    from finetune_helpers import recipe

    from megacann.config import ConfigError

    family, make, targets, message = REFUSED[case]
    hf_dir = make(str(tmp_path / "hf"))
    lora = ["lora=true", f"lora_target_modules=[{','.join(targets)}]", "data.tokenizer=byte"]
    with pytest.raises(ConfigError, match=r"<recipe>: lora_target_modules: " + message):
        recipe(lora, model={"type": family, "precision": "fp32", "init_from": hf_dir})
    if case in NOT_ADAPTED:
        with pytest.raises(ValueError, match=r"LoRA target_modules \['o_a_proj'\] match no layer of the model"):
            _adapted(hf_dir, tuple(targets))
        return
    model, lora_config = _adapted(hf_dir, tuple(targets))  # megacann trains them; PEFT cannot hold them
    with pytest.raises(PeftFormatError, match=message):
        save_peft_adapter([model], str(tmp_path / "adapter"), lora_config)
    assert not (tmp_path / "adapter").exists()


# -- tensor parallel 2 (sequence parallel) trains the adapters as one process ------------------------------

STEPS, SEQ = 3, 16
# The Gated DeltaNet families' weights are drawn at half the spread, as test_qwen3_5_parallel draws its MoE
# model: at 0.1 rounding alone (one process against TP 2, every adapter equal to 2e-7) moves Qwen3.5's step-2
# gradient norm by 2e-5 (measured), and Qwen3-Next's step-1 norm by 8e-6.
TP_RUNS = {  # family: (checkpoint maker, targets, layer 0's adapters split over TP (the rest whole), tier)
    "qwen3_5": (lambda p: tiny_hf_qwen3_5(p, std=0.05), (*DELTANET, "q_proj", "o_proj", "gate_up_proj", "down_proj"),
                {"in_proj_qkv.lora_B", "in_proj_z.lora_B", "in_proj_b.lora_B", "in_proj_a.lora_B", "out_proj.lora_A",
                 "gate_up_proj.lora_B", "down_proj.lora_A"}, ()),
    "deepseek_v32": (tiny_hf_deepseek_v32, (*LATENT, "wq_b", "wk", "weights_proj"),
                     {"q_b_proj.lora_B", "kv_b_proj.lora_B", "o_proj.lora_A"}, (pytest.mark.extended,)),
    "qwen3_next": (lambda p: tiny_hf_qwen3_next(p, std=0.05), ("in_proj_z", "in_proj_b", "out_proj", "v_proj"),
                   {"in_proj_z.lora_B", "in_proj_b.lora_B", "out_proj.lora_A"}, (pytest.mark.extended,)),
    "deepseek_v4": (tiny_hf_v4, ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"), {"q_b_proj.lora_B", "o_b_proj.lora_A"},
                    (pytest.mark.extended,)),
}  # fmt: skip


def _train_with_adapters(family: str, hf_dir: str, root: str, targets: tuple[str, ...], steps: int = STEPS) -> dict:
    """On each rank: ``steps`` LoRA steps of ``family`` from ``hf_dir`` (tp = the world, sequence parallel), the
    loss and gradient-norm traces, the whole adapters after them, and probes of the layout."""
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory

    from megacann.interop.peft import lora_full_tensors
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    tp = dist.get_world_size()
    layout = [f"distributed.tensor_parallel_size={tp}", f"distributed.sequence_parallel={str(tp > 1).lower()}"]
    overrides = [
        "lora=true", "lora_rank=4", "lora_alpha=8.0", f"lora_target_modules=[{','.join(targets)}]",
        "optim.name=sgd", "optim.lr=0.1", "optim.clip_grad=0.5", f"data.seq_length={SEQ}", "data.batch_size=2",
        "data.tokenizer=byte", "optim.grad_accum_steps=1", f"optim.max_steps={steps}",
        f"experiment.output_dir={root}/tp{tp}", *layout,
    ]  # fmt: skip
    cfg = recipe(overrides, model={"type": family, "precision": "fp32", "init_from": hf_dir}, world_size=tp)
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    chunk = trainer.model_chunks[0]
    trace = [trainer.train_step() for _ in range(steps)]
    shapes = {name: tuple(p.shape) for name, p in lora_parameters(chunk) if name.startswith("layers.0.")}
    return {
        "losses": [m["loss"] for m in trace],
        "norms": [m["grad_norm"] for m in trace],
        "adapters": lora_full_tensors([chunk]),
        "shapes": shapes,
        "frozen": all(not p.requires_grad for n, p in chunk.named_parameters() if ".adapter." not in n),
    }


@pytest.mark.parametrize(
    "family", [pytest.param(name, marks=marks) for name, (_, _, _, marks) in TP_RUNS.items()]
)  # fmt: skip
def test_tensor_parallel_trains_the_adapters_as_one_process(tmp_path, family):
    from dist_harness import run_on_ranks
    from test_training_parity import assert_close_trace

    make, targets, split, _ = TP_RUNS[family]
    hf_dir = make(str(tmp_path / "hf"))
    args = (family, hf_dir, str(tmp_path), targets)
    one = run_on_ranks(_train_with_adapters, 1, args=args, timeout=600)[0]
    ranks = run_on_ranks(_train_with_adapters, 2, args=args, timeout=600)
    trained = [t for name, t in one["adapters"].items() if name.endswith("lora_B")]  # B starts at zero
    assert one["frozen"] and trained and all(t.abs().max() > 0 for t in trained)  # adapters learn, base frozen
    for got in ranks:
        assert_close_trace(got["losses"], one["losses"], 1e-5)
        assert_close_trace(got["norms"], one["norms"], 1e-5)
        assert got["adapters"].keys() == one["adapters"].keys()
        for name, tensor in one["adapters"].items():
            torch.testing.assert_close(got["adapters"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    # the mode was on: column layers' B and row layers' A split in two (a DeltaNet's in_proj_qkv per q/k/v
    # block), the rest (latent down-projections, the indexer, A of column layers) whole on every rank
    for name, shape in ranks[0]["shapes"].items():
        whole, leaf = one["shapes"][name], ".".join(name.split(".")[-3::2])
        dim = 0 if name.endswith("lora_B") else 1
        expected = (*whole[:dim], whole[dim] // 2, *whole[dim + 1 :]) if leaf in split else whole
        assert shape == expected, (name, shape, whole)


def test_adapters_whole_on_every_rank_have_complete_gradients():
    """The indexer's adapters, like its weights, are whole on every TP rank with complete gradients, so
    neither factor is summed over TP (a partial A would count its gradient once per rank); the column-parallel
    up-projection's A is partial (each rank holds its heads' rows of B)."""
    from megacann.layers.sharding import get_sharding
    from megacann.models import DeepseekV32Model
    from megacann.models.deepseek_v32_config import DeepseekV32ModelConfig

    sizes = dict(hidden_size=64, num_layers=1, num_attention_heads=4, ffn_hidden_size=96, kv_lora_rank=16,
                 q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=4,
                 index_head_dim=16, index_topk=6, first_k_dense_replace=1, vocab_size=260)  # fmt: skip
    with torch.device("meta"):
        model = DeepseekV32Model(DeepseekV32ModelConfig(**sizes))
    attach_lora(model, LoRAConfig(target_modules=("wq_b", "wk", "weights_proj", "q_b_proj")))
    partial = {name.split(".", 3)[-1]: get_sharding(p).tp_partial_grad for name, p in lora_parameters(model)
               if name.startswith("layers.0.")}  # fmt: skip
    assert partial == {
        "indexer.wq_b.adapter.lora_A": False, "indexer.wq_b.adapter.lora_B": False,
        "indexer.wk.adapter.lora_A": False, "indexer.wk.adapter.lora_B": False,
        "indexer.weights_proj.adapter.lora_A": False, "indexer.weights_proj.adapter.lora_B": False,
        "q_b_proj.adapter.lora_A": True, "q_b_proj.adapter.lora_B": False,
    }  # fmt: skip
