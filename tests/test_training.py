"""End to end on a small real task: signature/docstring pairs of the standard library. The loss goes
down, retrieval of the pairs trained on improves, and the main job's pieces work together."""
import os
import subprocess
import sys

import numpy as np

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


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo.safetensors"
    assert demo.main(["--steps", "3", "--held-out", "32", "--depth", "1", "--hidden", "128", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "recall@1 on 32 held-out pairs before training" in printed.out
    assert "after 3 steps" in printed.out and "3/3" in printed.err
    assert "\r" not in printed.err  # not a terminal: whole lines, no redrawn bar
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
