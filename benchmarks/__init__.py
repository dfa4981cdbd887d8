"""What benchmark.py and gpu_check.sh measure, one concern a module:

    runs.py        the one runner of a numbered script (its record back, or the one line that
                   says why it failed) and the one protocol of the benchmark's own child processes
    peaks.py       the GPUs' peak FLOP/s for MFU, and the model's FLOPs per image
    throughput.py  images/s of the scripts beside their bare loops, in interleaved rounds; the
                   input pipeline; the report and its verdict
    memory.py      memory per process beside its arithmetic: by strategy as the model grows, the
                   talk's memory column, the memory sequel's chain
    gpu_check.py   the one GPU command: the stages above in order of value, within --minutes,
                   each stage's report written as it ends
"""
