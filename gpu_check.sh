#!/usr/bin/env bash
# The one GPU command: what the talk's lessons do on today's GPU without CIFAR-10 or the ImageNet
# weights (neither can be downloaded on a machine without internet), ViT-B/16 at 224 on synthetic
# data, within --minutes (default 7). Its stages, in order of value (benchmarks/gpu_check.py): 01,
# 04 and 16 at the talk's batch of 16, each beside its bare loop; 09 at batch 128 beside its bare
# loop; the talk's PIL input pipeline at 4, 8 and 16 workers; the memory sequel's chain 11-14 on
# ViT-L/16 against its published GB. A run that would not finish in the time left is not started;
# the report is written again after every run, so a stop at any moment leaves it whole.
#   bash gpu_check.sh               # on a GPU machine
#   bash gpu_check.sh --minutes 12  # more time for the stages
#   bash gpu_check.sh --smoke       # the same at smoke size on a CPU (the tests run this)
# Every output goes to results/gpu-check/ under the current folder (--out DIR: to DIR):
# gpu-check.md (the report: GPU, driver, versions, date), the records (gpu-check.jsonl,
# memory-runs.jsonl) and the memory chart; the model files the runs make are deleted.
# PYTHON=PATH picks the interpreter (default: python, else python3).
# Exit codes: 0 done; 2 no GPU without --smoke, or a bad flag; 4 a module the scripts import is
# missing (tools/preflight.py names every one and the commands that install them); 6 some
# configurations failed (their rows say why, the others were measured); 130 Ctrl-C.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # outputs go under the current folder, as the scripts' do
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
"$PYTHON" "$here/tools/preflight.py" || exit $?
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m benchmarks.gpu_check "$@"
