#!/usr/bin/env bash
# Tokenize text / JSONL into a Megatron-compatible .bin/.idx pair (wraps megacann-preprocess).
#
#   bash scripts/preprocess_data.sh --input data/ --output_prefix out/corpus --tokenizer tokenizers/llama \
#       --workers 8 --append_eod [--json_key text]
#
# All arguments go to megacann-preprocess (see `megacann-preprocess --help` or docs/data.md). The package
# does not need to be installed: this script puts the repository on PYTHONPATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [ "$#" -eq 0 ]; then
    exec env PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "${PYTHON}" -m megacann.data.preprocess --help
fi
exec env PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "${PYTHON}" -m megacann.data.preprocess "$@"
