"""The GRPO loop (``train_mode: grpo``) on a tiny random LLaMA with the byte tokenizer (CPU, fp32): seeded
rollouts by the training model itself, scored, trained. At tp 2 with sequence parallelism and at dp 2 the
loop trains the one-process trace (losses, rewards, KL, 1e-5) for 3 steps; a run stopped inside a rollout
phase or on its boundary and resumed repeats the uninterrupted one bit for bit; without dropout the trainer's recomputed log-probabilities
equal the generator's (1e-6); a phase of one update takes the old policy from the training forward and
trains the forced recompute's run bit for bit; bad input is refused by name."""

from __future__ import annotations

import re

import pytest
from dist_harness import run_on_ranks
from finetune_helpers import COMMON, LORA, recipe, write_jsonl

from megacann.config import ConfigError

STEPS = 3
WORDS = ["abc", "dog", "moon", "tree", "fish", "lamp", "rain", "star", "wind", "bird", "cake", "door"]
# compared run against run; the timings differ by nature
TIMINGS = ("rollout_seconds", "rollout_tokens_per_second", "training_tokens_per_second")
FIGURES = ("loss", "pg_loss", "kl", "reward_mean", "reward_std", "advantage_std", "entropy", "grad_norm")


def write_prompts(path: str, answers: bool = True) -> str:
    """Reversal prompts, with their answers (what exact_match reads) unless ``answers`` is False."""
    records = [{"prompt": f"Reverse: {w}\n", **({"answer": w[::-1]} if answers else {})} for w in WORDS]
    return write_jsonl(path, records)


def rl_overrides(prompts: str, *extra: str) -> list[str]:
    # the random model's bytes hold a lower-case letter about half the time: rewards differ within groups
    return [
        *COMMON,
        "train_mode=grpo",
        f"rl.prompts={prompts}",
        "rl.group_size=4",
        "rl.max_new_tokens=6",
        "rl.reward=regex:[a-z]",
        "rl.kl_coef=0.05",
        "rl.clip_high=0.28",
        "data.batch_size=4",
        "optim.lr=1e-3",
        *extra,
    ]


def _trainer(overrides: list[str], world_size: int = 1, checkpoint_follows: bool = False):
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = recipe(overrides, world_size=world_size)
    return Trainer(cfg, setup_runtime(cfg), checkpoint_follows=checkpoint_follows)


def _trace(steps: list[dict]) -> dict[str, list[float]]:
    return {k: [s[k] for s in steps] for k in FIGURES}


def _run_loop(prompts: str, overrides: list[str], world_size: int = 1) -> dict:
    """STEPS steps of the loop; the trace, and probes of the layout and the rollouts."""
    from megacann import parallel_state as ps

    trainer = _trainer(rl_overrides(prompts, *overrides), world_size)
    from megacann.layers import TransformerBlock

    seen = []  # the sequence length the first block saw in training (seq / tp under sequence parallelism)
    block = next(m for m in trainer.model_chunks[0].modules() if isinstance(m, TransformerBlock))
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]) if m.training else None)
    steps = [trainer.train_step() for _ in range(STEPS)]
    out = {
        "trace": _trace(steps),
        "layout": (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()),
        "seq": sorted(set(seen)),
        "mismatch": [s["logprob_mismatch_max"] for s in steps],
        "reference": trainer.objective.kind,
    }
    ps.destroy_model_parallel()
    return out


def _on_ranks(prompts: str, runs: dict[str, list[str]]) -> dict:
    import torch.distributed as dist

    return {name: _run_loop(prompts, overrides, dist.get_world_size()) for name, overrides in runs.items()}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    return write_prompts(str(tmp_path_factory.mktemp("rl") / "prompts.jsonl"))


@pytest.fixture(scope="module")
def world1(prompts) -> dict:
    return run_on_ranks(_on_ranks, 1, args=(prompts, {"one": [], "lora": LORA}), timeout=300)[0]


@pytest.fixture(scope="module")
def one_process(world1) -> dict:
    return world1["one"]


def assert_same_trace(got: dict, ref: dict, rel: float = 1e-5) -> None:
    for key, values in ref.items():
        for step, (a, b) in enumerate(zip(got[key], values), start=1):
            assert a == pytest.approx(b, rel=rel, abs=1e-6), f"{key} at step {step}: {a} != {b}"


