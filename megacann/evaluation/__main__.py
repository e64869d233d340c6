"""lm-eval's command line with the ``megacann`` model registered:

python -m megacann.evaluation --model megacann --model_args model=DIR --tasks TASK [lm-eval options]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    """Run lm-eval's ``run`` (or ``ls`` / ``validate``) command on ``argv``."""
    from lm_eval.__main__ import cli_evaluate

    import megacann.evaluation.lm_eval_adapter  # noqa: F401  (registers "megacann")

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
