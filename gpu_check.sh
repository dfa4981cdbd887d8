#!/usr/bin/env bash
# The one GPU command: everything that compares with the talk without CIFAR-10 or the ImageNet
# weights (neither can be downloaded on a machine without internet). ViT-B/16 at 224 on
# synthetic data: every training script at batch 16 (05-07 with --devices 1, which still runs
# DDP, FSDP2 and NCCL), 01 and 04 also at batch 128, 09's recipe, a bare loop per configuration,
# each measured in several interleaved rounds; MFU, the talk's speedups and memory beside ours,
# the input pipeline's rate, and the talk's memory column and the memory sequel's chain
# (benchmark.py --memory --talk, --sequel).
#   bash gpu_check.sh            # on a GPU machine
#   bash gpu_check.sh --smoke    # the same at smoke size on a CPU (the tests run this)
# Every output goes to results/gpu-check/ under the current folder (GPU_CHECK_DIR=DIR: to DIR):
# gpu-check.md (the report: GPU, driver, versions, date), the records (gpu-check.jsonl), each
# part's report and the memory charts; nothing else is written, and the model files the runs
# make are deleted. 10 (tensor parallelism) needs 2 GPUs, counted as the scripts count them
# (torch.cuda.device_count, which CUDA_VISIBLE_DEVICES limits); on one it is skipped, saying so.
# Other flags go to benchmark.py's throughput run. PYTHON=PATH picks the interpreter (default:
# python).
# Exit codes: 0 done; 2 no GPU without --smoke; 4 a module the scripts import is missing
# (tools/preflight.py names it and its wheel); otherwise benchmark.py's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # outputs go under the current folder, as the scripts' do
PYTHON=${PYTHON:-python}
out=${GPU_CHECK_DIR:-results/gpu-check}
smoke=no
case " $* " in *" --smoke "*) smoke=yes ;; esac
gpus=$("$PYTHON" "$here/tools/preflight.py" --count-gpus) || exit $?
if [ "$gpus" -eq 0 ] && [ "$smoke" = no ]; then
  echo "gpu_check.sh: error: no CUDA GPU found (torch sees none). On a CPU, run the same" \
       "check at smoke size: bash gpu_check.sh --smoke" >&2
  exit 2
fi
mkdir -p "$out"
images=4000 scripts="01 02 03 04 05 06 07 09 11 12 13 14 15 01@128 04@128"
[ "$smoke" = yes ] && images=400
if [ "$smoke" = yes ] || [ "$gpus" -ge 2 ]; then
  scripts="$scripts 10"
else
  echo "gpu_check.sh: 10_fabric-vit-tensor-parallel.py skipped: tensor parallelism splits each" \
       "MLP across 2 GPUs, and this machine has 1." >&2
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1) || true
gpu=${gpu:-"no NVIDIA GPU: a CPU run"}
# shellcheck disable=SC2086
"$PYTHON" "$here/benchmark.py" --scripts $scripts --loader-images "$images" \
  --loader-workers 0 1 2 4 8 --results "$out/gpu-check.jsonl" --report "$out/throughput.md" "$@"
# the talk's memory column and the memory sequel's chain (ViT-B/16 and ViT-L/16), each script as
# it is at 224x224, batch 16: max_memory_reserved beside the arithmetic. At smoke size there is
# nothing to measure (the smoke ViT is 0.4 M parameters): skipped, saying so.
parts=("$out/throughput.md")
if [ "$smoke" = yes ]; then
  echo "gpu_check.sh: the memory tables (benchmark.py --memory --talk, --sequel) skipped at smoke" \
       "size: they measure ViT-B/16 and ViT-L/16 at 224 (docs/benchmarks.md gives their time on a CPU)" >&2
else
  "$PYTHON" "$here/benchmark.py" --memory --talk --results "$out/gpu-check.jsonl" --report "$out/memory-talk.md"
  "$PYTHON" "$here/benchmark.py" --memory --sequel --results "$out/gpu-check.jsonl" --report "$out/memory-sequel.md"
  parts+=("$out/memory-talk.md" "$out/memory-sequel.md")
fi
{
  echo "## GPU check, $(date -u +%Y-%m-%d)"
  echo
  echo "GPU (name, driver, memory): $gpu; GPUs the scripts see: $gpus"
  for part in "${parts[@]}"; do
    echo
    cat "$part"
  done
} > "$out/gpu-check.md"
echo "gpu_check.sh: report written to $out/gpu-check.md (its parts and records beside it)" >&2
