"""Shared pieces of the training tests: a tiny recipe and a synthetic, layout-independent data source."""

from __future__ import annotations

import torch

from megacann.config import MegacannConfig, apply_overrides, config_from_dict
from megacann.training.recipe import prepare_recipe

TINY_MODEL = {
    "type": "llama",
    "precision": "fp32",
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "ffn_hidden_size": 128,
    "vocab_size": 200,
    "max_position_embeddings": 64,
    "make_vocab_size_divisible_by": 16,
}


def prepared_recipe(raw: dict, overrides: list[str] = (), world_size: int = 1, **sections) -> MegacannConfig:
    """The recipe ``raw`` with each of ``sections`` merged into its section, then ``overrides`` applied,
    prepared for ``world_size`` ranks."""
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    cfg = config_from_dict(raw)
    apply_overrides(cfg, list(overrides))
    prepare_recipe(cfg, world_size=world_size)
    return cfg


def tiny_config(overrides: list[str] = (), world_size: int = 1, **sections) -> MegacannConfig:
    raw = {
        "experiment": {"name": "test", "output_dir": "/tmp/megacann-test-unused"},
        "model": dict(TINY_MODEL),
        "data": {"seq_length": 32, "batch_size": 2},
        "optim": {"lr": 1e-2, "max_steps": 5, "warmup_steps": 1, "grad_accum_steps": 2, "weight_decay": 0.1},
        "logging": {"log_interval": 1, "ckpt_interval": 0},
        "seed": 7,
    }
    return prepared_recipe(raw, overrides, world_size, **sections)


def synthetic_sample(index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """seq_length + 1 tokens of global sample ``index``: a noisy repeating pattern a model can learn."""
    g = torch.Generator().manual_seed(1000 + index)
    period = 3 + index % 5
    pattern = torch.randint(0, vocab_size, (period,), generator=g)
    tokens = pattern.repeat(seq_length // period + 2)[: seq_length + 1].clone()
    noise = torch.rand(seq_length + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
    return tokens


class SyntheticData:
    """Micro-batches for one data-parallel rank, by the global sample order: in step k the global batch is
    samples [kG, (k+1)G); micro-batch j of rank r holds samples kG + j*b*D + r*b + [0, b). With
    ``consumed_samples`` (a multiple of G) it starts where a run that used that many samples stopped."""

    def __init__(
        self,
        cfg: MegacannConfig,
        dp_rank: int,
        dp_size: int,
        num_distinct: int | None = None,
        consumed_samples: int = 0,
    ):
        self.b, self.s = cfg.data.batch_size, cfg.data.seq_length
        self.accum, self.vocab = cfg.optim.grad_accum_steps, cfg.model.vocab_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_distinct = num_distinct
        global_batch = self.b * dp_size * self.accum
        if consumed_samples % global_batch:
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of the global batch {global_batch}"
            )
        self.train = self._iterate(consumed_samples // global_batch)

    def _batch(self, first: int) -> dict[str, torch.Tensor]:
        ids = [first + i for i in range(self.b)]
        if self.num_distinct:
            ids = [i % self.num_distinct for i in ids]
        rows = torch.stack([synthetic_sample(i, self.s, self.vocab) for i in ids])
        return {"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    def _iterate(self, start_step: int):
        step = start_step
        global_batch = self.b * self.dp_size * self.accum
        while True:
            for j in range(self.accum):
                yield self._batch(step * global_batch + j * self.b * self.dp_size + self.dp_rank * self.b)
            step += 1

    def valid(self):
        return None


def synthetic_data_factory(cfg: MegacannConfig, num_distinct: int | None = None):
    """A Trainer ``data_factory``: this rank's SyntheticData from a consumed_samples offset."""
    from megacann import parallel_state as ps

    def build(consumed_samples: int) -> SyntheticData:
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        return SyntheticData(cfg, dp_rank, dp_size, num_distinct, consumed_samples=consumed_samples)

    return build


def tiny_hf_mixtral(path: str, vocab_size: int, seed: int = 3, **settings) -> str:
    """A tiny Mixtral (4 experts, top-2) written by transformers as a Hugging Face directory; ``settings``
    override MixtralConfig's."""
    import transformers

    cfg = transformers.MixtralConfig(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 64,
            "attn_implementation": "eager",
            **settings,
        }
    )
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises norms to ones: randomise them so a test sees them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
