"""The `uform` command end to end on a tiny config: train, evaluate, rotate checkpoints, resume, embed,
info; SIGTERM mid-run leaves a checkpoint that resumes to the same weights as a run never stopped;
logs as JSON lines and TensorBoard events, read back here.
"""

import glob
import json
import os
import re
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


def test_train_evaluates_rotates_checkpoints_logs_and_resumes(run, capsys):
    config = run()
    folder = os.path.join(os.path.dirname(config), "runs", "pairs")
    assert cli.main(["train", config]) == 0
    assert steps_in(folder) == [6, 9]  # every 3 steps, the newest 2 kept
    assert sorted(os.listdir(os.path.join(folder, "checkpoints"))) == [
        f"step-00000000{s}.{kind}" for s in (6, 9) for kind in ("cursor.json", "safetensors")]
    log = read_log(folder)
    trained = [line for line in log if "loss" in line]
    assert [line["step"] for line in trained] == list(range(1, 10))
    assert all(line["data_seconds"] >= 0 and line["step_seconds"] > 0 for line in trained)
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

    config = run(steps=12)
    assert cli.main(["train", config]) == 0
    assert steps_in(folder) == [9, 12]
    started = [line for line in read_log(folder) if "started" in line]
    assert started[0]["resumed"] is None and started[1]["resumed"].endswith("step-000000009.safetensors")
    assert cli.main(["train", config]) == 0
    assert "already took its 12 steps" in capsys.readouterr().out


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
    assert described["tensors"]["text.embedding"]["shape"] == [260, 128]
    weights = safetensors.numpy.load_file(checkpoint)
    assert described["geometry"]["parameters"] == sum(t.size for name, t in weights.items() if not name.startswith("adamw."))


def test_embed_writes_npy_and_parquet_in_input_order(run, tmp_path, capsys):
    config = run(steps=2)
    assert cli.main(["train", config]) == 0
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "pairs" / "checkpoints" / "*.safetensors"))
    source = str(tmp_path / "held-out.jsonl")
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.npy")]) == 1
    assert "--column: " in capsys.readouterr().err
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.npy"), "--column", "answer", "--chunk", "5"]) == 0
    vectors = np.load(tmp_path / "out.npy")
    answers = [json.loads(line)["answer"] for line in open(source)]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Encoder.load(checkpoint, cpu) as encoder:
        expected = np.array(encoder.embed(["text"] * len(answers), answers))
    assert vectors.shape == (12, 128) and vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, expected)
    pyarrow = pytest.importorskip("pyarrow.parquet")
    assert cli.main(["embed", checkpoint, source, str(tmp_path / "out.parquet"), "--column", "answer", "--scalar", "f16"]) == 0
    table = pyarrow.read_table(tmp_path / "out.parquet")
    assert table.column("location").to_pylist() == [f"{source}:{i}" for i in range(12)]
    halves = np.array(table.column("embedding").to_pylist(), np.float16)
    np.testing.assert_allclose(halves, expected, atol=1e-3)


def test_a_config_error_names_its_field_before_any_step(run, capsys):
    for replace, message in (({'answer = "text"': 'answr = "text"'}, "data.columns.answr: .*has no column 'answr'"),
                             ({"keep = 2": "keep = 2\nkept = 3"}, "checkpoints.kept: unknown field"),
                             ({"depth = 1": "depth = 1\ndeep = 2"}, "trainer.deep: unknown field"),
                             ({"[run]": "[runs]"}, "runs: unknown section"),
                             ({"hidden = 128": "hidden = 100"}, "trainer.hidden: 100 is not a multiple of 128")):
        assert cli.main(["train", run(**replace)]) == 1
        assert re.search(message, capsys.readouterr().err), message
    assert not glob.glob(os.path.join(os.path.dirname(run()), "runs", "*", "checkpoints"))


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


def test_the_tutorials_config_is_one_uform_train_reads(tmp_path):
    tutorial = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tutorial.md")
    if not os.path.isfile(tutorial):
        pytest.skip("an installed package without the checkout's docs")
    blocks = re.findall(r"```toml\n(.*?)```", open(tutorial).read(), re.S)
    (full,) = [block for block in blocks if "[trainer]" in block]
    for name in ("train.jsonl", "held-out.jsonl"):
        (tmp_path / name).write_text('{"signature": "f(x)", "doc": "Return x."}\n')
    (tmp_path / "pairs.toml").write_text(full)
    config = cli.load_config(str(tmp_path / "pairs.toml"))
    assert config.trainer["schedule"]["steps"] == 1200 and config.checkpoints.keep == 3
    assert config.run.folder == str(tmp_path / "runs" / "pairs") and config.evaluation.max_records == 400
