#!/usr/bin/env bash
# The one GPU command: everything that compares with the talk without CIFAR-10 or the ImageNet
# weights (neither can be downloaded on a machine without internet). ViT-B/16 at 224 on
# synthetic data: every training script at batch 16 (05-07 with --devices 1, which still runs
# DDP, FSDP2 and NCCL), 01 and 04 also at batch 128, 09's recipe, a bare loop per configuration,
# MFU, the talk's speedups and memory beside ours, and the input pipeline's rate. Writes the
# report to results/gpu-check.md (GPU, driver, versions, date), ready for the README.
# About 5 minutes on one H200; no network.
#   bash gpu_check.sh            # on a GPU machine
#   bash gpu_check.sh --smoke    # the same at smoke size on a CPU (the tests run this)
# GPU_CHECK_DIR=DIR puts every output in DIR instead of results/.
set -euo pipefail
cd "$(dirname "$0")"
out=${GPU_CHECK_DIR:-results}
mkdir -p "$out"
images=4000
case " $* " in *" --smoke "*) images=400 ;; esac
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
      | head -n 1) || true
gpu=${gpu:-"no NVIDIA GPU (nvidia-smi found none): a CPU run"}
python benchmark.py --scripts 01 02 03 04 05 06 07 09 01@128 04@128 --max-steps 40 \
  --loader-images "$images" --loader-workers 0 1 2 4 8 --results "$out/gpu-check.jsonl" \
  --report "$out/gpu-check-body.md" "$@"
{
  echo "## GPU check, $(date -u +%Y-%m-%d)"
  echo
  echo "GPU (name, driver, memory): $gpu"
  echo
  cat "$out/gpu-check-body.md"
} > "$out/gpu-check.md"
rm -f "$out/gpu-check-body.md"
echo "Report written to $out/gpu-check.md"
