"""The command line of every script and tool, without the libraries (plot_results.py imports no
torch): argparse whose errors are one line, whole numbers in a range said in words, paths
checked before any work, and the commands the suite prints, which name the script as it was
invoked, its arguments quoted, so that each runs as printed from the folder it was printed in."""
import argparse
import shlex
import sys

from run_keeping.errors import fail
from run_keeping.files import unwritable


def invoked(*flags):
    """The command that runs this program again with `flags`: the script named as it was invoked
    (so it runs from the folder it was started in), every argument quoted for a POSIX shell."""
    return " ".join(["python", *map(shlex.quote, [sys.argv[0], *flags])])


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (`<program>: error: ...`, exit 2), not a usage block."""

    def error(self, message):
        fail(f"{message}; {invoked('--help')} lists the flags")


def whole_number(minimum, maximum=None):
    """An argparse type: a whole number in [minimum, maximum], said in words when it is not."""
    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {value:,}")
        return value
    return check


def check_path(flag, path, folder=False):
    """One line, exit 2, when `path` cannot be written (a file, or a folder with folder=True)."""
    problem = unwritable(path, folder=folder)
    if problem:
        fail(f"{flag} {path} cannot be written: {problem}")
