#!/usr/bin/env bash
# The one GPU command: everything that compares with the talk without CIFAR-10 or the ImageNet
# weights (neither can be downloaded on a machine without internet), ViT-B/16 at 224 on synthetic
# data, within --minutes (default 8). Its stages, in order of value (benchmarks/gpu_check.py):
# the talk's headline (01 against 04 at batch 16 and 128), the talk's memory column, the talk's
# other lessons, the memory sequel's chain, the lessons beyond the talk, a bare loop beside each
# configuration, the input pipeline. A stage that would not finish in the time left is not
# started; the report is written again after every run, so a stop at any moment leaves it whole.
#   bash gpu_check.sh               # on a GPU machine
#   bash gpu_check.sh --minutes 12  # more of the stages
#   bash gpu_check.sh --smoke       # the same at smoke size on a CPU (the tests run this)
# Every output goes to results/gpu-check/ under the current folder (GPU_CHECK_DIR=DIR: to DIR):
# gpu-check.md (the report: GPU, driver, versions, date), the records (gpu-check.jsonl,
# memory-runs.jsonl) and the memory charts; the model files the runs make are deleted. 10 (tensor
# parallelism) needs 2 GPUs, counted as the scripts count them (torch.cuda.device_count, which
# CUDA_VISIBLE_DEVICES limits). Other flags go to benchmark.py. PYTHON=PATH picks the interpreter
# (default: python, else python3).
# Exit codes: 0 done; 2 no GPU without --smoke; 4 a module the scripts import is missing
# (tools/preflight.py names every one and the commands that install them); 6 some configurations
# failed (their rows say why, the others were measured); 130 Ctrl-C.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # outputs go under the current folder, as the scripts' do
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
export GPU_CHECK_STARTED=$(date +%s)  # --minutes counts from here
"$PYTHON" "$here/tools/preflight.py" || exit $?
exec "$PYTHON" "$here/benchmark.py" --gpu-check "$@"
