"""A lesson is Python, and argparse is argparse (docs/adding-a-lesson.md): every way argparse declares a flag
reaches the run's name, its record's settings and --resume's check; building the parser changes nothing outside
it, and a parse puts back what it changed where it refuses; a lesson's relation to what the run derives refuses
before any work, and before the machine does."""
import json
import os
import signal
import sys
import warnings

import pytest

from conftest import ROOT, parse_as
from run_keeping.config import LATEST, SETTINGS

# 04 with a flag of each of argparse's ways: a group, a mutually exclusive group (and one inside a group), choices,
# nargs, store_false, BooleanOptionalAction, dest, a type function of the script's own, and a relation to the run's
# steps (check=).
OWN_FLAGS = '''
def fraction_below_1(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def warmup_within_the_run(args):
    if args.warmup_steps >= args.steps:
        return f"--warmup-steps {args.warmup_steps}: must be below the run's {args.steps} optimizer steps"
    return None


if __name__ == "__main__":
    parser = lesson_parser(epochs=3, check=warmup_within_the_run)
    tuning = parser.add_argument_group("tuning")
    tuning.add_argument("--label-smoothing", type=fraction_below_1, default=0.0, metavar="P", help="in [0, 1)")
    tuning.add_argument("--warmup-steps", type=int, default=0, help="below the run's steps")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam", help="the optimizer")
    choice.add_argument("--sgd-momentum", type=float, dest="momentum", help="SGD with this momentum")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16], help="sizes")
    parser.add_argument("--no-bias", action="store_false", dest="bias", help="no bias")
    averaging = tuning.add_mutually_exclusive_group()
    averaging.add_argument("--ema", action="store_true", help="an average of the weights")
    averaging.add_argument("--swa", action="store_true", help="a stochastic weight average")
    parser.add_argument("--ema-eval", action=argparse.BooleanOptionalAction, default=True, help="evaluate the average")
    args = parser.parse_args()
'''


@pytest.fixture
def lesson(tmp_path):
    text = (ROOT / "04_fabric-vit-mixed-precision.py").read_text()
    start, end = text.index('if __name__ == "__main__":'), text.index("    args = parser.parse_args()\n")
    end += len("    args = parser.parse_args()\n")
    path = tmp_path / "my04.py"
    path.write_text("import argparse\n" + text[:start] + OWN_FLAGS.strip() + "\n" + text[end:])
    return path


