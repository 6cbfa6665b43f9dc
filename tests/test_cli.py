"""The `uform` command end to end on a tiny config: train, evaluate, rotate checkpoints, resume, embed,
info; SIGTERM mid-run leaves a checkpoint that resumes to the same weights as a run never stopped, its
stream's cursor in the checkpoint's note (or, from older versions, in a file beside it); logs as JSON
lines and TensorBoard events, read back here.
"""

import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

import uform
from uform import cli
from uform.errors import PeerError
from uform.logs import masked_crc32c

CONFIG = """
[trainer]
depth = 1
hidden = 128
objective = "joint"
seed = 3

[trainer.batch]
max_rows_per_device = 8
max_columns_per_row = 64

[trainer.schedule]
steps = {steps}

[data]
paths = ["train.jsonl"]
shuffle_buffer = 16

[data.columns]
question = "text"
answer = "text"

[evaluation]
paths = ["held-out.jsonl"]
every_steps = 4

[checkpoints]
every_steps = {every}
keep = 2

[run]
threads = 1
"""


def write_pairs(path, numbers):
    with open(path, "w") as lines:
        for i in numbers:
            lines.write(json.dumps(dict(question=f"what is {i} squared?", answer=f"{i * i}, the square of {i}")) + "\n")


@pytest.fixture
def run(tmp_path):
    write_pairs(tmp_path / "train.jsonl", range(60))
    write_pairs(tmp_path / "held-out.jsonl", range(100, 112))

    def configure(name="pairs", steps=9, every=3, **replace):
        text = CONFIG.format(steps=steps, every=every)
        for old, new in replace.items():
            text = text.replace(old, new)
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        return str(path)

    return configure


def read_log(folder):
    with open(os.path.join(folder, "log.jsonl")) as lines:
        return [json.loads(line) for line in lines]


def steps_in(folder):
    return [step for step, _ in cli.checkpoints_in(os.path.join(folder, "checkpoints"))]


def read_events(path):
    """(step, {tag: value}) of every scalar event in a TFRecord file, each frame's checksums verified."""
    events, data = [], open(path, "rb").read()
    while data:
        length = data[:8]
        (size,) = struct.unpack("<Q", length)
        assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(length)
        event = data[12:12 + size]
        assert struct.unpack("<I", data[12 + size:16 + size])[0] == masked_crc32c(event)
        data = data[16 + size:]
        fields = dict(_fields(event))
        if 5 in fields:
            values = [dict(_fields(value)) for number, value in _fields(fields[5]) if number == 1]
            events.append((fields.get(2, 0), {v[1].decode(): struct.unpack("<f", v[2])[0] for v in values}))
        else:
            assert fields[3] == b"brain.Event:2"
    return events


def _fields(message):
    """(field number, value) of a protocol buffer: ints for varints, bytes for the rest."""
    position = 0
    while position < len(message):
        key, position = _varint(message, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(message, position)
        elif wire == 1:
            value, position = message[position:position + 8], position + 8
        elif wire == 5:
            value, position = message[position:position + 4], position + 4
        else:
            size, position = _varint(message, position)
            value, position = message[position:position + size], position + size
        yield number, value


def _varint(data, position):
    value = shift = 0
    while True:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if not byte & 0x80:
            return value, position


def test_each_step_is_logged_before_the_next_begins_on_a_cpu(run, monkeypatch):
    """A CPU runs a step whole as it begins, so its line is in the log (and the bar moved) before the next step
    begins; a GPU's step lands while the next one runs."""
    config, seen = run(steps=5, every=1000), []
    folder = os.path.join(os.path.dirname(config), "runs", "pairs")
    begun_step = uform.Trainer._begun_step

    def counting(trainer, batch):
        seen.append(sum('"loss"' in line for line in open(os.path.join(folder, "log.jsonl"))))
        return begun_step(trainer, batch)

    monkeypatch.setattr(uform.Trainer, "_begun_step", counting)
    assert cli.main(["train", config]) == 0
    if read_log(folder)[0]["device"] == "ram":
        assert seen == list(range(5))
    else:  # up to a step behind, fewer where a checkpoint or an evaluation waits for the step
        assert all(step - 1 <= count <= step for step, count in enumerate(seen))


def test_train_evaluates_rotates_checkpoints_logs_and_resumes(run, capsys):
    config = run()
    folder = os.path.join(os.path.dirname(config), "runs", "pairs")
    assert cli.main(["train", config]) == 0
    assert steps_in(folder) == [6, 9]  # every 3 steps, the newest 2 kept
    assert sorted(os.listdir(os.path.join(folder, "checkpoints"))) == [f"step-00000000{s}.safetensors" for s in (6, 9)]
    for step, path in cli.checkpoints_in(os.path.join(folder, "checkpoints")):
        written = json.loads(uform.checkpoint_note(path))
        assert written["step"] == step and written["cursor"]["batch"] == step  # one device batch a step
    log = read_log(folder)
    trained = [line for line in log if "loss" in line]
    assert [line["step"] for line in trained] == list(range(1, 10))
    assert all(line["data_seconds"] >= 0 and line["step_seconds"] > 0 for line in trained)
    assert all(line["evaluation_seconds"] > 0 for line in log if "evaluation" in line)
    evaluations = [line for line in log if "evaluation" in line]
    assert [line["step"] for line in evaluations] == [4, 8, 9]
    for metrics in evaluations[-1]["evaluation"].values():
        assert set(metrics) == {"recall@1", "recall@10", "mrr"} and 0 <= metrics["recall@1"] <= metrics["recall@10"] <= 1
    assert set(evaluations[-1]["evaluation"]) == {"question->answer", "answer->question"}
    assert "step 9: question->answer recall@1" in capsys.readouterr().err

    (events,) = glob.glob(os.path.join(folder, "tensorboard", "events.out.tfevents.*"))
    scalars = read_events(events)
    assert [step for step, values in scalars if "loss/loss" in values] == list(range(1, 10))
    by_step = dict(scalars)
    assert by_step[3]["loss/loss"] == pytest.approx(trained[2]["loss"])
    assert by_step[3]["time/data_seconds"] == pytest.approx(trained[2]["data_seconds"], rel=1e-6)
    assert "loss/late_interaction_loss" not in by_step[3]  # a term that did not run logs nothing
    assert any("evaluation/answer->question/mrr" in values for step, values in scalars if step == 8)
    try:  # TensorBoard's own reader, where it is installed
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        accumulator = EventAccumulator(os.path.dirname(events))
        accumulator.Reload()
        assert [event.step for event in accumulator.Scalars("loss/loss")] == list(range(1, 10))

    capsys.readouterr()
    config = run(steps=12, **{"steps = 12": "steps = 12\nlearning_rate = 5e-4\nwarmup_steps = 0\nmin_learning_rate = 0",
                              "[data]": "[trainer.contrastive]\nmatryoshka_dimensions = [128]\n\n[data]"})
    assert cli.main(["train", config]) == 0
    assert steps_in(folder) == [9, 12]
    started = [line for line in read_log(folder) if "started" in line]
    assert started[0]["resumed"] is None and started[1]["resumed"].endswith("step-000000009.safetensors")
    # Said, as each field's change: the rate the user gave, the steps raised; a field left to the library is none.
    assert started[1]["changed"] == {"trainer.schedule.learning_rate": [0.001, 0.0005],
                                     "trainer.schedule.steps": [9, 12]}
    err = capsys.readouterr().err
    assert re.search(r"uform: resuming .*step-000000009.safetensors with trainer.schedule.steps = 12 \(was 9\), "
                     r"trainer.schedule.learning_rate = 0.0005 \(was 0.001\)\n", err)
    assert err.count("uform: trainer.schedule.min_learning_rate: 0 is read as absent, so it derives learning_rate / 10, "
                     "not 0") == 1  # said once, though the config is checked more than once
    assert cli.main(["train", config]) == 0
    assert "already took its 12 steps; raise trainer.schedule.steps above 12" in capsys.readouterr().out
    assert cli.main(["train", run(steps=5)]) == 0
    assert f"{folder} is at step 12, past the 5 steps its config asks for; raise trainer.schedule.steps above 12" \
        in capsys.readouterr().out
    assert steps_in(folder) == [9, 12]
    resumed = run("other", steps=4, **{"seed = 3": f'seed = 3\nresume = "{cli.checkpoints_in(folder + "/checkpoints")[-1][1]}"'})
    assert cli.main(["train", resumed]) == 0
    assert re.search(r"uform: trainer.resume .*step-000000012.safetensors is at step 12, past the 4 steps",
                     capsys.readouterr().out)


def test_info_describes_a_checkpoint(run, capsys):
    config = run(steps=3)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(os.path.join(os.path.dirname(config), "runs", "pairs", "checkpoints", "*.safetensors"))
    capsys.readouterr()
    assert cli.main(["info", checkpoint]) == 0
    printed = capsys.readouterr().out
    assert "step 3" in printed and "depth 1, hidden 128, 2 heads" in printed and "text.embedding" in printed
    assert "stream: epoch 0" in printed
    assert cli.main(["info", checkpoint, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["step"] == 3 and described["config"]["hidden"] == 128 and described["cursor"]["batch"] == 3
    named = described["config"]  # as the TOML file and Python take them, not the C library's numbers
    assert (named["objective"], named["determinism"], named["contrastive"]["negatives"]) == ("joint", "bitwise", "ambient")
    assert (named["contrastive"]["pair_loss"], named["late_interaction"]["pair_loss"]) == ("sigmoid", "ranked")
    assert '"objective": "joint"' in printed and '"pair_loss": "sigmoid"' in printed
    given = {name: named[name] for name in ("depth", "hidden", "objective", "determinism", "contrastive", "late_interaction")}
    assert uform.config.normalize(uform.TrainerConfig, dict(given, schedule=dict(steps=1)), "config")["objective"] == 3
    written = json.loads(described["note"])
    assert written == dict(step=3, cursor=described["cursor"], files=written["files"], data=os.path.dirname(config))
    assert described["tensors"]["text.embedding"]["shape"] == [260, 128]
    weights = safetensors.numpy.load_file(checkpoint)
    assert described["geometry"]["parameters"] == sum(t.size for name, t in weights.items() if not name.startswith("adamw."))

    by_hand = os.path.join(os.path.dirname(config), "by-hand.safetensors")  # a note of someone else's
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1))) as trainer:
        trainer.save(by_hand, note="fine-tuned by hand")
    assert cli.main(["info", by_hand]) == 0
    printed = capsys.readouterr().out
    assert "note: fine-tuned by hand" in printed and "stream:" not in printed
    assert cli.main(["info", by_hand, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["note"] == "fine-tuned by hand" and "cursor" not in described


def test_info_refuses_a_checkpoint_the_loader_refuses_after_its_summary(run, tmp_path, capsys):
    """`uform info` checks the file as `Encoder.load` does, not its header alone: a truncated file and a
    tensor of the wrong shape are described as far as they go, then refused, naming what is wrong."""
    config = run(steps=3)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "pairs" / "checkpoints" / "*.safetensors"))
    truncated, reshaped = str(tmp_path / "truncated.safetensors"), str(tmp_path / "reshaped.safetensors")
    with open(checkpoint, "rb") as file:
        data = file.read()
    with open(truncated, "wb") as file:
        file.write(data[:len(data) // 2])
    with safetensors.safe_open(checkpoint, "np") as file:
        metadata, tensors = file.metadata(), {name: file.get_tensor(name) for name in file.keys()}
    tensors["text.embedding"] = tensors["text.embedding"][:, :64].copy()
    safetensors.numpy.save_file(tensors, reshaped, metadata=metadata)
    capsys.readouterr()
    for path, why in ((truncated, r"runs past the end of the data"), (reshaped, r"holds text.embedding as F32 \[260, 64\], "
                                                                              r"the model needs F32 \[260, 128\]")):
        assert cli.main(["info", path]) == 1
        printed = capsys.readouterr()
        assert "step 3" in printed.out and "depth 1, hidden 128" in printed.out
        assert re.fullmatch(rf"uform info: CHECKPOINT: {re.escape(path)}:? .*{why}.*\n", printed.err), printed.err
        assert cli.main(["info", path, "--json"]) == 1
        described = json.loads(capsys.readouterr().out)
        assert described["valid"] is False and re.search(why, described["error"]) and described["step"] == 3
    assert cli.main(["info", checkpoint, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["valid"] is True and "error" not in described
    junk, zeros, missing = tmp_path / "junk.bin", tmp_path / "zeros.bin", str(tmp_path / "missing.safetensors")
    junk.write_bytes(bytes(range(100)))
    zeros.write_bytes(bytes(100))
    for path, why in ((str(junk), "but only 92 bytes follow its length"), (missing, "No such file"),
                      (str(zeros), "claims a header of 0 bytes; a header takes 2 bytes to 64 MiB")):
        assert cli.main(["info", path, "--json"]) == 1
        printed = capsys.readouterr()
        answered = json.loads(printed.out)
        assert answered.keys() == {"path", "valid", "error"} and answered["path"] == path and not answered["valid"]
        assert why in answered["error"] and why in printed.err and not answered["error"].startswith("CHECKPOINT")


def test_info_shows_a_note_of_another_shape_as_text(run, tmp_path, capsys):
    """Only a note of exactly the shape `uform train` writes is read as a stream's cursor; any other JSON,
    `"cursor"` key or not, is its writer's own text."""
    config = run(steps=3)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "pairs" / "checkpoints" / "*.safetensors"))
    written = json.loads(uform.checkpoint_note(checkpoint))
    assert cli.written_cursor(written) == written["cursor"]
    notes = ['{"step": 5, "cursor": 3}', '{"cursor": {"epoch": "x"}}', json.dumps(dict(written, step=-1)),
             json.dumps(dict(written, cursor=dict(written["cursor"], epoch="0"))),
             json.dumps(dict(written, cursor={k: v for k, v in written["cursor"].items() if k != "skip"})),
             json.dumps(dict(written, comment="mine")), "[1, 2]"]
    path = str(tmp_path / "noted.safetensors")
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1))) as trainer:
        for note in notes:
            trainer.save(path, note=note)
            capsys.readouterr()
            assert cli.main(["info", path]) == 0, note
            printed = capsys.readouterr().out
            assert f"note: {note}\n" in printed and "stream:" not in printed, note
            assert cli.main(["info", path, "--json"]) == 0
            described = json.loads(capsys.readouterr().out)
            assert described["note"] == note and "cursor" not in described, note


