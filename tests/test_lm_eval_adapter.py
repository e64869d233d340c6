"""megacann's lm-evaluation-harness model against lm-eval's own Hugging Face backend, offline.

A tiny random LLaMA and a byte-level tokenizer are written by transformers; megacann loads that directory,
lm-eval's ``hf`` model loads megacann's export of it (``save_pretrained_hf``). Task YAMLs and JSONL data are
written into tmp: a multiple-choice task (loglikelihood), a rolling-perplexity task (loglikelihood_rolling,
windows of 32 tokens) and a generate_until task whose stop string is cut from what the model really says.
Both backends run the same tasks with batches of 3; each request's log-likelihood, each generated text and
each score must agree. The adapter's ``until`` ends generation (fewer tokens, the texts of cutting
after), and at tensor parallel 2 on 2 gloo ranks (half the heads a rank) rank 0 scores as one process; at
data parallel 2 (2 ranks) and data parallel 2 x tensor parallel 2 (4 ranks) each rank is handed only its
documents' requests and global rank 0 gets one process's scores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

pytestmark = pytest.mark.extended  # a slow multi-rank check: `make test-extended` runs it

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local JSONL files: never the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from generation_helpers import LLAMA_SHAPE, one_thread, tiny_hf_llama  # noqa: E402,F401  (one_thread: autouse fixture)

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
MAX_LENGTH, BATCH, NEW_TOKENS = 32, 3, 12

QUESTIONS = [
    {"question": "Two plus two is", "choices": [" four", " five", " a fish"], "answer": 0},
    {"question": "The sky at noon looks", "choices": [" blue", " green"], "answer": 0},
    {"question": "Cats say", "choices": [" woof", " meow", " moo", " quack"], "answer": 1},
    {"question": "Water freezes at zero", "choices": [" degrees", " apples"], "answer": 0},
]
TEXTS = [
    "A short line.",
    "A longer paragraph that needs more than one window of thirty-two tokens to be scored in full.",
    "Numbers 0123456789 and symbols !?",
]
PROMPTS = ["def f(x):", "Once upon a time, a", "Q: 3+4=? A:", "The quick brown fox jumps over", "x"]


def byte_tokenizer(path: str) -> None:
    """A byte-level tokenizer (one token per byte, no merges) plus 4 special tokens: 260 ids."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS.values()))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **SPECIALS
    )
    fast.save_pretrained(path)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def task(directory, name: str, data: str, **settings) -> None:
    spec = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data}},
        "test_split": "test",
        **settings,
    }
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(spec, allow_unicode=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(megacann's directory, the export lm-eval's hf backend reads, the task directory, the stop string)."""
    from megacann.evaluation.lm_eval_adapter import MegacannLM
    from megacann.interop import from_pretrained_hf, save_pretrained_hf

    root = tmp_path_factory.mktemp("lm_eval")
    source = str(root / "hf")
    tiny_hf_llama(source, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    byte_tokenizer(source)
    export = str(root / "export")
    model = from_pretrained_hf(source)
    save_pretrained_hf([model], export, model.config)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(source, name), export)
    # the stop string: a character from the middle of what the model says to the second prompt
    lm = MegacannLM(model, tokenizer=source)
    said = lm.tok_decode(lm.generator.generate([lm.tok_encode(PROMPTS[1])], max_new_tokens(NEW_TOKENS))[0].tokens)
    stop = said[len(said) // 2]
    tasks = root / "tasks"
    tasks.mkdir()
    task(
        tasks,
        "tiny_choice",
        write_jsonl(root / "choice.jsonl", QUESTIONS),
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}],
    )
    task(
        tasks,
        "tiny_rolling",
        write_jsonl(root / "texts.jsonl", [{"text": t} for t in TEXTS]),
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    )
    task(
        tasks,
        "tiny_generate",
        write_jsonl(root / "prompts.jsonl", [{"prompt": p, "target": said[: len(said) // 2]} for p in PROMPTS]),
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{target}}",
        generation_kwargs={"until": [stop], "max_gen_toks": NEW_TOKENS, "do_sample": False},
        metric_list=[{"metric": "exact_match"}],
    )
    return source, export, str(tasks), stop


def max_new_tokens(n: int):
    from megacann.generation import SamplingParams

    return SamplingParams(max_new_tokens=n)


def evaluate(model, model_args: dict, tasks_dir: str) -> dict:
    """``simple_evaluate`` of the three tiny tasks on ``model`` (a registered name, or an LM object)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import megacann.evaluation.lm_eval_adapter  # noqa: F401  (registers "megacann")

    return simple_evaluate(
        model=model,
        model_args={**model_args, "max_length": MAX_LENGTH} if isinstance(model, str) else None,
        tasks=["tiny_choice", "tiny_rolling", "tiny_generate"],
        batch_size=BATCH,
        task_manager=TaskManager(include_path=tasks_dir),
        bootstrap_iters=0,
        log_samples=True,
    )


@pytest.fixture(scope="module")
def both(setup):
    source, export, tasks, _ = setup
    ours = evaluate("megacann", {"model": source}, tasks)
    reference = evaluate("hf", {"pretrained": export, "dtype": "float32", "device": "cpu"}, tasks)
    return ours, reference


def responses(results: dict, name: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][name], key=lambda s: s["doc_id"])]


