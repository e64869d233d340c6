"""Router replay (``rl.router_replay``) on a tiny MoE policy (4 experts, top 2; CPU, fp32, one process): the
experts each router chose while the rollouts were generated are recorded per token and reused by the
training forward.

- The recording lines up with the training rows: without replay and with unchanged weights, the training
  forward picks the recorded experts for every recorded token (prompt and response but the last token).
- With the routers perturbed after the rollout, the training forward without replay routes some tokens
  elsewhere; with replay it routes every recorded token exactly as the rollout did, and the gate weights
  are the perturbed router's own scores of the replayed experts.
- The whole loop with replay at ep 2, pp 2 (also with 2 interleaved chunks a stage and with zbv), tp 2 + SP and
  cp 2 equals one process: tests/test_rl_layouts.py.
- With full activation recomputation the blocks recomputed in backward route every recorded token as
  recorded too (the routers moved after the rollout), and the gradients equal those without recomputation.
- Refused by name: a policy without routers (selective and full recomputation train the trace of no
  recomputation: tests/test_rl_layouts.py).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from test_rl_layouts import MOE
from test_rl_loop import _trainer, rl_overrides, write_prompts

from megacann.constants import IGNORE_INDEX

REPLAY = [*MOE, "rl.router_replay=true"]


def _routes(chunk, step, batch) -> list[dict]:
    """Each router's chosen ids ``[b, s, k]``, gate weights and input in one eval forward of ``step``."""
    from megacann.layers.moe.routing_replay import routers

    seen: list[dict] = []
    shape = batch["tokens"].shape

    def keep(router, args, out):
        x = args[0]
        seen.append({"ids": out.expert_ids.view(*shape, -1), "probs": out.probs, "x": x, "router": router})

    hooks = [router.register_forward_hook(keep) for router in routers(chunk)]
    try:
        chunk.eval()
        with torch.no_grad():
            step(chunk, batch, None)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _gate_error(route: dict) -> float:
    """Largest difference of the gate weights to the router's own normalised softmax at the chosen ids."""
    router, ids = route["router"], route["ids"].reshape(-1, route["ids"].shape[-1])
    scores = torch.softmax(route["x"].float() @ router.weight.float().t(), dim=-1).gather(1, ids)
    return float((route["probs"] - scores / scores.sum(-1, keepdim=True)).abs().max())


def _agreement(routes: list[dict], batch: dict, sort: bool) -> torch.Tensor:
    """Per router, whether each recorded token was routed to the recorded experts ``[routers, tokens]``."""
    out = []
    for route, expected in zip(routes, batch["replay_ids"].unbind(2)):
        got = route["ids"].sort(-1).values if sort else route["ids"]
        want = expected.sort(-1).values if sort else expected
        out.append((got == want).all(-1)[batch["replay_mask"]])
    return torch.stack(out)


def _replay_probes(prompts: str) -> dict:
    from megacann import parallel_state as ps

    trainer = _trainer(rl_overrides(prompts, *REPLAY))
    objective, chunk, plain = trainer.objective, trainer.model_chunks[0], trainer.model_spec.forward_step
    objective.prepare([{"rl_step": torch.tensor(0)}], None)  # the rollout phase: routing recorded while generating
    batches = objective.mini_batches[0]  # the phase's micro-batches: 2 groups, prompts of different lengths
    out: dict = {"routers": batches[0]["replay_ids"].shape[2], "recorded_tokens": [], "last_label_plus_one": []}
    for batch in batches:
        labelled = batch["labels"] != IGNORE_INDEX
        last_label = torch.arange(labelled.shape[1]).expand_as(labelled).masked_fill(~labelled, -1).amax(1)
        out["recorded_tokens"] += batch["replay_mask"].sum(1).tolist()
        out["last_label_plus_one"] += (last_label + 1).tolist()
    own = [_agreement(_routes(chunk, plain, batch), batch, sort=True) for batch in batches]
    _perturb_routers(chunk)
    moved = [_agreement(_routes(chunk, plain, batch), batch, sort=True) for batch in batches]
    replayed_routes = [_routes(chunk, objective.policy_step, batch) for batch in batches]
    replayed = [_agreement(routes, batch, sort=False) for routes, batch in zip(replayed_routes, batches)]
    share = lambda parts: torch.cat(parts, dim=1).double().mean(1).tolist()  # noqa: E731
    out.update(own=share(own), moved=share(moved), replayed=share(replayed))
    out["replayed_gate_error"] = max(_gate_error(route) for routes in replayed_routes for route in routes)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    prompts = write_prompts(str(tmp_path_factory.mktemp("replay") / "prompts.jsonl"))
    return run_on_ranks(_replay_probes, 1, args=(prompts,), timeout=300)[0]


def test_recording_covers_each_rows_tokens_but_the_last(probes):
    assert probes["routers"] == 4  # one per layer of the tiny model
    assert probes["recorded_tokens"] == probes["last_label_plus_one"]  # prompt + response - 1 tokens a row


def test_training_forward_with_unchanged_weights_routes_as_recorded(probes):
    assert probes["own"] == [1.0] * 4