def test_embed_writes_npy_and_parquet_in_input_order(run, tmp_path, capsys):
    config = run(steps=2)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "pairs" / "checkpoints" / "*.safetensors"))
    source = str(tmp_path / "held-out.jsonl")
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.npy")]) == 1
    assert "--column: " in capsys.readouterr().err
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.npy"), "--column", "answr"]) == 1
    assert capsys.readouterr().err == (f"uform embed: --column: {source}'s first records have no column 'answr' "
                                       "(it has 'question', 'answer')\n")
    assert not os.path.exists(tmp_path / "out.npy")
    on_cpu = ["--device", "cpu", "--threads", "1"]  # bit for bit with the encoder below: bits repeat for one thread count
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.npy"), "--column", "answer", "--chunk", "5"] + on_cpu) == 0
    vectors = np.load(tmp_path / "out.npy")
    answers = [json.loads(line)["answer"] for line in open(source)]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Encoder.load(checkpoint, cpu) as encoder:
        expected = np.array(encoder.embed(["text"] * len(answers), answers))
    assert vectors.shape == (12, 128) and vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, expected)
    pyarrow = pytest.importorskip("pyarrow.parquet")
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.parquet"), "--column", "answer", "--scalar", "f16"]
                    + on_cpu) == 0
    table = pyarrow.read_table(tmp_path / "out.parquet")
    assert table.column("location").to_pylist() == [f"{source}:line {i + 1}" for i in range(12)]
    halves = np.array(table.column("embedding").to_pylist(), np.float16)
    np.testing.assert_allclose(halves, expected, atol=1e-3)


def test_without_pyarrow_parquet_names_the_package_to_install(run, tmp_path, capsys, monkeypatch):
    config = run(steps=1)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "pairs" / "checkpoints" / "*.safetensors"))
    (tmp_path / "held-out.parquet").write_bytes(b"PAR1")
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # as where it is not installed
    capsys.readouterr()
    source = str(tmp_path / "held-out.jsonl")
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.parquet"), "--column", "answer"]) == 1
    assert "uform embed: OUTPUT: writing Parquet needs pyarrow: pip install pyarrow\n" == capsys.readouterr().err
    assert cli.main(["embed", checkpoint, str(tmp_path / "held-out.parquet"), str(tmp_path / "out.npy")]) == 1
    assert "reading Parquet needs pyarrow: pip install pyarrow\n" in capsys.readouterr().err


def test_a_config_error_names_its_field_before_any_step(run, capsys):
    for replace, message in (({'answer = "text"': 'answr = "text"'}, "data.columns.answr: .*have no column 'answr'"),
                             ({"keep = 2": "keep = 2\nkept = 3"}, "checkpoints.kept: unknown field"),
                             ({"depth = 1": "depth = 1\ndeep = 2"}, "trainer.deep: unknown field"),
                             ({"[run]": "[runs]"}, "runs: unknown section"),
                             ({"hidden = 128": "hidden = 100"}, "trainer.hidden: 100 is not a multiple of 128")):
        assert cli.main(["train", run(**replace)]) == 1
        assert re.search(message, capsys.readouterr().err), message
    assert not os.path.exists(os.path.join(os.path.dirname(run()), "runs"))  # no run folder for a refused config


def test_the_trainers_fields_are_named_as_the_toml_file_names_them(run, tmp_path, capsys):
    """The library names the trainer's config `config.` to Python and C callers, and still does; the command
    names its fields by the `[trainer]` section they were given in."""
    assert cli.main(["train", run(**{"[trainer.schedule]": "[trainer.schedule]\nlearning_rate = inf"})]) == 1
    assert "uform train: trainer.schedule.learning_rate: inf is not in [0, 1]" in capsys.readouterr().err
    with uform.Executor.for_ram(threads=1) as cpu:
        with pytest.raises(uform.InvalidArgument, match=r"^config\.schedule\.learning_rate: inf is not in \[0, 1\]"):
            uform.Trainer.init_ram(cpu, dict(depth=1, hidden=128, objective="joint",
                                             schedule=dict(steps=1, learning_rate=float("inf"))))
    assert cli.main(["train", run(steps=3)]) == 0
    capsys.readouterr()
    assert cli.main(["train", run(steps=6, **{"seed = 3": "seed = 4"})]) == 1
    assert "uform train: trainer.seed: the stream being resumed read seed = 3, now 4" in capsys.readouterr().err
    kept = uform.InvalidArgument("data.paths[0]: '/data/config.batch/a.jsonl' matches no file")
    assert cli.as_toml_names(kept) is kept
    renamed = cli.as_toml_names(uform.InvalidCheckpoint("config.late_interaction.max_query_span: 70 does not fit "
                                                        "config.batch.max_columns_per_row = 64"))
    assert type(renamed) is uform.InvalidCheckpoint and str(renamed) == (
        "trainer.late_interaction.max_query_span: 70 does not fit trainer.batch.max_columns_per_row = 64")


def test_every_minutes_takes_zero_for_by_steps_alone_and_refuses_what_is_no_duration(run, tmp_path, capsys):
    for value in ("-1", "nan", "inf", "-0.5"):
        assert cli.main(["train", run(**{"keep = 2": f"keep = 2\nevery_minutes = {value}"})]) == 1
        assert f"checkpoints.every_minutes: {float(value)} is not a number of minutes, 0 or more" in capsys.readouterr().err
    assert cli.main(["train", run(steps=5, every=0, **{"keep = 2": "keep = 5\nevery_minutes = 0"})]) == 0
    assert steps_in(str(tmp_path / "runs" / "pairs")) == [5]  # neither by steps nor by time: at the end alone
    assert cli.main(["train", run(steps=7, every=1000, **{"keep = 2": "keep = 5\nevery_minutes = 1e-9"})]) == 0
    assert steps_in(str(tmp_path / "runs" / "pairs")) == [5, 6, 7]  # a moment passes between steps


