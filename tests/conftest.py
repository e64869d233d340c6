import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# Tests import their helpers (dist_harness, ...) by module name, in this process and in spawned ranks.
sys.path.insert(0, TESTS)
# megacann itself comes from the installed package, never from the source tree by accident (python -m pytest
# puts the current directory first on sys.path): a broken install must fail the suite.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
os.environ.setdefault("MEGACANN_DEVICE", "cpu")
