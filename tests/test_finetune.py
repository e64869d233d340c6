"""Fine-tuning through the trainer (one process, CPU, fp32): ``model.init_from`` (megacann checkpoint, output
and consolidated directories, Hugging Face directory: the same weights, HF logits), SFT loss masking and its
defaults, LoRA (the adapted model equals its base at initialisation; the base is frozen: no gradients, no
optimizer state, unchanged), adapter-only checkpoints that resume bit for bit and refuse another base, and
the exports of a trained LoRA run: merged (megacann and Hugging Face) and PEFT, which transformers and peft
load with megacann's logits.

The trainer runs happen in one spawned rank (``_checks``); the tests assert on what it measured.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_harness import run_on_ranks
from finetune_helpers import COMMON, LORA, recipe

from megacann.config import ConfigError

# -- inside the rank --------------------------------------------------------------------------------------


def _trainer(overrides, out, model=None, **sections):
    import torch.distributed as dist
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    cfg = recipe([*COMMON, f"experiment.output_dir={out}", *overrides], model, dist.get_world_size(), **sections)
    runtime = setup_runtime(cfg)
    if cfg.train_mode == "sft":
        return Trainer(cfg, runtime)
    return Trainer(cfg, runtime, data_factory=synthetic_data_factory(cfg))


def _weights(trainer):
    from megacann.interop.full_state import full_state_dict

    return full_state_dict(trainer.model_chunks)


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _init_from_checks(tmp: str) -> dict:
    from finetune_helpers import VOCAB, chunk_logits, tiny_hf_base
    from training_helpers import tiny_hf_mixtral
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    from megacann.interop.export import consolidate

    out = {}
    hf_dir = tiny_hf_base(os.path.join(tmp, "hf_base"))
    from_hf = _trainer(
        [f"model.init_from={hf_dir}"], os.path.join(tmp, "unused"), model={"type": "llama", "precision": "fp32"}
    )
    theirs = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        out["hf_logits_diff"] = _max_diff(chunk_logits(from_hf), theirs(_ids()).logits)
    out["hf_sizes"] = (from_hf.cfg.model.hidden_size, from_hf.cfg.model.num_layers, from_hf.cfg.model.vocab_size)

    mixtral_dir = tiny_hf_mixtral(os.path.join(tmp, "hf_mixtral"), VOCAB)
    from_mixtral = _trainer(
        [f"model.init_from={mixtral_dir}"], os.path.join(tmp, "unused"), model={"type": "moe", "precision": "fp32"}
    )
    theirs = MixtralForCausalLM.from_pretrained(mixtral_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        out["mixtral_logits_diff"] = _max_diff(chunk_logits(from_mixtral), theirs(_ids()).logits)
    m = from_mixtral.cfg.model
    out["mixtral_sizes"] = (m.hidden_size, m.num_layers, m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size)

    pretrained = _trainer(["optim.max_steps=2"], os.path.join(tmp, "pretrain"))
    pretrained.fit()
    expected = _weights(pretrained)
    consolidate(os.path.join(tmp, "pretrain"), os.path.join(tmp, "consolidated"))
    for name, path in (
        ("output_dir", os.path.join(tmp, "pretrain")),
        ("checkpoint", os.path.join(tmp, "pretrain", "checkpoint_2")),
        ("consolidated", os.path.join(tmp, "consolidated")),
    ):
        got = _weights(_trainer([f"model.init_from={path}"], os.path.join(tmp, "unused")))
        out[f"same_weights_{name}"] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected
        )
    return out


def _ids():
    from finetune_helpers import IDS

    return IDS


def _lora_init_and_frozen_checks(tmp: str) -> dict:
    from finetune_helpers import chunk_logits

    from megacann.layers.lora import is_lora_parameter
    from megacann.training import finetune

    out = {}
    base_dir = os.path.join(tmp, "pretrain")
    plain = _trainer([f"model.init_from={base_dir}"], os.path.join(tmp, "unused"))
    adapted = _trainer([*LORA, f"model.init_from={base_dir}"], os.path.join(tmp, "unused"))
    out["init_logits_equal"] = torch.equal(chunk_logits(plain), chunk_logits(adapted))
    batches = [next(iter(plain.data.train)) for _ in range(2)]
    out["init_eval_loss_equal"] = _forward_loss(plain, batches) == _forward_loss(adapted, batches)
    before = _weights(adapted)
    adapted.train_step()
    after = _weights(adapted)
    named = [(n, p) for c in adapted.model_chunks for n, p in c.named_parameters()]
    frozen = [n for n, p in named if not p.requires_grad]
    trainable = [n for n, p in named if p.requires_grad]
    out["trainable_are_adapters"] = bool(trainable) and all(is_lora_parameter(p) for _, p in named if p.requires_grad)
    out["frozen_count"] = len(frozen)
    out["frozen_unchanged"] = all(torch.equal(before[n], after[n]) for n in frozen)
    out["adapters_moved"] = any(not torch.equal(before[n], after[n]) for n in trainable)
    out["frozen_without_grads"] = not any(
        hasattr(p, "main_grad") or p.grad is not None for _, p in named if not p.requires_grad
    )
    out["state_names"] = sorted({s.name for s in adapted.optimizer.state_shards()})
    out["trainable_names"] = sorted(trainable)
    counted = finetune.parameter_counts(adapted.model_chunks)
    out["counts"] = counted
    out["adapter_numel"] = sum(p.numel() for n, p in named if p.requires_grad)
    out["line"] = finetune.memory_line(adapted.model_chunks, adapted.optimizer)
    return out


def _forward_loss(trainer, batches) -> float:
    totals = trainer.forward_backward(trainer.model_chunks, batches, loss_normalizer=1.0, forward_only=True)
    return float(totals.reduce(1.0)["loss"])


def _masking_checks(tmp: str, jsonl: str) -> dict:
    import torch.nn.functional as F
    from finetune_helpers import sft_overrides

    from megacann.constants import IGNORE_INDEX

    trainer = _trainer(sft_overrides(jsonl, os.path.join(tmp, "cache")), os.path.join(tmp, "unused"))
    batch = next(trainer.data.train)
    tokens, labels, segments = batch["tokens"], batch["labels"], batch["segment_ids"]
    expected = torch.full_like(labels, IGNORE_INDEX)
    for b in range(tokens.shape[0]):  # "Reverse: abc\n" + "cba" + EOS: only "cba" and EOS are targets
        row = tokens[b].tolist()
        for s in set(segments[b].tolist()):
            where = [i for i in range(len(row)) if segments[b, i] == s]
            newline = next((i for i in where if row[i] == ord("\n")), None)
            if newline is None:
                continue  # padding
            for i in where[where.index(newline) : -1]:
                expected[b, i] = row[i + 1]
    out = {"labels_match_answers": torch.equal(labels, expected), "targets": int((labels != IGNORE_INDEX).sum())}
    chunk = trainer.model_chunks[0]
    kwargs = dict(input_ids=tokens, position_ids=batch["position_ids"], segment_ids=segments)
    with torch.no_grad():
        per_token = chunk(labels=labels, **kwargs)
        logits = chunk(**kwargs)
    keep = labels != IGNORE_INDEX
    reference = F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
    out["loss_vs_reference"] = abs(float(per_token.sum()) - float(reference)) / float(reference)
    out["ignored_positions_zero"] = bool((per_token[~keep] == 0).all())
    out["lr"], out["warmup_ratio"] = trainer.cfg.optim.lr, trainer.cfg.optim.warmup_ratio
    return out


def _resume_and_export_checks(tmp: str, jsonl: str) -> dict:
    from finetune_helpers import chunk_logits, sft_overrides
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from megacann.checkpoint import CheckpointError
    from megacann.checkpoint.metadata import read_dcp_metadata, read_info
    from megacann.interop.export import export_hf
    from megacann.interop.lora_export import build_full_model, export_peft_checkpoint, merge_lora_checkpoint

    out = {}
    sft = [*sft_overrides(jsonl, os.path.join(tmp, "cache")), *LORA, "lora_dropout=0.1", "model.hidden_dropout=0.1"]
    sft += ["optim.max_steps=4", "logging.ckpt_interval=2"]
    first_dir, second_dir = os.path.join(tmp, "lora_a"), os.path.join(tmp, "lora_b")
    base_dir = os.path.join(tmp, "pretrain")
    sft_on = [*sft, f"model.init_from={base_dir}"]
    straight = _trainer(sft_on, first_dir)
    history = straight.fit()
    resumed = _trainer(sft_on, second_dir)
    resumed.resume(os.path.join(first_dir, "checkpoint_2"))
    tail = resumed.fit()
    losses = [r["loss"] for r in history if "loss" in r]
    out["losses"] = losses
    out["resumed_losses"] = [r["loss"] for r in tail if "loss" in r]
    a, b = _weights(straight), _weights(resumed)
    out["resumed_weights_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    ckpt = os.path.join(first_dir, "checkpoint_4")
    keys = [k for k in read_dcp_metadata(ckpt).state_dict_metadata if k.startswith("model/")]
    out["model_keys_all_adapters"] = bool(keys) and all(".adapter.lora_" in k for k in keys)
    info = read_info(ckpt)
    out["base"], out["lora"] = info["base"], info["lora"]

    # the same adapters on another base (same weights, other directory kind: another fingerprint)
    other = _trainer([*sft, f"model.init_from={os.path.join(tmp, 'consolidated')}"], second_dir)
    try:
        other.load_checkpoint(ckpt)
        out["other_base_error"] = None
    except CheckpointError as err:
        out["other_base_error"] = str(err)

    ours = chunk_logits(straight)
    merged_dir = merge_lora_checkpoint(first_dir, os.path.join(tmp, "merged"))
    merged = build_full_model(merged_dir).eval()
    with torch.no_grad():
        out["merged_megacann_diff"] = _max_diff(merged(input_ids=_ids()), ours)
    hf_merged = merge_lora_checkpoint(first_dir, os.path.join(tmp, "merged_hf"), to="hf")
    with torch.no_grad():
        theirs = LlamaForCausalLM.from_pretrained(hf_merged, attn_implementation="eager").eval()(_ids()).logits
    out["merged_hf_diff"] = _max_diff(theirs, ours)
    from transformers import AutoTokenizer

    for kind in ("merged", "merged_hf"):  # the run's tokenizer goes with the merged model
        found = AutoTokenizer.from_pretrained(os.path.join(tmp, kind, "tokenizer" if kind == "merged" else ""))
        out[f"{kind}_tokenizer"] = found("Reverse: abc")["input_ids"]
    base_hf = export_hf(base_dir, os.path.join(tmp, "base_hf"))
    adapter = export_peft_checkpoint(first_dir, os.path.join(tmp, "peft"), base=base_hf)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        out["peft_config"] = json.load(f)
    hf_base = LlamaForCausalLM.from_pretrained(base_hf, attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = hf_base(_ids()).logits
        peft_logits = PeftModel.from_pretrained(hf_base, adapter).eval()(_ids()).logits
    out["peft_diff"], out["adapters_act"] = _max_diff(peft_logits, ours), _max_diff(base_logits, ours)
    for name, call in (
        ("to_hf_refused", lambda: export_hf(first_dir, os.path.join(tmp, "x"))),
        ("wrong_base_refused", lambda: merge_lora_checkpoint(first_dir, os.path.join(tmp, "y"), base=base_hf)),
    ):
        try:
            call()
            out[name] = None
        except CheckpointError as err:
            out[name] = str(err)
    return out


def _checks(tmp: str) -> dict:
    from finetune_helpers import write_reverse_task

    jsonl = write_reverse_task(os.path.join(tmp, "data", "reverse.jsonl"))
    results = {}
    results.update(_init_from_checks(tmp))
    results.update(_lora_init_and_frozen_checks(tmp))
    results.update(_masking_checks(tmp, jsonl))
    results.update(_resume_and_export_checks(tmp, jsonl))
    return results


# -- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return run_on_ranks(_checks, 1, args=(str(tmp_path_factory.mktemp("finetune")),), timeout=600)[0]


def test_init_from_a_hugging_face_directory_gives_its_logits_and_sizes(measured):
    assert measured["hf_logits_diff"] < 1e-4
    assert measured["hf_sizes"] == (64, 4, 260)  # taken from config.json: the recipe named only the type


def test_init_from_a_hugging_face_mixtral_directory_gives_its_logits_and_sizes(measured):
    assert measured["mixtral_logits_diff"] < 1e-4
    assert measured["mixtral_sizes"] == (64, 2, 4, 2, 48)  # from config.json: the recipe named only model.type


@pytest.mark.parametrize("kind", ["output_dir", "checkpoint", "consolidated"])
def test_init_from_megacann_weights_loads_them_exactly(measured, kind):
    assert measured[f"same_weights_{kind}"]


def test_lora_model_equals_its_base_at_initialisation(measured):
    assert measured["init_logits_equal"] and measured["init_eval_loss_equal"]


def test_lora_base_is_frozen_without_grads_or_optimizer_state(measured):
    assert measured["trainable_are_adapters"] and measured["frozen_count"] > 0
    assert measured["frozen_unchanged"] and measured["adapters_moved"] and measured["frozen_without_grads"]
    assert measured["state_names"] == measured["trainable_names"]
    trainable, total = measured["counts"]
    assert trainable == measured["adapter_numel"] and total > 5 * trainable
    assert f"parameters: {trainable:,} trainable of {total:,}" in measured["line"]


def test_sft_loss_counts_only_the_answers(measured):
    assert measured["labels_match_answers"] and measured["targets"] > 0
    assert measured["ignored_positions_zero"] and measured["loss_vs_reference"] < 1e-6
    assert (measured["lr"], measured["warmup_ratio"]) == (1e-2, 0.05)  # the recipe's lr, SFT's warmup default


def test_sft_with_lora_resumes_bit_for_bit_from_adapter_only_checkpoints(measured):
    assert measured["resumed_losses"] == measured["losses"][2:]
    assert measured["resumed_weights_equal"] and measured["model_keys_all_adapters"]
    assert measured["base"]["kind"] == "checkpoint" and measured["base"]["step"] == 2
    assert measured["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": "all-linear"}
    assert "was trained on another base" in measured["other_base_error"]


def test_merged_and_peft_exports_give_the_adapter_logits(measured):
    assert measured["adapters_act"] > 1e-3
    assert measured["merged_megacann_diff"] < 1e-5
    assert measured["merged_hf_diff"] < 1e-4
    expected = list(b"Reverse: abc")  # the byte tokenizer: one id per byte
    for kind in ("merged", "merged_hf"):
        assert measured[f"{kind}_tokenizer"][-len(expected) :] == expected, measured[f"{kind}_tokenizer"]
    assert measured["peft_diff"] < 1e-4
    assert measured["peft_config"]["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    assert "holds LoRA adapters only" in measured["to_hf_refused"]
    assert "is not the base this LoRA checkpoint was trained on" in measured["wrong_base_refused"]


# -- recipes (no rank needed) ---------------------------------------------------------------------------------


def test_sft_defaults_fill_only_what_the_recipe_leaves_unset():
    cfg = recipe(["train_mode=sft"], optim={"lr": None})
    assert (cfg.optim.lr, cfg.optim.warmup_ratio) == (1e-5, 0.05)
    assert recipe(["train_mode=sft", "optim.lr=2e-4", "optim.warmup_ratio=0.1"]).optim.warmup_ratio == 0.1
    assert recipe([], optim={"lr": None}).optim.lr == 3e-4 and recipe().optim.warmup_ratio == 0.0


def test_init_from_refuses_a_recipe_with_another_architecture(tmp_path):
    from finetune_helpers import tiny_hf_base

    hf_dir = tiny_hf_base(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"model.hidden_size is 128 in the recipe but 64 there"):
        recipe([f"model.init_from={hf_dir}", "model.hidden_size=128"])
    with pytest.raises(ConfigError, match=r"model.init_from: .*nowhere' is not a directory"):
        recipe([f"model.init_from={tmp_path / 'nowhere'}"])


def test_lora_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"lora_rank: LoRA rank must be a positive integer, got 0"):
        recipe([*LORA, "lora_rank=0"])
    with pytest.raises(ConfigError, match=r"lora_target_modules: .*'qproj' is not a projection name.*'q_proj'"):
        recipe([*LORA, "lora_target_modules=[qproj]"])
    with pytest.raises(ConfigError, match=r"lora_target_modules: LoRA target_modules \['gate_proj'\] match no layer"):
        recipe([*LORA, "lora_target_modules=[q_proj,gate_proj]", "model.type=gpt"])  # GELU MLP: up, down