def test_sigterm_mid_run_saves_and_the_resumed_run_ends_where_an_unbroken_one_does(run, tmp_path):
    steps = 400
    unbroken, broken = run("unbroken", steps=steps, every=1000), run("broken", steps=steps, every=1000)
    assert cli.main(["train", unbroken]) == 0
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    # From tmp_path: `-m` puts the working folder first on the path, where a checkout's uncompiled `uform/`
    # would shadow the package the tests import.
    child = subprocess.Popen([sys.executable, "-m", "uform.cli", "train", os.path.abspath(broken)], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "runs" / "broken" / "log.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        if log.exists() and log.read_text().count('"loss"') >= 5:
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, errors = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM, errors
    assert "stopped by SIGTERM" in errors
    (stopped,) = steps_in(str(tmp_path / "runs" / "broken"))
    assert 5 <= stopped < steps
    assert [(line["step"], line["stopped"]) for line in read_log(tmp_path / "runs" / "broken")
            if "stopped" in line] == [(stopped, "SIGTERM")]
    assert os.listdir(tmp_path / "runs" / "broken" / "checkpoints") == [f"step-{stopped:09d}.safetensors"]
    checkpoint = glob.glob(str(tmp_path / "runs" / "broken" / "checkpoints" / "*.safetensors"))[0]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Encoder.load(checkpoint, cpu):
        pass
    assert cli.main(["train", broken]) == 0
    ends = [glob.glob(str(tmp_path / "runs" / name / "checkpoints" / f"step-{steps:09d}.safetensors"))[0]
            for name in ("unbroken", "broken")]
    first, second = (safetensors.numpy.load_file(path) for path in ends)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_a_signal_during_the_final_evaluation_ends_the_run_as_a_signal_does(run, tmp_path, monkeypatch, capfd):
    """The evaluation runs to its end (it cannot be left half done), then the run exits as signals make it exit,
    saying that nothing is left to do."""
    evaluate = cli._evaluate

    def signalled(trainer, executor, config, held_out, log, step, mesh=None):
        evaluate(trainer, executor, config, held_out, log, step, mesh)
        if step == 9:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(cli, "_evaluate", signalled)
    config, folder = run(), str(tmp_path / "runs" / "pairs")
    assert cli.main(["train", config]) == 128 + signal.SIGTERM
    err = capfd.readouterr().err
    assert "uform: SIGTERM: stopping after the final evaluation, of step 9, under way; a second signal" in err
    assert (f"uform: stopped by SIGTERM during the final evaluation of step 9, which ended first; the run is complete, "
            f"checkpoints in {folder}/checkpoints\n") in err
    log = read_log(folder)
    assert [line["step"] for line in log if "evaluation" in line] == [4, 8, 9]
    assert [(line["step"], line["stopped"]) for line in log if "stopped" in line] == [(9, "SIGTERM")]


def test_a_signal_during_the_last_step_leaves_the_final_evaluation_to_the_rerun(run, tmp_path, monkeypatch, capsys):
    """A signal while the last step trains stops the run after it, before the final evaluation, saying so; the
    same command then makes that evaluation, training nothing, and only the one after it finds the run done."""
    begun_step, begun = uform.Trainer._begun_step, []

    def signalled_at_the_last(trainer, batch):
        begun.append(batch)
        if len(begun) == 9:
            os.kill(os.getpid(), signal.SIGTERM)  # as the last step begins: the run stops once it lands
        return begun_step(trainer, batch)

    monkeypatch.setattr(uform.Trainer, "_begun_step", signalled_at_the_last)
    config, folder = run(), str(tmp_path / "runs" / "pairs")
    assert cli.main(["train", config]) == 128 + signal.SIGTERM
    newest = os.path.join(folder, "checkpoints", "step-000000009.safetensors")
    assert (f"uform: stopped by SIGTERM at step 9, the last, before its final evaluation; `uform train {config}` "
            f"evaluates it from {newest}\n") in capsys.readouterr().err
    assert [line["step"] for line in read_log(folder) if "evaluation" in line] == [4, 8]
    monkeypatch.undo()

    assert cli.main(["train", config]) == 0
    err = capsys.readouterr().err
    assert f"uform: {folder} is at step 9, done training, but its log holds no evaluation of that step" in err
    assert "uform: step 9: question->answer recall@1" in err
    log = read_log(folder)
    assert [line["step"] for line in log if "evaluation" in line] == [4, 8, 9]
    assert [line["step"] for line in log if "loss" in line] == list(range(1, 10))  # nothing trained again
    assert steps_in(folder) == [6, 9]
    assert cli.main(["train", config]) == 0
    assert "already took its 9 steps" in capsys.readouterr().out


def test_paths_given_with_dot_dot_are_shown_tidied_when_the_run_resumes(run, tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "answer": ""}\n' + data.read_text())  # a bad record, met at once
    spelled = {'paths = ["train.jsonl"]': 'paths = ["sub/../train.jsonl"]', "[run]": '[run]\nfolder = "sub/../runs/tidy"'}
    assert cli.main(["train", run(steps=3, **spelled)]) == 0
    assert cli.main(["train", run(steps=5, **spelled)]) == 0
    out, err = capsys.readouterr()
    folder = tmp_path / "runs" / "tidy"
    assert f"uform: resuming {folder}/checkpoints/step-000000003.safetensors with trainer.schedule.steps = 5 (was 3)" in err
    assert f"uform: trained to step 5; checkpoints in {folder}/checkpoints, log in {folder}/log.jsonl" in out
    assert "/../" not in out + err
    log = read_log(folder)
    assert f"{data}:line 1: 'answer' is empty" in [line.get("bad_record") for line in log]
    assert "/../" not in json.dumps(log)


def test_a_second_signal_stops_at_once_as_the_first_said(tmp_path):
    """The first signal asks for a stop after the step in flight and says what a second would lose; the second, of
    either kind, ends the process by that signal at once, by the system's own action: even a thread inside native
    code, where no Python handler runs, is stopped."""
    child = ("import os, signal, sys, time\n"
             "from uform import cli\n"
             "stop = cli._Stop()\n"
             "os.kill(os.getpid(), signal.SIGTERM)\n"
             "print(signal.Signals(stop.signal).name, flush=True)\n"
             "os.kill(os.getpid(), signal.SIGINT)\n"
             "time.sleep(30)\n"
             "print('still running', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    ended = subprocess.run([sys.executable, "-c", child], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert ended.returncode == -signal.SIGINT, ended
    assert ended.stdout == "SIGTERM\n"
    assert ended.stderr == ("uform: SIGTERM: stopping after the step in flight; a second signal stops at once, "
                            "without saving what the first would\n"), ended.stderr


def test_a_checkpoint_without_a_cursor_is_refused_and_an_older_versions_cursor_beside_it_read(run, tmp_path, capsys):
    """Before checkpoints carried notes, the cursor lay beside each in `step-N.cursor.json`: such a run
    folder still resumes exactly. A checkpoint with neither cursor is refused, named, not resumed with
    its data from the start."""
    folder = tmp_path / "runs" / "pairs" / "checkpoints"
    assert cli.main(["train", run()]) == 0
    unbroken = safetensors.numpy.load_file(str(folder / "step-000000009.safetensors"))
    os.remove(folder / "step-000000009.safetensors")  # as if stopped after step 6
    older = str(folder / "step-000000006.safetensors")
    with safetensors.safe_open(older, framework="numpy") as file:
        metadata, tensors = file.metadata(), {name: file.get_tensor(name) for name in file.keys()}
    written = json.loads(metadata.pop("note"))
    written["cursor"]["shards"] = [str(tmp_path / "train.jsonl")]  # beside the checkpoint, the list itself
    safetensors.numpy.save_file(tensors, older, metadata=metadata)
    assert uform.checkpoint_note(older) is None
    capsys.readouterr()
    assert cli.main(["train", run()]) == 1
    assert f"{older}: no stream cursor in its note (nor in step-000000006.cursor.json beside it)" in capsys.readouterr().err

    (folder / "step-000000006.cursor.json").write_text(json.dumps(written, indent=1))
    assert cli.main(["train", run(**{"keep = 2": "keep = 1"})]) == 0
    assert os.listdir(folder) == ["step-000000009.safetensors"]  # the older cursor went with its checkpoint
    resumed = safetensors.numpy.load_file(str(folder / "step-000000009.safetensors"))
    assert resumed.keys() == unbroken.keys()
    for name in unbroken:
        np.testing.assert_array_equal(resumed[name], unbroken[name], err_msg=name)


def test_an_unreadable_newest_checkpoint_is_refused_naming_the_one_before_it(run, tmp_path, capsys):
    """A truncated newest checkpoint, or junk named like one, stops the run rather than let it resume from
    older work unasked; the message says which file to move and what the run then resumes from."""
    config = run(steps=9, every=3)
    assert cli.main(["train", config]) == 0
    saved_in = tmp_path / "runs" / "pairs" / "checkpoints"
    assert steps_in(str(tmp_path / "runs" / "pairs")) == [6, 9]
    config = run(steps=12, every=3)
    junk = saved_in / "step-000000010.safetensors"
    junk.write_bytes(b"junk")
    newest = saved_in / "step-000000009.safetensors"
    for damaged, older, why in ((junk, "step-000000009.safetensors", "it is 4 bytes, too short"),
                                (newest, "step-000000006.safetensors", "tensor adamw.")):
        if damaged == newest:
            junk.unlink()
            data = newest.read_bytes()
            newest.write_bytes(data[:len(data) // 2])
        capsys.readouterr()
        assert cli.main(["train", config]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"uform train: the run's newest checkpoint {damaged} is unreadable ({why}") and err.endswith(
            f"); move it out of {saved_in} to resume from {older}, the one before it\n"), err
    junk.write_bytes(b"junk")  # the one before the newest unreadable too: the advice passes over it
    assert cli.main(["train", config]) == 1
    assert capsys.readouterr().err.endswith(f"; move it and the unreadable step-000000009.safetensors out of {saved_in} "
                                            "to resume from step-000000006.safetensors\n")
    junk.unlink()
    newest.rename(tmp_path / "moved.safetensors")
    assert cli.main(["train", config]) == 0
    assert steps_in(str(tmp_path / "runs" / "pairs")) == [9, 12]
    assert read_log(str(tmp_path / "runs" / "pairs"))[-1]["step"] == 12


def test_a_refused_record_keeps_what_trained_before_it_and_the_mended_run_ends_where_an_unbroken_one_does(
        run, tmp_path, capsys):
    """Under `bad_records = "refuse"` a bad record stops the run, named, and the steps since the last checkpoint
    are saved with the cursor before the record's batch: once it is mended the run resumes there and ends bit for
    bit where a run over good data ends."""
    refusing = {"[data]\n": '[data]\nbad_records = "refuse"\n',
                '[evaluation]\npaths = ["held-out.jsonl"]\nevery_steps = 4': ""}
    unbroken, broken = run("unbroken", every=100, **refusing), run("broken", every=100, **refusing)
    assert cli.main(["train", unbroken]) == 0
    data = tmp_path / "train.jsonl"
    good = data.read_text()
    data.write_text(good.replace('"answer": "2500, the square of 50"', '"answer": ""'))
    capsys.readouterr()
    assert cli.main(["train", broken]) == 1
    error = capsys.readouterr().err
    found = re.search(r"uform train: .*train.jsonl:line 51: 'answer' is empty; steps to (\d+) are saved in (\S+), from "
                      r"which `uform train .*broken.toml` resumes once the record is mended in place \(deleting its line would "
                      r"shift the records after it\), or with data.bad_records = \"skip\" to leave it out", error)
    assert found, error
    stopped = int(found.group(1))
    assert 0 < stopped < 9 and steps_in(str(tmp_path / "runs" / "broken")) == [stopped]
    assert found.group(2).endswith(f"step-{stopped:09d}.safetensors")
    (refused,) = [line for line in read_log(tmp_path / "runs" / "broken") if "refused_record" in line]
    assert refused["step"] == stopped and refused["refused_record"].startswith(f"{data}:line 51: 'answer' is empty")
    data.write_text(good)
    assert cli.main(["train", broken]) == 0
    ends = [os.path.join(tmp_path, "runs", name, "checkpoints", f"step-{9:09d}.safetensors")
            for name in ("unbroken", "broken")]
    first, second = (safetensors.numpy.load_file(path) for path in ends)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_a_run_whose_data_moved_resumes_over_the_same_files_where_they_are_now(run, tmp_path, capsys):
    """Data copied to another folder or mount keeps each shard's path below their folder and its size: the run
    resumes there, saying so, and ends where a run resumed in place ends. A file of another size is refused."""
    for name in ("in-place", "moved"):
        assert cli.main(["train", run(name, steps=4, every=100)]) == 0
    assert cli.main(["train", run("in-place", every=100)]) == 0
    (tmp_path / "elsewhere").mkdir()
    os.rename(tmp_path / "train.jsonl", tmp_path / "elsewhere" / "train.jsonl")
    elsewhere = {'paths = ["train.jsonl"]': 'paths = ["elsewhere/train.jsonl"]'}
    capsys.readouterr()
    assert cli.main(["train", run("moved", every=100, **elsewhere)]) == 0
    assert (f"uform: data.paths: the shard read from {tmp_path} is in {tmp_path / 'elsewhere'} now, of the same "
            "size; the stream resumes there") in capsys.readouterr().err
    ends = [os.path.join(tmp_path, "runs", name, "checkpoints", f"step-{9:09d}.safetensors") for name in ("in-place", "moved")]
    first, second = (safetensors.numpy.load_file(path) for path in ends)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)

    assert cli.main(["train", run("grown", steps=4, every=100, **elsewhere)]) == 0
    os.rename(tmp_path / "elsewhere" / "train.jsonl", tmp_path / "train.jsonl")
    write_pairs(tmp_path / "train.jsonl", range(61))  # one record more: not the file the run read
    assert cli.main(["train", run("grown", every=100)]) == 1
    assert (f"uform train: data.paths: the shard listed now (train.jsonl below {tmp_path}) is not the files step 4 "
            f"was read from (below {tmp_path / 'elsewhere'}, their names and sizes kept as a digest): a resumed run "
            "reads the same files") in capsys.readouterr().err


def test_the_note_keeps_a_digest_of_the_shards_which_the_resumed_stream_checks(run, tmp_path, capsys):
    """A dataset of many shards lists more than a note holds; the note keeps the list's digest."""
    many = {'paths = ["train.jsonl"]': f'paths = {json.dumps(["train.jsonl"] * 20000)}'}
    assert cli.main(["train", run(steps=3, **many)]) == 0
    assert cli.main(["train", run(steps=6, **many)]) == 0  # resumed: the digest matched, the list was checked
    step, path = cli.checkpoints_in(str(tmp_path / "runs" / "pairs" / "checkpoints"))[-1]
    cursor = json.loads(uform.checkpoint_note(path))["cursor"]
    assert step == 6 and cursor["shards"] == cli.shards_digest([str(tmp_path / "train.jsonl")] * 20000)
    assert len(json.dumps([str(tmp_path / "train.jsonl")] * 20000)) > 2**20
    capsys.readouterr()
    assert cli.main(["train", run(steps=9)]) == 1  # the same run over other shards
    assert (f"data.paths: the shard listed now (train.jsonl below {tmp_path}) is not the files step 6 was read from "
            f"(below {tmp_path}, their names and sizes kept as a digest): a resumed run reads the same files"
            ) in capsys.readouterr().err


def test_the_tutorials_config_is_one_uform_train_reads(tmp_path):
    tutorial = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tutorial.md")
    if not os.path.isfile(tutorial):
        pytest.skip("an installed package without the checkout's docs")
    blocks = re.findall(r"```toml\n(.*?)```", open(tutorial).read(), re.S)
    (full,) = [block for block in blocks if "[trainer]" in block and "train.jsonl" in block]
    for name in ("train.jsonl", "held-out.jsonl"):
        (tmp_path / name).write_text('{"signature": "f(x)", "doc": "Return x."}\n')
    (tmp_path / "pairs.toml").write_text(full)
    config = cli.load_config(str(tmp_path / "pairs.toml"))
    assert config.trainer["schedule"]["steps"] == 1200 and config.checkpoints.keep == 3
    assert config.run.folder == str(tmp_path / "runs" / "pairs") and config.evaluation.max_records == 400


# ---------------------------------------------------------------------------------------------- #
#  Images through the command, records the library refuses, data with no usable record             #
# ---------------------------------------------------------------------------------------------- #


def write_photos(folder, count, broken=(), start=0):
    """`count` captioned PNGs, `{key}.png` beside `{key}.txt`; `broken` keys get a PNG's signature and garbage."""
    from test_media import png_bytes

    folder.mkdir()
    rng = np.random.default_rng(start)
    for i in range(start, start + count):
        png = png_bytes(rng.integers(0, 256, (24, 40, 3)).astype(np.uint8))
        (folder / f"p{i:02d}.png").write_bytes(png[:8] + bytes(40) if i in broken else png)
        (folder / f"p{i:02d}.txt").write_text(f"picture number {i}")
    return str(folder)


def photos_config(tmp_path, steps=2, evaluation=True, **replace):
    """The tutorial's image config, shrunk to a test's size, over `photos/` (and `held-out-photos/`)."""
    tutorial = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tutorial.md")
    if not os.path.isfile(tutorial):
        pytest.skip("an installed package without the checkout's docs")
    (text,) = [block for block in re.findall(r"```toml\n(.*?)```", open(tutorial).read(), re.S)
               if "[trainer.batch.image]" in block]
    for old, new in {"depth = 2": "depth = 1", "hidden = 256": "hidden = 128", "max_rows_per_device = 32":
                     "max_rows_per_device = 8", "max_columns_per_row = 256": "max_columns_per_row = 64",
                     "steps = 300": f"steps = {steps}", "warmup_steps = 30": "warmup_steps = 1",
                     "[data]": "[data]\nshuffle_buffer = 0", "[checkpoints]": "[run]\nthreads = 1\n\n[checkpoints]",
                     **replace}.items():
        assert old in text, old
        text = text.replace(old, new)
    if evaluation:
        text += '\n[evaluation]\npaths = ["held-out-photos"]\n'
    path = tmp_path / "photos.toml"
    path.write_text(text)
    return str(path)


def test_the_tutorials_image_config_trains_and_logs_every_stat_of_a_step(tmp_path):
    write_photos(tmp_path / "photos", 12)
    write_photos(tmp_path / "held-out-photos", 4, start=50)
    assert cli.main(["train", photos_config(tmp_path)]) == 0
    folder = tmp_path / "runs" / "photos"
    trained = [line for line in read_log(folder) if "loss" in line]
    assert [line["step"] for line in trained] == [1, 2]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1))) as trainer:
        fields = set(trainer.step(dict(modalities=["text"] * 2, contents=["a", "b"],
                                       relations=dict(attract=uform.Edges([0, 1, 2], [1, 0])))).stats) - {"step"}
    assert fields <= set(trained[0])  # every stat a step reports, the media terms included
    assert trained[0]["image_loss"] > 0 and trained[0]["masked_patches"] > 0 and trained[0]["truncated_items"] == 0
    terms = sum(trained[0][name] or 0 for name in ("masked_loss", "contrastive_loss", "image_loss"))
    assert trained[0]["loss"] == pytest.approx(terms, rel=1e-5)  # the default weights are one
    (events,) = glob.glob(str(folder / "tensorboard" / "events.out.tfevents.*"))
    tags = set(dict(read_events(events))[1])
    assert {"loss/image_loss", "batch/masked_patches", "batch/truncated_items", "time/host_seconds",
            "contrastive/inverse_temperature/0"} <= tags
    assert "loss/video_loss" not in tags  # a term that did not run logs nothing
    assert [line["step"] for line in read_log(folder) if "evaluation" in line] == [2]


