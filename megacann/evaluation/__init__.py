"""Evaluation built on the generator: lm-evaluation-harness's model adapter (:mod:`.lm_eval_adapter`,
needs the ``eval`` extra; ``python -m megacann.evaluation`` is lm-eval's command with the ``megacann``
model registered) and the generation evaluation a training run can make every N steps
(:mod:`.generation_eval`). See docs/generation.md, "Evaluation"."""
