"""deepseek_v32 under context parallelism (all-gather, cp 2), started from a transformers-written checkpoint
(index_topk 6 under 16-token sequences, the indexer loss on): the sparse stage and the dense warm-up train
alike as on one process (gloo, CPU, fp32): losses, gradient norms and the indexer loss to 1e-5 relative.
Probes: each rank held half the tokens and scored its 8 queries against all 16 keys of the sequence, and
the keys its queries read follow their global positions in the load-balanced layout (rank 0 holds
positions 0-3 and 12-15, rank 1 4-11; query t reads min(t + 1, 6) keys); the warm-up chose none. The
layer refuses ring attention by name at run time. Tensor parallelism 2 with sequence parallelism x cp 2
(world 4, the extended tier) trains the sparse stage alike too: each rank's layers held half the heads and
a quarter of the tokens, its queries (its cp half, gathered over the tp ranks) scored all 16 keys and read
as above. Spawns: world 2 the cp runs, world 4 the tp x cp run, world 1 the references."""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from test_deepseek_v32_models import tiny_hf_deepseek_v32
from test_qwen_parallel import ACCUM2, SEQ, _trainer
from test_training_parity import assert_close_trace

WARMUP = "model.indexer_warmup=true"
CP2 = ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=allgather", ACCUM2]
TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
HEADS = 4  # the helper's num_attention_heads
TOPK = 6
POSITIONS = {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: list(range(4, 12))}  # cp 2: chunks of 4, rank r holds r and 3 - r


def _keys_read(positions: list[int]) -> float:
    return sum(min(t + 1, TOPK) for t in positions) / len(positions)


def _train(trainer) -> dict:
    import torch

    from megacann import parallel_state as ps

    seen, read, scored = [], [], []
    block = trainer.model_chunks[0].layers["0"]
    block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    attn = block.self_attn
    indexer = attn.indexer
    select, scores = indexer.select, indexer.scores
    indexer.select = lambda *args: read.append(select(*args)) or read[-1]
    indexer.scores = lambda *args: scored.append(scores(*args)) or scored[-1]
    trace = [trainer.train_step() for _ in range(3)]
    facts = {
        "losses": [m["loss"] for m in trace],
        "norms": [m["grad_norm"] for m in trace],
        "indexer": [m["indexer_kl"] for m in trace],
        "tokens": sorted(set(seen)),
        "scored": sorted({tuple(s.shape[1:]) for s in scored}),
        "keys_read": sorted({float(mask.sum(-1).float().mean()) for mask in read}),
        "heads": attn.local_heads,
        "q_b_proj": attn.q_b_proj.weight.shape[0] // attn.qk_head_dim,  # the heads the rank's weight holds
        "cp_rank": ps.get_context_parallel_rank(),
    }
    if ps.get_context_parallel_world_size() > 1:
        attn.context_parallel_algo = "ring"  # what the recipe check refuses, the layer refuses too
        try:
            attn(torch.zeros(1, SEQ // 2, attn.kv_a_proj_with_mqa.weight.shape[1]))
        except ValueError as error:
            facts["ring"] = str(error)
    return facts


def _layer_errors() -> dict:
    """A LatentAttention with a SparseIndexer (top 5 of 16 keys, or dense as in the warm-up) over packed
    documents crossing the chunk edges, at cp 2 against the same layer over the whole sequence on this rank
    (a group of one): relative errors of the output, the input's gradient, every weight's gradient (summed
    over the cp ranks) and the indexer loss (the mean of the ranks' losses)."""
    import torch
    import torch.distributed as dist
    from layers_reference import rel_err

    from megacann import parallel_state as ps
    from megacann.layers import LatentAttention
    from megacann.layers.context_parallel import context_parallel_gather, context_parallel_split
    from megacann.layers.rotary import RotaryEmbedding
    from megacann.layers.sparse_indexer import SparseIndexer

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    alone = [dist.new_group([r]) for r in range(2)][dist.get_rank()]
    segments = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [4] * 16])
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1)
    index = torch.arange(16).expand(2, 16)
    positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values  # restarting per document
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    errors = {}
    for dense in (False, True):
        torch.manual_seed(0)
        attn = LatentAttention(32, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                               q_lora_rank=16, indexer=SparseIndexer(32, 16, 4, 8, 4, 5), indexer_dense=dense,
                               indexer_loss_coeff=0.5, context_parallel_algo="allgather").train()  # fmt: skip
        with torch.no_grad():  # wide weights: distributions far from uniform, choices far from ties
            for param in attn.parameters():
                param.normal_(0.0, 0.5)
        rotary = RotaryEmbedding(4, 10000.0)
        results = []
        for group, split, share in ((alone, lambda t: t, 1.0), (None, context_parallel_split, 0.5)):
            attn.context_parallel_group = group
            attn.zero_grad()
            local = split(x).clone().requires_grad_()
            out = attn(local, rotary(split(positions)), split(segments))
            loss = attn.last_indexer_loss
            # each rank's loss is the mean over its half of the queries: half of it, as the trainer weighs it
            ((out * split(grad)).sum() + share * loss).backward()
            grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
            out, loss = out.detach(), loss.detach().clone()
            if group is None:  # back to the whole sequence, the weights' gradients and the losses summed
                out = context_parallel_gather(out)
                for g in (*grads.values(), loss):
                    dist.all_reduce(g, group=ps.get_context_parallel_group())
            results.append((out, local.grad, grads, share * loss))
        (out_1, dx_1, grads_1, loss_1), (out_2, dx_2, grads_2, loss_2) = results
        name = "dense" if dense else "sparse"
        errors[f"{name}/out"] = rel_err(out_2, out_1)
        errors[f"{name}/dx"] = rel_err(dx_2, context_parallel_split(dx_1))
        errors[f"{name}/loss"] = rel_err(loss_2, loss_1)
        errors |= {f"{name}/d.{n}": rel_err(grads_2[n], grads_1[n]) for n in grads_1}
    return errors