def test_an_image_the_library_cannot_decode_is_one_bad_record_named_by_its_location(tmp_path, capsys):
    photos = write_photos(tmp_path / "photos", 12, broken={3})
    write_photos(tmp_path / "held-out-photos", 4, broken={51}, start=50)
    config = photos_config(tmp_path)
    assert cli.main(["train", config]) == 0
    log = read_log(tmp_path / "runs" / "photos")
    assert not [line for line in log if "refused_batch" in line]
    (bad,) = [line["bad_record"] for line in log if "bad_record" in line]
    assert re.match(rf"{re.escape(photos)}:p03: 'jpg;png;webp': not a readable PNG image", bad)
    first = [line for line in log if "loss" in line][0]
    assert first["items"] == 2 * 6 - 2  # six pictures fill the rows; the broken one's pair left out, the rest trained
    (held_out,) = [line["held_out_bad_records"] for line in log if "held_out_bad_records" in line]
    assert held_out[0].startswith(f"{tmp_path / 'held-out-photos'}:p51: 'jpg;png;webp': not a readable PNG")
    assert [line["step"] for line in log if "evaluation" in line] == [2]

    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "photos" / "checkpoints" / "*.safetensors"))
    capsys.readouterr()
    assert cli.main(["embed", checkpoint, photos, str(tmp_path / "out.npy"), "--column", "png"]) == 1
    assert re.search(rf"uform embed: {re.escape(photos)}:p03: 'png': not a readable PNG", capsys.readouterr().err)

    refusing = photos_config(tmp_path, evaluation=False, **{"[data]": "[data]\nbad_records = \"refuse\""})
    shutil.rmtree(tmp_path / "runs")
    assert cli.main(["train", refusing]) == 1
    assert re.search(rf"uform train: {re.escape(photos)}:p03: 'jpg;png;webp': not a readable PNG", capsys.readouterr().err)


