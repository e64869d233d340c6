#!/usr/bin/env bash
# What a user of the wheel gets: build a wheel from this checkout, install it (with its dev extra) into a
# fresh virtual environment, then, from outside the source tree,
#   1. check that the wheel holds the compiled kernels (megacann/_C) and their sources (megacann/csrc),
#   2. run the kernel tests against the installed package (skips are failures),
#   3. delete the compiled kernels and check that the build on first use finds the packaged sources,
#   4. train the tiny recipe for a few steps with the installed megacann-train.
# Run by .ci/run after the test suites. PYTHON picks the interpreter (default python3); TORCH_INDEX_URL as
# in the Makefile. Takes a few minutes (two compilations of the kernels).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megacann-wheel-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
step() { echo "check_wheel: $*"; }
export MEGACANN_CACHE="$WORK/cache"  # tokenizer and corpus caches stay out of ~/.cache/megacann

step "fresh environment in $WORK"
"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$PY" -m pip install -q setuptools wheel

step "building the wheel"
(cd "$REPO" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .)
WHEEL=$(ls "$WORK"/dist/megacann-*.whl)
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
kernels = [n for n in names if n.startswith("megacann/_C") and n.endswith((".so", ".pyd"))]
sources = [n for n in names if n.startswith("megacann/csrc/")]
assert kernels, f"{sys.argv[1]}: no compiled kernels (megacann/_C) in the wheel"
assert any(n.endswith(".cpp") for n in sources), f"{sys.argv[1]}: no kernel sources (megacann/csrc) in the wheel"
print(f"check_wheel: the wheel holds {kernels[0]} and {len(sources)} source files")
EOF
"$PY" -m pip install -q "$WHEEL[dev]"

cd "$WORK"  # nothing of the source tree on sys.path from here on
SITE=$("$PY" -c "import megacann, os; print(os.path.dirname(megacann.__file__))")
case "$SITE" in "$REPO"*) echo "check_wheel: megacann was imported from the checkout ($SITE)" >&2; exit 1 ;; esac

step "kernel tests against $SITE"
MEGACANN_STRICT_SKIPS=1 "$PY" -m pytest -q -p no:cacheprovider "$REPO/tests/test_ops_kernels.py" "$REPO/tests/test_ops_isa.py"

step "build on first use from the packaged sources"
rm -f "$SITE"/_C*.so
MEGACANN_CPP=jit TORCH_EXTENSIONS_DIR="$WORK/jit" "$PY" -c "
from megacann.ops import extension
assert extension.source_dir() is not None and str(extension.source_dir()).startswith('$SITE'), extension.source_dir()
assert extension.load(), 'the C++ kernels were not built from the packaged sources'
from megacann.ops import isa
print('check_wheel: built from', extension.source_dir(), 'with kernel variants', isa.built_variants())
"

step "the tiny recipe, a few steps, with the installed megacann-train"
"$WORK/venv/bin/megacann-train" --config "$REPO/examples/configs/llama/tiny.yaml" \
    optim.max_steps=6 logging.log_interval=2 logging.eval_interval=0 logging.ckpt_interval=0 \
    experiment.output_dir="$WORK/run" | tee "$WORK/train.log"
grep -q "step 6/6" "$WORK/train.log" || { echo "check_wheel: the tiny recipe did not reach step 6" >&2; exit 1; }
step "ok"
