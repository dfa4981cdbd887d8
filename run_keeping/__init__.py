"""Run-keeping for the numbered scripts, kept out of the lesson, one concern a module:

    config.py   the command line, parsed once into a Config; lessons.csv; the precision that runs
    keeper.py   RunKeeper, what a script calls: checkpoints, --resume, signals, errors, timing
    record.py   the run record and the model file: their fields, written here only
    reading.py  records and model files read back, for 08 and the tools (no lesson's run reads it)

Importing it does nothing. Exit codes: docs/flags-records-exit-codes.md.
"""