def test_an_item_in_a_format_this_build_does_not_decode_is_a_bad_record(tmp_path, monkeypatch, capfd):
    """As the library answers a WebP picture where the build lacks libwebp: `Unsupported`, naming the item."""
    photos = write_photos(tmp_path / "photos", 12)
    write_photos(tmp_path / "held-out-photos", 4, start=50)
    decode, refused = uform.Trainer.decode, []

    def without_webp(trainer, batch):
        if not refused:  # the batch's second record's picture
            refused.append(batch)
            raise uform.Unsupported("batch.contents[2]: WebP images need a build with libwebp (Debian: libwebp-dev)")
        return decode(trainer, batch)

    monkeypatch.setattr(uform.Trainer, "decode", without_webp)
    monkeypatch.setattr(uform, "capabilities", lambda: {"ram", "mesh", "jpeg", "png"})
    assert cli.main(["train", photos_config(tmp_path)]) == 0
    (bad,) = [line["bad_record"] for line in read_log(tmp_path / "runs" / "photos") if "bad_record" in line]
    assert bad == f"{photos}:p01: 'jpg;png;webp': WebP images need a build with libwebp (Debian: libwebp-dev)"
    said = capfd.readouterr().err  # said before the run, for the data and the held-out set alike
    for field_path in ("data.columns", "evaluation.columns"):
        assert (f"uform: {field_path}.jpg;png;webp: this build decodes no webp (uform.capabilities() lacks it); such "
                "files are bad records\n") in said


def test_an_empty_dataset_is_refused_naming_it_before_the_run_makes_its_folder(run, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert cli.main(["train", run(**{'paths = ["train.jsonl"]': 'paths = ["empty.jsonl"]'})]) == 1
    assert f"uform train: data.paths: {tmp_path / 'empty.jsonl'} holds no records" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_dataset_whose_every_record_is_bad_stops_with_the_reasons(run, tmp_path, capsys):
    config = run(**{'answer = "text"': 'answer = "image"', '[evaluation]\npaths = ["held-out.jsonl"]\nevery_steps = 4': ""})
    started = time.monotonic()
    assert cli.main(["train", config]) == 1
    assert time.monotonic() - started < 20
    error = capsys.readouterr().err
    assert re.search(r"data.paths: a whole epoch of .*train.jsonl made no usable batch: 60 bad records; the first: "
                     r".*train.jsonl:line \d+: 'answer' names no file \('\d+, the square of \d+'\); a column declared image holds a path",
                     error), error
    log = read_log(tmp_path / "runs" / "pairs")
    assert len(log) < 100
    assert "made no usable batch" in log[-1]["error"]  # where an unattended run's stderr may be gone


def test_sigterm_before_the_first_step_saves_nothing_and_says_so(run, tmp_path, monkeypatch, capsys):
    opened = cli.open_executor

    def open_then_signal(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # while the trainer is being built: no step has run
        return opened(*args)

    monkeypatch.setattr(cli, "open_executor", open_then_signal)
    config = run()
    assert cli.main(["train", config]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at step 0; nothing saved yet" in capsys.readouterr().err
    assert steps_in(str(tmp_path / "runs" / "pairs")) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back


def test_errors_name_the_field_or_argument_at_fault(run, tmp_path, capsys):
    cases = [(["train", run("resume", **{"seed = 3": 'seed = 3\nresume = "nope.safetensors"'})],
              r"trainer.resume: .*nope.safetensors: no such file"),
             (["train", run("absent", **{'paths = ["held-out.jsonl"]': 'paths = ["absent.jsonl"]'})],
              r"evaluation.paths\[0\]: .*absent.jsonl.*no such file"),
             (["train", run("mislabelled", **{'[evaluation]': '[evaluation]\ncolumns = { question = "image", answer = "text" }'})],
              r"evaluation.paths: 0 usable records; retrieval needs at least two; 12 bad, the first: "
              r".*held-out.jsonl:line 1: 'question' names no file"),
             (["train", run("none", **{"[evaluation]": "[evaluation]\nmax_records = 0"})],
              r"^uform train: evaluation.max_records: 0; retrieval needs at least two records$"),
             (["train", run("one", **{"[evaluation]": "[evaluation]\nmax_records = 1"})],
              r"^uform train: evaluation.max_records: 1; retrieval needs at least two records$"),
             (["train", "nope.toml"], r"^uform train: CONFIG: nope.toml: no such file$"),
             (["train", str(tmp_path)], rf"^uform train: CONFIG: {re.escape(str(tmp_path))}: Is a directory$"),
             (["info", "nope.safetensors"], r"uform info: CHECKPOINT: nope.safetensors: No such file"),
             (["embed", "nope.safetensors", "in.jsonl", "out.npy"], r"CHECKPOINT: nope.safetensors: No such file or directory")]
    for argv, message in cases:
        assert cli.main(argv) == 1
        assert re.search(message, capsys.readouterr().err), message
    assert not os.path.exists(tmp_path / "runs")  # a refused config leaves no run folder behind


def test_options_and_run_fields_are_named_as_the_user_gave_them(run, tmp_path, capsys, monkeypatch):
    """The library and the data layer name `threads` and `data.paths`; `uform embed` names the option or
    argument that gave the value, and `uform train` the config field, run folder included."""
    checkpoint = str(tmp_path / "tiny.safetensors")
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1), batch=dict(max_columns_per_row=64))) as trainer:
        trainer.save(checkpoint)
    source, output = str(tmp_path / "held-out.jsonl"), str(tmp_path / "out.npy")
    embedding = ["embed", checkpoint, source, output, "--column", "question", "--device", "cpu"]  # CPU threads
    cases = [(["--threads", "5000"], r"^uform embed: --threads: 5000 is over 1024$"),
             (["--format", "parquet"], rf"^uform embed: INPUT: {re.escape(source)}: no Parquet file \(.*\)$"),
             (["--chunk", "0"], r"^uform embed: --chunk: 0 is not a positive integer \(the items embedded per call\)$"),
             (["--chunk", "-1"], r"^uform embed: --chunk: -1 is not a positive integer \(the items embedded per call\)$")]
    if "vram" not in uform.capabilities():
        cases.append((["--device", "gpu"], r"^uform embed: --device: 'gpu', but this build or machine has no GPU"))
    for options, message in cases:
        assert cli.main(embedding + options) == 1, options
        assert re.search(message, capsys.readouterr().err.rstrip("\n")), message
    assert not os.path.exists(output)
    unknown = str(tmp_path / "held-out.txt")
    os.link(source, unknown)
    assert cli.main(["embed", checkpoint, unknown, output, "--column", "question", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.endswith("and is no folder; name its layout with --format\n")
    assert cli.main(embedding + ["--chunk", "5"]) == 0  # 12 records: two whole chunks and a part
    assert np.load(output).shape == (12, 128)

    assert cli.main(["train", run("threads", **{"threads = 1": "threads = 5000\ndevice = \"cpu\""})]) == 1
    assert capsys.readouterr().err == "uform train: run.threads: 5000 is over 1024\n"
    (tmp_path / "a-file").write_text("")
    under_a_file = str(tmp_path / "a-file" / "run")
    on_cpu = '\ndevice = "cpu"'  # where a GPU would first say the fixture's `threads = 1` is ignored there
    assert cli.main(["train", run("under", **{"[run]": '[run]\nfolder = "a-file/run"' + on_cpu})]) == 1
    assert capsys.readouterr().err == f"uform train: run.folder: {under_a_file}: Not a directory\n"
    made = os.makedirs

    def refused(path, *args, **kwargs):  # as a folder the user may not write to answers, even to root
        if os.path.basename(path) == "locked":
            raise PermissionError(1, "Operation not permitted", path)
        return made(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", refused)
    assert cli.main(["train", run("locked", **{"[run]": '[run]\nfolder = "runs/locked"' + on_cpu})]) == 1
    assert capsys.readouterr().err == f"uform train: run.folder: {tmp_path / 'runs' / 'locked'}: Operation not permitted\n"


def test_threads_on_a_gpu_are_said_to_apply_to_the_cpu_only(monkeypatch, capsys):
    """A GPU is simulated: the executor answered stands for one, and no trainer is built on it."""
    gpu = object()
    monkeypatch.setattr(uform, "capabilities", lambda: {"ram", "vram"})
    monkeypatch.setattr(uform.Executor, "for_vram", lambda *args: gpu)
    for device in ("auto", "gpu"):
        assert cli.open_executor(device, 2) == (gpu, uform.Trainer.init_vram)
        assert capsys.readouterr().err == "uform: run.threads: 2 applies to the CPU only; this run uses the GPU, so it " \
                                          "is ignored\n"
    assert cli.open_executor("auto", None) == (gpu, uform.Trainer.init_vram)
    assert cli.open_executor("auto", 2, ("--device", "--threads"))[0] is gpu
    assert capsys.readouterr().err == "uform: --threads: 2 applies to the CPU only; this run uses the GPU, so it is ignored\n"

    def no_gpu(*args):
        raise uform.Unsupported("no GPU here")

    monkeypatch.setattr(uform.Executor, "for_vram", no_gpu)  # "auto" then takes the CPU, with its threads
    for device in ("auto", "cpu"):
        executor, init = cli.open_executor(device, 2)
        with executor:
            assert executor.kind == "ram" and init == uform.Trainer.init_ram
    assert capsys.readouterr().err == ""


def test_retrieval_scores_targets_it_cannot_tell_apart_as_chance():
    units = np.eye(4, dtype=np.float32)
    assert cli.retrieval(units, units) == {"recall@1": 1.0, "recall@10": 1.0, "mrr": 1.0}
    alike = np.full((5, 3), 3 ** -0.5, np.float32)  # five items the model embeds alike
    alike[1:] += np.float32(1e-8)  # as rounding tells them apart: still a tie
    scored = cli.retrieval(alike, alike)
    assert scored["recall@1"] == pytest.approx(0.2) and scored["recall@10"] == 1.0
    assert scored["mrr"] == pytest.approx(np.mean(1 / np.arange(1, 6)))
    mixed = np.concatenate([units, np.zeros((4, 4), np.float32)], 1)
    mixed = np.concatenate([mixed, np.tile(np.eye(8, dtype=np.float32)[4:5], (2, 1))])  # two alike beside four apart
    assert cli.retrieval(mixed, mixed)["recall@1"] == pytest.approx((4 + 0.5 + 0.5) / 6)


def test_items_cut_to_a_row_are_said_once_and_counted_in_the_log(run, tmp_path, capsys):
    assert cli.main(["train", run("cut", steps=9, **{"max_columns_per_row = 64": "max_columns_per_row = 16"})]) == 0
    err = capsys.readouterr().err
    said = re.findall(r"uform: step \d+: \d+ items longer than a row \(trainer.batch.max_columns_per_row\) were cut", err)
    assert len(said) == 1
    assert len(re.findall(r"uform: evaluation: \d+ held-out items are longer than a row and were cut to it", err)) == 1
    counted = [line["truncated_items"] for line in read_log(tmp_path / "runs" / "cut") if "truncated_items" in line]
    assert len(counted) == 9 and all(counted)  # evaluated at steps 4, 8 and 9, said once


def test_more_threads_than_cores_are_taken_and_said_to_be_slower(capsys):
    cores = len(os.sched_getaffinity(0))
    executor, _ = cli.open_executor("cpu", cores + 1, ("--device", "--threads"))
    with executor:
        assert executor.kind == "ram"
    assert capsys.readouterr().err == f"uform: --threads: {cores + 1} threads on the {cores} cores this process may " \
                                      "use; more threads than cores make each step slower, not faster\n"
    with cli.open_executor("cpu", cores)[0]:
        assert capsys.readouterr().err == ""


def test_sigint_before_train_takes_it_over_stops_in_one_line(run, tmp_path, monkeypatch, capsys):
    loaded = cli.load_config

    def load_then_interrupt(path):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the config is read: Python's own handler still answers it
        return loaded(path)

    monkeypatch.setattr(cli, "load_config", load_then_interrupt)
    assert cli.main(["train", run()]) == 128 + signal.SIGINT  # as a SIGINT later in the run exits
    assert capsys.readouterr().err == "uform: stopped by SIGINT before training began; nothing saved\n"
    assert not os.path.exists(tmp_path / "runs")


def test_embed_refuses_an_output_it_cannot_write_naming_it(tmp_path, capsys, monkeypatch):
    checkpoint = str(tmp_path / "tiny.safetensors")
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1), batch=dict(max_columns_per_row=64))) as trainer:
        trainer.save(checkpoint)
    source = tmp_path / "lines.jsonl"
    source.write_text('{"text": "a red panda"}\n{"text": "bamboo"}\n')
    missing, taken, read_only, same = (tmp_path / name for name in ("missing", "taken.npy", "read-only", "same.npy"))
    taken.mkdir()
    read_only.mkdir()
    os.symlink(source, same)  # INPUT under another name
    with monkeypatch.context() as patched:
        patched.setattr(cli, "list_shards", None)  # each is found before the input is read
        patched.setattr(os, "access", lambda path, mode: path != str(read_only))  # as for a user, not root
        for output, why in ((missing / "x.npy", f": its folder {missing} does not exist"),
                            (source / "x.npy", f": its folder {source} is no folder"),
                            (taken, " is a folder; name a file in it"),
                            (same, " is INPUT; the embeddings would replace the records"),
                            (read_only / "x.npy", f": permission denied (to write {read_only})")):
            assert cli.main(["embed", checkpoint, str(source), str(output)]) == 1
            assert capsys.readouterr().err == f"uform embed: OUTPUT: {output}{why}\n"


