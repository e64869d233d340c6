"""The recipe's schema: one dataclass per section, with Megatron-style names and documented defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import yaml

from megacann.config.generation_eval import GenerationEvalConfig
from megacann.errors import MegacannError


class ConfigError(MegacannError, ValueError):
    """A recipe that cannot be used as written."""


@dataclass
class ExperimentConfig:
    name: str = "megacann"
    output_dir: str = "./output"
    # modules that register model families (megacann.models.register_model): module names or .py files
    # (relative to the recipe); imported by every process that reads the recipe, ranks and tools alike
    imports: list = field(default_factory=list)


@dataclass
class ModelConfig:
    """Architecture and numerics every decoder has. Sizes may come from ``config_path`` (HF config.json);
    inline keys win. A model family with keys of its own derives from this class (its ``ModelSpec``
    names it) and the recipe's ``model`` section is read into that class: a key only one family reads
    lives in that family's files. A field's ``metadata`` may mark it ``shape`` (decides tensor shapes),
    ``architecture`` (fixed by the weights a run starts from) or give its ``choices`` (checked by validate).

    ``HF_KEYS`` maps Hugging Face config.json names onto fields (also accepted inline in a recipe);
    ``HF_INERT_KEYS`` are config.json keys read only at the value that changes nothing (others refused);
    ``HF_VALUE_KEYS`` config.json keys whose values stand for values of a field, ``key -> (field,
    {config.json value: field value})`` (others refused). A family extends them for its own keys.
    """

    HF_KEYS: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_attention_heads",
        "num_key_value_heads": "num_key_value_heads",
        "intermediate_size": "ffn_hidden_size",
        "vocab_size": "vocab_size",
        "rms_norm_eps": "norm_eps",
        "layer_norm_eps": "norm_eps",
        "layer_norm_epsilon": "norm_eps",
        "rope_theta": "rope_theta",
        "rope_scaling": "rope_scaling",
        "max_position_embeddings": "max_position_embeddings",
        "tie_word_embeddings": "tie_word_embeddings",
        "initializer_range": "init_method_std",
        "attention_dropout": "attention_dropout",
        "attention_bias": "add_bias_linear",
    }
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {"sliding_window": None}
    HF_VALUE_KEYS: ClassVar[dict[str, tuple[str, dict]]] = {}

    type: str = "llama"  # a registered family: llama, gpt, moe, mistral, qwen2, qwen3, qwen3_moe, or one imported
    config_path: Optional[str] = None
    # weights to start from (fine-tuning): a megacann checkpoint or output directory, a consolidated
    # directory, or a local Hugging Face directory; its architecture keys fill the recipe's
    init_from: Optional[str] = None
    precision: str = "bf16"  # bf16 | fp16 | fp32
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None  # None: same as num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: the family's default (LLaMA 2/3*4h rounded to 256, GPT 4h)
    vocab_size: Optional[int] = None  # None: taken from the tokenizer
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3 style: {rope_type: llama3, factor, low_freq_factor, ...}
    rotary_interleaved: bool = False
    tie_word_embeddings: bool = False
    add_bias_linear: Optional[bool] = None  # None: the family's default (GPT: true, LLaMA: false)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    activation_checkpointing: str = "none"  # none | selective | full

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads  # type: ignore[return-value]

    @property
    def ffn_size(self) -> int:
        return self._family_default("ffn_hidden_size")

    @property
    def use_bias(self) -> bool:
        return self._family_default("add_bias_linear")

    @property
    def stage_hidden_size(self) -> int:
        """The last dim of the hidden states a pipeline stage passes to the next (``[b, s, this]``): the
        hidden size; a family whose residual is wider between layers (DeepSeek-V4's streams) says its own."""
        return self.hidden_size  # type: ignore[return-value]

    def _family_default(self, key: str):
        value = getattr(self, key)
        if value is None:
            raise ConfigError(
                f"model.{key} is not set and the model family's default was not filled in "
                "(megacann.models.prepare_model_config does it)"
            )
        return value


@dataclass
class DataConfig:
    path: Optional[Union[str, list]] = None  # None: the embedded default corpus (stdlib sources)
    tokenizer: Optional[str] = None  # None: byte-level BPE trained on the default corpus and cached
    seq_length: int = 2048
    batch_size: int = 1  # micro-batch per device
    num_workers: int = 2
    persistent_workers: bool = False
    pin_memory: Optional[bool] = None  # None: pin when the device supports it
    split: str = "98,2,0"  # train, validation, test weights
    weights: Optional[list] = None  # blending weights, one per entry of `path`
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    tokenizer_vocab_size: int = 8192  # vocabulary of the BPE trained on the default corpus
    cache_dir: Optional[str] = None  # index / tokenizer caches; None: next to the data
    json_key: str = "text"
    prompt_template: str = "alpaca"
    skip_bad_lines: bool = False
    pack_sft: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: Optional[float] = None  # None: the train_mode's default (MODE_DEFAULTS)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    scheduler: str = "cosine"  # cosine | linear | constant
    warmup_ratio: Optional[float] = None  # None: the train_mode's default (MODE_DEFAULTS)
    warmup_steps: Optional[int] = None  # wins over warmup_ratio when set
    min_lr_ratio: float = 0.1
    grad_accum_steps: int = 1
    max_steps: int = 1000
    clip_grad: float = 1.0  # 0 disables clipping
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scaling
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    # fp32 master weights and optimizer state in host memory, the update on the CPU (docs/zero.md#offload)
    offload_optimizer: bool = False


@dataclass
class DistributedConfig:
    world_size: Optional[int] = None  # None: from torchrun (WORLD_SIZE) or 1
    parallel_mode: str = "hybrid"  # data | tensor | pipeline | hybrid
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: Optional[int] = None  # None: world / (tp * pp * cp)
    context_parallel_size: int = 1  # cp ranks share every sequence (each holds s / cp tokens)
    context_parallel_algo: str = "ring"  # ring | allgather | ulysses: how attention crosses the cp ranks
    expert_parallel_size: int = 1
    virtual_pipeline_size: Optional[int] = None
    # a registered schedule's name (megacann.pipeline checks it: 1f1b | interleaved | zb1p | zbv | dualpipev, or
    # one a module of experiment.imports registers); None: 1F1B, interleaved when virtual_pipeline_size > 1
    pipeline_schedule: Optional[str] = None
    # dualpipev: a pair's forward and backward run at once (one's collectives behind the other's compute);
    # auto: where safe (else back to back), true: required (refused where unsafe), false: back to back
    dualpipev_overlap: Union[bool, str] = "auto"
    sequence_parallel: bool = False
    pipeline_layers: Optional[list] = None  # layers per (virtual) stage; None: even split
    zero_optimization: Union[bool, int] = False  # false | true (=1) | 1 | 2 | 3 (weights sharded too)
    zero_shard_group_size: Optional[int] = None  # hybrid: shard within groups of this many dp ranks
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False  # sequence-parallel all-gather / reduce-scatter behind the linear layers' matmuls
    bucket_size_mb: float = 40.0
    device: Optional[str] = None  # npu | cuda | cpu; None: auto (MEGACANN_DEVICE wins)
    timeout_minutes: float = 30.0

    @property
    def sequence_parallel_active(self) -> bool:
        """Sequence parallelism in effect: asked for, and more than one tensor-parallel rank to split over."""
        return self.sequence_parallel and self.tensor_parallel_size > 1

    @property
    def zero_stage(self) -> int:
        z = self.zero_optimization
        return int(z) if not isinstance(z, bool) else (1 if z else 0)


@dataclass
class LoggingConfig:
    log_interval: int = 10
    ckpt_interval: int = 1000  # 0: save only at the end
    keep_last: Optional[int] = None  # None: keep all
    # also write a Hugging Face directory <output_dir>/hf_<step> every N steps and at the last; 0: never
    hf_save_interval: int = 0
    eval_interval: int = 0  # 0: no evaluation during training
    eval_iters: int = 10
    wandb: bool = False
    wandb_project: Optional[str] = None
    wandb_run_name: Optional[str] = None  # None: experiment.name
    wandb_mode: str = "online"  # online | offline (no network; `wandb sync` later) | disabled
    tensorboard: bool = False
    async_save: bool = False
    timers: bool = False  # per-stage forward/backward/communication timing
    profile_breakdown: bool = False  # each step split into data wait, forward, backward, communication, optimizer
    profiler: Optional[dict] = None  # {start_step, end_step}: a torch.profiler trace (and CUDA memory snapshot)


@dataclass
class TrainingConfig:
    """What the trainer does when a step goes wrong: a non-finite or spiking loss, a hang, a stop signal."""

    max_skipped_steps: int = 10  # consecutive skipped steps (non-finite loss / grad norm, spikes) before stopping
    loss_spike_factor: float = 0.0  # warn when the loss exceeds this multiple of its running mean; 0: off
    loss_spike_window: int = 50  # steps in that running mean (warnings start once it is full)
    skip_loss_spikes: bool = False  # skip a spiking step (like a non-finite one) instead of only warning
    hang_factor: float = 10.0  # watchdog: report and stop a step running this many times the median; 0: off
    hang_min_seconds: float = 300.0  # ... never sooner than this (and always before the collective timeout)
    save_on_signal: bool = True  # SIGTERM / SIGINT: save a checkpoint at the step reached, then exit
    # activations the chosen transformer layers save for backward go to host memory: N (the first N
    # layers) or a list of global layer indices; 0: none (docs/zero.md#offload)
    activation_offload_layers: Union[int, list] = 0


@dataclass
class PrecisionConfig:
    # ops computed in fp32 whatever the model precision (megacann.ops names; default: ops.DEFAULT_FP32_OPS)
    fp32_ops: list = field(default_factory=lambda: ["rms_norm"])
    fused_ops: Union[bool, list] = True  # true: every available fused op; false: none; list: only those
    # torch.compile each transformer block: false | true (inductor) | a torch.compile backend name
    compile: Union[bool, str] = False
    # FP8 linear layers (docs/ops.md, FP8 products): none | tensorwise | rowwise | blockwise | mxfp8; the
    # activations and weights in e4m3, the output gradient in fp8_grad_format; fp32 accumulation and masters
    fp8: str = "none"
    fp8_grad_format: str = "e5m2"  # e5m2 | e4m3
    # the first / last N transformer blocks keep plain products (the embedding and the head always do)
    fp8_exclude_first_layers: int = 0
    fp8_exclude_last_layers: int = 0
    # current: each product scaled by its operands' own amax; delayed (tensorwise only): by the largest amax of
    # the last fp8_amax_history_len steps (kept in checkpoints), so no reduction waits before a product
    fp8_scaling: str = "current"
    fp8_amax_history_len: int = 16


@dataclass
class DPOConfig:
    """Preference optimisation (``train_mode: dpo``; megacann.training.preference)."""

    beta: float = 0.1  # strength of the KL-like constraint: rewards are beta * log(pi / pi_ref)
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo (reference-free, length-normalised)
    label_smoothing: float = 0.0  # sigmoid / simpo: assumed share of flipped preferences (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # weight of an SFT term: the chosen answer's mean per-token NLL added to each pair's loss (RPO-style; 0: off)
    sft_loss_weight: float = 0.0
    # the reference policy: auto (LoRA: adapters_off, else copy) | copy (a frozen copy of the starting weights,
    # sharded like the policy) | adapters_off (LoRA: the base with adapters disabled) | precomputed (log-probs of
    # the starting weights computed in one pass before training and cached beside the data)
    reference: str = "auto"


@dataclass
class RLConfig:
    """Reinforcement learning on the model's own rollouts (``train_mode: grpo``; megacann.training.rl, docs/rl.md)."""

    prompts: Optional[str] = None  # JSONL: {"prompt": text} or {"messages": [...]} plus the fields the reward reads
    group_size: int = 4  # responses sampled per prompt (>= 2: advantages compare a group's members)
    max_new_tokens: int = 64  # rollout sampling: a response's length limit, then temperature, top-p, top-k
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    reward: str = "exact_match"  # exact_match | math | regex:<pattern> | module:function (experiment.imports)
    advantage_estimator: str = "grpo"  # grpo | rloo
    scale_rewards: str = "group"  # grpo: divide by the std over the group | the batch | none (Dr. GRPO)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher: 0.28)
    clip_high: float = 0.2
    ratio_level: str = "token"  # token | sequence (GSPO)
    loss_aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer updates per pass: a rollout phase samples mini_batches global batches
    kl_coef: float = 0.0  # weight of the KL to the reference policy (0: no KL, no reference)
    kl_estimator: str = "k3"  # k1 | k3
    reference: str = "auto"  # auto (kl_coef 0: none; LoRA: adapters_off; else copy) | copy | adapters_off | none
    filter_groups: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal, sample more
    filter_max_rounds: int = 4  # extra sampling rounds a step may take to fill its batch
    filter_shortfall: str = "error"  # when the rounds run out: error | fill (with all-equal groups, counted)
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last N tokens before max_new_tokens (0: off)
    overlong_penalty: float = 1.0  # the penalty reached at max_new_tokens
    tis_cap: Optional[float] = None  # truncated importance sampling: min(pi_trainer / pi_rollout, cap) per token
    router_replay: bool = False  # MoE: reuse the rollout's expert choices in the training forward


@dataclass
class MegacannConfig:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    generation_eval: GenerationEvalConfig = field(default_factory=GenerationEvalConfig)
    seed: int = 1234
    train_mode: str = "pretrain"  # pretrain | sft | dpo | grpo
    lora: bool = False  # train LoRA adapters on a frozen base (megacann.training.finetune)
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    # projection names (q_proj ... down_proj, fused qkv_proj / gate_up_proj; MLP names reach MoE experts too) or
    # "all-linear"
    lora_target_modules: Union[list, str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @property
    def global_batch_size(self) -> int:
        dp = self.distributed.data_parallel_size or 1
        return self.data.batch_size * dp * self.optim.grad_accum_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


_SECTION_CLASSES = {
    "experiment": ExperimentConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
    "precision": PrecisionConfig,
    "training": TrainingConfig,
    "dpo": DPOConfig,
    "rl": RLConfig,
    "generation_eval": GenerationEvalConfig,
}
TOP_LEVEL_KEYS = [f.name for f in dataclasses.fields(MegacannConfig) if f.name not in _SECTION_CLASSES]

# Optimizer settings whose default depends on train_mode; validation fills those the recipe leaves unset.
MODE_DEFAULTS = {
    "pretrain": {"lr": 3.0e-4, "warmup_ratio": 0.0},
    "sft": {"lr": 1.0e-5, "warmup_ratio": 0.05},
    "dpo": {"lr": 1.0e-6, "warmup_ratio": 0.1},
    "grpo": {"lr": 1.0e-6, "warmup_ratio": 0.0},
}

CHOICES = {  # a family's own keys give theirs in their field's metadata ("choices")
    "model.precision": ("bf16", "fp16", "fp32"),
    "model.activation_checkpointing": ("none", "selective", "full"),
    "optim.name": ("adamw", "adam", "sgd"),
    "optim.scheduler": ("cosine", "linear", "constant"),
    "distributed.parallel_mode": ("data", "tensor", "pipeline", "hybrid"),
    "distributed.context_parallel_algo": ("ring", "allgather", "ulysses"),
    "train_mode": ("pretrain", "sft", "dpo", "grpo"),
    "dpo.loss_type": ("sigmoid", "ipo", "simpo"),
    "dpo.reference": ("auto", "copy", "adapters_off", "precomputed"),
    "rl.advantage_estimator": ("grpo", "rloo"),
    "rl.scale_rewards": ("group", "batch", "none"),
    "rl.ratio_level": ("token", "sequence"),
    "rl.loss_aggregation": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"),
    "rl.kl_estimator": ("k1", "k3"),
    "rl.reference": ("auto", "copy", "adapters_off", "none"),
    "rl.filter_shortfall": ("error", "fill"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
    "precision.fp8": ("none", "tensorwise", "rowwise", "blockwise", "mxfp8"),
    "precision.fp8_grad_format": ("e5m2", "e4m3"),
    "precision.fp8_scaling": ("current", "delayed"),
}
