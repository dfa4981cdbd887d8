"""A lesson is its script: a copy of any lesson, under a new name and run from another folder, runs as
its original (docs/adding-a-lesson.md). The copy lives beside the project's shared files, as a user's
`cp 04_fabric-vit-mixed-precision.py my04.py` does; it runs from a folder of its own."""
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, SAID, native_bf16, parse_as, run_script, script_env
from run_keeping.device import fallback_line

LESSONS = [script for script in SAID if script[:2] != "08"]  # 08 loads a model; it has no lesson's run
SHARED = ("local_utilities.py", "parallelize.py", "run_keeping", "smoke_weights")


def copy_of(script, folder):
    """`script` copied as my<NN>.py into `folder`, beside links to the project's shared files."""
    folder.mkdir(exist_ok=True)
    for name in SHARED:
        if not (folder / name).exists():
            os.symlink(ROOT / name, folder / name)
    copy = folder / f"my{script[:2]}.py"
    shutil.copy(ROOT / script, copy)
    return copy


def helped(path, capsys):
    """`python PATH --help` without its whitespace (argparse wraps by the name's length) and the script's name."""
    with pytest.raises(SystemExit):
        parse_as(path, "--help")
    return "".join(capsys.readouterr().out.replace(path.name, "SCRIPT").split())


@pytest.mark.parametrize("script", LESSONS)
def test_a_copy_asks_for_what_its_original_asks_for(script, tmp_path, monkeypatch, capsys):
    """The copy's --help, its own flags with their defaults, the precision it asks for and runs (on a CPU
    with bfloat16 units and, rehearsed, without), its fallback line, its compile mode: the original's."""
    copy = copy_of(script, tmp_path / "project")
    monkeypatch.chdir(tmp_path)
    assert helped(copy, capsys) == helped(ROOT / script, capsys)
    for cap in (None, "AVX2"):  # oneDNN capped at AVX2: a CPU without native bfloat16, on any CPU
        if cap:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        monkeypatch.delenv("LT_PRECISION", raising=False)
        ours, theirs = parse_as(copy, "--smoke"), parse_as(ROOT / script, "--smoke")
        for key in ("own", "precision", "precision_asked", "compile_mode", "micro_batches", "data_parallel", "epochs"):
            assert getattr(ours, key) == getattr(theirs, key), (script, cap, key)
        assert fallback_line(ours, ours.precision) == fallback_line(theirs, theirs.precision), script
        assert ours.script == copy.name and ours.save_model == theirs.save_model.replace(script[:-3], copy.stem)


# A copy that runs end to end: 10 (its own flag, two processes; a traceback before lessons held their own
# flags), beside the suite's own smoke run of 10, and 04 on a CPU without native bfloat16 (its fallback line),
# beside its original so run. The others are held to what their command line decides, above.
RUN = {"10_fabric-vit-tensor-parallel.py": {}, "04_fabric-vit-mixed-precision.py": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


@pytest.mark.slow
@pytest.mark.parametrize("script", RUN)
def test_a_copy_runs_as_its_original_from_another_folder(script, tmp_path, smoke_runs):
    """The copy's --smoke run, from a folder of its own, beside the original's: the same lines (its fallback
    line where the CPU has no bfloat16 units), the same record but for its own name, a model file of its name."""
    copy = copy_of(script, tmp_path / "project")
    runs = {}
    for name, path in (("copy", copy), ("original", ROOT / script)):
        if name == "original" and not RUN[script]:  # the suite's own run of it, with the same flags
            shared = smoke_runs(script)
            runs[name] = (shared.out, shared.record, sorted(p.name for p in (shared.dir / "models").iterdir()))
            continue
        folder = tmp_path / name
        folder.mkdir()
        short = ["--max-steps", "4"] if RUN[script] else []  # both runs are this test's own: short ones
        proc = run_script(str(path), "--smoke", *short, cwd=folder, env=script_env(folder, **RUN[script]))
        assert proc.returncode == 0, proc.stderr[-2000:]
        record = json.loads((folder / "results" / "runs.jsonl").read_text().splitlines()[-1])
        runs[name] = (proc.stdout, record, sorted(p.name for p in (folder / "models").iterdir()))
    said = {name: [line for line in out.splitlines() if re.match(r"This .* has no native bfloat16|Parameters held", line)]
            for name, (out, _, _) in runs.items()}
    falls_back = bool(RUN[script]) or not native_bf16()  # oneDNN capped, or a CPU without bfloat16 units
    assert said["copy"] == said["original"] and falls_back == any("bfloat16" in s for s in said["copy"]), said
    (_, ours, our_model), (_, theirs, their_model) = runs["copy"], runs["original"]
    assert ours["script"] == copy.name and our_model == [m.replace(script[:-3], copy.stem) for m in their_model]
    alike = ("kind", "devices", "world_size", "data_parallel", "settings", "precision", "precision_asked", "compile_mode",
             "batch_size", "micro_batches", "train_loss", "val_acc", "test_acc")
    assert {k: ours[k] for k in alike} == {k: theirs[k] for k in alike}
