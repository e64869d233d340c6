"""megacann-convert on one process: a checkpoint written by 2 tensor-parallel ranks consolidates to whole
weights, exports to a Hugging Face directory that transformers loads with the same logits, and comes back."""

import pytest
import torch
from dist_harness import run_on_ranks
from safetensors.torch import load_file

from megacann.checkpoint import read_info
from megacann.checkpoint.metadata import model_config_of
from megacann.convert import main
from megacann.interop.reading import read_consolidated

CASES = {
    "untied_fp32": ["distributed.tensor_parallel_size=2"],
    "tied_bf16": ["distributed.tensor_parallel_size=2", "model.tie_word_embeddings=true", "model.precision=bf16"],
}


def _write_checkpoints(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps, weights

    out = {}
    for name, overrides in CASES.items():
        trainer = make_trainer(overrides, f"{root}/{name}")
        run_steps(trainer, 2)
        out[name] = {"path": trainer.save_checkpoint(), "weights": weights(trainer), "output_dir": f"{root}/{name}"}
    return out


def _hf_tensors_by_hand(weights: dict, cfg) -> dict:
    """What LlamaForCausalLM's state dict must hold, written out here rather than by megacann's adapter:
    ``model.`` before every name but the head; megacann's fused ``qkv_proj`` rows are q (heads x head_dim),
    k and v (kv heads x head_dim each), its ``gate_up_proj`` rows gate then up (ffn each)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.float()
        hf = name if name == "lm_head.weight" else "model." + name
        if ".qkv_proj." in name:
            out[hf.replace("qkv_proj", "q_proj")] = tensor[:q_rows]
            out[hf.replace("qkv_proj", "k_proj")] = tensor[q_rows : q_rows + kv_rows]
            out[hf.replace("qkv_proj", "v_proj")] = tensor[q_rows + kv_rows :]
            assert tensor.shape[0] == q_rows + 2 * kv_rows, name
        elif ".gate_up_proj." in name:
            half = tensor.shape[0] // 2
            out[hf.replace("gate_up_proj", "gate_proj")], out[hf.replace("gate_up_proj", "up_proj")] = (
                tensor[:half],
                tensor[half:],
            )
        else:
            out[hf] = tensor
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return run_on_ranks(_write_checkpoints, 2, args=(str(tmp_path_factory.mktemp("export")),), timeout=200)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_consolidate_gives_the_whole_weights(written, tmp_path, case):
    source = written[case]
    assert main(["consolidate", source["output_dir"], str(tmp_path / "c")]) == 0  # an output dir: its latest
    tensors, cfg = read_consolidated(str(tmp_path / "c"))
    assert tensors.keys() == source["weights"].keys()
    for name, expected in source["weights"].items():
        assert torch.equal(tensors[name], expected.to(tensors[name].dtype)), name
    assert cfg.vocab_size == 200 and cfg.precision == ("bf16" if "bf16" in case else "fp32")
    assert ("lm_head.weight" in tensors) == case.startswith("untied")
    assert main(["consolidate", source["path"], str(tmp_path / "f"), "--dtype", "fp32"]) == 0
    assert all(t.dtype == torch.float32 for t in load_file(str(tmp_path / "f" / "model.safetensors")).values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_export_loads_in_transformers_and_comes_back(written, tmp_path, case):
    transformers = pytest.importorskip("transformers")
    from megacann.interop.full_state import load_full_state_dict_
    from megacann.layers import LayerContext
    from megacann.models import LlamaModel

    source = written[case]
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert main(["to-hf", source["path"], hf_dir, "--dtype", "fp32"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    cfg = model_config_of(read_info(source["path"]))
    state = hf.state_dict()
    expected = _hf_tensors_by_hand(source["weights"], cfg)
    assert expected.keys() == {k for k in state if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    cfg.precision, cfg.hidden_dropout, cfg.attention_dropout = "fp32", 0.0, 0.0
    ours = LlamaModel(cfg, context=LayerContext(params_dtype=torch.float32))
    load_full_state_dict_([ours], {k: v.float() for k, v in source["weights"].items()})
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.eval()(input_ids=ids), atol=1e-4, rtol=0)

    assert main(["from-hf", hf_dir, back]) == 0
    tensors, again = read_consolidated(back)
    for name, tensor in source["weights"].items():
        assert torch.equal(tensors[name], tensor.float()), name
    assert (again.hidden_size, again.num_layers, again.tie_word_embeddings) == (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.tie_word_embeddings,
    )


def test_convert_errors_name_the_problem(tmp_path, capsys):
    assert main(["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 1
    assert "neither a megacann checkpoint" in capsys.readouterr().err
