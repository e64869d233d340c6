"""An honest recipe schema: every key is read by the code named here, or refused until its feature lands.

A key added to the schema without a reader (or without a refusal) fails ``test_every_key_is_accounted_for``;
a reader that stops reading its key fails ``test_each_key_is_read_where_the_table_says``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from training_helpers import tiny_config

import megacann
from megacann.config import ConfigError, all_dotted_keys, model_config_class
from megacann.config.validation import NOT_YET_IMPLEMENTED

PACKAGE = Path(megacann.__file__).parent

# key -> the module (under megacann/) that reads it, as an attribute of its section
READ_BY = {
    "seed": "training/runtime.py",
    "train_mode": "data/builders.py",
    "experiment.name": "training/step_log.py",
    "experiment.output_dir": "training/trainer.py",
    "experiment.imports": "config/loading.py",
    "model.type": "models/spec.py",
    "model.config_path": "config/loading.py",
    "model.init_from": "training/finetune.py",
    "model.precision": "models/spec.py",  # layer_context_from_config: params_dtype
    "model.hidden_size": "models/decoder.py",
    "model.num_layers": "pipeline/partition.py",
    "model.num_attention_heads": "models/decoder.py",
    "model.num_key_value_heads": "config/schema.py",  # kv_heads, read by models/decoder.py
    "model.ffn_hidden_size": "models/llama.py",  # its default; models/decoder.py reads it as ffn_size
    "model.vocab_size": "models/decoder.py",
    "model.max_position_embeddings": "models/decoder.py",
    "model.norm_eps": "models/decoder.py",
    "model.rope_theta": "models/decoder.py",
    "model.rope_scaling": "models/decoder.py",
    "model.rotary_interleaved": "models/decoder.py",
    "model.tie_word_embeddings": "models/decoder.py",
    "model.add_bias_linear": "models/llama.py",  # its default; models/decoder.py reads it as use_bias
    "model.hidden_dropout": "models/decoder.py",
    "model.attention_dropout": "models/decoder.py",
    "model.init_method_std": "models/decoder.py",
    "model.make_vocab_size_divisible_by": "models/decoder.py",
    "model.activation_checkpointing": "models/decoder.py",
    # the moe family's own keys (models/moe_config.py); the other families do not have them
    "model.num_experts": "models/moe.py",
    "model.moe_top_k": "models/moe.py",
    "model.mtp_num_layers": "models/mtp.py",
    "model.mtp_loss_scaling_factor": "models/decoder.py",
    "model.moe_router": "models/moe.py",
    "model.moe_capacity_factor": "models/moe.py",
    "model.moe_aux_loss_coeff": "models/moe.py",
    "model.moe_router_load_balancing_type": "models/moe.py",
    "model.moe_z_loss_coeff": "models/moe.py",
    "model.moe_bias_update_rate": "models/moe.py",
    "model.moe_layer_freq": "models/moe.py",
    "model.moe_shared_experts": "models/moe.py",
    "model.moe_ffn_hidden_size": "models/moe.py",
    # the mistral family's own keys (models/mistral.py)
    "model.head_dim": "models/mistral.py",  # its check; models/sizing.py reads it as attention_head_dim
    "model.sliding_window": "models/mistral.py",
    # the Qwen families' own keys (models/qwen_config.py; head_dim as Mistral's)
    "model.use_sliding_window": "models/qwen.py",  # refused when true
    "model.norm_topk_prob": "models/qwen.py",
    "model.decoder_sparse_step": "models/qwen_config.py",  # qwen3_moe_layer_flags -> moe_layer_freq
    "model.mlp_only_layers": "models/qwen_config.py",
    # the deepseek_v3 family's own keys (models/deepseek_config.py)
    "model.q_lora_rank": "models/deepseek.py",
    "model.kv_lora_rank": "models/deepseek.py",
    "model.qk_nope_head_dim": "models/deepseek.py",
    "model.qk_rope_head_dim": "models/deepseek.py",
    "model.v_head_dim": "models/deepseek.py",
    "model.qk_head_dim": "models/deepseek.py",  # checked against nope + rope
    "model.n_group": "models/deepseek.py",
    "model.topk_group": "models/deepseek.py",
    "model.routed_scaling_factor": "models/deepseek.py",
    "model.first_k_dense_replace": "models/deepseek_config.py",  # deepseek_layer_flags -> moe_layer_freq
    "data.path": "data/builders.py",
    "data.tokenizer": "data/builders.py",
    "data.seq_length": "data/builders.py",
    "data.batch_size": "data/builders.py",
    "data.num_workers": "data/builders.py",
    "data.persistent_workers": "data/builders.py",
    "data.pin_memory": "data/builders.py",
    "data.split": "data/builders.py",
    "data.weights": "data/builders.py",
    "data.reset_position_ids": "data/builders.py",
    "data.reset_attention_mask": "data/builders.py",
    "data.eod_mask_loss": "data/builders.py",
    "data.tokenizer_vocab_size": "data/builders.py",
    "data.cache_dir": "data/builders.py",
    "data.prompt_template": "data/builders.py",
    "data.skip_bad_lines": "data/builders.py",
    "data.pack_sft": "data/builders.py",
    "optim.name": "optimizer/optimizer.py",
    "optim.lr": "optimizer/lr_schedule.py",
    "optim.weight_decay": "optimizer/optimizer.py",
    "optim.adam_beta1": "optimizer/optimizer.py",
    "optim.adam_beta2": "optimizer/optimizer.py",
    "optim.adam_eps": "optimizer/optimizer.py",
    "optim.scheduler": "optimizer/lr_schedule.py",
    "optim.warmup_ratio": "optimizer/lr_schedule.py",
    "optim.warmup_steps": "optimizer/lr_schedule.py",
    "optim.min_lr_ratio": "optimizer/lr_schedule.py",
    "optim.grad_accum_steps": "training/trainer.py",
    "optim.max_steps": "training/trainer.py",
    "optim.clip_grad": "optimizer/optimizer.py",
    "optim.initial_loss_scale": "optimizer/optimizer.py",
    "optim.loss_scale_window": "optimizer/optimizer.py",
    "optim.min_loss_scale": "optimizer/optimizer.py",
    "optim.offload_optimizer": "optimizer/__init__.py",
    "distributed.world_size": "config/validation.py",
    "distributed.parallel_mode": "config/validation.py",
    "distributed.tensor_parallel_size": "training/runtime.py",
    "distributed.pipeline_parallel_size": "training/runtime.py",
    "distributed.data_parallel_size": "config/validation.py",
    "distributed.context_parallel_size": "training/runtime.py",
    "distributed.context_parallel_algo": "models/spec.py",
    "distributed.virtual_pipeline_size": "training/runtime.py",
    "distributed.expert_parallel_size": "training/runtime.py",
    "distributed.sequence_parallel": "models/spec.py",
    "distributed.pipeline_layers": "pipeline/partition.py",
    "distributed.pipeline_schedule": "pipeline/schedules.py",
    "distributed.dualpipev_overlap": "pipeline/schedules.py",
    "distributed.zero_optimization": "config/schema.py",  # zero_stage, read by optimizer/__init__.py
    "distributed.zero_shard_group_size": "optimizer/zero/optimizer.py",
    "distributed.overlap_grad_reduce": "optimizer/optimizer.py",
    "distributed.overlap_param_gather": "optimizer/__init__.py",
    "distributed.tp_comm_overlap": "models/spec.py",
    "distributed.bucket_size_mb": "optimizer/optimizer.py",
    "distributed.device": "training/runtime.py",
    "distributed.timeout_minutes": "training/runtime.py",
    "logging.log_interval": "training/trainer.py",
    "logging.ckpt_interval": "training/trainer.py",
    "logging.keep_last": "checkpoint/checkpointer.py",
    "logging.hf_save_interval": "training/hf_save.py",
    "logging.eval_interval": "training/trainer.py",
    "logging.eval_iters": "training/objective.py",
    "logging.wandb": "training/metrics.py",
    "logging.wandb_project": "training/metrics.py",
    "logging.wandb_run_name": "training/metrics.py",
    "logging.wandb_mode": "training/metrics.py",
    "logging.tensorboard": "training/metrics.py",
    "logging.async_save": "training/trainer.py",
    "logging.timers": "training/trainer.py",
    "logging.profile_breakdown": "training/profiling.py",
    "logging.profiler": "training/profiling.py",
    "training.max_skipped_steps": "training/guards.py",
    "training.loss_spike_factor": "training/guards.py",
    "training.loss_spike_window": "training/guards.py",
    "training.skip_loss_spikes": "training/guards.py",
    "training.hang_factor": "training/watchdog.py",
    "training.hang_min_seconds": "training/watchdog.py",
    "training.save_on_signal": "training/signals.py",
    "training.activation_offload_layers": "config/offload_keys.py",  # offloaded_layer_ids, read by the trainer
    "dpo.beta": "models/preference_loss.py",
    "dpo.loss_type": "models/preference_loss.py",
    "dpo.label_smoothing": "models/preference_loss.py",
    "dpo.simpo_gamma": "models/preference_loss.py",
    "dpo.sft_loss_weight": "models/preference_loss.py",
    "dpo.reference": "training/preference.py",
    "rl.prompts": "training/rl.py",
    "rl.group_size": "training/rl.py",
    "rl.max_new_tokens": "rl/rollout.py",
    "rl.temperature": "rl/rollout.py",
    "rl.top_p": "rl/rollout.py",
    "rl.top_k": "rl/rollout.py",
    "rl.reward": "training/rl.py",
    "rl.advantage_estimator": "training/rl.py",
    "rl.scale_rewards": "training/rl.py",
    "rl.clip_low": "models/policy_loss.py",
    "rl.clip_high": "models/policy_loss.py",
    "rl.ratio_level": "models/policy_loss.py",
    "rl.loss_aggregation": "models/policy_loss.py",
    "rl.ppo_epochs": "config/rl_keys.py",
    "rl.mini_batches": "training/rl.py",
    "rl.kl_coef": "models/policy_loss.py",
    "rl.kl_estimator": "models/policy_loss.py",
    "rl.reference": "config/rl_keys.py",
    "rl.filter_groups": "training/rl.py",
    "rl.filter_max_rounds": "training/rl.py",
    "rl.filter_shortfall": "training/rl.py",
    "rl.overlong_buffer": "training/rl.py",
    "rl.overlong_penalty": "training/rl.py",
    "rl.tis_cap": "models/policy_loss.py",
    "rl.router_replay": "config/rl_keys.py",
    **{
        f"generation_eval.{key}": "training/generation_eval.py"
        for key in ("interval", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed")
        + ("batch_size", "scorer")
    },
    "precision.fp32_ops": "training/runtime.py",
    "precision.fused_ops": "training/runtime.py",
    "precision.compile": "training/recipe.py",
    "precision.fp8": "models/spec.py",  # fp8_settings -> LayerContext.fp8, read by layers/linear.py
    "precision.fp8_grad_format": "models/spec.py",
    "precision.fp8_exclude_first_layers": "models/spec.py",
    "precision.fp8_exclude_last_layers": "models/spec.py",
    "precision.fp8_scaling": "models/spec.py",
    "precision.fp8_amax_history_len": "models/spec.py",
    "lora": "training/finetune.py",
    "lora_rank": "training/finetune.py",
    "lora_alpha": "training/finetune.py",
    "lora_dropout": "training/finetune.py",
    "lora_target_modules": "training/finetune.py",
}
# keys whose only effect is through another key that is refused for now
ONLY_WITH: dict[str, str] = {}
# a value each refused key takes only once its feature lands
REFUSED_VALUES = {
    "data.json_key": "content",
}


def schema_keys() -> set[str]:
    """Every recipe key: the shared schema's and those of megacann's own families."""
    families = ("llama", "gpt", "moe", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
    return {key for family in families for key in all_dotted_keys(model_config_class(family))}


def test_every_key_is_accounted_for():
    accounted = set(READ_BY) | set(NOT_YET_IMPLEMENTED) | set(ONLY_WITH)
    assert sorted(schema_keys() - accounted) == [], "schema keys with no reader and no refusal"
    assert sorted(accounted - schema_keys()) == [], "keys listed here that the schema does not have"
    assert set(REFUSED_VALUES) == set(NOT_YET_IMPLEMENTED)


@pytest.mark.parametrize("key", sorted(READ_BY))
def test_each_key_is_read_where_the_table_says(key):
    source = (PACKAGE / READ_BY[key]).read_text()
    leaf = key.split(".")[-1]
    assert re.search(rf"\.{leaf}\b", source), f"{READ_BY[key]} does not read {key}"


@pytest.mark.parametrize("key", sorted(NOT_YET_IMPLEMENTED))
def test_unimplemented_keys_are_refused_with_the_reason(key):
    tiny_config()  # the inert default passes
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: .* is refused: "):
        tiny_config([f"{key}={REFUSED_VALUES[key]}"], world_size=4)


def test_seed_recipes_still_load():
    from megacann.config import load_config

    root = PACKAGE.parent / "examples" / "configs"
    for recipe in sorted(root.glob("*/*.yaml")):  # the custom family's recipe imports its script
        load_config(str(recipe))


def test_precision_keys_name_ops_and_default_to_the_documented_list():
    from megacann import ops
    from megacann.config import MegacannConfig

    assert MegacannConfig().precision.fp32_ops == list(ops.DEFAULT_FP32_OPS)
    tiny_config(["precision.fused_ops=[rms_norm,swiglu]", "precision.fp32_ops=[swiglu]"])
    for key in ("precision.fused_ops", "precision.fp32_ops"):
        with pytest.raises(
            ConfigError, match=rf"{key}: unknown op name\(s\) \['rmsnorm'\]; valid op names: .*rms_norm"
        ):
            tiny_config([f"{key}=[rmsnorm]"])
