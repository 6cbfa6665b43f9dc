"""End to end on a small real task: signature/docstring pairs of the standard library. The loss goes
down, retrieval of the pairs trained on improves, and the main job's pieces work together."""
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
    assert out.exists()