def test_sigterm_during_embed_says_so_and_leaves_the_output_as_it_was(tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "tiny.safetensors"
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1), batch=dict(max_columns_per_row=64))) as trainer:
        trainer.save(str(checkpoint))
    source, output = tmp_path / "lines.jsonl", tmp_path / "out.npy"
    source.write_text("".join(json.dumps(dict(text=f"line {i}")) + "\n" for i in range(10)))
    output.write_bytes(b"an earlier run's")
    loaded = cli.load_media

    def terminated_at_the_fifth(group):
        if group.items[0][1] == "line 4":
            os.kill(os.getpid(), signal.SIGTERM)
        return loaded(group)

    monkeypatch.setattr(cli, "load_media", terminated_at_the_fifth)
    assert cli.main(["embed", str(checkpoint), str(source), str(output), "--chunk", "2"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "uform: stopped by SIGTERM\n"
    assert output.read_bytes() == b"an earlier run's"
    assert sorted(os.listdir(tmp_path)) == ["lines.jsonl", "out.npy", "tiny.safetensors"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # as it was before the command

    def full(file, array):
        file.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "load_media", loaded)
    monkeypatch.setattr(np, "save", full)
    assert cli.main(["embed", str(checkpoint), str(source), str(output)]) == 1
    assert capsys.readouterr().err.endswith(f"uform embed: OUTPUT: {output}: No space left on device\n")
    assert output.read_bytes() == b"an earlier run's"  # nor any part of the write left beside it
    assert sorted(os.listdir(tmp_path)) == ["lines.jsonl", "out.npy", "tiny.safetensors"]


def test_embed_names_the_argument_at_fault_before_reading_a_record(tmp_path, capsys):
    checkpoint = tmp_path / "tiny.safetensors"
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1), batch=dict(max_columns_per_row=64))) as trainer:
        trainer.save(str(checkpoint))
    source, cut = tmp_path / "lines.jsonl", tmp_path / "cut.safetensors"
    source.write_text('{"text": "a red panda"}\n')
    data = checkpoint.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for arguments, message in (([source, checkpoint], rf"CHECKPOINT: {source} claims a header of \d+ bytes"),
                               ([tmp_path, source], f"CHECKPOINT: {tmp_path}: Is a directory"),
                               ([cut, source], f"CHECKPOINT: {cut}: tensor .* runs past the end of the data"),
                               ([checkpoint, pipe], f"INPUT: {pipe} is neither a file nor a folder \\(a pipe or a device\\)")):
        assert cli.main(["embed", *map(str, arguments), str(tmp_path / "out.npy"), "--format", "jsonl"]) == 1
        assert re.match(f"uform embed: {message}", capsys.readouterr().err), message
    assert not (tmp_path / "out.npy").exists()


def test_evaluation_columns_may_name_two_of_the_datas_columns_in_a_list(run, tmp_path, capsys):
    listed = run(**{"[evaluation]": '[evaluation]\ncolumns = ["answer", "question"]'})
    config = cli.load_config(listed)
    assert config.evaluation.columns == {"answer": uform.Modality.TEXT, "question": uform.Modality.TEXT}
    assert cli.main(["train", run(steps=4, **{"[evaluation]": '[evaluation]\ncolumns = ["answer", "question"]'})]) == 0
    (evaluation,) = [line["evaluation"] for line in read_log(tmp_path / "runs" / "pairs") if "evaluation" in line]
    assert set(evaluation) == {"answer->question", "question->answer"}
    for columns, message in (('["answer", "passage"]', r"evaluation.columns\[1\]: 'passage' is none of \[data\]'s "
                                                      r"columns \('question', 'answer'\), so its modality is unknown"),
                             ('["answer"]', "evaluation.columns: retrieval needs two columns, a query's and its "
                                            "target's; got 1"),
                             ('["answer", "question", "passage"]', "evaluation.columns: retrieval needs two columns, "
                                                                   "a query's and its target's; got 3"),
                             ('["answer", "answer"]', r"evaluation.columns\[1\]: 'answer' again; retrieval needs two "
                                                      "different columns"),
                             ("[1, 2]", r"evaluation.columns\[0\]: expected a column name, got int"),
                             ('"answer"', "evaluation.columns: expected a list of two of \\[data\\]'s columns or a "
                                          "table of column = modality, got str")):
        with pytest.raises(uform.InvalidArgument, match=message):
            cli.load_config(run(**{"[evaluation]": f"[evaluation]\ncolumns = {columns}"}))


def test_help_lists_every_section_but_the_trainers_field_by_field(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    printed = capsys.readouterr().out
    for section, field in (("data", "shuffle_buffer"), ("evaluation", "max_records"), ("checkpoints", "every_minutes"),
                           ("run", "threads")):
        assert re.search(rf"^\[{section}\].*\n(  .*\n)*  {field} ", printed, re.M), section
    assert re.search(r"^  threads +CPU threads; 0 or absent: every core\.", printed, re.M)  # 0 is the C library's every core


def test_embed_reads_a_tables_column_of_picture_paths_as_pictures(tmp_path, capsys):
    photos = write_photos(tmp_path / "photos", 3)
    table = tmp_path / "pictures.jsonl"
    table.write_text("".join(json.dumps(dict(picture=os.path.join(photos, f"p{i:02d}.png"))) + "\n" for i in range(3)))
    checkpoint = str(tmp_path / "tiny.safetensors")
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", schedule=dict(steps=1),
            batch=dict(max_columns_per_row=64, image=dict(patch_side=8)))) as trainer:
        trainer.save(checkpoint)
    for name, extra in (("guessed", []), ("told", ["--modality", "image"]), ("paths", ["--modality", "text"])):
        assert cli.main(["embed", checkpoint, str(table), str(tmp_path / f"{name}.npy"), *extra]) == 0
    assert "'picture' holds image files" in capsys.readouterr().err
    guessed, told, paths = (np.load(tmp_path / f"{name}.npy") for name in ("guessed", "told", "paths"))
    assert np.array_equal(guessed, told) and not np.allclose(guessed, paths)
    captions = tmp_path / "captions.jsonl"  # text that ends like a file name, and names no file, is text
    captions.write_text(json.dumps(dict(caption="a photo saved as cat.png")) + "\n")
    assert cli.main(["embed", checkpoint, str(captions), str(tmp_path / "captions.npy")]) == 0
    assert "holds image files" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- #
#  A run of several processes                                                                      #
# ---------------------------------------------------------------------------------------------- #

MESH = "\n[mesh]\nhost_domain_count = 2\ntimeout_minutes = 1\n"


