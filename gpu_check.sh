#!/usr/bin/env bash
# The one GPU command: everything that compares with the talk without CIFAR-10 or the ImageNet
# weights (neither can be downloaded on a machine without internet). ViT-B/16 at 224 on
# synthetic data: every training script at batch 16 (05-07 with --devices 1, which still runs
# DDP, FSDP2 and NCCL), 01 and 04 also at batch 128, 09's recipe, a bare loop per configuration,
# MFU, the talk's speedups and memory beside ours, the input pipeline's rate, and the talk's
# memory column and the memory sequel's chain (benchmark.py --memory --talk, --sequel). Writes the
# report to results/gpu-check.md under the current folder (GPU, driver, versions, date).
# Not yet run on a GPU (expected: minutes on one H200); no network.
#   bash gpu_check.sh            # on a GPU machine
#   bash gpu_check.sh --smoke    # the same at smoke size on a CPU (the tests run this)
# 10 (tensor parallelism) needs 2 GPUs: on one it is skipped, with a line saying so.
# GPU_CHECK_DIR=DIR puts every output in DIR instead of results/; PYTHON=PATH picks the
# interpreter (default: python).
# Exit codes: 0 done, 2 no GPU without --smoke; otherwise benchmark.py's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # outputs go under the current folder, as the scripts' do
PYTHON=${PYTHON:-python}
out=${GPU_CHECK_DIR:-results}
smoke=no
case " $* " in *" --smoke "*) smoke=yes ;; esac
gpus=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null) || true
if [ -z "$gpus" ] && [ "$smoke" = no ]; then
  echo "gpu_check.sh: error: no NVIDIA GPU found (nvidia-smi sees none). On a CPU, run the same" \
       "check at smoke size: bash gpu_check.sh --smoke" >&2
  exit 2
fi
mkdir -p "$out"
images=4000 scripts="01 02 03 04 05 06 07 09 11 12 13 14 15 01@128 04@128"
[ "$smoke" = yes ] && images=400
if [ "$smoke" = yes ] || [ "$(printf '%s\n' "$gpus" | grep -c .)" -ge 2 ]; then
  scripts="$scripts 10"
else
  echo "gpu_check.sh: 10_fabric-vit-tensor-parallel.py skipped: tensor parallelism splits each" \
       "MLP across 2 GPUs, and this machine has 1." >&2
fi
gpu=$(printf '%s\n' "$gpus" | head -n 1)
gpu=${gpu:-"no NVIDIA GPU (nvidia-smi found none): a CPU run"}
# shellcheck disable=SC2086
"$PYTHON" "$here/benchmark.py" --scripts $scripts --max-steps 40 \
  --loader-images "$images" --loader-workers 0 1 2 4 8 --results "$out/gpu-check.jsonl" \
  --report "$out/gpu-check-body.md" "$@"
# the talk's memory column and the memory sequel's chain (ViT-B/16 and ViT-L/16), each script as
# it is at 224x224, batch 16: max_memory_reserved beside the arithmetic. At smoke size there is
# nothing to measure (the smoke ViT is 0.4 M parameters): skipped, saying so.
if [ "$smoke" = yes ]; then
  echo "gpu_check.sh: the memory tables (benchmark.py --memory --talk, --sequel) skipped: they" \
       "measure ViT-B/16 and ViT-L/16 at 224, 14 and 25 min on a 2-core CPU" >&2
  : > "$out/gpu-check-memory.md"
else
  "$PYTHON" "$here/benchmark.py" --memory --talk --results "$out/gpu-check.jsonl" \
    --report "$out/gpu-check-talk.md"
  "$PYTHON" "$here/benchmark.py" --memory --sequel --results "$out/gpu-check.jsonl" \
    --report "$out/gpu-check-sequel.md"
  cat "$out/gpu-check-talk.md" <(echo) "$out/gpu-check-sequel.md" > "$out/gpu-check-memory.md"
  rm -f "$out/gpu-check-talk.md" "$out/gpu-check-sequel.md"
fi
{
  echo "## GPU check, $(date -u +%Y-%m-%d)"
  echo
  echo "GPU (name, driver, memory): $gpu"
  echo
  cat "$out/gpu-check-body.md"
  echo
  cat "$out/gpu-check-memory.md"
} > "$out/gpu-check.md"
rm -f "$out/gpu-check-body.md" "$out/gpu-check-memory.md"
echo "Report written to $out/gpu-check.md"
