#!/usr/bin/env bash
# The GPU check: ViT-B/16 at 224x224 on synthetic data (no network), scripts 01, 03 and 04 at
# batch 16 (the talk's) and 128, printing images/s, peak memory and model FLOP utilisation.
# About 3 minutes on one H200. Extra flags go to benchmark.py (the tests run it with --smoke).
#   bash gpu_check.sh                 # on a GPU machine
#   bash gpu_check.sh --smoke         # the same check at smoke size, on a CPU
set -euo pipefail
cd "$(dirname "$0")"
date -u +"GPU check, %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  || echo "no nvidia-smi: no NVIDIA GPU visible"
python -c "import torch; print('torch', torch.__version__, '| CUDA', torch.cuda.is_available(), '| bf16', torch.cuda.is_available() and torch.cuda.is_bf16_supported())"
results=${GPU_CHECK_RESULTS:-results/gpu-check.jsonl}
python benchmark.py --scripts 01 03 04 --batch-size 16 128 --max-steps 30 \
  --loader-images 3000 --results "$results" "$@"
