"""Hardening: handles misused from C and Python, saves interrupted by SIGKILL or refused by the
filesystem, and poisoned steps that must leave the weights and moments as they were."""
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

import uform

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER_DIR = os.path.join(HERE, "..", "libuform", "include")
TEXT = uform.Modality.TEXT


def tiny_config(**extra):
    made = dict(depth=1, hidden=128, objective=uform.Objective.JOINT, seed=3, schedule=dict(steps=1000),
                batch=dict(max_rows_per_device=4, max_columns_per_row=32))
    made.update(extra)
    return made


def pair_batch():
    return dict(modalities=[TEXT] * 4,
                contents=["a small red panda", "red pandas eat bamboo", "the sun is a star", "stars shine at night"],
                relations=dict(attract=uform.Edges(offsets=[0, 1, 2, 3, 4], ids=[1, 0, 3, 2])))


# ---------------------------------------------------------------------------------------------- #
#  Handles misused                                                                                 #
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_program_misusing_handles_is_refused_every_time(tmp_path):
    library_dir = os.path.dirname(uform.__file__)
    program = str(tmp_path / "misuse")
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-pedantic", "-pthread", os.path.join(HERE, "c", "misuse.c"),
                    "-I", HEADER_DIR, "-L", library_dir, "-luform", f"-Wl,-rpath,{library_dir}", "-o", program],
                   check=True)
    result = subprocess.run([program, str(tmp_path / "misuse.safetensors")], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every misuse was refused" in result.stdout


def test_blocking_and_deferred_steps_from_many_threads_are_each_applied_once():
    threads, rounds = 4, 6
    seen, errors = [], []
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, tiny_config()) as trainer:
        start = threading.Barrier(threads)

        def hammer():
            try:
                start.wait()
                pending = []
                for _ in range(rounds):  # a deferred step, then a blocking one behind it
                    pending.append(trainer.deferred().step(pair_batch()))
                    seen.append(trainer.step(pair_batch()).stats.step)
                seen.extend(answer.wait(timeout=120).stats.step for answer in pending)
            except BaseException as error:  # noqa: B036 - the thread's error fails the test below
                errors.append(error)

        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert not errors, errors
        total = threads * rounds * 2
        assert sorted(seen) == list(range(1, total + 1))  # every step once: none lost, none applied twice
        assert trainer.step(pair_batch()).stats.step == total + 1


def test_python_misuse_raises_and_never_crashes(tmp_path):
    cpu = uform.Executor.for_ram(threads=1)
    trainer = uform.Trainer.init_ram(cpu, tiny_config())
    trainer.step(pair_batch())
    with pytest.raises(uform.Busy, match="^executor: borrowed by a live trainer"):
        cpu.free()
    with pytest.raises(uform.Busy, match="^executor:"):
        cpu._native.free()  # the library refuses on its own too
    assert trainer.step(pair_batch()).stats.step == 2  # the refused free changed nothing

    native = trainer._native
    trainer.free()
    trainer.free()  # twice is harmless
    with pytest.raises(uform.InvalidHandle, match=r"^trainer: used after free\(\)$"):
        trainer.step(pair_batch())
    with pytest.raises(uform.InvalidHandle, match="^trainer:"):
        trainer.deferred().step(pair_batch()).wait(timeout=60)
    with pytest.raises(uform.InvalidHandle, match="^trainer:"):
        trainer.save(tmp_path / "never.safetensors")
    with pytest.raises(uform.InvalidHandle, match="^trainer:"):
        native.step(uform._native.StepInputs(uform.batch.normalize_batch(pair_batch())), None, 0)
    native.free()  # the native handle's own double free is harmless too
    assert not list(tmp_path.iterdir())

    # A new trainer may take over the freed one's memory; the old handle still reaches nothing.
    again = uform.Trainer.init_ram(cpu, tiny_config())
    with pytest.raises(uform.InvalidHandle):
        native.step(uform._native.StepInputs(uform.batch.normalize_batch(pair_batch())), None, 0)
    assert again.step(pair_batch()).stats.step == 1
    again.free()
    cpu.free()
    cpu.free()
    with pytest.raises(uform.InvalidHandle, match="^executor:"):
        uform.Trainer.init_ram(cpu, tiny_config())


def test_free_racing_steps_from_other_threads_never_crashes():
    """Frees racing blocking steps on other threads: each step lands whole or raises InvalidHandle."""
    with uform.Executor.for_ram(threads=1) as cpu:
        for _ in range(3):
            trainer = uform.Trainer.init_ram(cpu, tiny_config())
            outcomes, errors = [], []
            stepping = threading.Event()

            def step_until_freed():
                try:
                    while True:
                        outcomes.append(trainer.step(pair_batch()).stats.step)
                        stepping.set()
                except uform.InvalidHandle as error:
                    outcomes.append(error)
                except BaseException as error:  # noqa: B036
                    errors.append(error)

            workers = [threading.Thread(target=step_until_freed) for _ in range(3)]
            for worker in workers:
                worker.start()
            assert stepping.wait(timeout=60)
            trainer.free()
            for worker in workers:
                worker.join(timeout=60)
            assert not errors, errors
            steps = sorted(o for o in outcomes if isinstance(o, int))
            assert steps == list(range(1, len(steps) + 1))
            assert sum(isinstance(o, uform.InvalidHandle) for o in outcomes) == 3