def test_every_kind_of_argparse_flag_reaches_the_name_the_record_and_resume(lesson):
    """Each own flag, wherever declared, is in the settings (the record's and --resume's) by its first option
    string, and a changed one in the run's name (a number after its flag, a word after a dash, a list by commas, a
    switch by its flag)."""
    args = parse_as(lesson, "--smoke", "--label-smoothing", "0.1", "--optimizer", "sgd", "--sizes", "8", "4",
                    "--no-bias", "--warmup-steps", "2", "--ema", "--no-ema-eval")
    assert args.own == {"--label-smoothing": 0.1, "--warmup-steps": 2, "--optimizer": "sgd", "--sgd-momentum": None,
                        "--sizes": [8, 4], "--no-bias": False, "--ema": True, "--swa": False, "--ema-eval": False}
    name = "my04-smoke-label-smoothing0.1-warmup-steps2-optimizer-sgd-sizes8,4-no-bias-ema-no-ema-eval"
    assert args.save_model == f"models/{name}.pt" and args.checkpoint_dir == f"checkpoints/{name}"
    defaults = parse_as(lesson, "--smoke")
    assert defaults.save_model == "models/my04-smoke.pt" and defaults.own["--optimizer"] == "adam"
    assert defaults.steps == 2 * (1197 // 16)  # 2 smoke epochs of the 1,197 training digits


def test_the_flags_page_shows_each_flag_as_its_help_does(lesson):
    """The flags page's row of each own flag (tools/figures.py): a switch is off (store_true) or as its default
    (BooleanOptionalAction, with the --no- name argparse adds), a value flag its default, each by its lesson."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "tools"))
    rows = {row[0]: (row[1], row[3]) for row in figures.flag_rows(lesson)}
    assert rows["`--ema-eval, --no-ema-eval`"] == ("my", "`on`") and rows["`--ema`"] == ("my", "`off`")
    assert rows["`--label-smoothing`"] == ("my", "`0.0`") and rows["`--sgd-momentum`"] == ("my", "`None`")
    assert rows["`--no-bias`"] == ("my", "`on`")  # store_false: the switch is on until given


def test_resume_says_a_lessons_changed_flags_in_words_not_pythons(lesson, tmp_path, capsys):
    """--resume with a lesson's own flags changed names each in the line's words: a switch on or off (--no-bias on
    where it was given), a flag whose default is None unset, a list by commas, never Python's True, None or [8, 4]."""
    ck = str(tmp_path / "ck")
    started = parse_as(lesson, "--smoke", "--checkpoint-dir", ck, "--sizes", "8", "4", "--no-bias")
    os.mkdir(ck)
    settings = {key: getattr(started, key) for key in SETTINGS} | started.own
    made = {"checkpoint": "epoch-0001.ckpt", "script": started.script, "kind": started.kind, "settings": settings}
    (tmp_path / "ck" / LATEST).write_text(json.dumps(made | {"flags": ["--smoke"]}))
    with pytest.raises(SystemExit) as stopped:
        parse_as(lesson, "--smoke", "--checkpoint-dir", ck, "--resume", "--no-ema-eval", "--sgd-momentum", "0.9")
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    words = "--sgd-momentum unset (now 0.9), --sizes 8,4 (now 16), --no-bias on (now off), --ema-eval on (now off)"
    assert f"was made with {words}; continue it as started" in err, err


@pytest.mark.parametrize("flags, says", [
    (["--label-smoothing", "1.0"], "argument --label-smoothing: must be in [0, 1), got 1.0"),
    (["--optimizer", "sgd", "--sgd-momentum", "0.9"], "argument --sgd-momentum: not allowed with argument --optimizer"),
    (["--warmup-steps", "99999"], "--warmup-steps 99999: must be below the run's"),
    (["--ema", "--swa"], "argument --swa: not allowed with argument --ema"),  # exclusive within the group
])
def test_a_lessons_own_refusal_is_one_line_and_comes_before_the_machines(lesson, capsys, flags, says):
    """Without --smoke on this GPU-less machine the machine refuses ("no CUDA GPU found"), but the lesson's own
    refusal comes first: its type function, argparse's, its relation to the run's steps (check=)."""
    for machine in ([], ["--smoke"]):
        with pytest.raises(SystemExit) as stopped:
            parse_as(lesson, *machine, *flags)
        err = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def interpreter():
    return (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), dict(os.environ),
            list(warnings.filters))


def test_building_the_parser_and_parsing_change_nothing(monkeypatch, capsys):
    """lesson_parser(...) reads no file and installs nothing; a parse, refused or not (and one of a run that falls
    back to another precision), leaves the interpreter as it found it: what a run changes is RunKeeper's to set."""
    import local_utilities as lu
    monkeypatch.setattr(sys, "argv", [str(ROOT / "04_fabric-vit-mixed-precision.py"), "--smoke", "--epochs", "0"])
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # no bfloat16 units: this run falls back to 32-true
    before = interpreter()
    parser = lu.lesson_parser(epochs=3)
    assert interpreter() == before
    with pytest.raises(SystemExit):
        parser.parse_args()
    assert interpreter() == before
    args = lu.lesson_parser(epochs=3).parse_args(["--smoke"])
    assert args.precision == "32-true" and interpreter() == before


def test_a_flag_whose_dest_the_run_derives_is_refused(tmp_path, capsys):
    """A lesson's flag that would set a setting the run derives (its dest one of Settings', but micro_batches and
    tensor_parallel): refused in one line as the lesson is parsed, naming the flag and the dest; a group's too."""
    text = (ROOT / "04_fabric-vit-mixed-precision.py").read_text()
    parse = "    args = parser.parse_args()\n"
    for declared in ('parser.add_argument("--total-steps", dest="steps", type=int)',
                     'parser.add_argument_group("g").add_argument("--total-steps", dest="steps", type=int)'):
        lesson = tmp_path / "my04.py"
        lesson.write_text(text.replace(parse, f"    {declared}\n{parse}", 1))
        with pytest.raises(SystemExit) as stopped:
            parse_as(lesson, "--smoke")
        err = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
        assert "--total-steps: its dest 'steps' is a setting the run derives (Settings); give it another" in err
