"""lm-evaluation-harness on megacann models: the ``megacann`` model adapter (:mod:`.lm_eval_adapter`, needs
the ``eval`` extra) and ``python -m megacann.evaluation``, lm-eval's command with that model registered. The
generation evaluation a training run makes every N steps is the trainer's
(:mod:`megacann.training.generation_eval`). See docs/generation.md, "Evaluation"."""