def test_loglikelihoods_equal_the_hf_backend(both):
    ours, reference = both
    mine, theirs = responses(ours, "tiny_choice"), responses(reference, "tiny_choice")
    assert [len(r) for r in mine] == [len(q["choices"]) for q in QUESTIONS]
    scores = torch.tensor([c[0][0] for d in mine for c in d])
    expected = torch.tensor([c[0][0] for d in theirs for c in d])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert [c[0][1] for d in mine for c in d] == [c[0][1] for d in theirs for c in d]  # is_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_choice"][metric] == reference["results"]["tiny_choice"][metric]


def test_rolling_loglikelihoods_equal_the_hf_backend(both):
    ours, reference = both
    mine = torch.tensor([r[0] for r in responses(ours, "tiny_rolling")])
    theirs = torch.tensor([r[0] for r in responses(reference, "tiny_rolling")])
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_rolling"][metric] == pytest.approx(
            reference["results"]["tiny_rolling"][metric], rel=1e-5
        )


def test_generations_equal_the_hf_backend_and_stop_at_until(both, setup):
    ours, reference = both
    stop = setup[3]
    mine, theirs = responses(ours, "tiny_generate"), responses(reference, "tiny_generate")
    assert mine == theirs
    texts = [r[0] for r in mine]
    assert all(stop not in text for text in texts)
    assert len(texts[1]) < NEW_TOKENS  # the second prompt's text was cut at the stop string
    metric = "exact_match,none"
    assert ours["results"]["tiny_generate"][metric] == reference["results"]["tiny_generate"][metric]


def test_the_command_runs_the_megacann_model(setup, both):
    source, _, tasks, _ = setup
    command = [sys.executable, "-m", "megacann.evaluation", "--model", "megacann", "--model_args"]
    command += [f"model={source},max_length={MAX_LENGTH}", "--tasks", "tiny_choice", "--include_path", tasks]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = {}  # metric -> value, from lm-eval's results table
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 7 and cells[5] in ("acc", "acc_norm"):
            printed[cells[5]] = float(cells[7])
    results = both[0]["results"]["tiny_choice"]
    assert printed == {"acc": round(results["acc,none"], 4), "acc_norm": round(results["acc_norm,none"], 4)}, (
        done.stdout
    )


def test_unknown_generation_option_is_refused_by_name(setup):
    from megacann.evaluation.lm_eval_adapter import MegacannLM

    lm = MegacannLM(setup[0])
    with pytest.raises(ValueError, match="gen_kwargs key 'beams' is not supported"):
        lm._sampling({"until": ["\n"], "beams": 4})


def test_until_stops_generation_early_with_the_text_cut_after_gives(setup):
    """``until`` is the generator's stop strings: each text equals the full ``NEW_TOKENS`` generation cut at
    its first stop string (computed here), and a row that meets one generates fewer tokens."""
    from types import SimpleNamespace

    from megacann.evaluation.lm_eval_adapter import MegacannLM

    source, _, _, stop = setup
    lm = MegacannLM(source, batch_size=BATCH)
    generated: list[int] = []  # tokens each generated row cost, in the order the adapter ran them
    generate = lm.generator.generate

    def counting_generate(*args, **kwargs):
        results = generate(*args, **kwargs)
        generated.extend(len(result.tokens) for result in results)
        return results

    lm.generator.generate = counting_generate
    gen_kwargs = {"until": [stop], "max_gen_toks": NEW_TOKENS, "do_sample": False}
    texts = lm.generate_until([SimpleNamespace(args=(prompt, gen_kwargs)) for prompt in PROMPTS])

    full = generate([lm.tok_encode(p) for p in PROMPTS], max_new_tokens(NEW_TOKENS))
    expected = []
    for result in full:
        text = lm.tok_decode(result.tokens)
        expected.append(text[: text.find(stop)] if stop in text else text)
    assert texts == expected
    assert sum(generated) < sum(len(result.tokens) for result in full)
    assert min(generated) < NEW_TOKENS  # at least the second prompt's row stopped at the stop string