def test_one_process_loop_learns_from_differing_rewards(one_process):
    trace = one_process["trace"]
    assert all(0.0 < r < 1.0 for r in trace["reward_mean"]), trace["reward_mean"]  # mixed rewards: a signal
    assert all(s > 0 for s in trace["advantage_std"])
    assert any(abs(loss) > 1e-4 for loss in trace["loss"])
    assert trace["kl"][0] == pytest.approx(0.0, abs=1e-7) and trace["kl"][-1] > 0  # the policy moved off the copy
    assert one_process["layout"] == (1, 1)


def test_tp2_sequence_parallel_and_dp2_loops_equal_one_process(prompts, world1):
    tp2 = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
    runs = {
        "tp2": tp2,
        "dp2": ["optim.grad_accum_steps=1"],  # global batch 8, as one process's 2 x 4
        "tp2_lora": [*tp2, *LORA],  # the KL's reference: the base with the adapters off
    }
    ranks = run_on_ranks(_on_ranks, 2, args=(prompts, runs), timeout=600)
    one_process = world1["one"]
    for rank in ranks:
        assert_same_trace(rank["tp2"]["trace"], one_process["trace"])
        assert_same_trace(rank["dp2"]["trace"], one_process["trace"])
        assert_same_trace(rank["tp2_lora"]["trace"], world1["lora"]["trace"])
    assert ranks[0]["tp2_lora"]["reference"] == world1["lora"]["reference"] == "adapters_off"
    assert one_process["reference"] == "copy"
    assert world1["lora"]["trace"]["kl"][-1] > 0 and world1["lora"]["trace"]["loss"] != one_process["trace"]["loss"]
    assert ranks[0]["tp2"]["layout"] == (2, 1) and ranks[0]["dp2"]["layout"] == (1, 2)
    assert ranks[0]["tp2"]["seq"] == [16] and one_process["seq"] == [32]  # sequence parallel in training


def test_recomputed_logprobs_equal_the_rollouts_in_fp32(one_process):
    assert max(one_process["mismatch"]) < 1e-6, one_process["mismatch"]


def _resume_runs(prompts: str, tmp: str, layout: tuple[str, ...] = ()) -> dict:
    """6 steps at once (rl.ppo_epochs 2 x rl.mini_batches 2: phases of 4 steps, all but the first of each
    off-policy), and the same run split by checkpoints: one at step 2, inside the first phase, resumed by a
    fresh trainer for 4 steps, and one at step 4, on the phase boundary, resumed for 2 (``layout``: extra
    overrides, on every rank of the harness). A mid-phase checkpoint loaded with another micro-batch size
    is refused."""
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.checkpoint.metadata import describe_layout

    def run(name: str, *extra: str, **kw):
        overrides = rl_overrides(prompts, *PHASES, *layout, f"experiment.output_dir={tmp}/{name}", *extra)
        return _trainer(overrides, dist.get_world_size(), **kw)

    whole = run("whole")
    uninterrupted = [whole.train_step() for _ in range(6)]
    ps.destroy_model_parallel()
    first = run("split")
    [first.train_step() for _ in range(2)]
    inside = first.save_checkpoint()
    saved = first.checkpoint_parts().objective_state
    [first.train_step() for _ in range(2)]
    boundary = first.save_checkpoint()
    at_boundary = first.checkpoint_parts().objective_state
    accum = first.cfg.optim.grad_accum_steps
    ps.destroy_model_parallel()
    resumed = {}
    for name, path, steps in (("inside", inside, 4), ("boundary", boundary, 2)):
        trainer = run("split", checkpoint_follows=True)
        trainer.load_checkpoint(path)
        resumed[name] = [trainer.train_step() for _ in range(steps)]
        ps.destroy_model_parallel()
    halved = [f"data.batch_size={first.cfg.data.batch_size // 2}", f"optim.grad_accum_steps={2 * accum}"]
    other = run("split", *halved, checkpoint_follows=True)  # the same global batch in smaller micro-batches
    try:
        other.load_checkpoint(inside)
        refused = None
    except ValueError as err:
        refused = str(err)
    ps.destroy_model_parallel()

    def strip(steps: list[dict]) -> list[dict]:
        return [{k: v for k, v in s.items() if k not in TIMINGS} for s in steps]

    return {
        "uninterrupted": strip(uninterrupted),
        "inside": strip(resumed["inside"]),
        "boundary": strip(resumed["boundary"]),
        "saved": (saved["phase"], [len(m) for m in saved["mini_batches"]], sorted(saved["mini_batches"][0][0])),
        "cut": describe_layout(saved["cut"]),
        "saved_tokens": [mb["tokens"].tolist() for batches in saved["mini_batches"] for mb in batches],
        "at_boundary": at_boundary,
        "refused": refused,
    }


