"""A training loop of the user's own (no Trainer) saves and resumes with megacann's checkpoints, given its
parts explicitly: model chunks, optimizer, step, data position, its own counters and files of its own."""

from __future__ import annotations

from dist_harness import run_on_ranks

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # the RNG must be restored too


def _custom_loop(root: str) -> dict:
    import json

    import torch
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.checkpoint import Checkpointer, CheckpointParts
    from megacann.layers import model_parallel_manual_seed
    from megacann.models import count_target_tokens, get_model_spec
    from megacann.optimizer import build_optimizer
    from megacann.pipeline import build_model_chunks

    cfg = tiny_config([*DROPOUT, f"experiment.output_dir={root}", "optim.grad_accum_steps=1"])
    ps.initialize_model_parallel()
    spec = get_model_spec(cfg.model.type)

    def fresh():
        torch.manual_seed(cfg.seed)
        model_parallel_manual_seed(cfg.seed)
        chunks = build_model_chunks(cfg, spec)
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        return CheckpointParts(chunks, build_optimizer(cfg, named, modules=chunks))

    def step(parts: CheckpointParts, batch) -> float:
        parts.optimizer.zero_grad()
        parts.optimizer.set_lr(1e-3)
        out = spec.forward_step(parts.model[0], batch, None)
        tokens = count_target_tokens([batch])
        with parts.optimizer.last_micro_batch_backward():
            (out.token_loss.sum() / tokens).backward()
        parts.optimizer.finalize_grads()
        parts.optimizer.step()
        parts.step += 1
        parts.consumed_samples += cfg.data.batch_size
        parts.progress["loss_sum"] = parts.progress.get("loss_sum", 0.0) + float(out.token_loss.sum() / tokens)
        return float(out.token_loss.sum() / tokens)

    class Notes:  # files of the loop's own saved beside the weights (as the trainer saves its tokenizer)
        key = "notes"

        def record(self):
            return {"file": "notes.txt"}

        def write(self, directory, info):
            with open(f"{directory}/notes.txt", "w") as f:
                f.write(f"step {info['step']}\n")
            return [f"{directory}/notes.txt"]

    data = SyntheticData(cfg, 0, 1)
    batches = [next(data.train) for _ in range(4)]
    run = fresh()
    run.files = [Notes()]
    straight = [step(run, b) for b in batches[:2]]
    path = Checkpointer().save(run, cfg, log=lambda line: None)
    straight += [step(run, b) for b in batches[2:]]

    resumed = fresh()
    Checkpointer().load(resumed, cfg, path, log=lambda line: None)
    restored = (resumed.step, resumed.consumed_samples, dict(resumed.progress))
    after = [step(resumed, b) for b in batches[2:]]
    with open(f"{path}/notes.txt") as f:
        notes = f.read()
    with open(f"{path}/megacann.json") as f:
        recorded = json.load(f)["notes"]
    return {"straight": straight, "after": after, "restored": restored, "path": path, "notes": (notes, recorded)}


def test_custom_loop_saves_and_resumes_bit_for_bit(tmp_path):
    out = run_on_ranks(_custom_loop, 1, args=(str(tmp_path),), timeout=300)[0]
    assert out["path"].endswith("checkpoint_2")
    step, consumed, progress = out["restored"]
    assert (step, consumed) == (2, 4)
    assert progress == {"loss_sum": out["straight"][0] + out["straight"][1]}
    assert out["after"] == out["straight"][2:]  # weights, Adam state and dropout RNG all restored
    assert out["notes"] == ("step 2\n", {"file": "notes.txt"})  # CheckpointParts.files, written and recorded
