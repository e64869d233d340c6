"""The sequence-wise load-balancing loss (``moe_router_load_balancing_type: seq_aux_loss``; DeepSeek-V2/V3).

Against a reference written here (float64, a loop over the sequences and experts, DeepSeek's form of the
formula: ``f_i = E / (K T) · count_i``, ``P_i`` the mean normalised score, ``alpha · Σ f_i P_i`` averaged
over sequences) for softmax and sigmoid scores, value and router-weight gradient; equal to the micro-batch
loss with one sequence; through the MoE layer (which passes its batch size); the refusals; DeepSeek's
config.json keys ``aux_loss_alpha`` / ``seq_aux`` read and written; and cp 2 (ring) and, in the extended
tier, tp 2 + SP (both with full recompute) and tp 2 + SP + cp 2 runs whose loss, gradient-norm and
auxiliary-loss traces equal one process's.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from deepseek_helpers import SHAPE
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.layers.moe import MoEConfig, MoELayer, TopKRouter

HIDDEN, EXPERTS, TOP_K, COEFF = 8, 8, 2, 0.01


def reference_seq_aux(x: torch.Tensor, weight: torch.Tensor, sequences: int, score_function: str) -> torch.Tensor:
    """The sequence-wise loss of the tokens ``x`` (``sequences`` runs of equal length, one after the
    other) under router ``weight``, in float64 with loops (no bias, no groups: plain top-k)."""
    logits = x.double() @ weight.double().t()
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    chosen = torch.topk(scores.detach(), TOP_K, dim=-1).indices
    normalised = scores / scores.sum(-1, keepdim=True)
    length = x.shape[0] // sequences
    total = torch.zeros((), dtype=torch.float64)
    for j in range(sequences):
        rows = slice(j * length, (j + 1) * length)
        for e in range(EXPERTS):
            f = EXPERTS / (TOP_K * length) * int((chosen[rows] == e).sum())
            total = total + f * normalised[rows, e].mean()
    return COEFF * total / sequences


def _tokens(sequences: int, length: int = 8, seed: int = 0) -> torch.Tensor:
    """Sequences that route differently: sequence ``j`` leans towards experts ``2j`` and ``2j + 1``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sequences, length, HIDDEN, generator=g, dtype=torch.float64)
    for j in range(sequences):
        x[j, :, (2 * j) % HIDDEN] += 2.0
        x[j, :, (2 * j + 1) % HIDDEN] += 1.5
    return x.reshape(-1, HIDDEN)


def _router(score_function: str, kind: str = "seq_aux_loss", seed: int = 1) -> TopKRouter:
    router = TopKRouter(
        HIDDEN, EXPERTS, TOP_K, score_function=score_function, aux_loss_coeff=COEFF, load_balancing_type=kind
    )
    with torch.no_grad():  # near the identity, so the lean of each sequence shows in its choices
        g = torch.Generator().manual_seed(seed)
        router.weight.data = (torch.eye(EXPERTS, HIDDEN) + 0.3 * torch.randn(EXPERTS, HIDDEN, generator=g)).double()
    return router


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_loss_and_gradient_equal_a_per_sequence_reference(score_function):
    router, x = _router(score_function), _tokens(3)
    routing = router(x, num_sequences=3)
    assert set(routing.aux_losses) == {"seq_load_balancing"}
    loss = routing.aux_losses["seq_load_balancing"]
    weight = router.weight.detach().clone().requires_grad_(True)
    expected = reference_seq_aux(x, weight, 3, score_function)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    (got,) = torch.autograd.grad(loss, router.weight)
    (want,) = torch.autograd.grad(expected, weight)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-15)
    counts = [torch.bincount(ids.reshape(-1), minlength=EXPERTS) for ids in routing.expert_ids.view(3, -1, TOP_K)]
    assert len({tuple(c.tolist()) for c in counts}) == 3  # every sequence routes differently
    assert routing.tokens_per_expert.tolist() == sum(counts).tolist()
    batch = _router(score_function, "aux_loss")(x).aux_losses["load_balancing"]
    assert loss.item() > 1.05 * batch.item()  # per sequence the imbalance shows; over the batch it averages out


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_one_sequence_gives_the_micro_batch_loss(score_function):
    x = _tokens(1, length=12)
    seq, batch = _router(score_function), _router(score_function, "aux_loss")
    a, b = seq(x, num_sequences=1).aux_losses["seq_load_balancing"], batch(x).aux_losses["load_balancing"]
    assert a.item() == pytest.approx(b.item(), rel=1e-14)
    (ga,), (gb,) = torch.autograd.grad(a, seq.weight), torch.autograd.grad(b, batch.weight)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=0)