PHASES = ["optim.max_steps=6", "rl.ppo_epochs=2", "rl.mini_batches=2", "logging.ckpt_interval=100"]


def test_resume_inside_a_rollout_phase_repeats_the_uninterrupted_run_bit_for_bit(prompts, tmp_path):
    got = run_on_ranks(_resume_runs, 1, args=(prompts, str(tmp_path)), timeout=300)[0]
    whole = got["uninterrupted"]
    assert got["inside"] == whole[2:] and got["boundary"] == whole[4:]
    # the phase's rollouts were saved with the step-2 checkpoint: 2 mini-batches of 2 micro-batches each
    phase, counts, keys = got["saved"]
    assert (phase, counts) == (0, [2, 2]) and {"old_logps", "ref_logps", "rollout_logps", "advantages"} <= set(keys)
    assert got["at_boundary"] is None  # the next step samples afresh: nothing to save
    assert whole[0]["reward_mean"] == whole[3]["reward_mean"]  # one phase's rollouts for steps 0-3
    # the later passes are off-policy: the trainer's log-probs moved away from the rollout's; step 4 samples
    # a new phase from the current policy, on-policy again
    diffs = [step["logp_diff_mean"] for step in whole]
    assert diffs[2] > 100 * max(diffs[0], 1e-8) and diffs[3] > 100 * max(diffs[4], 1e-8), diffs
    assert "inside rollout phase 0" in got["refused"] and "data.batch_size 4; this run has" in got["refused"]


def _failure(prompts: str, overrides: list[str]) -> str:
    """The error a one-step run of the loop ends with, as ``Type: message``."""
    try:
        trainer = _trainer(rl_overrides(prompts, *overrides))
        trainer.train_step()
    except Exception as err:  # noqa: BLE001 -- the message is what the test reads
        return f"{type(err).__name__}: {err}"
    finally:
        from megacann import parallel_state as ps

        ps.destroy_model_parallel()
    return "no error"


def test_bad_rollout_input_is_named(tmp_path):
    bare = write_prompts(str(tmp_path / "bare.jsonl"), answers=False)
    rewards = tmp_path / "myreward.py"
    rewards.write_text("def scored(prompt, response, record):\n    return 1.0\n")
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"))
    cases = {
        "no_answer": (bare, ["rl.reward=exact_match"]),
        "missing_function": (prompts, [f"experiment.imports=[{rewards}]", "rl.reward=myreward:missing"]),
        "cannot_fill": (prompts, ["rl.reward=regex:ZZZ", "rl.filter_groups=true", "rl.filter_max_rounds=2"]),
    }
    got = {name: run_on_ranks(_failure, 1, args=case, timeout=300)[0] for name, case in cases.items()}
    named = re.match(
        rf"RewardError: {re.escape(bare)}:(\d+): reward exact_match reads the field 'answer'", got["no_answer"]
    )
    assert named and 1 <= int(named.group(1)) <= len(WORDS), got["no_answer"]
    assert "has no function 'missing'" in got["missing_function"], got["missing_function"]
    assert got["cannot_fill"].startswith("FilterShortfall: rl.filter_groups: 0 of the 2 groups"), got["cannot_fill"]
    assert "after 3 sampling rounds" in got["cannot_fill"]


def _filled_step(prompts: str) -> dict:
    trainer = _trainer(
        rl_overrides(prompts, "rl.reward=regex:ZZZ", "rl.filter_groups=true", "rl.filter_shortfall=fill")
    )
    return trainer.train_step()


def test_dynamic_sampling_fills_a_short_batch_when_asked_and_counts_it(prompts):
    step = run_on_ranks(_filled_step, 1, args=(prompts,), timeout=300)[0]
    assert step["sampling_rounds"] == 5 and step["filter_filled_groups"] == 2  # 1 + filter_max_rounds 4
    assert step["filtered_groups"] == 10 and step["pg_loss"] == 0.0  # all-equal groups: advantage 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.group_size=1"], "rl.group_size must be an integer >= 2, got 1"),
        (["rl.clip_low=0.3", "rl.clip_high=0.2"], "rl.clip_high 0.2 is below rl.clip_low 0.3: reversed?"),
        (["rl.clip_low=-0.1"], "rl.clip_low must be a finite number >= 0.0, got -0.1"),
        (["rl.clip_high=-0.2"], "rl.clip_high must be a finite number >= 0.0, got -0.2"),
        (["rl.group_size=3"], "(8) must be a multiple of rl.group_size 3"),
        (["rl.temperature=0"], "rl.temperature must be a finite number > 0.0, got 0"),
        (["rl.kl_coef=0.1", "rl.reference=none"], "rl.kl_coef 0.1 needs a reference policy"),
        (["rl.overlong_buffer=6"], "rl.overlong_buffer 6 must be below rl.max_new_tokens 6"),
        (["rl.filter_shortfall=skip"], "rl.filter_shortfall: 'skip' is not one of error, fill"),
    ],
)
def test_bad_rl_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as err:
        recipe(rl_overrides("prompts.jsonl", *overrides), world_size=1)
    assert message in str(err.value)


