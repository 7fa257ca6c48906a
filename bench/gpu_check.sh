#!/usr/bin/env bash
# The check for a machine with CUDA: epochal's digits example through `epochal run` and every
# parallel mode in float32, bf16 and fp16, on NCCL with the GPUs present, against the same runs on
# gloo/CPU; the torch, CUDA and NCCL versions and the network gloo and NCCL chose. One PASS or
# FAIL line per check (bench/gpu_check.py says what each compares and its tolerance).
#
#   bench/gpu_check.sh [REPORT] [OPTIONS]     REPORT: the report file ('-' or none: stdout)
#   bench/gpu_check.sh - --device cpu         the same checks on gloo/CPU (a dry run)
#
# Exit status: 0 every check passed; 1 a check failed; 77 skipped: no CUDA device (one line says
# so, at once); 2 bad arguments. Progress goes to stderr. Run it from anywhere, with the Python
# that has epochal installed with its test and examples extras (`pip install -e '.[test,examples]'`).
# Sized to finish in under five minutes on one H200.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
report="${1:--}"
[ "$#" -gt 0 ] && shift
cd "$here/.."
exec "${PYTHON:-python}" bench/gpu_check.py --report "$report" "$@"