def test_the_layer_passes_its_batch_size():
    torch.manual_seed(0)
    layer = MoELayer(
        MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=16, top_k=TOP_K, aux_loss_coeff=COEFF)
    )
    seq_layer = MoELayer(
        MoEConfig(
            hidden_size=HIDDEN,
            num_experts=EXPERTS,
            ffn_hidden_size=16,
            top_k=TOP_K,
            aux_loss_coeff=COEFF,
            load_balancing_type="seq_aux_loss",
        )
    )
    with torch.no_grad():  # the identity-like router of the tests above, so the sequences' lean shows
        layer.router.weight.copy_(_router("softmax").weight)
    seq_layer.load_state_dict(layer.state_dict())
    x = _tokens(2).float().view(2, 8, HIDDEN)
    torch.testing.assert_close(seq_layer(x), layer(x), rtol=0, atol=0)  # the routing itself is unchanged
    assert set(seq_layer.last_stats.aux_losses) == {"seq_load_balancing"}
    got = seq_layer.last_stats.aux_losses["seq_load_balancing"].item()
    expected = reference_seq_aux(x.reshape(-1, HIDDEN), seq_layer.router.weight, 2, "softmax").item()
    assert got == pytest.approx(expected, rel=1e-5)
    assert got != pytest.approx(layer.last_stats.aux_losses["load_balancing"].item(), rel=1e-3)
    assert seq_layer.last_stats.tokens_per_expert.tolist() == layer.last_stats.tokens_per_expert.tolist()


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"MoEConfig.load_balancing_type='seq_aux' is not one of .*'seq_aux_loss'\?"):
        MoEConfig(hidden_size=8, num_experts=4, ffn_hidden_size=8, load_balancing_type="seq_aux")
    with pytest.raises(
        ValueError, match=r"load_balancing_type 'sinkhorn' is not one of \('aux_loss', 'seq_aux_loss'\)"
    ):
        TopKRouter(8, 4, 2, load_balancing_type="sinkhorn")
    with pytest.raises(ValueError, match=r"12 tokens do not split into num_sequences=5"):
        _router("softmax")(_tokens(3, length=4), num_sequences=5)
    moe = ["model.type=moe", "model.num_experts=4", "model.moe_ffn_hidden_size=32"]
    with pytest.raises(
        ConfigError,
        match=r"model.moe_router_load_balancing_type: 'global_aux_loss' is not one of aux_loss, seq_aux_loss",
    ):
        tiny_config([*moe, "model.moe_router_load_balancing_type=global_aux_loss"])


def test_the_recipe_key_reaches_the_layers():
    from megacann.models.moe import moe_layer_config

    cfg = tiny_config(["model.type=moe", "model.num_experts=4", "model.moe_router_load_balancing_type=seq_aux_loss"])
    block = types.SimpleNamespace(
        sequence_parallel=False, init_method_std=0.02, output_layer_init_std=0.02, params_dtype=torch.float32
    )
    assert moe_layer_config(cfg.model, block).load_balancing_type == "seq_aux_loss"
    assert tiny_config(["model.type=moe", "model.num_experts=4"]).model.moe_router_load_balancing_type == "aux_loss"


# -- DeepSeek's config.json: aux_loss_alpha and seq_aux --------------------------------------------------


def _config_json(tmp_path, **keys) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SHAPE, "model_type": "deepseek_v3", **keys}))
    return str(path)


