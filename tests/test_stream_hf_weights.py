"""``stream_hf_weights``: a live model's weights under Hugging Face names, in buckets, from any layout.

Two runs on 4 gloo ranks train one step and save a checkpoint: a LLaMA with tied embeddings at tensor
parallel 2 x pipeline parallel 2 (the head's tied copy lives on the last stage), and gpt-oss (experts
stacked per layer in its Hugging Face format) at tensor parallel 2 x expert parallel 2. Streamed on rank
0, the buckets hold bit for bit the tensors ``megacann-convert to-hf`` writes from that checkpoint, each
bucket within its size unless one unit alone is larger, and a transformers model filled by the receiver
gives the exported directory's logits. The layouts are shown in force (shards, stages, experts per rank).

At data parallel 2 with ZeRO-3 (2 ranks), the streamed buckets equal that run's ``to-hf`` export bit for
bit too; each rank holds half of the weights before and after the stream, and while streaming at most one
unit's weights whole (the largest unit's elements), none after.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_on_ranks
from training_helpers import synthetic_data_factory

# a tiny LLaMA layer is about 120 KB, a gpt-oss one about 200 KB: some buckets hold two units, others one
BUCKET_MB = {"llama": 0.2, "gpt_oss": 0.45, "llama_zero3": 0.3}
LLAMA = [
    "distributed.tensor_parallel_size=2",
    "distributed.pipeline_parallel_size=2",
    "model.tie_word_embeddings=true",
]
ZERO3 = ["distributed.zero_optimization=3", "optim.grad_accum_steps=1"]
GPT_OSS = ["distributed.tensor_parallel_size=2", "distributed.expert_parallel_size=2", "optim.grad_accum_steps=1"]


def _stream(name: str, root: str, hf_dir: str) -> dict:
    import torch.distributed as dist
    from finetune_helpers import recipe

    from megacann import parallel_state as ps
    from megacann.interop import stream_hf_weights
    from megacann.interop.streaming import unit_of
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    common = [f"experiment.output_dir={root}/{name}", "optim.max_steps=1", "logging.ckpt_interval=1"]
    common += ["data.seq_length=16", "data.batch_size=2", "data.tokenizer=byte"]
    if name.startswith("llama"):
        model = {"type": "llama", "precision": "fp32", "hidden_size": 64, "num_layers": 4, "vocab_size": 260}
        model.update(num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=96, max_position_embeddings=64)
        layout = LLAMA if name == "llama" else ZERO3
        cfg = recipe(common + layout, model=model, world_size=dist.get_world_size())
    else:
        model = {"type": "gpt_oss", "precision": "fp32", "init_from": hf_dir}
        cfg = recipe(common + GPT_OSS, model=model, world_size=dist.get_world_size())
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    trainer.fit()
    probe = _Zero3Probe(trainer.optimizer) if name == "llama_zero3" else None
    chunk = trainer.model_chunks[0]
    layout = {
        "layers": sorted(int(i) for i in chunk.layers),
        "experts": sorted({n.split(".")[4] for n, _ in chunk.named_parameters() if ".experts." in n}),
        "q_rows": next(p.shape[0] for n, p in chunk.named_parameters() if n.endswith("q_proj.weight")),
    }
    buckets = []
    for bucket in stream_hf_weights(trainer.model_chunks, cfg.model, bucket_mb=BUCKET_MB[name]):
        units = {unit_of(hf) for hf, _ in bucket}
        buckets.append(
            {"bytes": sum(t.nbytes for _, t in bucket), "units": len(units), "names": [n for n, _ in bucket]}
        )
        if dist.get_rank() == 0:
            torch.save(dict(bucket), os.path.join(root, f"{name}_bucket{len(buckets)}.pt"))
    if probe is not None:
        layout.update(probe.figures())
    return {"layout": layout, "buckets": buckets}


class _Zero3Probe:
    """The weight elements whole on this rank after each ZeRO-3 gather (the peak) and the stored shares."""

    def __init__(self, optimizer):
        from zero3_checks import storages

        self.optimizer, self.storages = optimizer, storages(optimizer)
        self.kept = self.gathered()  # the checkpoint's save leaves every unit whole until its next forward
        for storage in self.storages:  # sharded, as between training steps
            storage.free_all()
        self.before = self.gathered()
        self.peak = 0
        for storage in self.storages:
            wait = storage.wait_bucket

            def counted(index, wait=wait):
                wait(index)
                self.peak = max(self.peak, self.gathered())

            storage.wait_bucket = counted

    def gathered(self) -> int:
        return sum(s.gathered_numel() for s in self.storages)

    def figures(self) -> dict:
        units = self.optimizer._unit_hooks.units  # ZeRO-3's units: each unit's buckets
        return {
            "unit_sizes": [sum(storage.layout.buckets[index].numel for storage, index in u.pieces) for u in units],
            "kept_by_the_save": self.kept,
            "gathered_before": self.before,
            "gathered_after": self.gathered(),
            "peak": self.peak,
            "stored": sum(s.shard.numel() for s in self.storages),
            "total": sum(s.layout.numel for s in self.storages),
        }


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    pytest.importorskip("transformers")
    from gpt_oss_helpers import tiny_hf_gpt_oss

    root = str(tmp_path_factory.mktemp("stream"))
    hf_dir = tiny_hf_gpt_oss(os.path.join(root, "gpt_oss_hf"), swiglu_limit=7.0)
    results = {name: run_on_ranks(_stream, 4, args=(name, root, hf_dir), timeout=300) for name in ("llama", "gpt_oss")}
    return root, results


def test_the_layouts_are_in_force(streamed):
    _, results = streamed
    llama = [results["llama"][rank]["layout"] for rank in range(4)]
    assert [r["layers"] for r in llama] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # two stages of two layers
    assert llama[0]["q_rows"] == 64 // 2  # each tensor-parallel rank holds half of the query rows
    oss = [results["gpt_oss"][rank]["layout"] for rank in range(4)]
    assert [r["experts"] for r in oss] == [["0", "1"], ["0", "1"], ["2", "3"], ["2", "3"]]  # ep 2 across dp 2
    assert oss[0]["q_rows"] == 4 * 24 // 2


@pytest.fixture(scope="module")
def streamed_zero3(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("stream_zero3"))
    return root, {"llama_zero3": run_on_ranks(_stream, 2, args=("llama_zero3", root, ""), timeout=300)}


def test_zero3_streams_one_unit_whole_at_a_time(streamed_zero3):
    _, results = streamed_zero3
    for rank in results["llama_zero3"]:
        probe = rank["layout"]
        assert probe["layers"] == [0, 1, 2, 3]
        assert probe["stored"] * 2 == probe["total"]  # each rank stores half of the weights
        assert (probe["gathered_before"], probe["gathered_after"]) == (0, 0), (
            probe
        )  # none whole between steps, nor after
        assert len(probe["unit_sizes"]) == 5  # the 4 blocks and the chunk's own weights
        assert probe["kept_by_the_save"] == probe["total"] > probe["peak"]
        assert probe["peak"] == max(probe["unit_sizes"])  # while streaming, one unit whole at a time
    assert results["llama_zero3"][1]["buckets"] == []  # only rank 0 receives


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "llama_zero3"])
def test_buckets_equal_the_to_hf_export_bit_for_bit(streamed, streamed_zero3, name):
    from safetensors.torch import load_file

    from megacann.interop import export_hf

    root, results = streamed_zero3 if name == "llama_zero3" else streamed
    buckets = results[name][0]["buckets"]
    assert all(not r["buckets"] for r in results[name][1:])  # only rank 0 receives
    assert len(buckets) > 2
    limit = BUCKET_MB[name] * 2**20
    for bucket in buckets:  # a bucket passes its size only when one unit alone is larger
        assert bucket["bytes"] <= limit or bucket["units"] == 1
    assert any(bucket["units"] > 1 for bucket in buckets)
    streamed_tensors: dict[str, torch.Tensor] = {}
    for index in range(1, len(buckets) + 1):
        part = torch.load(os.path.join(root, f"{name}_bucket{index}.pt"))
        assert not set(part) & set(streamed_tensors)  # every tensor once
        streamed_tensors.update(part)
    out = export_hf(os.path.join(root, name, "checkpoint_1"), os.path.join(root, f"{name}_to_hf"), log=lambda _: None)
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(streamed_tensors) == sorted(exported)
    for key, tensor in exported.items():
        assert streamed_tensors[key].dtype == tensor.dtype and torch.equal(streamed_tensors[key], tensor), key


def test_a_receiver_fills_a_transformers_model(streamed):
    import transformers

    from megacann.interop import load_into_module

    root, results = streamed
    out = os.path.join(root, "llama_to_hf")
    if not os.path.isdir(out):
        pytest.skip("needs the export of test_buckets_equal_the_to_hf_export_bit_for_bit")
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    engine = transformers.AutoModelForCausalLM.from_config(config).eval()  # random weights until updated
    loaded = []
    for index in range(1, len(results["llama"][0]["buckets"]) + 1):
        bucket = list(torch.load(os.path.join(root, f"llama_bucket{index}.pt")).items())
        loaded += load_into_module(engine, bucket, strict_names=False)
    assert "model.embed_tokens.weight" in loaded and "lm_head.weight" not in loaded  # tied: sent once
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, reference(ids).logits, rtol=0, atol=0)
    with pytest.raises(KeyError, match="no tensor named 'lm_head.weight.extra'"):
        load_into_module(engine, [("lm_head.weight.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\], the module's is \[64\]"):
        load_into_module(engine, [("model.norm.weight", torch.zeros(3))])


def test_bad_bucket_size_and_lora_are_refused():
    from finetune_helpers import recipe

    from megacann.interop import stream_hf_weights
    from megacann.layers.lora import attach_lora
    from megacann.models import get_model_spec
    from megacann.training.finetune import lora_config
    from megacann.training.rank_model import build_rank_chunks

    with pytest.raises(ValueError, match="bucket_mb must be > 0, got 0"):
        next(stream_hf_weights([], None, bucket_mb=0))
    cfg = recipe(["lora=true", "lora_rank=2", "lora_target_modules=[q_proj]"])
    chunks = build_rank_chunks(cfg, get_model_spec("llama"), "cpu")
    attach_lora(chunks[0], lora_config(cfg))
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.q_proj\.adapter\.lora_A' is a LoRA adapter"):
        next(stream_hf_weights(chunks, cfg.model))
