"""``python -m megacann.train`` is the same as ``megacann-train``."""

import sys

from megacann.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
