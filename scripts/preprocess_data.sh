#!/usr/bin/env bash
# Tokenize text / JSONL into a Megatron-compatible .bin/.idx pair (wraps megacann-preprocess).
#
#   bash scripts/preprocess_data.sh --input data/ --output_prefix out/corpus --tokenizer tokenizers/llama \
#       --workers 8 --append_eod [--json_key text]
#
# All arguments go to megacann-preprocess (see `megacann-preprocess --help` or docs/data.md). PYTHON selects
# the interpreter (default: python3), which must have megacann installed (`make venv`, or `pip install -e .`).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import megacann" 2>/dev/null; then
    echo "preprocess_data.sh: error: megacann is not installed for $PYTHON: run 'make venv' and 'source .venv/bin/activate' (or 'pip install -e .' in the repository), or set PYTHON to an interpreter that has it" >&2
    exit 2
fi
if [ "$#" -eq 0 ]; then
    exec "${PYTHON}" -m megacann.data.preprocess --help
fi
exec "${PYTHON}" -m megacann.data.preprocess "$@"
