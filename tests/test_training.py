"""End to end on small real tasks: signature/docstring pairs of the standard library, and pictures the
main job draws with their captions. The loss goes down, retrieval improves, and the main job's pieces
work together."""
import os
import subprocess
import sys

import numpy as np
import pytest

import uform
from uform import demo


def test_loss_goes_down_and_retrieval_improves(tmp_path):
    pairs = demo.split(demo.stdlib_pairs(), held_out=0, seed=0)[0][:64]
    assert len(pairs) == 64
    config = uform.TrainerConfig(
        depth=1, hidden=128, objective=uform.Objective.JOINT, seed=1,
        batch=uform.BatchShape(max_rows_per_device=64, max_columns_per_row=96, max_segments_per_device=64),
        schedule=uform.Schedule(learning_rate=3e-3, steps=60, warmup_steps=3),
    )
    path = str(tmp_path / "small.safetensors")
    with uform.Executor.for_ram(threads=2) as executor, uform.Trainer.init_ram(executor, config) as trainer:
        trainer.save(path)
        with uform.Encoder.load(path, executor) as encoder:
            before = demo.recall_at_1(encoder, pairs)
        losses = []
        rng = np.random.default_rng(0)
        for _ in range(60):
            chosen = [pairs[i] for i in rng.choice(len(pairs), 32, replace=False)]
            stats = trainer.step(demo.pair_batch(chosen)).stats
            assert not stats.skipped
            losses.append(stats.loss)
        trainer.save(path)
        with uform.Encoder.load(path, executor) as encoder:
            after = demo.recall_at_1(encoder, pairs)
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    assert after >= before + 0.2, (before, after)


@pytest.mark.parametrize("options, said", [
    (["--held-out", "5000"], "uform-demo: --held-out 5000 leaves 0 of the "),
    (["--pairs-per-step", "5000"], "fewer than --pairs-per-step 5000"),
    (["--held-out", "1"], "uform-demo: error: --held-out: 1 is below 2"),
    (["--out", "/nonexistent-uform/demo.safetensors"], "uform-demo: error: --out: its folder /nonexistent-uform does not"),
    (["--pairs-per-step", "0"], "--pairs-per-step: 0 is below 1"),
    (["--hidden", "100"], "uform-demo: error: --hidden: 100 is not a multiple of 128"),
    (["--task", "images", "--held-out", "100000"], "uform-demo: --held-out: 100000 scenes asked"),
])
def test_demo_refuses_what_it_cannot_do_in_one_line_before_training(tmp_path, capsys, options, said):
    with pytest.raises(SystemExit) as ended:
        demo.main(["--steps", "2", "--depth", "1", "--out", str(tmp_path / "demo.safetensors")] + options)
    assert ended.value.code == 2
    printed = capsys.readouterr()
    assert said in printed.err and "Traceback" not in printed.err, printed.err
    assert not (tmp_path / "demo.safetensors").exists()
    if "error:" in said:  # an option refused as such: before any data is built
        assert printed.out == "", printed.out