def start_process(config, index, tmp_path):
    """`uform train CONFIG --host-domain-index I` as a process of its own, as a launcher starts one per host domain."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    return subprocess.Popen([sys.executable, "-m", "uform.cli", "train", config, "--host-domain-index", str(index)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_processes(children, limit=120):
    ended = []
    for child in children:
        try:
            ended.append((child.returncode if child.wait(timeout=limit) is None else child.returncode,
                          *child.communicate()))
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            raise AssertionError("a process of the mesh hangs")
    return ended


def test_two_processes_train_one_run_share_its_evaluation_and_resume(run, tmp_path):
    config = os.path.abspath(run("meshed", **{"[run]": MESH + "\n[run]"}))
    folder = str(tmp_path / "runs" / "meshed")
    ended = finish_processes([start_process(config, index, tmp_path) for index in (0, 1)])
    assert [code for code, _, _ in ended] == [0, 0], ended
    assert steps_in(folder) == [6, 9]  # host domain 0 alone writes and rotates
    for step, path in cli.checkpoints_in(os.path.join(folder, "checkpoints")):
        written = json.loads(uform.checkpoint_note(path))
        assert written["step"] == step and written["cursor"]["batch"] == 2 * step  # two device batches a step
    log, other = read_log(folder), [json.loads(line) for line in open(os.path.join(folder, "log.host-domain-1.jsonl"))]
    assert log[0]["host_domain"] == 0 and other[0]["host_domain"] == 1 and other[0]["host_domains"] == 2
    losses = [(line["step"], line["loss"]) for line in log if "loss" in line]
    assert losses == [(line["step"], line["loss"]) for line in other if "loss" in line]  # the whole step's, alike
    assert [step for step, _ in losses] == list(range(1, 10))
    evaluations = [line for line in log if "evaluation" in line]
    assert [line["step"] for line in evaluations] == [4, 8, 9]
    assert not [line for line in other if "evaluation" in line]  # host domain 0 scores every share
    assert "step 9: question->answer recall@1" in ended[0][2] and "recall@1" not in ended[1][2]
    # The shared evaluation scores as one process alone scores the same weights.
    last = cli.checkpoints_in(os.path.join(folder, "checkpoints"))[-1][1]
    held_out = cli.read_held_out(cli.load_config(config).evaluation)
    with uform.Executor.for_ram(threads=1) as cpu, \
            uform.Trainer.init_ram(cpu, dict(cli.load_config(config).trainer, resume=last)) as trainer:
        alone, _ = cli.evaluate(trainer, cpu, str(tmp_path), held_out)
    for direction, metrics in alone.items():
        assert evaluations[-1]["evaluation"][direction] == pytest.approx(metrics, abs=1e-6)

    resumed = os.path.abspath(run("meshed", steps=12, **{"[run]": MESH + "\n[run]"}))
    ended = finish_processes([start_process(resumed, index, tmp_path) for index in (0, 1)])
    assert [code for code, _, _ in ended] == [0, 0], ended
    assert steps_in(folder) == [9, 12]


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(run, tmp_path):
    config = os.path.abspath(run("stopped", steps=400, every=1000, **{"[run]": MESH + "\n[run]"}))
    folder = tmp_path / "runs" / "stopped"
    children = [start_process(config, index, tmp_path) for index in (0, 1)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(child.poll() is None for child in children):
        log = folder / "log.host-domain-1.jsonl"
        if log.exists() and log.read_text().count('"loss"') >= 3:
            break
        time.sleep(0.02)
    children[1].send_signal(signal.SIGTERM)
    ended = finish_processes(children)
    assert [code for code, _, _ in ended] == [128 + signal.SIGTERM] * 2, ended
    assert all("stopped by SIGTERM" in errors for _, _, errors in ended)
    (stopped,) = steps_in(str(folder))  # host domain 0 saved where both stopped
    other = [json.loads(line) for line in open(folder / "log.host-domain-1.jsonl")]
    assert 3 <= stopped < 400 and max(line["step"] for line in other if "loss" in line) == stopped


def test_a_mesh_config_is_checked_by_name(run, tmp_path, capsys):
    for mesh, message in (("host_domain_count = 0", "mesh.host_domain_count: 0"),
                          ("hosts = 2", "mesh.hosts: unknown field"),
                          ('host_domain_count = 2\njob = "a/b"', "mesh.job: 'a/b' is not one folder name"),
                          ('host_domain_count = 2\njob = ""', "mesh.job: '' is not one folder name"),
                          ("host_domain_count = 2\ntimeout_minutes = -1", "(0 waits the default 5)"),
                          ("host_domain_count = 2\ntimeout_minutes = 1e12", "mesh.timeout_minutes: 1e+12 minutes; "
                                                                           "at most 1.66667e+07"),
                          ("host_domain_count = 70000", "mesh.host_domain_count: 70000; a run has 1 to 65536"),
                          (f'host_domain_count = 2\ndirectory = "{__file__}"', f"mesh.directory: {__file__} is not "
                                                                                "a folder")):
        extra = "" if "timeout_minutes" in mesh else "\ntimeout_minutes = 0.02"
        assert cli.main(["train", run("checked", **{"[run]": f"[mesh]\n{mesh}{extra}\n\n[run]"})]) == 1
        assert message in capsys.readouterr().err
        assert not (tmp_path / "runs" / "checked").exists()  # a refused config leaves no run folder
    assert cli.main(["train", run("checked", **{"[run]": MESH + "\n[run]"}), "--host-domain-index", "2"]) == 1
    assert "--host-domain-index (or $UFORM_HOST_DOMAIN_INDEX): 2 is not below mesh.host_domain_count = 2" in \
        capsys.readouterr().err


def test_two_processes_pass_over_bad_records_alike_and_drop_bad_held_out_records_from_every_share(tmp_path):
    """Pictures the library cannot decode, in the training data and the held-out split, with the run spread
    over two processes: each passes over its own bad records, and the shared evaluation drops a bad held-out
    record from every process's list, so the next evaluation splits the same records."""
    photos = write_photos(tmp_path / "photos", 24, broken={3, 14})
    write_photos(tmp_path / "held-out-photos", 6, broken={51}, start=50)
    config = photos_config(tmp_path, steps=4, **{"[checkpoints]": "[evaluation]\npaths = [\"held-out-photos\"]\n"
                                                 "every_steps = 2\n\n[checkpoints]"}, evaluation=False)
    with open(config, "a") as file:
        file.write(MESH)
    ended = finish_processes([start_process(config, index, tmp_path) for index in (0, 1)])
    assert [code for code, _, _ in ended] == [0, 0], ended
    folder = tmp_path / "runs" / "photos"
    log, other = read_log(folder), [json.loads(line) for line in open(folder / "log.host-domain-1.jsonl")]
    bad = sorted({line["bad_record"] for line in log + other if "bad_record" in line})  # by their share's process
    assert [re.match(rf"{re.escape(photos)}:p(\d\d): ", b).group(1) for b in bad] == ["03", "14"]
    assert [line["step"] for line in log if "loss" in line] == [1, 2, 3, 4]
    assert [line["step"] for line in log if "evaluation" in line] == [2, 4]
    dropped = [message for line in log if "held_out_bad_records" in line for message in line["held_out_bad_records"]]
    assert len(dropped) == 1 and ":p51: 'jpg;png;webp': not a readable PNG" in dropped[0]  # once, by its share