def test_replay_routes_exactly_as_the_rollout_after_the_router_moved(probes):
    assert min(probes["moved"]) < 0.9, probes["moved"]  # without replay the perturbed routers choose otherwise
    assert probes["replayed"] == [1.0] * 4
    assert probes["replayed_gate_error"] < 1e-6  # the gates: the router's own scores at the replayed experts


def _perturb_routers(chunk) -> None:
    """Move every router's weights, so that its own choice differs from the rollout's recorded one."""
    from megacann.layers.moe.routing_replay import routers

    with torch.no_grad():
        for router in routers(chunk):
            router.weight.add_(torch.randn_like(router.weight, generator=torch.Generator().manual_seed(5)))


def _recompute_probes(prompts: str) -> dict:
    """Training forward + backward of the phase's micro-batches with replay, the routers moved after the
    rollout, with full recomputation and without: the choices of the recomputed routers and the gradients."""
    from megacann import parallel_state as ps
    from megacann.layers import TransformerBlock
    from megacann.layers.moe.routing_replay import routers
    from megacann.layers.random import is_recomputing

    trainer = _trainer(rl_overrides(prompts, *REPLAY, "model.activation_checkpointing=full"))
    objective, chunk = trainer.objective, trainer.model_chunks[0]
    objective.prepare([{"rl_step": torch.tensor(0)}], None)
    batches = objective.mini_batches[0]
    _perturb_routers(chunk)
    found = routers(chunk)
    recomputed: list[tuple[int, torch.Tensor]] = []  # (router, ids [b * s, k]) of each recomputed forward

    def keep(index):
        return lambda router, args, out: recomputed.append((index, out.expert_ids)) if is_recomputing() else None

    hooks = [router.register_forward_hook(keep(j)) for j, router in enumerate(found)]
    blocks = [m for m in chunk.modules() if isinstance(m, TransformerBlock)]
    chunk.train()
    grads, agreement = {}, []
    for mode in ("full", "none"):
        for block in blocks:
            block.config.recompute = mode
        chunk.zero_grad()
        for batch in batches:
            recomputed.clear()
            output = objective.policy_step(chunk, batch, None)
            (output.token_loss.sum() + sum(output.aux_losses.values())).backward()
            for index, ids in recomputed:
                expected = batch["replay_ids"][:, :, index].reshape(ids.shape)
                agreement.append(
                    (mode, float((ids == expected).all(-1)[batch["replay_mask"].reshape(-1)].double().mean()))
                )
        grads[mode] = [p.grad.clone() for p in chunk.parameters() if p.grad is not None]
    for hook in hooks:
        hook.remove()
    ps.destroy_model_parallel()
    return {
        "recomputed": [share for mode, share in agreement if mode == "full"],
        "recomputed_without": [share for mode, share in agreement if mode == "none"],
        "routers": len(found),
        "batches": len(batches),
        "grad_error": max(float((a - b).abs().max()) for a, b in zip(grads["full"], grads["none"])),
        "grads": (len(grads["full"]), len(grads["none"])),
    }


def test_full_recomputation_replays_the_recorded_choices(tmp_path):
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"))
    probes = run_on_ranks(_recompute_probes, 1, args=(prompts,), timeout=300)[0]
    # every router of every micro-batch was recomputed in backward, and none without recomputation
    assert len(probes["recomputed"]) == probes["routers"] * probes["batches"] == 4 * 2
    assert probes["recomputed_without"] == []
    assert probes["recomputed"] == [1.0] * 8  # each recomputed router routed every recorded token as recorded
    assert probes["grads"][0] == probes["grads"][1] > 0
    assert probes["grad_error"] == 0.0  # the recomputed forward is the forward: the same gradients, bit for bit


def _dense_failure(prompts: str) -> str:
    from megacann import parallel_state as ps

    try:
        _trainer(rl_overrides(prompts, "rl.router_replay=true"))
    except ValueError as err:
        return str(err)
    finally:
        ps.destroy_model_parallel()
    return "no error"


def test_router_replay_on_a_dense_policy_is_refused(tmp_path):
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"))
    message = run_on_ranks(_dense_failure, 1, args=(prompts,), timeout=300)[0]
    assert "rl.router_replay needs a mixture-of-experts policy: model.type 'llama' has no router" in message


def test_request_routing_follows_padding_finished_rows_and_idle_steps():
    from megacann.generation import GenerationResult
    from megacann.rl.rollout import request_routing

    # 2 requests: prompts of 3 and 1 tokens (left-padded to 3), 3 and 1 new tokens; each routed token's id
    # is a label (100 x request + position) so the test reads where each one landed
    results = [GenerationResult(tokens=[7, 7, 7]), GenerationResult(tokens=[7])]
    label = lambda request, position: [100 * request + position, -1]  # noqa: E731
    prefill = torch.tensor([label(0, 0), label(0, 1), label(0, 2), [-9, -9], [-9, -9], label(1, 0)])
    step1 = torch.tensor([label(0, 3)])  # request 1 ended after its first token: request 0 alone
    step2 = torch.tensor([label(0, 4)])
    idle = torch.tensor([[-9, -9]])  # the expert-parallel lockstep's idle step: no request of this rank
    got = request_routing([[prefill, step1, step2, idle]], [3, 1], results)
    assert [routing[0].tolist() for routing in got] == [[label(0, p) for p in range(5)], [label(1, 0)]]
