"""Layout fuzzing: sample valid parallel layouts, train each a few steps, compare with one process.

A layout is drawn from a seed (``sample_layout(seed, world)``): tensor (+ sequence) parallel, context parallel
with its algorithm, pipeline parallel (2 or 4 stages) with virtual chunks, the V schedules (zbv, dualpipev) or
zb1p, and uneven layer counts, data parallel with a ZeRO stage (0-3) and optimizer offload, expert parallel
(the moe family; up to all ranks), LoRA, recompute, packed documents, tied embeddings, a vocabulary
that tensor parallelism does not divide, the optimizer (adamw, adam or sgd), and LoRA trained by DPO on
preference pairs (reference: the base with its adapters off). Draws the recipe validation refuses are
redrawn (the seed stays the replay handle). ``run_layouts`` trains every layout on its ranks and the matching
one-process runs, and returns per layout the loss, gradient-norm (and DPO's reward) traces and the probes
that prove the modes were on (tests/layout_probes.py); failures are returned, not raised, so one bad layout
does not hide the others. tests/test_layout_fuzz.py runs a fixed sample; ``make fuzz``
(scripts/fuzz_layouts.py) runs more and prints the seed of each failure.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Optional

from layout_probes import INNER_OPTIMIZERS, ZERO_SLACK, expected_state, probe, state_probe

STEPS, SEQ, ACCUM = 3, 32, 2
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per stage in a V (megacann.pipeline.v_schedules)
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", "optim.warmup_steps=1"]
MOE = [
    "model.type=moe",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_experts=1",
    "model.moe_z_loss_coeff=1e-3",
]
EOS = 5  # the token id that ends a document in packed samples
AUX_METRICS = ("moe_load_balancing", "moe_seq_load_balancing", "moe_z_loss")  # logged, compared like the loss
# DPO on byte-tokenized preference pairs (the data path is added per run: preference_overrides)
DPO = ["train_mode=dpo", "dpo.beta=0.5", "data.tokenizer=byte", "data.prompt_template=plain", "data.split=90,10,0"]
DPO_VOCAB, DPO_ODD_VOCAB = 260, 261  # the byte tokenizer's 259 ids fit; 261: a vocabulary tp does not divide
REWARD_METRICS = ("chosen_reward", "rejected_reward", "reward_margin")  # DPO's, logged each step
# Adam and AdamW train DPO layouts at this lr: their first updates are near lr x sign(gradient), and DPO's first
# gradients (policy = reference, chosen and rejected sharing the prompt) leave some elements at rounding
# level, so at LoRA's 2e-2 (and at 5e-3) the layout's summation order moved the third step's gradient norm by
# 2-3e-5 (seeds 1000120 at world 2, 1000050 at world 4); at 1e-3 (tests/test_dpo_parallel.py's) 2e-6, with
# SGD (lr 0.1) 3e-7
DPO_ADAM_LR = "1e-3"
PAIRS = 64  # preference pairs for DPO layouts, 90 % for training: 3 steps at 8 ranks take at most 48


@dataclass
class Layout:
    """One drawn layout: ``model`` overrides are shared with the one-process reference, ``parallel`` ones
    are the layout's own; ``dp`` scales the reference's accumulation so both see the same global batch."""

    seed: int
    world: int
    model: list[str] = field(default_factory=list)
    parallel: list[str] = field(default_factory=list)
    dp: int = 1
    accum: int = ACCUM  # micro-batches per step (the interleaved schedule needs a multiple of the stages)
    packed: bool = False
    steps: int = STEPS
    label: str = ""
    distinct: Optional[int] = None  # samples repeat with this period (a memorisation task), None: all new

    @property
    def name(self) -> str:
        return self.label or f"seed{self.seed}-w{self.world}"

    def overrides(self) -> list[str]:
        return [
            *COMMON,
            f"optim.max_steps={self.steps}",
            *self.model,
            *self.parallel,
            f"optim.grad_accum_steps={self.accum}",
        ]

    def reference_overrides(self) -> list[str]:
        return [*COMMON, f"optim.max_steps={self.steps}", *self.model, f"optim.grad_accum_steps={self.accum * self.dp}"]

    def describe(self) -> str:
        return " ".join(self.model + self.parallel) + (" [packed]" if self.packed else "")

    @property
    def dpo(self) -> bool:
        return "train_mode=dpo" in self.model


def draw(rng: random.Random, seed: int, world: int) -> Layout:
    moe = rng.random() < 0.3
    model = list(MOE) if moe else []
    ep = rng.choice([e for e in (1, 2, 4) if world % e == 0]) if moe else 1  # first, so that ep 4 is drawn
    tp = rng.choice([t for t in (1, 2, 4) if world % t == 0 and (world // t) % ep == 0])
    heads = 4
    model.append(f"model.num_key_value_heads={rng.choice([k for k in (2, 4) if k % tp == 0])}")
    remaining = world // tp
    cp = rng.choice([c for c in (1, 2) if (remaining // c) % ep == 0 and remaining % c == 0])
    remaining //= cp
    pp = rng.choice([p for p in (1, 2, 4) if remaining % p == 0 and (remaining // p) % ep == 0])
    dp = remaining // pp
    layers = 8 if pp == 4 else rng.choice([2, 4, 4, 8])  # 4 stages: room for two chunks each
    model.append(f"model.num_layers={layers}")
    parallel = [
        f"distributed.tensor_parallel_size={tp}",
        f"distributed.context_parallel_size={cp}",
        f"distributed.pipeline_parallel_size={pp}",
    ]
    if tp > 1 and rng.random() < 0.6:
        parallel.append("distributed.sequence_parallel=true")
    if cp > 1:
        algos = ["ring", "allgather"] + (["ulysses"] if (heads // tp) % cp == 0 else [])
        parallel.append(f"distributed.context_parallel_algo={rng.choice(algos)}")
    accum = ACCUM
    if pp > 1:
        schedule = rng.choice(["default", "default", "zb1p", *V_SCHEDULES])
        if schedule in V_SCHEDULES and layers >= 2 * pp:
            chunks = 2  # two chunks per stage, placed as a V
            parallel.append(f"distributed.pipeline_schedule={schedule}")
            if schedule == "dualpipev":
                accum = 2 * pp  # its pairs need at least two micro-batches per stage
            if rng.random() < 0.5:
                parallel.append("distributed.virtual_pipeline_size=2")  # what the V implies, said
        else:
            chunks = 1 if schedule != "default" else rng.choice([v for v in (1, 2) if layers % (pp * v) == 0])
            if schedule == "zb1p":
                parallel.append("distributed.pipeline_schedule=zb1p")
            if chunks > 1:
                parallel.append(f"distributed.virtual_pipeline_size={chunks}")
                accum = max(ACCUM, pp)  # interleaved 1F1B: micro-batches a multiple of the stages
        if rng.random() < 0.5 and layers >= pp * chunks + 1:  # uneven: every (virtual) stage at least one layer
            stages = pp * chunks
            counts = [1] * stages
            for _ in range(layers - stages):
                counts[rng.randrange(stages)] += 1
            if len(set(counts)) == 1:  # an even draw: move one layer so the stages really differ
                counts[0], counts[-1] = counts[0] + 1, counts[-1] - 1
            parallel.append(f"distributed.pipeline_layers=[{','.join(map(str, counts))}]")
    if dp > 1:
        parallel.append(f"distributed.zero_optimization={rng.choice([0, 1, 2, 3])}")
    if moe:
        parallel.append(f"distributed.expert_parallel_size={ep}")
        model.append("model.moe_aux_loss_coeff=1e-2")
    if rng.random() < 0.25:
        model += ["lora=true", "lora_rank=4", "lora_alpha=8.0", "lora_target_modules=all-linear", "optim.lr=2e-2"]
    model.append(f"model.activation_checkpointing={rng.choice(['none', 'selective', 'full'])}")
    if not moe and rng.random() < 0.3:
        model.append("model.tie_word_embeddings=true")
    if rng.random() < 0.3:  # a vocabulary tp does not divide: padded to a multiple of tp only
        model += ["model.vocab_size=203", "model.make_vocab_size_divisible_by=1"]
    optimizer = rng.choice(["adamw", "adamw", "adam", "sgd"])
    if optimizer != "adamw":
        model += [f"optim.name={optimizer}"] + (["optim.lr=0.1"] if optimizer == "sgd" else [])
    packed = rng.random() < 0.3
    if rng.random() < 0.15:  # optimizer state and the update in host memory
        parallel.append("optim.offload_optimizer=true")
    if packed:
        model += ["data.reset_position_ids=true", "data.reset_attention_mask=true"]
    lora = "lora=true" in model
    if lora and not packed and rng.random() < 0.5:  # drawn last: the choices above stay what they were
        odd = "model.vocab_size=203" in model
        model = [o for o in model if o != "model.vocab_size=203"]
        model += [*DPO, f"model.vocab_size={DPO_ODD_VOCAB if odd else DPO_VOCAB}"]
        if optimizer != "sgd":
            model.append(f"optim.lr={DPO_ADAM_LR}")
    return Layout(seed, world, model, parallel, dp, accum, packed)


def sample_layout(seed: int, world: int, attempts: int = 50) -> Layout:
    """The first draw from ``seed`` that the recipe validation accepts at ``world`` ranks."""
    from training_helpers import tiny_config

    rng = random.Random(seed)
    errors = []
    for _ in range(attempts):
        layout = draw(rng, seed, world)
        try:
            tiny_config(layout.overrides(), world_size=world)
            tiny_config(layout.reference_overrides(), world_size=1)
        except Exception as error:  # a combination megacann refuses: draw again
            errors.append(f"{layout.describe()}: {error}")
            continue
        return layout
    raise RuntimeError(f"seed {seed}: no valid layout in {attempts} draws; last refusals: {errors[-3:]}")


class FuzzData:
    """SyntheticData's global sample order; with ``packed`` each sample holds documents ended by EOS and
    carries the position and segment ids the real data pipeline derives from them."""

    def __init__(self, cfg, dp_rank: int, dp_size: int, packed: bool, distinct: Optional[int] = None):
        from training_helpers import SyntheticData

        self.inner = SyntheticData(cfg, dp_rank, dp_size, num_distinct=distinct)
        self.packed = packed
        self.train = self._batches()

    def _batches(self):
        import torch

        from megacann.data.gpt_dataset import pretrain_fields

        for batch in self.inner.train:
            if not self.packed:
                yield batch
                continue
            rows = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
            rows[:, 7::11] = EOS  # documents of 7, 11, 11 ... tokens
            fields = [pretrain_fields(row.numpy(), EOS, True, True) for row in rows]
            yield {k: torch.stack([torch.from_numpy(f[k]) for f in fields]) for k in fields[0]}

    def valid(self):
        return None


def write_preference_data(directory: str) -> str:
    """The preference pairs DPO layouts and their one-process runs train on (tests/test_dpo.py's reversal
    questions, right answer chosen, a near miss rejected), written once into ``directory``."""
    import os

    from test_dpo import write_pairs

    return write_pairs(os.path.join(directory, "pairs.jsonl"), count=PAIRS)


def preference_overrides(directory: str) -> list[str]:
    """Where a DPO run reads its pairs (written by :func:`write_preference_data`) and caches them tokenized;
    read in the rank process itself (ranks are daemon processes: no loader workers)."""
    import os

    path, cache = os.path.join(directory, "pairs.jsonl"), os.path.join(directory, "cache")
    return [f"data.path={path}", f"data.cache_dir={cache}", "data.num_workers=0"]


def _train(layout: Layout, overrides: list[str], world: int, directory: Optional[str]) -> dict:
    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    if layout.dpo:
        if directory is None:
            raise ValueError(f"{layout.name}: a DPO layout needs the directory of its preference data")
        overrides = [*overrides, *preference_overrides(directory)]
    cfg = tiny_config(overrides, world_size=world)
    runtime = setup_runtime(cfg)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    # DPO: the recipe's own preference data (pairs kept in one micro-batch, dealt like pretraining's samples)
    data = None if layout.dpo else FuzzData(cfg, dp_rank, dp_size, layout.packed, layout.distinct)
    trainer = Trainer(cfg, runtime, data=data)
    seen = probe(trainer)
    losses, norms, aux, rewards = [], [], [], []
    for _ in range(layout.steps):
        metrics = trainer.train_step()
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        aux.append({k: v for k, v in metrics.items() if k in AUX_METRICS})
        rewards.append({k: v for k, v in metrics.items() if k in REWARD_METRICS})
    seen.update(state_probe(trainer))
    ps.destroy_model_parallel()
    seen["seq"] = sorted(seen["seq"])
    return {"losses": losses, "norms": norms, "aux": aux, "rewards": rewards, "probes": seen}


def run_layouts(layouts: list[Layout], reference: bool, directory: Optional[str] = None) -> dict[str, dict]:
    """On every rank: each layout (or, with ``reference``, its one-process run) trained; a failure is
    returned as ``{"error": traceback}`` so the other layouts still run. ``directory`` holds the preference
    data of DPO layouts."""
    import torch.distributed as dist

    from megacann import parallel_state as ps

    out = {}
    for layout in layouts:
        overrides = layout.reference_overrides() if reference else layout.overrides()
        try:
            result = _train(layout, overrides, 1 if reference else layout.world, directory)
        except Exception:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            result = {"error": traceback.format_exc()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, result.get("probes"))
        result["probes"] = every
        out[layout.name] = result
    return out


def _setting(overrides: list[str], key: str, default):
    values = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    return values[-1] if values else default


def _logged_figures(what: str, got: list[dict], ref: list[dict], bound) -> list[str]:
    """Per-step figures logged beside the loss (``[{name: value}]``): the same names each step as one
    process, each value within ``bound(one process's value)``."""
    if [sorted(x) for x in got] != [sorted(x) for x in ref]:
        return [f"{what} logged differ: {got} vs one process {ref}"]
    if any(abs(x[k] - y[k]) > bound(y[k]) for x, y in zip(got, ref) for k in y):
        return [f"{what} differ: {got} vs one process {ref}"]
    return []


def check_layout(
    layout: Layout, got: dict, ref: dict, rel: float = 1e-5, norm_rel: Optional[float] = None
) -> list[str]:
    """What is wrong with ``got`` (the layout's run) against ``ref`` (one process): the loss trace (within
    ``rel``), the gradient-norm trace (within ``norm_rel``, default ``rel``) and the mode probes."""
    problems = [
        f"{which} failed:\n{run['error']}" for which, run in (("layout", got), ("reference", ref)) if "error" in run
    ]
    if problems:
        return problems
    for key, bound in (("losses", rel), ("norms", rel if norm_rel is None else norm_rel)):
        a, e = got[key], ref[key]
        if len(a) != len(e) or any(abs(x - y) > bound * abs(y) for x, y in zip(a, e)):
            problems.append(f"{key} differ: {a} vs one process {e}")
    problems += _logged_figures("auxiliary losses", got.get("aux", []), ref.get("aux", []), lambda y: rel * abs(y))
    # DPO's rewards: beta x differences of log-probability sums, 0 at the first step: relative above 1 only
    rewards = got.get("rewards", [])
    problems += _logged_figures("rewards", rewards, ref.get("rewards", []), lambda y: rel * max(1.0, abs(y)))
    if layout.dpo and not (rewards and all(rewards)):
        problems.append(f"a DPO layout logged no rewards: {rewards}")
    o = layout.overrides()
    tp = int(_setting(o, "distributed.tensor_parallel_size", 1))
    cp = int(_setting(o, "distributed.context_parallel_size", 1))
    pp = int(_setting(o, "distributed.pipeline_parallel_size", 1))
    v_shape = _setting(o, "distributed.pipeline_schedule", None) in V_SCHEDULES
    vpp = 2 if v_shape else int(_setting(o, "distributed.virtual_pipeline_size", 1))
    sp = _setting(o, "distributed.sequence_parallel", "false") == "true" and tp > 1
    layers = int(_setting(o, "model.num_layers", 4))
    counts = _setting(o, "distributed.pipeline_layers", None)
    counts = [int(c) for c in counts.strip("[]").split(",")] if counts else [layers // (pp * vpp)] * (pp * vpp)
    experts = int(_setting(o, "model.num_experts", 0))
    ep = int(_setting(o, "distributed.expert_parallel_size", 1))
    zero = int(_setting(o, "distributed.zero_optimization", 0))
    lora = _setting(o, "lora", "false") == "true"
    offload = _setting(o, "optim.offload_optimizer", "false") == "true"
    recompute = _setting(o, "model.activation_checkpointing", "none")
    optimizer = _setting(o, "optim.name", "adamw")
    full = recompute == "full"
    objective = "adapters_off" if layout.dpo else "per-token"  # DPO with LoRA: the base is the reference
    seq = SEQ // cp // (tp if sp else 1)
    for rank, probes in enumerate(got["probes"]):
        stage = probes["pp_rank"]
        # chunk v of stage r holds segment v*pp + r, in the V segment r (v = 0) or 2pp - 1 - r (v = 1)
        segments = [(2 * pp - 1 - stage if v else stage) if v_shape else v * pp + stage for v in range(vpp)]
        trained = [layout.steps * layout.accum * counts[segment] for segment in segments]
        # DPO's reference is the policy with its adapters off: one more forward-only pass of the same blocks
        want = [n * (2 if layout.dpo else 1) for n in trained]
        if probes["forwards"] != want:
            problems.append(f"rank {rank}: block forwards per chunk {probes['forwards']}, expected {want}")
        if probes["objective"] != objective:
            problems.append(f"rank {rank}: objective {probes['objective']}, expected {objective}")
        if probes["seq"] != [seq]:
            problems.append(f"rank {rank}: blocks saw sequence lengths {probes['seq']}, expected [{seq}]")
        if probes["recomputes"] != (sum(trained) if full else 0):
            problems.append(f"rank {rank}: {probes['recomputes']} recomputed blocks (full recompute: {full})")
        if probes["core_recomputes"] != (0 if recompute == "none" else sum(trained)):  # selective: attention only
            problems.append(f"rank {rank}: core attention replayed {probes['core_recomputes']} times ({recompute})")
        if experts and probes["local_experts"] != [experts // ep]:
            problems.append(f"rank {rank}: local experts {probes['local_experts']}, expected [{experts // ep}]")
        if probes["sharded"] != (zero > 0) or probes["offloaded"] != offload:
            problems.append(f"rank {rank}: optimizer {probes['optimizer']} for ZeRO {zero}, offload {offload}")
        if probes["tp_splits"] != [tp]:
            problems.append(f"rank {rank}: linear layers split {probes['tp_splits']} ways, expected [{tp}]")
        if probes["inner_optimizer"] != INNER_OPTIMIZERS[optimizer]:
            problems.append(f"rank {rank}: optim.name={optimizer} built {probes['inner_optimizer']}")
        state, want = probes["state_elems"], expected_state(probes, optimizer, zero, layout.dp * cp, ep)
        if abs(state - want) > ZERO_SLACK * want:
            problems.append(f"rank {rank}: {state} optimizer-state elements, expected {want:.0f} for ZeRO {zero}")
        if lora != all("lora" in n for n in probes["trainable"]):
            problems.append(f"rank {rank}: trainable parameters {probes['trainable'][:4]}... with lora={lora}")
    return problems


def compare(layouts: list[Layout], rel: float = 1e-5, timeout: float = 900) -> dict[str, list[str]]:
    """Layouts (all of one world size) against their one-process runs: ``{name: problems}``, empty when
    the traces agree within ``rel`` and the probes show every mode on."""
    import tempfile

    from dist_harness import run_on_ranks

    (world,) = {layout.world for layout in layouts}
    with tempfile.TemporaryDirectory(prefix="megacann-fuzz-") as directory:
        if any(layout.dpo for layout in layouts):
            write_preference_data(directory)
        got = run_on_ranks(run_layouts, world, args=(layouts, False, directory), timeout=timeout)[0]
        ref = run_on_ranks(run_layouts, 1, args=(layouts, True, directory), timeout=timeout)[0]
    return {layout.name: check_layout(layout, got[layout.name], ref[layout.name], rel) for layout in layouts}


def fuzz(seeds: list[int], world: int, timeout: float = 900) -> dict[int, list[str]]:
    """Each seed's layout at ``world`` ranks against one process: ``{seed: problems}`` (empty when equal)."""
    layouts = [sample_layout(seed, world) for seed in seeds]
    found = compare(layouts, timeout=timeout)
    return {layout.seed: found[layout.name] for layout in layouts}