def _world(runs: dict, hf_dir: str, root: str) -> dict:
    import torch.distributed as dist

    results = {}
    for name, overrides in runs.items():
        results[name] = _train(_trainer("deepseek_v32", hf_dir, overrides, f"{root}/{name}"))
    if dist.get_world_size() == 2:  # the layer check runs beside the cp 2 runs only
        results["layer"] = _layer_errors()
    return results


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_deepseek_v32(str(tmp_path_factory.mktemp("dsv32_hf") / "hf"), index_topk=TOPK)


@pytest.fixture(scope="module")
def one(hf_dir, tmp_path_factory):
    runs = {"one": [ACCUM2], "one_warmup": [ACCUM2, WARMUP]}
    return run_on_ranks(_world, 1, args=(runs, hf_dir, str(tmp_path_factory.mktemp("dsv32_cp1"))), timeout=900)[0]


@pytest.fixture(scope="module")
def world2(hf_dir, tmp_path_factory):
    runs = {"cp2": CP2, "cp2_warmup": [*CP2, WARMUP]}
    return run_on_ranks(_world, 2, args=(runs, hf_dir, str(tmp_path_factory.mktemp("dsv32_cp2"))), timeout=900)


@pytest.fixture(scope="module")
def world4(hf_dir, tmp_path_factory):
    runs = {"tp2_sp_cp2": [*CP2, *TP2_SP]}
    return run_on_ranks(_world, 4, args=(runs, hf_dir, str(tmp_path_factory.mktemp("dsv32_tp2cp2"))), timeout=900)


# (the run, the world that ran it, tensor-parallel ranks): tp 2 x cp 2 is world 4, a slow check
LAYOUTS = [
    pytest.param("cp2", "world2", 1, id="cp2"),
    pytest.param("cp2_warmup", "world2", 1, id="cp2_warmup"),
    pytest.param("tp2_sp_cp2", "world4", 2, id="tp2_sp_cp2", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("run,world,tp", LAYOUTS)
def test_all_gather_context_parallelism_trains_like_one_process(request, one, run, world, tp):
    stage = "_warmup" if run.endswith("_warmup") else ""
    reference = one[f"one{stage}"]
    assert reference["tokens"] == [SEQ] and reference["scored"] == [(SEQ, SEQ)]
    assert reference["heads"] == reference["q_b_proj"] == HEADS and reference["cp_rank"] == 0
    assert all(loss > 1.0 for loss in reference["indexer"])  # summed over 4 layers, far from 0
    ranks = [r[run] for r in request.getfixturevalue(world)]
    assert sorted(f["cp_rank"] for f in ranks) == sorted([0, 1] * tp)  # both cp ranks, on each tp rank
    for facts in ranks:
        for key in ("losses", "norms", "indexer"):
            assert_close_trace(facts[key], reference[key], 1e-5)
        # the layer sees its cp half, split again over the tp ranks under SP; its queries are the cp half
        assert facts["tokens"] == [SEQ // 2 // tp] and facts["scored"] == [(SEQ // 2, SEQ)]
        assert facts["heads"] == facts["q_b_proj"] == HEADS // tp
        if stage:  # dense attention: no key chosen
            assert facts["keys_read"] == [] and reference["keys_read"] == []
        else:
            assert facts["keys_read"] == [_keys_read(POSITIONS[facts["cp_rank"]])]
            assert reference["keys_read"] == [_keys_read(list(range(SEQ)))] == [81 / 16]
        assert facts["ring"] == (
            "LatentAttention: a sparse indexer (DeepSeek-V3.2) runs under context parallelism with "
            "context_parallel_algo 'allgather' only (each query picks its keys from the whole sequence), got 'ring'"
        )


def test_packed_documents_choose_and_read_like_one_process(world2):
    for rank, world in enumerate(world2):
        errors = world["layer"]
        assert len(errors) == 2 * (3 + 12), sorted(errors)  # out, dx, loss, 12 weights; sparse and dense
        bad = {name: err for name, err in errors.items() if not err < 1e-5}
        assert not bad, (rank, bad)
