"""``megacann-generate --model`` of a LoRA run: by default the adapters stay attached and active on the base,
unmerged (as ``peft.PeftModel.from_pretrained`` loads them); ``--lora merged`` merges them. Both print the
tokens the merged weights generate, and the adapters really were unmerged (and really change the output)."""

from __future__ import annotations

import os

import pytest
from dist_harness import run_on_ranks
from generation_helpers import one_thread  # noqa: F401 (an autouse fixture)

from megacann.data.tokenizer import ByteTokenizer
from megacann.generate import load_model, main
from megacann.generation import Generator, SamplingParams
from megacann.layers.lora import lora_adapters
from megacann.models import get_model_spec

TOKENIZER = ByteTokenizer()
PROMPT = "abc de"


def _train_lora(root: str) -> None:
    """A LoRA run of 3 steps on a base drawn from the seed, its checkpoint at step 3 (byte tokenizer)."""
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann.data.tokenizer import load_tokenizer
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    overrides = [
        f"experiment.output_dir={root}",
        "model.vocab_size=260",
        "lora=true",
        "lora_rank=4",
        "lora_target_modules=[q_proj,v_proj,down_proj]",
        "optim.lr=5e-2",
        "optim.max_steps=3",
        "logging.ckpt_interval=3",
    ]
    cfg = tiny_config(overrides)
    trainer = Trainer(
        cfg, setup_runtime(cfg), tokenizer=load_tokenizer("byte"), data_factory=synthetic_data_factory(cfg)
    )
    trainer.fit()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("generate_lora") / "run")
    run_on_ranks(_train_lora, 1, args=(root,), timeout=300)
    return os.path.join(root, "checkpoint_3")


def _greedy(model) -> list[int]:
    generator = Generator(model, get_model_spec(model.config.type), eos_token_ids=[TOKENIZER.eos_id])
    (result,) = generator.generate([TOKENIZER.encode(PROMPT)], SamplingParams(max_new_tokens=16))
    return result.tokens


def test_a_lora_run_generates_with_its_adapters_unmerged_what_the_merged_weights_do(lora_run, capsys):
    unmerged, merged = load_model(lora_run, lora="unmerged"), load_model(lora_run, lora="merged")
    adapters = [adapter for _, adapter in lora_adapters(unmerged)]
    assert len(adapters) == 3 * unmerged.config.num_layers and not list(lora_adapters(merged))  # 3 targets a layer
    assert all(
        float(adapter.lora_B.detach().abs().max()) > 0 for adapter in adapters
    )  # trained: they change the output
    tokens = _greedy(merged)
    assert _greedy(unmerged) == tokens
    for _, adapter in lora_adapters(unmerged):
        adapter.lora_B.data.zero_()  # the base alone answers otherwise: the adapters were really used
    assert _greedy(unmerged) != tokens
    expected = TOKENIZER.decode([t for t in tokens if t != TOKENIZER.eos_id])
    for flags in ([], ["--lora", "merged"]):
        argv = ["--model", lora_run, "--tokenizer", "byte", "--prompt", PROMPT, "--max_new_tokens", "16", *flags]
        assert main(argv) == 0
        assert capsys.readouterr().out == expected + "\n"


def test_the_command_keeps_adapters_unmerged_by_default(lora_run, monkeypatch):
    built = []
    import megacann.generate as command

    real = command.load_model
    monkeypatch.setattr(command, "load_model", lambda *args: built.append(real(*args)) or built[-1])
    assert main(["--model", lora_run, "--tokenizer", "byte", "--prompt", "x", "--max_new_tokens", "1"]) == 0
    assert len(list(lora_adapters(built[-1]))) == 3 * built[-1].config.num_layers
    assert (
        main(["--model", lora_run, "--tokenizer", "byte", "--prompt", "x", "--max_new_tokens", "1", "--lora", "merged"])
        == 0
    )
    assert not list(lora_adapters(built[-1]))