def test_a_second_run_of_one_folder_is_refused_while_the_first_trains(run, tmp_path, capsys):
    config = run("held", steps=400, every=1000)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    child = subprocess.Popen([sys.executable, "-m", "uform.cli", "train", os.path.abspath(config)], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "runs" / "held" / "log.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None and not (log.exists() and '"loss"' in log.read_text()):
        time.sleep(0.02)
    try:
        assert cli.main(["train", config]) == 1
        assert re.search(rf"run.folder: .*held is in use by another `uform train` \(process {child.pid} on ",
                         capsys.readouterr().err)
    finally:
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM
    (stopped,) = steps_in(str(tmp_path / "runs" / "held"))
    assert cli.main(["train", run("held", steps=stopped + 1, every=1000)]) == 0  # free once the first has ended
    assert steps_in(str(tmp_path / "runs" / "held")) == [stopped, stopped + 1]


def test_a_signal_while_the_processes_meet_ends_the_wait_at_once(run, tmp_path):
    config = os.path.abspath(run("alone", **{"[run]": "[mesh]\nhost_domain_count = 2\ntimeout_minutes = 10\n\n[run]"}))
    child = start_process(config, 0, tmp_path)  # host domain 1 never comes
    meeting = tmp_path / "runs" / "alone" / "mesh" / "train" / "rendezvous"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None and not meeting.exists():
        time.sleep(0.02)
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    ((code, _, errors),) = finish_processes([child], limit=30)
    assert code == 128 + signal.SIGTERM and time.monotonic() - started < 10, errors
    assert "stopped by SIGTERM while the mesh's processes met; nothing saved yet" in errors
    assert re.search(r"host domain 0 of 2 waits up to 10 min for the others to meet in \S+mesh/train", errors), errors


def test_processes_whose_data_or_evaluation_differ_are_refused_naming_the_field(run, tmp_path):
    first = os.path.abspath(run("first", **{"[run]": MESH + '\ndirectory = "meet"\n\n[run]'}))
    second = os.path.abspath(run("second", **{"[run]": MESH + '\ndirectory = "meet"\n\n[run]',
                                              "every_steps = 4": "every_steps = 5"}))
    ended = finish_processes([start_process(first, 0, tmp_path), start_process(second, 1, tmp_path)])
    assert [code for code, _, _ in ended] == [1, 1], ended
    for _, _, errors in ended:
        assert ("evaluation.every_steps: 4 on host domain 0, 5 on host domain 1; every process of a mesh trains one "
                "run from one config") in errors


def test_a_second_host_domain_zero_of_one_run_is_refused_before_it_meets(run, tmp_path):
    config = os.path.abspath(run("twice", **{"[run]": "[mesh]\nhost_domain_count = 2\ntimeout_minutes = 1\n\n[run]"}))
    first = start_process(config, 0, tmp_path)  # waits for host domain 1, holding the run folder
    lock = tmp_path / "runs" / "twice" / ".lock"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (lock.exists() and lock.read_text()):
        time.sleep(0.02)
    ((code, _, errors),) = finish_processes([start_process(config, 0, tmp_path)], limit=30)
    first.send_signal(signal.SIGTERM)
    finish_processes([first], limit=30)
    assert code == 1 and f"in use by another `uform train` (process {first.pid} on " in errors, errors


def test_train_keeps_a_step_in_flight_between_checkpoints_and_evaluations(run, monkeypatch):
    """On a GPU the next step is queued while the device runs this one: the loop begins step k + 1 before it waits
    for step k, except where a checkpoint (every 3), an evaluation (every 4) or the run's end follows step k."""
    order = []
    begun_step = uform.Trainer._begun_step

    class Landing:
        def __init__(self, deferred, number):
            self.deferred, self.number = deferred, number

        def done(self):
            return self.deferred.done()

        def add_done_callback(self, callback):
            self.deferred.add_done_callback(lambda _: callback(self))

        def wait(self):
            order.append(("land", self.number))
            return self.deferred.wait()

    def recording(trainer, batch):
        number = sum(kind == "begin" for kind, _ in order) + 1
        order.append(("begin", number))
        return Landing(begun_step(trainer, batch), number)

    monkeypatch.setattr(uform.Trainer, "_begun_step", recording)
    monkeypatch.setattr(cli, "_steps_overlap", lambda executor: True)  # the GPU's loop, on whichever device
    config = run(steps=12)
    assert cli.main(["train", config]) == 0
    at = {call: i for i, call in enumerate(order)}
    landed_late = {n for kind, n in order if kind == "land" and at.get(("begin", n + 1), len(order)) < at[("land", n)]}
    # Steps 3, 4, 6, 8, 9 and 12 are followed by a save or an evaluation (or end the run): each lands before the next
    # begins; every other step lands once the next is queued.
    assert landed_late == {1, 2, 5, 7, 10, 11}, order
    # Each step's time is its own, whether it landed at once or behind the next: none near zero, none doubled.
    seconds = [line["step_seconds"] for line in read_log(os.path.join(os.path.dirname(config), "runs", "pairs"))
               if "loss" in line]
    middle = sorted(seconds)[len(seconds) // 2]
    assert len(seconds) == 12 and all(middle / 10 < s < middle * 10 for s in seconds[1:]), seconds  # 1: a GPU plans


def test_a_run_of_no_steps_is_refused_by_name(run, tmp_path, capsys):
    assert cli.main(["train", run("none", steps=0)]) == 1
    assert "trainer.schedule.steps: 0; a run takes at least one step" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "none").exists()


def test_mistakes_an_outside_try_made_are_refused_before_any_step(run, tmp_path, capsys):
    """A contrastive term with nothing to attract, an empty run folder, a file where the checkpoints go: each
    refused, named, before a step is spent; [evaluation]'s columns taken from [data] say so."""
    one = {'answer = "text"\n': "", '[evaluation]\npaths = ["held-out.jsonl"]\nevery_steps = 4\n': ""}
    with pytest.raises(uform.InvalidArgument, match=r"^data\.columns: 'question' alone: the joint objective's "
                                                    r"contrastive term .* set trainer\.objective = \"masked\"$"):
        cli.load_config(run("one", **one))
    masked = cli.load_config(run("masked", **one, **{'objective = "joint"': 'objective = "masked"'}))
    assert list(masked.data.columns) == ["question"]
    with pytest.raises(uform.InvalidArgument, match=r"got 1, taken from \[data\]'s as it gives none$"):
        cli.load_config(run("masked", **{'answer = "text"\n': "", 'objective = "joint"': 'objective = "masked"'}))
    with pytest.raises(uform.InvalidArgument, match=r"^run\.folder: empty; leave it out for runs/empty beside"):
        cli.load_config(run("empty", **{"[run]": '[run]\nfolder = ""'}))

    config = run("filed", **{"[run]": '[run]\ndevice = "cpu"'})
    (tmp_path / "runs" / "filed").mkdir(parents=True)
    (tmp_path / "runs" / "filed" / "checkpoints").write_text("")
    assert cli.main(["train", config]) == 1
    folder = tmp_path / "runs" / "filed"
    assert capsys.readouterr().err == (f"uform train: run.folder: {folder}: a file, not a folder, stands at "
                                       f"{folder / 'checkpoints'}; move it, or name another run.folder\n")
    assert not (folder / "log.jsonl").exists()  # no step taken


def test_a_resume_the_run_folder_passes_over_is_said(run, tmp_path, capsys):
    config = run(steps=3)
    assert cli.main(["train", config]) == 0
    older = tmp_path / "runs" / "pairs" / "checkpoints" / "step-000000003.safetensors"
    capsys.readouterr()
    assert cli.main(["train", run(steps=4, **{"seed = 3": f'seed = 3\nresume = "{older}"'})]) == 0
    assert (f"uform: trainer.resume {older} is passed over: {tmp_path / 'runs' / 'pairs'} holds checkpoints, and a run "
            f"resumes from its newest, {older}") not in capsys.readouterr().err  # the newest itself: nothing to say
    newest = tmp_path / "runs" / "pairs" / "checkpoints" / "step-000000004.safetensors"
    assert cli.main(["train", run(steps=5, **{"seed = 3": f'seed = 3\nresume = "{older}"'})]) == 0
    assert (f"uform: trainer.resume {older} is passed over: {tmp_path / 'runs' / 'pairs'} holds checkpoints, and a run "
            f"resumes from its newest, {newest}; to resume from it, move the checkpoints after it out of "
            f"{newest.parent}\n") in capsys.readouterr().err


def test_a_plain_resume_and_held_out_bad_records_are_said(run, tmp_path, capsys):
    held_out = tmp_path / "held-out.jsonl"
    lines = held_out.read_text().splitlines(keepends=True)
    held_out.write_text(lines[0] + '{"question": "q", "answer": ""}\n' + "".join(lines[1:]))  # left out of evaluations
    config = run(steps=4)
    assert cli.main(["train", config]) == 0
    err = capsys.readouterr().err
    assert (f"uform: evaluation.paths: 1 bad record left out of the evaluation, the first: {held_out}:line 2: "
            "'answer' is empty (all in log.jsonl)\n") in err
    assert "resuming" not in err
    saved_in = tmp_path / "runs" / "pairs" / "checkpoints"
    os.remove(saved_in / "step-000000004.safetensors")  # as if the run had stopped after step 3
    assert cli.main(["train", config]) == 0
    assert f"uform: resuming {saved_in / 'step-000000003.safetensors'}\n" in capsys.readouterr().err
    os.remove(saved_in / "step-000000004.safetensors")
    assert cli.main(["train", run(steps=5)]) == 0
    assert (f"uform: resuming {saved_in / 'step-000000003.safetensors'} with trainer.schedule.steps = 5 (was 4)\n"
            in capsys.readouterr().err)


def test_bad_records_met_each_epoch_are_counted_once_as_distinct(run, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "answer": ""}\n' + data.read_text() + '{"question": "", "answer": "a"}\n')
    assert cli.main(["train", run(steps=20)]) == 0  # 160 rows of 60 records: the two bad ones met in three epochs
    out = capsys.readouterr().out
    skipped = re.search(r"; (\d+) bad records skipped by this command \(2 distinct, met again in later epochs\)\n$", out)
    assert skipped and int(skipped.group(1)) > 2, out


def test_a_finished_run_still_checks_its_data_columns(run, tmp_path, capsys):
    assert cli.main(["train", run(steps=3)]) == 0
    capsys.readouterr()
    assert cli.main(["train", run(steps=3, **{'answer = "text"': 'answer = "text"\nzz = "text"'})]) == 1
    assert "data.columns.zz: " in capsys.readouterr().err
    assert cli.main(["train", run(steps=3)]) == 0
    assert "already took its 3 steps" in capsys.readouterr().out


def test_a_shard_edited_in_place_is_said_when_the_run_resumes(run, tmp_path, capsys):
    config = run(steps=3)
    assert cli.main(["train", config]) == 0
    with open(tmp_path / "train.jsonl", "a") as data:
        data.write('{"question": "a new one", "answer": "added"}\n')
    capsys.readouterr()
    assert cli.main(["train", run(steps=4)]) == 0
    assert "uform: data.paths: a shard's size changed since step 3 was saved" in capsys.readouterr().err


def test_a_config_that_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    config = tmp_path / "utf16.toml"
    config.write_bytes(b"\xff\xfe[trainer]\n")
    assert cli.main(["train", str(config)]) == 1
    assert f"CONFIG: {config}: not TOML: byte 0 is not UTF-8 text\n" in capsys.readouterr().err


def test_a_weights_only_resume_is_refused_as_such_whatever_the_steps(run, tmp_path, capsys):
    """Said before comparing steps: raising schedule.steps past the checkpoint's would not make it resumable."""
    assert cli.main(["train", run(steps=3)]) == 0
    weights = tmp_path / "weights.safetensors"
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, dict(
            depth=1, hidden=128, objective="joint", seed=3, schedule=dict(steps=3),
            batch=dict(max_rows_per_device=8, max_columns_per_row=64),
            resume=str(tmp_path / "runs" / "pairs" / "checkpoints" / "step-000000003.safetensors"))) as trainer:
        trainer.save(str(weights), weights_only=True)  # at step 3
    for steps in (1, 9):
        capsys.readouterr()
        assert cli.main(["train", run("other", steps=steps, **{"seed = 3": f'seed = 3\nresume = "{weights}"'})]) == 1
        assert (f"uform train: trainer.resume: {weights} is a weights-only checkpoint: it holds no optimizer moments, "
                "so no run resumes from it") in capsys.readouterr().err


def test_options_are_not_taken_by_an_abbreviation(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["embed", "a.safetensors", "in.jsonl", "out.npy", "--colum", "doc"])
    printed = capsys.readouterr().err
    assert ended.value.code == 2 and "uform embed: error: unrecognized arguments: --colum doc" in printed
    assert printed.startswith("usage: uform embed ")  # the command's usage, not the top level's


def test_a_mesh_that_never_meets_names_the_field_that_sets_the_wait(run, capsys):
    config = run("alone", **{"[run]": "[mesh]\nhost_domain_count = 2\ntimeout_minutes = 0.02\n\n[run]"})
    assert cli.main(["train", config]) == 1
    assert re.search(r"uform train: mesh.timeout_minutes: host domain 1 of 2 never joined within 1.2 s under \S+mesh/train; "
                     r"start every process", capsys.readouterr().err)


def test_a_peer_silent_past_the_timeout_names_the_field_that_sets_it(monkeypatch, capsys):
    def silent(*_):
        raise PeerError("mesh: host domain 1 did not answer within the mesh's timeout while summing gradients")
    monkeypatch.setattr(cli, "train", silent)
    assert cli.main(["train", "run.toml", "--host-domain-index", "0"]) == 1
    assert ("while summing gradients; mesh.timeout_minutes sets how long a process waits; start every process of the "
            "run again (`uform train run.toml --host-domain-index I`)") in capsys.readouterr().err