def test_deepseek_config_json_balancing_keys_are_read_and_written(tmp_path):
    from megacann.config.hf_config import load_hf_model_config
    from megacann.models import get_model_spec
    from megacann.models.deepseek_config import DeepseekV3ModelConfig

    adapter = get_model_spec("deepseek_v3").hf
    cfg = adapter.config_from_hf(_config_json(tmp_path, aux_loss_alpha=1e-4, seq_aux=True))
    assert (cfg.moe_aux_loss_coeff, cfg.moe_router_load_balancing_type) == (1e-4, "seq_aux_loss")
    written = adapter.config_to_hf(cfg, torch.float32)
    assert (written["aux_loss_alpha"], written["seq_aux"]) == (1e-4, True)
    (tmp_path / "back").mkdir()
    again = adapter.config_from_hf(_config_json(tmp_path / "back", **written))
    assert (again.moe_aux_loss_coeff, again.moe_router_load_balancing_type) == (1e-4, "seq_aux_loss")
    # seq_aux false: the micro-batch loss; a model.config_path recipe reads the same mapping
    values = load_hf_model_config(_config_json(tmp_path, aux_loss_alpha=0.01, seq_aux=False), DeepseekV3ModelConfig)
    assert (values["moe_aux_loss_coeff"], values["moe_router_load_balancing_type"]) == (0.01, "aux_loss")
    plain = adapter.config_from_hf(_config_json(tmp_path))  # transformers writes neither: the defaults, none back
    assert (plain.moe_aux_loss_coeff, plain.moe_router_load_balancing_type) == (0.0, "aux_loss")
    assert not {"aux_loss_alpha", "seq_aux"} & set(adapter.config_to_hf(plain, torch.float32))
    plain.moe_aux_loss_coeff = 0.01  # a loss over the micro-batch: seq_aux false beside it
    assert {k: adapter.config_to_hf(plain, torch.float32)[k] for k in ("aux_loss_alpha", "seq_aux")} == {
        "aux_loss_alpha": 0.01,
        "seq_aux": False,
    }
    for bad in ("yes", 1):
        with pytest.raises(ConfigError, match=rf"config.json: seq_aux {json.dumps(bad)} is not supported "):
            adapter.config_from_hf(_config_json(tmp_path, seq_aux=bad))


# -- tensor + sequence parallel and context parallel against one process ---------------------------------

SEQ_AUX = ["model.moe_aux_loss_coeff=1e-2", "model.moe_router_load_balancing_type=seq_aux_loss", "model.num_layers=2"]


FULL = "model.activation_checkpointing=full"  # the layout's only: the reference does not recompute


def _assert_like_one_process(layouts) -> None:
    """Each layout's loss, gradient-norm and auxiliary-loss traces equal its one-process run (1e-5), its
    probes show the modes on, and the sequence-wise loss is the one logged, non-zero, every step."""
    from dist_harness import run_on_ranks
    from layout_fuzz import check_layout, run_layouts

    (world,) = {layout.world for layout in layouts}
    got = run_on_ranks(run_layouts, world, args=(layouts, False), timeout=900)[0]
    ref = run_on_ranks(run_layouts, 1, args=(layouts, True), timeout=900)[0]
    for layout in layouts:
        problems = check_layout(layout, got[layout.name], ref[layout.name])
        assert not problems, (layout.name, problems)
        aux = ref[layout.name]["aux"]
        assert len(ref[layout.name]["losses"]) == len(aux) == layout.steps
        assert all(set(step) == {"moe_seq_load_balancing", "moe_z_loss"} for step in aux)
        assert all(step["moe_seq_load_balancing"] > 0 for step in aux)


def test_cp2_ring_with_full_recompute_trains_like_one_process():
    """World 2, micro-batches of 2 sequences, sigmoid scores: each cp rank holds half of every sequence;
    the recomputed forwards count nothing twice."""
    from layout_fuzz import MOE, Layout

    cp2 = ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=ring", FULL]
    _assert_like_one_process([Layout(0, 2, [*MOE, *SEQ_AUX, "model.moe_router=sigmoid"], cp2, steps=2, label="cp2")])


@pytest.mark.extended
def test_tp2_sp_trains_like_one_process():
    """World 2, micro-batches of 2 sequences: each TP rank routes its sequence shard of every sequence."""
    from layout_fuzz import MOE, Layout

    tp2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", FULL]
    _assert_like_one_process([Layout(0, 2, [*MOE, *SEQ_AUX], tp2, steps=2, label="tp2_sp")])


@pytest.mark.extended
def test_tp2_sp_cp2_trains_like_one_process():
    """World 4: every sequence split over both groups at once (the counts summed over TP, then CP)."""
    from layout_fuzz import MOE, Layout

    layout = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
    layout += ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=ring"]
    _assert_like_one_process([Layout(0, 4, [*MOE, *SEQ_AUX], layout, steps=2, label="tp2_sp_cp2")])
