"""Checks of a run's inputs before anything heavy starts: the output directory, the data files, the
tokenizer against the model, and the checkpoint to resume from.

The recipe's own rules are checked by ``prepare_recipe``; these look at the files the recipe names. Each
failure is a :class:`~megacann.errors.MegacannError` whose message names the file, key or path and what
would fix it. ``megacann-train`` and the launcher run :func:`preflight` once before any rank starts
(``--dry_run`` too, without creating anything); the trainer repeats the cheap ones it depends on.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megacann.config import ConfigError, MegacannConfig
from megacann.config.families import shape_keys


def check_output_dir(cfg: MegacannConfig) -> None:
    """experiment.output_dir is a directory this process can write, or can be created."""
    out = os.path.abspath(os.path.expanduser(cfg.experiment.output_dir))
    probe = out
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    problem = None
    if not os.path.isdir(probe):
        problem = f"{probe} is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe} is not writable by this user"
    if problem:
        raise ConfigError(
            f"experiment.output_dir {cfg.experiment.output_dir!r} cannot be used: {problem}; "
            "give a directory you can write (e.g. experiment.output_dir=./output/run1)"
        )


def check_data(cfg: MegacannConfig) -> None:
    """data.path names usable data: existing files, readable .bin/.idx headers of the right sizes."""
    if cfg.data.path is None:
        return  # the embedded default corpus
    from megacann.data.indexed_dataset import IndexedDataset, IndexedDatasetError
    from megacann.data.sources import resolve_sources

    sft = cfg.train_mode in ("sft", "dpo")  # JSONL records
    for _, path in resolve_sources(cfg.data.path, cfg.data.weights, sft=sft):
        if sft:
            if os.path.getsize(path) == 0:
                raise _data_error(f"data.path: {path!r} is empty (expected JSONL records, one per line)")
        else:
            try:  # the header, and that the .bin holds what the .idx says
                dataset = IndexedDataset(path)
            except IndexedDatasetError as err:
                raise IndexedDatasetError(
                    f"data.path: {err}; the pair is damaged or incomplete: write it again with megacann-preprocess "
                    "(or copy it again)"
                ) from None
            if len(dataset) == 0:
                raise _data_error(f"data.path: {path}.idx lists no sequences (an empty corpus?)")


def _data_error(message: str) -> Exception:
    from megacann.data.sources import DataPathError

    return DataPathError(message + "; preprocess data with megacann-preprocess")


def check_tokenizer_fits(cfg: MegacannConfig, tokenizer: Any) -> None:
    """The tokenizer's ids fit the model's embedding (when model.vocab_size is given)."""
    vocab = cfg.model.vocab_size
    if vocab is not None and tokenizer.vocab_size > vocab and cfg.model.init_from:
        raise ConfigError(
            f"the tokenizer ({cfg.data.tokenizer or 'default'}) has {tokenizer.vocab_size} tokens but the model of "
            f"model.init_from {cfg.model.init_from} only {vocab}: use the tokenizer it was trained with"
        )
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab}: ids from {vocab} "
            f"up would index past the embedding. Set model.vocab_size >= {tokenizer.vocab_size} (or leave it out "
            "to take the tokenizer's), or use the tokenizer the model was made for"
        )


def check_tokenizer(cfg: MegacannConfig) -> None:
    """A tokenizer named by the recipe loads, and fits model.vocab_size when that is given."""
    if cfg.data.tokenizer is None or cfg.model.vocab_size is None:
        return  # the default corpus's BPE is built on first use; without a vocab_size the model takes its size
    from megacann.data.tokenizer import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except TokenizerError as err:
        raise TokenizerError(f"data.tokenizer: {err}") from None
    check_tokenizer_fits(cfg, tokenizer)


def resume_path(cfg: MegacannConfig, resume_from: Optional[str]) -> Optional[str]:
    """The checkpoint a run would resume from (None: a fresh start), or a CheckpointError saying why the
    one asked for cannot be used."""
    from megacann.checkpoint import CheckpointError, find_resume_checkpoint, list_complete_checkpoints
    from megacann.checkpoint.files import COMPLETE_MARKER

    out = cfg.experiment.output_dir
    try:
        return find_resume_checkpoint(out, resume_from)
    except FileNotFoundError as err:
        fix = (
            "drop --resume_from to start from step 0"
            if resume_from == "latest"
            else "give a checkpoint_<step> directory, an output_dir holding one, or 'latest'"
        )
        raise CheckpointError(f"{err}; {fix}") from None
    except ValueError as err:
        parent = os.path.dirname(os.path.abspath(str(resume_from)))
        complete = [os.path.basename(p) for _, p in list_complete_checkpoints(parent)]
        hint = f"complete checkpoints next to it: {', '.join(complete)}" if complete else "no complete one next to it"
        raise CheckpointError(
            f"{err}: its save was interrupted (a complete checkpoint holds a {COMPLETE_MARKER} file); {hint}; "
            "give a complete one or 'latest'"
        ) from None


def check_checkpoint_model(cfg: MegacannConfig, path: str) -> None:
    """The checkpoint at ``path`` holds the model the recipe describes (any parallel layout is fine)."""
    from megacann.checkpoint import CheckpointError, read_info

    saved = read_info(path).get("model", {})
    differ = [
        f"{key} {saved[key]!r} (recipe: {getattr(cfg.model, key)!r})"
        for key in shape_keys(cfg.model)
        if key in saved and getattr(cfg.model, key) is not None and saved[key] != getattr(cfg.model, key)
    ]
    if differ:
        raise CheckpointError(
            f"{path} holds another model: {', '.join(differ)}. Resume it with the recipe it was saved with "
            f"(its copy: {os.path.join(path, 'config.yaml')}), or start this model in a new experiment.output_dir"
        )


def finished_run_message(cfg: MegacannConfig, resume_from: Optional[str]) -> Optional[str]:
    """What to say instead of training when the checkpoint to resume from is already at optim.max_steps."""
    from megacann.checkpoint import read_info

    path = resume_path(cfg, resume_from)
    if path is None:
        return None
    done, total = int(read_info(path).get("step", 0)), cfg.optim.max_steps
    if done < total:
        return None
    return (
        f"{cfg.experiment.output_dir} is already at step {done} of {total} (optim.max_steps; {path}): nothing to "
        f"train. To train further, raise optim.max_steps (e.g. optim.max_steps={2 * done}) and resume with "
        "--resume_from latest"
    )


def preflight(cfg: MegacannConfig, resume_from: Optional[str] = None, create: bool = True) -> Optional[str]:
    """Every input check that needs no process group; returns the checkpoint to resume from, if any.
    ``create``: make the output directory (a dry run only checks that it could be made)."""
    check_output_dir(cfg)
    check_data(cfg)
    check_tokenizer(cfg)
    path = resume_path(cfg, resume_from)
    if path is not None:
        check_checkpoint_model(cfg, path)
    if create:
        os.makedirs(cfg.experiment.output_dir, exist_ok=True)
    return path