TASKS = ("tiny_choice", "tiny_rolling", "tiny_generate")


def _evaluate_at_tp2(source: str, tasks_dir: str) -> dict:
    """On each of 2 gloo ranks: the adapter at tp 2 on the tiny tasks; the scores (rank 0 only, as lm-eval
    returns them) and what this rank held: its query and key rows, its cache's kv heads."""
    from megacann.evaluation.lm_eval_adapter import MegacannLM

    lm = MegacannLM(source, batch_size=BATCH, max_length=MAX_LENGTH, tensor_parallel_size=2)
    results = evaluate(lm, {}, tasks_dir)
    attention = lm.model.layers["0"].self_attn
    probe = {
        "q_rows": attention.q_proj.weight.shape[0],
        "k_rows": attention.k_proj.weight.shape[0],
        "cache_kv_heads": lm.generator.last_cache.layers[0].keys.shape[2],
        "rank_seen_by_lm_eval": (lm.rank, lm.world_size),
    }
    if results is None:
        return {"scores": None, **probe}
    scores = {name: responses(results, name) for name in TASKS}
    return {"scores": scores, "metrics": {name: results["results"][name] for name in TASKS}, **probe}


def test_tensor_parallel_2_scores_equal_one_process(setup, both):
    """``tensor_parallel_size=2`` on 2 gloo ranks: every rank holds half the query and kv heads and runs
    every request; rank 0 returns the log-likelihoods, rolling log-likelihoods and texts of one process."""
    from dist_harness import run_on_ranks

    source, _, tasks, _ = setup
    ranks = run_on_ranks(_evaluate_at_tp2, 2, args=(source, tasks), timeout=600)
    whole = from_pretrained_hf_shapes(source)
    for probe in ranks:
        assert probe["q_rows"] * 2 == whole["q_rows"] and probe["k_rows"] * 2 == whole["k_rows"]
        assert probe["cache_kv_heads"] * 2 == whole["kv_heads"]
        assert probe["rank_seen_by_lm_eval"] == (0, 1)  # lm-eval splits no request across TP ranks
    assert ranks[1]["scores"] is None  # only LOCAL_RANK 0 returns results
    one = both[0]
    assert ranks[0]["scores"]["tiny_generate"] == responses(one, "tiny_generate")
    choices = lambda docs: torch.tensor([c[0][0] for d in docs for c in d])  # noqa: E731
    rolling = lambda docs: torch.tensor([r[0] for r in docs])  # noqa: E731
    for name, values in (("tiny_choice", choices), ("tiny_rolling", rolling)):
        torch.testing.assert_close(values(ranks[0]["scores"][name]), values(responses(one, name)), rtol=1e-5, atol=1e-6)
    for name in ("tiny_choice", "tiny_generate"):
        assert ranks[0]["metrics"][name] == one["results"][name]


TASK_METHODS = {
    "tiny_choice": "loglikelihood",
    "tiny_rolling": "loglikelihood_rolling",
    "tiny_generate": "generate_until",
}
SHARE_METHODS = tuple(TASK_METHODS.values())


def _evaluate_at_dp2(source: str, tasks_dir: str, tp: int) -> dict:
    """On each of ``2 x tp`` gloo ranks: the adapter at data parallel 2 (tensor parallel ``tp``) on the tiny
    tasks; the scores (global rank 0 only, as lm-eval returns them), the distinct request arguments each of
    lm-eval's calls handed this rank, the rank lm-eval saw and this rank's query rows."""
    from megacann.evaluation.lm_eval_adapter import MegacannLM

    lm = MegacannLM(source, batch_size=BATCH, max_length=MAX_LENGTH, tensor_parallel_size=tp, data_parallel_size=2)
    seen: dict[str, set] = {name: set() for name in SHARE_METHODS}
    for name in SHARE_METHODS:
        method = getattr(lm, name)

        def recording(requests, *args, _method=method, _name=name, **kwargs):
            seen[_name].update(_arguments(request.args) for request in requests)
            return _method(requests, *args, **kwargs)

        setattr(lm, name, recording)
    results = evaluate(lm, {}, tasks_dir)
    probe = {
        "seen": seen,
        "rank_seen_by_lm_eval": (lm.rank, lm.world_size),
        "q_rows": lm.model.layers["0"].self_attn.q_proj.weight.shape[0],
    }
    if results is None:
        return {"scores": None, **probe}
    scores = {name: responses(results, name) for name in TASKS}
    filtered = {name: filtered_responses(results, name) for name in TASKS}
    metrics = {name: results["results"][name] for name in TASKS}
    return {"scores": scores, "filtered": filtered, "metrics": metrics, **probe}


