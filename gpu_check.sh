#!/usr/bin/env bash
# The one GPU command: what the talk's lessons do on today's GPU without CIFAR-10 or the ImageNet
# weights, within --minutes (default 7); benchmarks/gpu_check.py says what it runs, and writes
# its report and records to results/gpu-check/ under the current folder (--out DIR: to DIR).
#   bash gpu_check.sh               # on a GPU machine
#   bash gpu_check.sh --minutes 12  # more time for the stages
#   bash gpu_check.sh --smoke       # the same at smoke size on a CPU (the tests run this)
# PYTHON=PATH picks the interpreter (default: python, else python3). Exit codes: 0 done; 2 no GPU
# without --smoke, or a bad flag; 4 a module the scripts import is missing (tools/preflight.py
# names each and the commands that install them); 6 some configurations failed; 130 Ctrl-C.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # outputs go under the current folder, as the scripts' do
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
"$PYTHON" "$here/tools/preflight.py" || exit $?
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m benchmarks.gpu_check "$@"