def test_the_demos_pairs_hold_nothing_of_the_environment(monkeypatch):
    """A default of `os.environ` (`cgi.parse(environ=...)`) would put the whole environment in a signature: a run's
    data would then change with any variable, and carry its secrets into training."""
    monkeypatch.setenv("UFORM_TEST_MARKER", "a value no signature holds")
    pairs = demo.stdlib_pairs()
    assert len(pairs) > 1000 and not any("a value no signature holds" in text for pair in pairs for text in pair)
    assert not any(sys.executable in text for pair in pairs for text in pair)  # nor the interpreter's path


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo.safetensors"
    assert demo.main(["--steps", "3", "--held-out", "32", "--depth", "1", "--hidden", "128", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "recall@1 on 32 held-out pairs before training" in printed.out
    assert "after 3 steps" in printed.out and "3/3" in printed.err
    assert "\r" not in printed.err  # not a terminal: whole lines, no redrawn bar
    assert out.exists()


def test_held_out_pictures_find_their_captions_after_a_short_run(tmp_path):
    """Thirty-two two-shape scenes never drawn for training: 200 steps lift recall@1 both ways far above
    chance (1/32), so the captions' words are read in order, not matched by colour alone."""
    held_out_keys, held_out = demo.held_out_scenes(32, seed=0)
    stream = demo.training_scenes(held_out_keys, seed=1)
    config = uform.TrainerConfig(
        depth=2, hidden=128, objective=uform.Objective.CONTRASTIVE, seed=1,
        batch=uform.BatchShape(max_rows_per_device=32, max_columns_per_row=64, max_segments_per_device=32,
                               image=uform.ImageShape(patch_side=8)),
        schedule=uform.Schedule(learning_rate=3e-3, steps=200, warmup_steps=10),
    )
    path = str(tmp_path / "pictures.safetensors")
    with uform.Executor.for_ram(threads=2) as executor, uform.Trainer.init_ram(executor, config) as trainer:
        trainer.save(path, weights_only=True)
        with uform.Encoder.load(path, executor) as encoder:
            before = demo.image_recall_at_1(encoder, held_out)
        for _ in range(200):
            assert not trainer.step(demo.image_pair_batch([next(stream) for _ in range(16)])).stats.skipped
        trainer.save(path, weights_only=True)
        with uform.Encoder.load(path, executor) as encoder:
            after = demo.image_recall_at_1(encoder, held_out)
    assert max(before) < 0.15 and min(after) >= 0.25, (before, after)


def test_the_pictures_held_out_are_never_drawn_for_training():
    held_out_keys, held_out = demo.held_out_scenes(64, seed=0)
    assert len(held_out_keys) == len(held_out) == 64 and len({caption for caption, _ in held_out}) == 64
    named = {(layout, things): ["a " + " ".join(thing) for thing in things] for layout, things in held_out_keys}
    forbidden = {f"{first} {word} {second}" for (layout, _), (a, b) in named.items()
                 for word, first, second in zip(demo.LAYOUTS[layout], (a, b), (b, a))}
    stream = demo.training_scenes(held_out_keys, seed=5)
    trained = [next(stream) for _ in range(2000)]  # about 20 would name a held-out scene, were they not skipped
    assert not forbidden & {caption for caption, _ in trained}
    words = (" left of ", " right of ", " above ", " below ")
    assert all(any(word in caption for caption, _ in trained) for word in words)  # both word orders, both layouts
    assert max(len(caption.encode()) for caption, _ in trained) <= 64  # one row of the job's batch
    assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for _, image in trained)


def test_demo_images_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo-images.safetensors"
    assert demo.main(["--task", "images", "--steps", "3", "--held-out", "16", "--pairs-per-step", "8",
                      "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "recall@1 on 16 held-out pairs before training: image -> text" in printed.out
    assert "recall@1 on 16 held-out pairs after 3 steps" in printed.out and "3/3" in printed.err
    assert out.exists()


RUN = """
import hashlib, uform
items = [b"alpha beta gamma", b"delta epsilon", b"zeta eta theta iota", b"kappa lambda mu"] * 4
config = dict(depth=2, hidden=128, objective="joint", seed=9,
              batch=dict(max_rows_per_device=8, max_columns_per_row=64), schedule=dict(steps=10))
with uform.Executor.for_ram(threads=2) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
    for _ in range(4):
        stats = trainer.step(dict(modalities=["text"] * 16, contents=items,
                                  relations=dict(attract=dict(offsets=list(range(17)), ids=[i ^ 1 for i in range(16)])))).stats
    print(stats.loss, hashlib.sha256(trainer._weights().tobytes()).hexdigest())
"""


def test_the_same_seed_and_batches_reproduce_the_same_run_in_another_process(tmp_path):
    # the child imports the same uform this process tests, installed or built in place
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    runs = [subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, cwd=tmp_path, env=env)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.split()) == 2


def test_the_main_jobs_pairs_are_the_same_in_every_process():
    pairs = demo.stdlib_pairs()
    assert len(pairs) > 1000
    assert not [signature for signature, _ in pairs if " at 0x" in signature]