def _arguments(args) -> tuple:
    """A request's arguments as a hashable value (generation's gen_kwargs dict as sorted JSON)."""
    return tuple(json.dumps(a, sort_keys=True) if isinstance(a, dict) else a for a in args)


def filtered_responses(results: dict, name: str) -> list:
    return [s["filtered_resps"] for s in sorted(results["samples"][name], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_data_parallel_2_scores_equal_one_process(setup, both, tp):
    """``data_parallel_size=2`` (at tp 1 on 2 gloo ranks, at tp 2 on 4): each data-parallel rank (both of
    its TP ranks) is handed the requests of its documents only (lm-eval's ``doc_id % 2``) and lm-eval
    gathers the rest to global rank 0: the log-likelihoods, rolling log-likelihoods, texts and metrics of
    one process."""
    from dist_harness import run_on_ranks

    source, _, tasks, _ = setup
    ranks = run_on_ranks(_evaluate_at_dp2, 2 * tp, args=(source, tasks, tp), timeout=900)
    one = both[0]
    whole_q_rows = from_pretrained_hf_shapes(source)["q_rows"]
    for global_rank, probe in enumerate(ranks):
        dp_rank = global_rank // tp  # tp ranks are neighbours in megacann's tp-cp-ep-dp-pp grid
        assert probe["rank_seen_by_lm_eval"] == (dp_rank, 2)
        assert probe["q_rows"] * tp == whole_q_rows
        share = {name: set() for name in SHARE_METHODS}
        for name, method in TASK_METHODS.items():
            for sample in one["samples"][name]:
                if sample["doc_id"] % 2 == dp_rank:
                    share[method].update(_arguments(args) for args in sample["arguments"])
        assert probe["seen"] == share, f"rank {global_rank} ran requests outside its share"
    assert all(probe["scores"] is None for probe in ranks[1:])  # the table is global rank 0's alone
    mine = ranks[0]
    first = lambda docs: [[r[0] for r in d] for d in docs]  # noqa: E731  (lm-eval's padding adds copies after)
    assert first(mine["scores"]["tiny_generate"]) == first(responses(one, "tiny_generate"))
    assert mine["filtered"]["tiny_generate"] == filtered_responses(one, "tiny_generate")
    choices = lambda docs: torch.tensor([c[0][0] for d in docs for c in d])  # noqa: E731
    rolling = lambda docs: torch.tensor([r[0][0] for r in docs])  # noqa: E731
    for name, values in (("tiny_choice", choices), ("tiny_rolling", rolling)):
        torch.testing.assert_close(values(mine["scores"][name]), values(responses(one, name)), rtol=1e-5, atol=1e-6)
    assert [c[0][1] for d in mine["scores"]["tiny_choice"] for c in d] == [
        c[0][1] for d in responses(one, "tiny_choice") for c in d
    ]
    for name in ("tiny_choice", "tiny_generate"):
        assert mine["metrics"][name] == one["results"][name]
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert mine["metrics"]["tiny_rolling"][metric] == pytest.approx(
            one["results"]["tiny_rolling"][metric], rel=1e-5
        )


def from_pretrained_hf_shapes(source: str) -> dict:
    from megacann.interop import from_pretrained_hf

    model = from_pretrained_hf(source)
    attention = model.layers["0"].self_attn
    return {
        "q_rows": attention.q_proj.weight.shape[0],
        "k_rows": attention.k_proj.weight.shape[0],
        "kv_heads": LLAMA_SHAPE["num_key_value_heads"],
    }


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
        ({"data_parallel_size": 0}, "data_parallel_size must be >= 1, got 0"),
        ({"tensor_parallel_size": 2}, r"tensor_parallel_size 2 needs 2 processes, e.g. torchrun --nproc_per_node 2"),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 2},
            r"tensor_parallel_size 2 x data_parallel_size 2 needs 4 processes, e.g. torchrun --nproc_per_node 4 "
            r"-m megacann.evaluation \.\.\. \(this run has 1\)",
        ),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size 2 is not supported"),
        ({"expert_parallel_size": 2}, "expert_parallel_size 2 is not supported"),
    ],
)
def test_bad_parallel_sizes_are_refused_by_name(setup, monkeypatch, sizes, message):
    from megacann.evaluation.lm_eval_adapter import MegacannLM

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=message):
        MegacannLM(setup[0], **sizes)
