"""Run-keeping for the numbered scripts, kept out of the lesson, one concern a module:

    flags.py        the command line every script shares, checked before any work; the commands
                    the suite prints, which run as printed
    launch.py       how the processes were started (SLURM, torchrun, Lightning), checked and said
    keeper.py       RunKeeper, what a script calls (below)
    timing.py       per-step loss sum, loss guard and throughput timing, without GPU waits
    checkpoints.py  checkpoints (per epoch, and mid-epoch when stopped), --resume, the folder's lock
    together.py     what the processes of a run decide together: a failure, a stop, a timeout
    signals.py      Ctrl-C, SIGTERM and the errors a user can act on, in one line
    record.py       the run record
    model_file.py   the finetuned model as a plain state dict, and loading it back
    devices.py      CPU threads per process; bf16-mixed on a GPU without bfloat16; FSDP2's units
    files.py        whole-or-absent writes and JSONL records
    errors.py       fail(): one line and an exit code (documented there)

A script imports it first (a Ctrl-C while the libraries load is one line too), makes one
RunKeeper and calls it four times:

    keeper = RunKeeper(args, fabric)            # checks, signal handlers (fabric: None in 00-02)
    keeper.resume(model, optimizer, train_loader)   # says what runs; with --resume: restores
    keeper.step(loss, len(targets))             # after each optimizer step
    keeper.checkpoint(epoch, model, optimizer, val_acc)           # after each epoch
    keeper.finish(train_time_s, test_acc, model)                  # closing lines, model, record
"""
from run_keeping import errors  # noqa: F401  (its signal handlers, before the libraries load)


def __getattr__(name):  # RunKeeper imports torch; errors and files, used by plot_results.py, do not
    if name == "RunKeeper":
        from run_keeping.keeper import RunKeeper
        return RunKeeper
    raise AttributeError(f"module 'run_keeping' has no attribute {name!r}")
