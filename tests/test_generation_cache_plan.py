"""The generation cache ``--dry_run`` and ``megacann-plan`` print equals what the generator allocates, for every
kind of layer a family declares (``ModelSpec.decode_cache``): keys and values (llama), a rolling window
(mistral), sliding and full layers alternating (gpt_oss), compressed latents (deepseek_v3), latents with
the indexer's keys (deepseek_v32), Gated DeltaNet states beside full attention (qwen3_5, qwen3_next), a
window of KV heads with compressor and indexer projections (deepseek_v4).

Each family's tiny recipe, shrunk, is built on the CPU (fp32, random weights); a generation of the
recipe's size runs and the bytes of the cache's tensors (``KVCache.nbytes``) are measured: for
``generation_eval``, ``batch_size`` rows at the cache length the run preallocates; for GRPO,
``data.batch_size x grad_accum_steps`` rows with prompts of the longest length ``rl.max_new_tokens`` leaves.
The printed figures (the dry run's and the plan's report) are compared with those bytes, at tp 1 in one
process and at tp 2 on two gloo ranks (each rank measuring its own share)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_on_ranks

from megacann.config import load_config
from megacann.config.generation_eval import generation_cache_slots
from megacann.generation import Generator, SamplingParams
from megacann.models import ChunkPlacement, get_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, NEW, ROWS = 8, 4, 3  # generation_eval: 3 rows of 8 + 4 - 1 slots
RL_NEW, RL_ROWS = 3, (2, 2)  # GRPO: data.batch_size 2 x grad_accum_steps 2 rows, prompts of 8 - 3 tokens
WINDOW = 5  # shorter than the cache: the sliding layers' rolling caches hold only the window
FAMILIES = {
    "llama": ("llama", []),
    "mistral": ("mistral", [f"model.sliding_window={WINDOW}"]),
    "gpt_oss": ("gpt_oss", [f"model.sliding_window={WINDOW}"]),
    "deepseek_v3": ("deepseek", []),
    "deepseek_v32": ("deepseek_v32", []),
    "qwen3_5": ("qwen3_5", []),
    "qwen3_next": ("qwen3_next", []),
    "deepseek_v4": ("deepseek_v4", [f"model.sliding_window={WINDOW}"]),
}


def write_prompts(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "prompts.jsonl")
    with open(path, "w") as f:
        f.write('{"prompt": "ab", "answer": "ba"}\n')
    return path


def recipe(family: str, root: str, tp: int = 1, grpo: bool = False, extra: tuple = (), world: int = 0):
    """The family's tiny recipe, shrunk, asking for a generation evaluation (or, ``grpo``, GRPO), on ``world``
    ranks (0: ``tp``)."""
    folder, overrides = FAMILIES[family]
    prompts = write_prompts(root)
    shape = [f"data.seq_length={SEQ}", "model.vocab_size=260", f"distributed.tensor_parallel_size={tp}"]
    if grpo:
        batch, accum = RL_ROWS
        asked = ["train_mode=grpo", f"rl.prompts={prompts}", f"rl.max_new_tokens={RL_NEW}", "rl.group_size=2"]
        asked += [f"data.batch_size={batch}", f"optim.grad_accum_steps={accum}", "data.tokenizer=byte"]
    else:
        asked = ["generation_eval.interval=5", f"generation_eval.prompts={prompts}"]
        asked += [f"generation_eval.batch_size={ROWS}", f"generation_eval.max_new_tokens={NEW}"]
    path = os.path.join(ROOT, "examples", "configs", folder, "tiny.yaml")
    return load_config(path, shape + overrides + asked + list(extra), world_size=world or tp)


def measured_cache_bytes(cfg, grpo: bool) -> int:
    """Build the recipe's model on this process (its tensor-parallel share) and generate a batch of the
    recipe's size; the bytes of the cache's tensors after the generation."""
    spec = get_model_spec(cfg.model.type)
    model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "cpu").eval()
    torch.manual_seed(0)
    if grpo:  # the GRPO trainer's generator sizes the cache to the batch: prompts of the longest length allowed
        rows, new = RL_ROWS[0] * RL_ROWS[1], RL_NEW
        generator = Generator(model, spec)
        lengths = [SEQ - RL_NEW] + [2] * (rows - 1)
    else:  # generation_eval preallocates the longest prompt allowed plus the new tokens but the last
        rows, new = ROWS, NEW
        generator = Generator(model, spec, max_len=generation_cache_slots(cfg))
        lengths = [3, SEQ, 5][:rows]
    prompts = [torch.randint(1, 250, (n,)).tolist() for n in lengths]
    generator.generate(prompts, SamplingParams(max_new_tokens=new))
    assert len(generator.last_cache.layers) == cfg.model.num_layers  # every layer cached, none dropped
    return generator.last_cache.nbytes


def printed(cfg, tp: int, prefix: str) -> str:
    """The one line starting with ``prefix`` in ``--dry_run``'s description, the same in ``megacann-plan``'s
    report (deepseek_v4's report: its static memory and these lines)."""
    from megacann.dry_run import describe
    from megacann.planning import plan_report

    dry = [line for line in describe(cfg).splitlines() if line.startswith(prefix)]
    plan = [line for line in plan_report(cfg, None, tp, None).splitlines() if line.startswith(prefix)]
    assert len(dry) == 1 and dry == plan, (dry, plan)
    return dry[0]


def printed_generation_eval_bytes(cfg, tp: int) -> int:
    """The bytes of the generation_eval line, the same in ``--dry_run`` and ``megacann-plan``'s report."""
    prefix = "generation_eval key/value cache per rank: "
    return int(printed(cfg, tp, prefix)[len(prefix) :].split(" bytes")[0].replace(",", ""))


def printed_grpo_bytes(cfg) -> int:
    """The bytes of the GRPO generation cache line (in all, after its layers' summary), the same in
    ``--dry_run`` and ``megacann-plan``'s report."""
    line = printed(cfg, cfg.distributed.tensor_parallel_size, "GRPO generation cache")
    return int(line.split(" bytes in all")[0].rsplit("(", 1)[1].replace(",", ""))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_eval_cache_printed_equals_allocated(tmp_path, family):
    cfg = recipe(family, str(tmp_path))
    assert printed_generation_eval_bytes(cfg, 1) == measured_cache_bytes(cfg, grpo=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_cache_printed_equals_allocated(tmp_path, family):
    cfg = recipe(family, str(tmp_path), grpo=True)
    assert printed_grpo_bytes(cfg) == measured_cache_bytes(cfg, grpo=True)


def test_the_kinds_are_what_each_family_declares(tmp_path):
    """Probes that each kind of layer was really in the comparison: the dry run names what each keeps."""
    lines = {f: printed_line(recipe(f, str(tmp_path / f))) for f in FAMILIES}
    full = f"keys and values of 4 kv heads x head dim 32: {2 * ROWS * (SEQ + NEW - 1) * 4 * 32 * 4 * 4:,} bytes"
    assert lines["llama"].endswith(f"tp 1: 4 layers of {full}")
    assert lines["mistral"].endswith(f"window {WINDOW}: {4 * 2 * ROWS * WINDOW * 4 * 48 * 4:,} bytes")
    assert f"2 layers of keys and values of 4 kv heads x head dim 32, window {WINDOW}: " in lines["gpt_oss"]
    assert "2 layers of keys and values of 4 kv heads x head dim 32: " in lines["gpt_oss"]
    assert "layers of latent " in lines["deepseek_v3"] and "index key" not in lines["deepseek_v3"]
    assert "+ index key 32 a token" in lines["deepseek_v32"]
    # sliding, CSA (kv and gate 2 x 64 wide, the indexer's 2 x 32), HCA (kv and gate 64), CSA: whole KV head
    v4 = {width: ROWS * (WINDOW * 64 + (SEQ + NEW - 1) * width) * 4 for width in (0, 2 * 128 + 2 * 64, 2 * 64)}
    assert lines["deepseek_v4"].endswith(
        f"tp 1: 1 layers of a KV head of 64, window {WINDOW}: {v4[0]:,} bytes; "
        f"2 layers of a KV head of 64, window {WINDOW} + compressor projections 384 a token: {2 * v4[384]:,} bytes; "
        f"1 layers of a KV head of 64, window {WINDOW} + compressor projections 128 a token: {v4[128]:,} bytes"
    )
    for family in ("qwen3_5", "qwen3_next"):
        assert "3 layers of Gated DeltaNet states of 8 heads x 32 x 32" in lines[family]
        assert "1 layers of keys and values of 2 kv heads x head dim 64" in lines[family]


def test_grpo_on_pipeline_stages_counts_the_stage_that_caches_the_most(tmp_path):
    """qwen3_5's layers are linear, linear, linear, full: at pp 2 stage 0 caches two DeltaNet states a row,
    stage 1 one state and one full layer's keys and values, fewer bytes; the line counts stage 0's."""
    from megacann.generation import kv_cache_bytes, recurrent_cache_bytes

    cfg = recipe("qwen3_5", str(tmp_path), grpo=True, extra=("distributed.pipeline_parallel_size=2",), world=2)
    rows, slots = RL_ROWS[0] * RL_ROWS[1], SEQ - 1
    state = recurrent_cache_bytes(1, rows, 8, 32, 32, 2 * 4 * 32 + 8 * 32, 4, torch.float32)
    stage_1 = state + kv_cache_bytes(1, rows, slots, 2, 64, torch.float32)
    assert 2 * state > stage_1
    assert printed_grpo_bytes(cfg) == 2 * state


def printed_line(cfg) -> str:
    from megacann.planning.generation import generation_cache_lines

    (line,) = generation_cache_lines(cfg, 1)
    return line


TP2_CASES = [  # (family, overrides): kv heads split, a kv head read by both ranks, latents whole, states split,
    # DeepSeek-V4's single KV head and projections whole
    ("gpt_oss", ()),
    ("llama", ("model.num_key_value_heads=1",)),
    ("deepseek_v32", ()),
    ("qwen3_5", ()),
    ("deepseek_v4", ()),
]


def _on_tp2(root: str) -> list[tuple[int, int, int]]:
    """Each case's (printed generation_eval bytes, measured, GRPO printed and measured) on this rank."""
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.set_num_threads(1)
    out = []
    for family, extra in TP2_CASES:
        cfg = recipe(family, os.path.join(root, family), tp=2, extra=extra)
        grpo = recipe(family, os.path.join(root, family), tp=2, grpo=True, extra=extra)
        printed = printed_generation_eval_bytes(cfg, 2)
        out.append(
            (printed, measured_cache_bytes(cfg, False), printed_grpo_bytes(grpo), measured_cache_bytes(grpo, True))
        )
    ps.destroy_model_parallel()
    return out


def test_at_tp2_each_rank_allocates_the_printed_share(tmp_path):
    ranks = run_on_ranks(_on_tp2, world_size=2, args=(str(tmp_path),), timeout=400)
    assert ranks[0] == ranks[1]
    for (family, extra), (printed, measured, grpo_printed, grpo_measured) in zip(TP2_CASES, ranks[0]):
        assert printed == measured, family
        assert grpo_printed == grpo_measured, family
        one = recipe(family, str(tmp_path / family), extra=extra)
        whole = printed_generation_eval_bytes(one, 1)
        # the share is the layout's: halved kv heads and states, one kv head on both ranks, whole latents
        # and DeepSeek-V4 caches
        halved = {"gpt_oss", "qwen3_5"}
        expected = whole // 2 if family in halved else whole
        assert printed == expected, family
