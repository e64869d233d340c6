"""Multi-token prediction (``model.mtp_num_layers``): the loss a model returns equals the formula written
here in plain PyTorch with the model's weights (values and gradients of main + scaled MTP), the recipe
keys are checked, counted by the dry run, logged, kept by checkpoints, and the loss trace at tp 2 + SP
and pp 2 (untied and tied embeddings) equals one process, with each mode shown on."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_on_ranks
from test_training_parity import assert_close_trace
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.constants import IGNORE_INDEX
from megacann.models import LLAMA, MOE, ChunkPlacement, decoder_forward_step
from megacann.models.contract import backward_objective
from megacann.training.metrics import format_step_line

SEQ, STEPS = 16, 3
MTP = ["model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "model.num_layers=2", f"data.seq_length={SEQ}"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(model, ids: torch.Tensor, labels: torch.Tensor, scale: float):
    """Per-token main loss and the MTP loss from the formula: depth k embeds token i+k, projects
    [enorm(emb), hnorm(h)], runs its layer, and predicts token i+k+1 through the shared head."""
    eps, vocab = model.config.norm_eps, model.config.vocab_size
    emb, head = model.embed_tokens.weight, model.lm_head.output_weight
    h = F.embedding(ids, emb)
    for layer in model.layers.values():
        h = layer(h)
    h = _rms(h, model.norm.weight, eps)
    main = F.cross_entropy(
        (h @ head.T)[..., :vocab].transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    depth_losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        b = ids.shape[0]
        ids_k = torch.cat([ids[:, k:], torch.zeros(b, k, dtype=ids.dtype)], dim=1)
        target = torch.cat([labels[:, k:], torch.full((b, k), IGNORE_INDEX, dtype=labels.dtype)], dim=1)
        x = torch.cat([_rms(F.embedding(ids_k, emb), layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1)
        h = layer.transformer_layer(x @ layer.eh_proj.weight.T)
        logits = (_rms(h, layer.final_layernorm.weight, eps) @ head.T)[..., :vocab]
        depth_losses.append(F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=IGNORE_INDEX))
    return main, scale * torch.stack(depth_losses).mean()


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_loss_and_gradients_equal_the_formula(tied):
    cfg = tiny_config(MTP + [f"model.tie_word_embeddings={str(tied).lower()}"])
    model = LLAMA.build(cfg, ChunkPlacement((0, 1)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.randint(0, cfg.model.vocab_size, (2, 1), generator=gen)], dim=1)
    labels[0, 3:6] = IGNORE_INDEX  # prompt-like positions take no loss, at any depth that reaches them
    tokens = (labels != IGNORE_INDEX).sum()

    out = decoder_forward_step(model, {"tokens": ids, "labels": labels}, None)
    main, mtp = _reference(model, ids, labels, 0.3)
    assert torch.allclose(out.token_loss, main, rtol=1e-5, atol=1e-6)
    assert set(out.aux_losses) == {"mtp_loss"}
    assert abs(out.aux_losses["mtp_loss"].item() - mtp.item()) <= 1e-5 * mtp.item()

    # the objective is main + scaled MTP: its gradients are those of the formula's sum
    backward_objective(out, normalizer=tokens, aux_weight=1.0).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (main.sum() / tokens + mtp).backward()
    for name, param in model.named_parameters():
        assert torch.norm(got[name] - param.grad) <= 1e-5 * torch.norm(param.grad) + 1e-9, name
    assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_mtp_keys_are_checked_and_counted():
    with pytest.raises(ConfigError, match=r"'model.mtp_num_layers' for model.type 'gpt': it is a key of model famil"):
        tiny_config(["model.type=gpt", "model.mtp_num_layers=1"])
    with pytest.raises(ConfigError, match=r"model.mtp_num_layers must be an integer >= 0 \(0: off\), got -1"):
        tiny_config(["model.mtp_num_layers=-1"])
    with pytest.raises(ConfigError, match=r"mtp_num_layers 16 leaves no target.*below data.seq_length 16"):
        tiny_config([f"data.seq_length={SEQ}", "model.mtp_num_layers=16"])
    with pytest.raises(ConfigError, match=r"model.mtp_loss_scaling_factor must be a number >= 0, got -0.5"):
        tiny_config(["model.mtp_loss_scaling_factor=-0.5"])

    moe = ["model.type=moe", "model.num_experts=4", "model.moe_layer_freq=[0,1]", "model.moe_shared_experts=1"]
    for spec, extra in ((LLAMA, []), (MOE, moe)):
        with_mtp, without = tiny_config(MTP + extra).model, tiny_config(MTP[2:] + extra).model
        counted = dataclasses.replace(spec, num_parameters=None).total_parameters(with_mtp)  # built and counted
        assert spec.total_parameters(with_mtp) == counted  # the formula (the dry run's)
        h = with_mtp.hidden_size
        added = counted - spec.total_parameters(without)
        layer = (added - 2 * (3 * h + 2 * h * h)) // 2
        assert added == 2 * (layer + 3 * h + 2 * h * h) and layer > 0
        assert spec.flops_per_token(with_mtp, SEQ) > spec.flops_per_token(without, SEQ)


def test_dry_run_counts_and_places_mtp():
    from megacann.dry_run import describe

    cfg = tiny_config(MTP + ["distributed.pipeline_parallel_size=2"], world_size=2)
    text = describe(cfg)
    total = LLAMA.total_parameters(cfg.model)
    assert f"{total:,}" in text
    stage1 = next(line for line in text.splitlines() if line.startswith("stage 1"))
    assert "2 multi-token prediction depths, its embedding a copy of stage 0's" in stage1


@pytest.mark.parametrize("tied", [False, True])
def test_plan_counts_the_last_stage_mtp_parameters(tied):
    from megacann.planning.estimate import estimate_stages
    from megacann.planning.formulas import Layout

    layout = Layout(pp=2)
    flag = f"model.tie_word_embeddings={str(tied).lower()}"
    with_mtp, without = tiny_config(MTP + [flag], world_size=2), tiny_config(MTP[2:] + [flag], world_size=2)
    added = estimate_stages(with_mtp, layout)[1].params - estimate_stages(without, layout)[1].params
    last = LLAMA.build(with_mtp, ChunkPlacement((1,), pre_process=False, post_process=True))
    held = sum(p.numel() for n, p in last.named_parameters() if n.startswith(("mtp.", "mtp_embed_tokens.")))
    assert added == held and held > 0
    assert "2 MTP depths" in estimate_stages(with_mtp, layout)[1].holds


def test_console_line_shows_mtp_loss():
    record = {"step": 2, "loss": 5.25, "mtp_loss": 1.5, "lr": 1e-3, "tokens_per_second": 10.0, "step_time": 0.1}
    assert "loss 5.2500 | mtp_loss 1.5000 |" in format_step_line(record, 4, None)


# -- layouts, logging, checkpoints (gloo ranks) ------------------------------------------------------

ACCUM2 = "optim.grad_accum_steps=2"
LAYOUTS = {  # global batch 4 sequences everywhere: micro-batch 2 x dp x accumulation
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", ACCUM2],
    "pp2": ["distributed.pipeline_parallel_size=2", ACCUM2],
    "pp2_tied": ["distributed.pipeline_parallel_size=2", "model.tie_word_embeddings=true", ACCUM2],
}
COMMON = MTP + ["optim.clip_grad=0.5", "optim.lr=1e-2", "logging.log_interval=1", "logging.ckpt_interval=0"]


def _trainer(overrides: list[str], output_dir: str, steps: int = STEPS):
    import torch.distributed as dist
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    extra = [f"experiment.output_dir={output_dir}", f"optim.max_steps={steps}"]
    cfg = tiny_config(COMMON + extra + overrides, world_size=dist.get_world_size())
    return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))


def _layout_facts(trainer) -> dict:
    from megacann.layers.sharding import DUPLICATE_ATTR, SHARED_EMBEDDING_ATTR

    chunk = trainer.model_chunks[-1]
    facts = {"mtp": chunk.mtp is not None, "tied_copies": []}
    for name, param in chunk.named_parameters():
        if getattr(param, SHARED_EMBEDDING_ATTR, False):
            facts["tied_copies"].append((name, bool(getattr(param, DUPLICATE_ATTR, False))))
    if chunk.mtp is not None:
        facts["eh_proj"] = tuple(chunk.mtp.layers[0].eh_proj.weight.shape)
    return facts


def _train(trainer) -> dict:
    seen: list = []
    facts = _layout_facts(trainer)
    if trainer.model_chunks[-1].mtp is not None:
        block = trainer.model_chunks[-1].mtp.layers[0].transformer_layer
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    trace = [trainer.train_step() for _ in range(STEPS)]
    losses = [(m["loss"], m["mtp_loss"]) for m in trace]
    return {"trace": [x for pair in losses for x in pair] + [m["grad_norm"] for m in trace], "tokens": seen, **facts}


def _world2(root: str) -> dict:
    return {name: _train(_trainer(overrides, f"{root}/{name}")) for name, overrides in LAYOUTS.items()}


def _world1(root: str) -> dict:
    """The one-process trace; a run through fit() (metrics.jsonl); a checkpoint resumed keeps MTP's weights."""
    from checkpoint_helpers import weights

    tied = "model.tie_word_embeddings=true"
    result = {
        "one": _train(_trainer([ACCUM2], f"{root}/one")),
        "one_tied": _train(_trainer([ACCUM2, tied], f"{root}/t")),
    }
    first = _trainer([ACCUM2], f"{root}/fit", steps=2)
    first.fit()
    first.save_checkpoint()
    first.checkpointer.wait()
    saved = {k: v for k, v in weights(first).items() if k.startswith("mtp.")}
    second = _trainer([ACCUM2], f"{root}/fit", steps=2)
    second.resume()
    resumed = {k: v for k, v in weights(second).items() if k.startswith("mtp.")}
    result["resumed_equal"] = sorted(saved) == sorted(resumed) and all(torch.equal(saved[k], resumed[k]) for k in saved)
    result["mtp_names"] = sorted(saved)
    with open(f"{root}/fit/metrics.jsonl") as f:
        result["records"] = [json.loads(line) for line in f]
    return result


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_on_ranks(_world1, 1, args=(str(tmp_path_factory.mktemp("mtp1")),), timeout=300)[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_on_ranks(_world2, 2, args=(str(tmp_path_factory.mktemp("mtp2")),), timeout=400)


def test_logged_and_resumed(world1):
    records = [r for r in world1["records"] if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["mtp_loss"] > 0 and r["loss"] > 0 for r in records)
    assert world1["resumed_equal"]
    assert "mtp.layers.1.eh_proj.weight" in world1["mtp_names"]
    assert "mtp.layers.0.transformer_layer.self_attn.q_proj.weight" in world1["mtp_names"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_train_like_one_process(world1, world2, layout):
    reference = world1["one_tied" if layout == "pp2_tied" else "one"]
    assert len(reference["trace"]) == 3 * STEPS
    for rank in world2:
        if rank[layout]["mtp"]:  # the last stage's values; every rank's under TP
            assert_close_trace(rank[layout]["trace"], reference["trace"], 1e-5)
    last, first = world2[1][layout], world2[0][layout]
    assert last["mtp"]
    if layout == "tp2_sp":  # eh_proj split over TP; each rank's share of the sequence enters the MTP layer
        assert last["eh_proj"] == (32, 128) and set(last["tokens"]) == {SEQ // 2}
        assert first["mtp"] and not last["tied_copies"]
    else:  # MTP on the last stage only, its embedding a tied copy of the first stage's
        assert not first["mtp"] and set(last["tokens"]) == {SEQ}
        copy = "lm_head.weight" if layout == "pp2_tied" else "mtp_embed_tokens.weight"
        assert last["tied_copies"] == [(copy, True)] and first["tied_copies"] == [("embed_tokens.weight", False)]


def test_lora_adapts_eh_proj():
    from megacann.layers.lora import LoRAConfig, attach_lora

    cfg = tiny_config(MTP)
    model = LLAMA.build(cfg, ChunkPlacement((0, 1)))
    adapted = attach_lora(model, LoRAConfig(rank=2, target_modules=("eh_proj", "q_proj")))
    assert {n for n in adapted if "mtp" in n} == {
        f"mtp.layers.{k}.{p}" for k in (0, 1) for p in ("eh_proj", "transformer_layer.self_attn.q_proj")
    }


# -- extended: context parallelism, the MoE family ------------------------------------------------------

MOE_KEYS = ["model.type=moe", "model.num_experts=4", "model.moe_top_k=2", "model.moe_aux_loss_coeff=0.01"]
EXTENDED = {  # name -> (one-process reference overrides, world-2 overrides)
    "cp2_ring": ([ACCUM2], ["distributed.context_parallel_size=2", ACCUM2]),
    "cp2_ulysses": (
        [ACCUM2],
        ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=ulysses", ACCUM2],
    ),
    "moe_tp2_sp": (MOE_KEYS + [ACCUM2], MOE_KEYS + LAYOUTS["tp2_sp"]),
    "moe_pp2": (MOE_KEYS + [ACCUM2], MOE_KEYS + LAYOUTS["pp2"]),
    "moe_ep2": (MOE_KEYS + [ACCUM2], MOE_KEYS + ["distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"]),
}


def _extended(world: int, root: str) -> dict:
    runs = {}
    for name, overrides in EXTENDED.items():
        trainer = _trainer(overrides[0 if world == 1 else 1], f"{root}/{name}")
        runs[name] = _train(trainer)
        runs[name]["aux"] = sorted(k for k in trainer.train_step() if k.startswith("moe_") or k == "mtp_loss")
        mtp = trainer.model_chunks[-1].mtp
        moe = getattr(mtp.layers[0].transformer_layer.mlp, "experts", None) if mtp is not None else None
        runs[name]["experts"] = sorted(int(e) for e in moe) if moe is not None else []
    return runs


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(EXTENDED))
def test_extended_layouts_train_like_one_process(tmp_path_factory, name):
    global _EXTENDED_RESULTS
    if not _EXTENDED_RESULTS:
        root = str(tmp_path_factory.mktemp("mtpx"))
        _EXTENDED_RESULTS = {
            1: run_on_ranks(_extended, 1, args=(1, root + "/w1"), timeout=600)[0],
            2: run_on_ranks(_extended, 2, args=(2, root + "/w2"), timeout=900),
        }
    reference, ranks = _EXTENDED_RESULTS[1][name], _EXTENDED_RESULTS[2]
    for rank in ranks:
        if rank[name]["mtp"]:
            assert_close_trace(rank[name]["trace"], reference["trace"], 1e-5)
    last = ranks[1][name]
    if name.startswith("cp2"):  # each cp rank's share of the sequence enters the MTP layer
        assert set(last["tokens"]) == {SEQ // 2} and set(reference["tokens"]) == {SEQ}
    if name.startswith("moe"):  # the MTP layer is an MoE layer; its balancing loss is counted
        assert "moe_load_balancing" in last["aux"] and "mtp_loss" in last["aux"]
        assert reference["experts"] == [0, 1, 2, 3]
        if name == "moe_ep2":
            assert [r[name]["experts"] for r in ranks] == [[0, 1], [2, 3]]


_EXTENDED_RESULTS: dict = {}


def _zero_world4(root: str) -> dict:
    overrides = ["distributed.pipeline_parallel_size=2", "distributed.zero_optimization=1", "optim.grad_accum_steps=1"]
    return _train(_trainer(overrides, f"{root}/pp2_dp2_zero1"))


@pytest.mark.extended
def test_pp2_dp2_zero1_trains_like_one_process(tmp_path_factory):
    """ZeRO-1 over dp 2 with pipeline stages: the last stage's embedding copy is sharded and summed with stage 0's."""
    root = str(tmp_path_factory.mktemp("mtpz"))
    reference = run_on_ranks(_train_one, 1, args=(root + "/w1",), timeout=300)[0]
    ranks = run_on_ranks(_zero_world4, 4, args=(root + "/w4",), timeout=600)
    last = [r for r in ranks if r["mtp"]]
    assert len(last) == 2 and all(r["tied_copies"] == [("mtp_embed_tokens.weight", True)] for r in last)
    for rank in last:
        assert_close_trace(rank["trace"], reference["trace"], 1e-5)


def _train_one(root: str) -> dict:
    return _train(_trainer([ACCUM2], f"{root}/one"))