def _learning_curve(prompts: str) -> list[float]:
    overrides = ["optim.lr=1e-2", "optim.max_steps=30", "rl.kl_coef=0", "rl.group_size=8", "data.batch_size=8"]
    overrides += ["rl.max_new_tokens=3", "rl.reward=regex:^[a-z]", "rl.filter_groups=true", "rl.filter_shortfall=fill"]
    trainer = _trainer(rl_overrides(prompts, *overrides))
    return [trainer.train_step()["reward_mean"] for _ in range(30)]


def test_the_loop_learns_a_format_reward(prompts):
    # reward 1 when the response starts with a lower-case letter: about 1 in 10 bytes of the random model
    curve = run_on_ranks(_learning_curve, 1, args=(prompts,), timeout=300)[0]
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert first < 0.4 and last > 0.75 and last > first + 0.4, curve


def _skip_or_recompute_run(prompts: str, forced: bool) -> dict:
    """STEPS steps of the default phase (rl.ppo_epochs 1, one mini-batch) with truncated importance
    sampling, as the loop chooses or with the old policy's forward-only pass ``forced``: whether the loop
    chose to skip it, the policy's eval-mode forwards over whole micro-batch rows (generation's are shorter)
    and the logged figures, timings left out."""
    from megacann import parallel_state as ps
    from megacann.config.rl_keys import training_forward_is_old_policy
    from megacann.layers import TransformerBlock

    trainer = _trainer(rl_overrides(prompts, "rl.tis_cap=2.0"))
    if forced:
        trainer.objective.old_from_training = False
    passes, seq = [], trainer.cfg.data.seq_length
    block = next(m for m in trainer.model_chunks[0].modules() if isinstance(m, TransformerBlock))
    block.register_forward_pre_hook(
        lambda m, args: passes.append(1) if args[0].shape[1] == seq and not m.training else None
    )
    steps = [trainer.train_step() for _ in range(STEPS)]
    ps.destroy_model_parallel()
    return {
        "chose_skip": training_forward_is_old_policy(trainer.cfg),
        "passes": len(passes),
        "steps": [{k: v for k, v in s.items() if k not in TIMINGS} for s in steps],
    }


def test_one_update_phase_takes_the_old_policy_from_the_training_forward(prompts):
    skip, recompute = (
        run_on_ranks(_skip_or_recompute_run, 1, args=(prompts, f), timeout=300)[0] for f in (False, True)
    )
    assert skip["chose_skip"] and skip["passes"] == 0, skip["passes"]  # no forward-only pass of the policy
    assert recompute["passes"] == STEPS * 2, recompute["passes"]  # 2 micro-batches a step
    for step, (a, b) in enumerate(zip(skip["steps"], recompute["steps"]), start=1):
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        # bitwise: loss, grad norm, clip fractions, TIS weights, the mismatch's max; its mean is summed in
        # fp32 by the loss, in fp64 by the recompute
        differ = {k: (a[k], b[k]) for k in b if a[k] != b[k]}
        assert set(differ) <= {"logprob_mismatch_mean"}, f"step {step}: {differ}"
        assert a["logprob_mismatch_mean"] == pytest.approx(b["logprob_mismatch_mean"], rel=1e-6)
    first = skip["steps"][0]
    assert first["tis_weight_mean"] > 0 and "logprob_mismatch_max" in first and first["grad_norm"] > 0


def test_several_updates_or_dropout_keep_the_recompute():
    from megacann.config.rl_keys import training_forward_is_old_policy

    def chosen(*extra: str) -> bool:
        return training_forward_is_old_policy(recipe(rl_overrides("prompts.jsonl", *extra), world_size=1))

    assert chosen()
    assert not chosen("rl.ppo_epochs=2") and not chosen("rl.mini_batches=2")
    assert not chosen("model.hidden_dropout=0.1") and not chosen(*LORA, "lora_dropout=0.1")
    assert chosen(*LORA)
