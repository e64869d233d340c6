"""The Qwen families started from a Hugging Face checkpoint (``model.init_from``, written by transformers)
train alike under tensor + sequence parallelism, pipeline stages, context parallelism (qwen3: its q/k
norms under ring and Ulysses attention) and expert parallelism (qwen3_moe) as on one process (gloo, CPU,
fp32): losses and gradient norms to 1e-5 relative. Each layout shows it is on: TP shard shapes (the
per-head norms whole on every rank), tokens per rank under SP / CP, the layers of each stage, the experts
of each rank.

The TP and PP layouts also write the weights they started from back as a Hugging Face directory
(``save_pretrained_hf``, collective): the tensors equal the checkpoint's. Two spawns: world 2 runs every
layout of every family, world 1 the one-process references.
"""

from __future__ import annotations

import pytest
from dist_harness import run_on_ranks
from qwen_helpers import FAMILY_SETTINGS, tiny_hf_qwen
from test_training_parity import assert_close_trace

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

STEPS = 3
SEQ = 16
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", f"data.seq_length={SEQ}", "data.batch_size=2", "data.tokenizer=byte"]
ACCUM2 = "optim.grad_accum_steps=2"
# global batch 4 sequences everywhere: micro-batch 2 x dp x accumulation
LAYOUTS = {
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true", ACCUM2],
    "pp2": ["distributed.pipeline_parallel_size=2", ACCUM2],
    "cp2": ["distributed.context_parallel_size=2", ACCUM2],  # ring attention
    "cp2_ulysses": ["distributed.context_parallel_size=2", "distributed.context_parallel_algo=ulysses", ACCUM2],
    "ep2": ["distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"],  # dp 2 (ep within it)
}
RUNS = {
    "qwen2": ("tp2_sp", "pp2"),
    "qwen3": ("tp2_sp", "pp2", "cp2", "cp2_ulysses"),
    "qwen3_moe": ("tp2_sp", "pp2", "ep2"),
}


def _trainer(family: str, hf_dir: str, overrides: list[str], output_dir: str):
    import torch.distributed as dist
    from finetune_helpers import recipe
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    model = {"type": family, "precision": "fp32", "init_from": hf_dir}  # the sizes come from config.json
    extra = [f"experiment.output_dir={output_dir}", f"optim.max_steps={STEPS}"]
    cfg = recipe(COMMON + extra + overrides, model=model, world_size=dist.get_world_size())
    return Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))


def _facts(trainer) -> dict:
    """What shows the layout is on, on this rank."""
    from megacann.layers.moe import moe_layers
    from megacann.layers.sharding import get_sharding

    layers = {int(i): block for chunk in trainer.model_chunks for i, block in chunk.layers.items()}
    attn = layers[min(layers)].self_attn
    facts = {
        "layers": sorted(layers),
        "q_proj": tuple(attn.q_proj.weight.shape),
        "experts": sorted({int(e) for chunk in trainer.model_chunks for m in moe_layers(chunk) for e in m.experts}),
    }
    if attn.q_norm is not None:
        facts["q_norm"] = (tuple(attn.q_norm.weight.shape), get_sharding(attn.q_norm.weight).tp_partial_grad)
    return facts


def _train(trainer) -> dict:
    seen: list = []
    first = next(iter(trainer.model_chunks[0].layers.values()))
    first.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    trace = [trainer.train_step() for _ in range(STEPS)]
    return {
        "losses": [m["loss"] for m in trace],
        "norms": [m["grad_norm"] for m in trace],
        "tokens": sorted(set(seen)),
        **_facts(trainer),
    }


EXPORTED = ("tp2_sp", "pp2")  # layouts that write the weights they started from back as Hugging Face files


def _world(runs: dict, hf_dirs: dict, root: str) -> dict:
    from megacann.interop.hf import save_pretrained_hf

    results = {}
    for family, layouts in runs.items():
        for layout in layouts:
            trainer = _trainer(family, hf_dirs[family], LAYOUTS.get(layout, [ACCUM2]), f"{root}/{family}_{layout}")
            if layout in EXPORTED:  # collective: each stage writes its shard, TP slices gathered
                save_pretrained_hf(trainer.model_chunks, f"{root}/{family}_{layout}/hf", trainer.cfg.model)
            results[(family, layout)] = _train(trainer)
    return results


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("qwen_hf")
    return {family: tiny_hf_qwen(str(root / family), family) for family in FAMILY_SETTINGS}


@pytest.fixture(scope="module")
def world2_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qwen_world2"))


@pytest.fixture(scope="module")
def world2(hf_dirs, world2_root):
    return run_on_ranks(_world, 2, args=(RUNS, hf_dirs, world2_root), timeout=600)


@pytest.fixture(scope="module")
def world1(hf_dirs, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qwen_world1"))
    return run_on_ranks(_world, 1, args=({f: ("one",) for f in RUNS}, hf_dirs, root), timeout=600)[0]


@pytest.mark.parametrize("family,layout", [(f, layout) for f, layouts in RUNS.items() for layout in layouts])
def test_layouts_train_like_one_process(world1, world2, family, layout):
    reference = world1[(family, "one")]
    for rank in world2:
        got = rank[(family, layout)]
        assert_close_trace(got["losses"], reference["losses"], 1e-5)
        assert_close_trace(got["norms"], reference["norms"], 1e-5)
    assert reference["layers"] == [0, 1, 2, 3] and reference["tokens"] == [SEQ]
    head_dim = FAMILY_SETTINGS[family].get("head_dim", 16)
    facts = [rank[(family, layout)] for rank in world2]
    if layout == "tp2_sp":  # half the query heads per rank; the per-head norms whole, their grads summed
        assert {f["q_proj"] for f in facts} == {(2 * head_dim, 64)} and reference["q_proj"] == (4 * head_dim, 64)
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
        if family != "qwen2":
            assert {f["q_norm"] for f in facts} == {((head_dim,), True)} and reference["q_norm"] == ((head_dim,), False)
    elif layout == "pp2":
        assert [f["layers"] for f in facts] == [[0, 1], [2, 3]]
    elif layout.startswith("cp2"):
        assert {f["tokens"][0] for f in facts} == {SEQ // 2}
    elif layout == "ep2":
        assert [f["experts"] for f in facts] == [[0, 1], [2, 3]] and reference["experts"] == [0, 1, 2, 3]


def _hf_tensors(path: str) -> dict:
    import glob

    from safetensors.torch import load_file

    return {k: v for file in sorted(glob.glob(f"{path}/*.safetensors")) for k, v in load_file(file).items()}


@pytest.mark.parametrize("family,layout", [(f, layout) for f in RUNS for layout in EXPORTED])
def test_weights_written_back_from_a_layout_equal_the_checkpoint(hf_dirs, world2, world2_root, family, layout):
    import torch

    original, exported = _hf_tensors(hf_dirs[family]), _hf_tensors(f"{world2_root}/{family}_{layout}/hf")
    if layout == "pp2" and "lm_head.weight" not in original:  # tied: the last stage writes its copy too
        assert torch.equal(exported.pop("lm_head.weight"), original["model.embed_tokens.weight"])
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
