"""On a CUDA device (skipped elsewhere): resuming is bitwise with the CUDA generator in the state, an
asynchronous save copies device tensors out before training changes them, and a checkpoint written on the
GPU loads on the CPU."""

import pytest
import torch
from dist_harness import run_on_ranks
from test_checkpoint_resume import ASYNC, BF16, _check, _resume_matrix

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {"cuda_fp32": [], "cuda_bf16": BF16, "cuda_bf16_async": BF16 + ASYNC}
CUDA_ENV = {"MEGACANN_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _deterministic_matrix(root: str) -> dict:
    torch.use_deterministic_algorithms(True)  # embedding backward uses atomics otherwise
    torch.backends.cuda.matmul.allow_tf32 = False
    return _resume_matrix(CASES, root)


def _load_on_cpu(path: str, root: str) -> dict:
    from checkpoint_helpers import make_trainer, weights

    trainer = make_trainer(BF16, f"{root}/cpu")
    trainer.load_checkpoint(path)
    return {"device": str(trainer.device), "weights": weights(trainer), "step": trainer.state.step}


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cuda"))
    return root, run_on_ranks(_deterministic_matrix, 1, args=(root,), env=CUDA_ENV, timeout=300)[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_is_bitwise_on_cuda(on_cuda, name):
    _check(on_cuda[1], name)


def test_cuda_checkpoint_loads_on_cpu(on_cuda, tmp_path):
    root, results = on_cuda
    path = f"{root}/cuda_bf16/stopped/checkpoint_6"
    loaded = run_on_ranks(_load_on_cpu, 1, args=(path, str(tmp_path)), timeout=200)[0]
    assert loaded["device"] == "cpu" and loaded["step"] == 6
    assert results["cuda_bf16"]["same_weights"]
    expected = results["cuda_bf16"]["weights"]
    for name, tensor in expected.items():
        assert torch.equal(loaded["weights"][name], tensor), name
