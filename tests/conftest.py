import os
import sys

# Tests import their helpers (dist_harness) by module name, in this process and in spawned ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MEGACANN_DEVICE", "cpu")
