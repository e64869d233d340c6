"""What the generation tests share: prompts of different lengths, a tiny Hugging Face LLaMA,
transformers' own greedy generation with each token's log-probability (the reference), and one thread."""

from __future__ import annotations

import pytest
import torch

VOCAB = 260
NEW_TOKENS = 64
PROMPT_LENGTHS = (3, 9, 14, 6)  # one batch, left-padded to 14


@pytest.fixture(autouse=True)
def one_thread():
    """Each test of a module importing this runs its tiny models on one thread: with two, on 2 cores that
    other processes share, one qwen3_moe generation of 64 tokens took 37.7 s instead of 0.62 s (measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, vocab: int = VOCAB, seed: int = 1) -> list[list[int]]:
    """Random prompts (no token 0: the padding id) of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


LLAMA_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "attn_implementation": "eager",
}


def tiny_hf_llama(path: str, seed: int = 0, **settings) -> str:
    """A tiny LLaMA written by transformers, its norms randomised (transformers starts them at ones, which
    would hide a mix-up)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_SHAPE, **settings}))
    with torch.no_grad():
        for param in (p for name, p in model.named_parameters() if "norm" in name):
            param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``generate`` of the directory ``path`` (greedy, left padding, no EOS): the new tokens
    ``[b, new_tokens]`` and their log-probabilities under the unprocessed logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # 64 tokens for every row, as the generator is asked
    longest = max(map(len, batch))
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[:, longest:]
    logprobs = torch.stack(out.logits, 1).float().log_softmax(-1).gather(2, tokens.unsqueeze(2)).squeeze(2)
    return tokens, logprobs


def assert_same_results(ours: list, expected: list, atol: float = 1e-5) -> None:
    """Two runs' GenerationResults agree: the same tokens a request, log-probabilities (and processed ones,
    where the expected run has them) within ``atol``."""
    assert len(ours) == len(expected)
    for row, (result, reference) in enumerate(zip(ours, expected)):
        assert result.tokens == reference.tokens, f"row {row}"
        pairs = [(result.logprobs, reference.logprobs)]
        if reference.processed_logprobs is not None:
            pairs.append((result.processed_logprobs, reference.processed_logprobs))
        for got, want in pairs:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=atol)
