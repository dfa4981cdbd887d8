"""What benchmark.py and gpu_check.sh measure, one concern a module:

    runs.py        the one runner of a numbered script, and the benchmark's own child processes
    peaks.py       the GPUs' peak FLOP/s for MFU, and the model's FLOPs per image
    throughput.py  images/s of the scripts beside their bare loops; the input pipeline; the verdict
    memory.py      memory per process beside its arithmetic: by strategy, the talk's, the sequel's
    gpu_check.py   the one GPU command: the stages in order of value, within --minutes
"""
