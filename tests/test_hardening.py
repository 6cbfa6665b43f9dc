"""Hardening: handles misused from C and Python, saves interrupted by SIGKILL or refused by the
filesystem, and poisoned steps that must leave the weights and moments as they were."""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import safetensors
import safetensors.numpy

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
    from uform.__main__ import PACKAGE, openblas_flags

    program = str(tmp_path / "misuse")
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-pedantic", "-pthread", os.path.join(HERE, "c", "misuse.c"),
                    "-I", HEADER_DIR, "-L", PACKAGE, "-luform", f"-Wl,-rpath,{PACKAGE}", *openblas_flags(), "-o",
                    program], check=True)
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


# ---------------------------------------------------------------------------------------------- #
#  Saves interrupted, refused, or racing                                                           #
# ---------------------------------------------------------------------------------------------- #

# 20 MB checkpoints: long enough to write (some 25 ms) that most kills land inside a save.
SAVING_CONFIG = dict(depth=2, hidden=256, objective="contrastive", seed=11, schedule=dict(steps=100_000),
                     batch=dict(max_rows_per_device=2, max_columns_per_row=16))

SAVING_BATCH = dict(modalities=[TEXT] * 2, contents=["red panda", "bamboo"],
                    relations=dict(attract=dict(offsets=[0, 1, 2], ids=[1, 0])))
SAVING_CHILD = """
import sys
import uform
with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, %r) as trainer:
    while True:
        step = trainer.step(%r).stats.step
        print("saving", step, flush=True)
        trainer.save(sys.argv[1])
        print("saved", step, flush=True)
""" % (SAVING_CONFIG, dict(SAVING_BATCH, modalities=["text"] * 2))


def child_environment():
    """The environment a child Python needs to import the uform under test, from any folder."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(uform.__file__)))
    return dict(os.environ, PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def digest(path):
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


class ReferenceRun:
    """The children's run replayed here, one thread and the same seed, so bitwise the same: the digest of
    its checkpoint after each step is what a whole checkpoint of that step must be."""

    def __init__(self, executor, folder):
        self.trainer = uform.Trainer.init_ram(executor, SAVING_CONFIG)
        self.folder, self.digests = folder, {0: None}
        folder.mkdir()

    def digest(self, step):
        while max(self.digests) < step:
            assert self.trainer.step(SAVING_BATCH).stats.step == max(self.digests) + 1
            self.trainer.save(self.folder / "reference.safetensors")
            self.digests[max(self.digests) + 1] = digest(self.folder / "reference.safetensors")
        return self.digests[step]

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.trainer.free()


def metadata_step(path):
    with safetensors.safe_open(str(path), "np") as file:
        return int(file.metadata()["step"])


def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path):
    """SIGKILL a process saving over one path, 30 times at varied moments: the path always holds a whole
    checkpoint, the last saved or the one being saved; leftovers are hidden, never loadable as the
    checkpoint, and swept by the next save once their process is gone."""
    kills, rng = 30, random.Random(20261202)
    path = tmp_path / "run.safetensors"
    save_seconds, inside_a_save, caught_writing = None, 0, 0
    with uform.Executor.for_ram(threads=1) as cpu, \
            ReferenceRun(cpu, tmp_path.parent / f"{tmp_path.name}-reference") as reference:
        for kill in range(kills):
            child = subprocess.Popen([sys.executable, "-c", SAVING_CHILD, str(path)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=child_environment())
            heard = []

            def hear(word):
                line = child.stdout.readline()
                assert line.split()[:1] == [word], line + child.stderr.read()
                heard.append(line)

            try:
                # This child's first save (its checkpoint A) has landed, and has swept the last child's leftover.
                hear("saving"), hear("saved")
                assert not leftovers(tmp_path)
                if save_seconds is None:  # the first child measures how long a save takes here
                    durations = []
                    for _ in range(3):
                        hear("saving")
                        started = time.perf_counter()
                        hear("saved")
                        durations.append(time.perf_counter() - started)
                    save_seconds = sorted(durations)[1]
                # Kill anywhere from the start of the next save to a little past its end: while it writes,
                # flushes or renames, or just after, while it steps.
                hear("saving")
                time.sleep(rng.uniform(0, 1.5 * save_seconds))
            finally:
                child.kill()
                child.wait()
            assert child.returncode == -signal.SIGKILL  # killed by us, not crashed (nor stopped by a sanitizer)
            heard += [line for line in child.stdout.read().splitlines(keepends=True) if line.endswith("\n")]
            saving = [int(w[1]) for w in map(str.split, heard) if w[0] == "saving"]
            saved = [int(w[1]) for w in map(str.split, heard) if w[0] == "saved"]

            step = metadata_step(path)
            assert step in (max(saved), max(saved) + 1)  # the old checkpoint or the new one,
            assert digest(path) == reference.digest(step)  # whole, to the last byte
            assert safetensors.numpy.load_file(str(path)).keys()  # every tensor in place, per safetensors too
            with uform.Encoder.load(path, cpu) as encoder:
                assert np.isfinite(encoder.embed([TEXT], ["red panda"]).numpy()).all()

            left = leftovers(tmp_path)
            inside_a_save += max(saving) > max(saved)
            caught_writing += bool(left)
            assert [p.name for p in tmp_path.glob("*.safetensors")] == [path.name]  # hidden from globs
            for name in left:  # only the killed child's own, named so no reader takes it for a checkpoint
                assert name.startswith(f".{path.name}.{child.pid}.") and name.endswith(".partial")
                leftover = tmp_path / name
                if leftover.stat().st_size < path.stat().st_size:
                    with pytest.raises(uform.InvalidCheckpoint):
                        uform.Encoder.load(leftover, cpu)

        # A save from a live process sweeps the last leftover; nothing else was ever left behind.
        reference.trainer.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert inside_a_save >= kills // 3 and caught_writing >= kills // 4, (inside_a_save, caught_writing)
    print(f"{kills} kills: {inside_a_save} inside a save, {caught_writing} with its temporary file on disk; "
          f"a save took {save_seconds * 1000:.0f} ms")


def test_the_next_save_sweeps_only_leftovers_of_processes_that_are_gone(tmp_path):
    path = tmp_path / "run.safetensors"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    names = dict(
        dead=f".run.safetensors.{dead}.0.partial",
        dead_older_form=f".run.safetensors.{dead}.partial",
        dead_but_locked=f".run.safetensors.{dead}.7.partial",
        alive=f".run.safetensors.{os.getppid()}.0.partial",
        this_process=f".run.safetensors.{os.getpid()}.999.partial",  # another thread's save in flight
        another_name=f".other.safetensors.{dead}.0.partial",
        not_ours=f".run.safetensors.{dead}.0.partial.keep",
    )
    for name in names.values():
        (tmp_path / name).write_bytes(b"half a checkpoint")
    # A writer in another PID namespace would hold the lock every writer takes; a child stands in for it.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'r+'); fcntl.lockf(f, fcntl.LOCK_EX); print('locked', flush=True)\n"
                               "time.sleep(60)", str(tmp_path / names["dead_but_locked"])],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, tiny_config()) as trainer:
            trainer.save(path)
    finally:
        holder.kill()
        holder.wait()
    kept = {name for name in names.values() if (tmp_path / name).exists()}
    assert kept == set(names.values()) - {names["dead"], names["dead_older_form"]}


def test_saves_racing_onto_one_path_replace_it_whole_every_time(tmp_path):
    """Two trainers on two executors save over one path from two threads while a third reads it."""
    path = str(tmp_path / "shared.safetensors")
    with uform.Executor.for_ram(threads=1) as one, uform.Executor.for_ram(threads=1) as two, \
            uform.Trainer.init_ram(one, tiny_config(seed=1)) as first, \
            uform.Trainer.init_ram(two, tiny_config(seed=2, depth=2)) as second:
        wholes = []
        for trainer, name in ((first, "first"), (second, "second")):
            trainer.save(tmp_path / f"{name}.reference")
            wholes.append((tmp_path / f"{name}.reference").read_bytes())
        saving, errors, reads = threading.Event(), [], []

        def save_many(trainer):
            try:
                for _ in range(20):
                    trainer.save(path)
            except BaseException as error:  # noqa: B036
                errors.append(error)

        def read_while_saving():
            while saving.is_set():
                if os.path.exists(path):
                    with open(path, "rb") as file:
                        reads.append(file.read() in wholes)

        saving.set()
        workers = [threading.Thread(target=save_many, args=(t,)) for t in (first, second)]
        reader = threading.Thread(target=read_while_saving)
        for worker in workers + [reader]:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        saving.clear()
        reader.join(timeout=60)
        assert not errors, errors
        assert reads and all(reads)
        with open(path, "rb") as file:
            assert file.read() in wholes
    assert leftovers(tmp_path) == []


REFUSED_CHILD = """
import hashlib, json, os, resource, signal, sys
import uform
path, limit, first = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "first"
folder = os.path.dirname(path)
def digest():
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()
report = {}
with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, %r) as trainer:
    trainer.step(dict(modalities=["text"] * 2, contents=["red panda", "bamboo"]))
    if first:  # checkpoint A, while there is room for it
        trainer.save(path)
        trainer.step(dict(modalities=["text"] * 2, contents=["red panda", "bamboo"]))
    report["before"] = digest()
    if limit:  # a write past the limit fails with EFBIG rather than killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        trainer.save(path)
        report["error"] = None
    except uform.StorageError as error:
        report["error"] = str(error)
    report["after"] = digest()
    report["listing"] = sorted(os.listdir(folder))
print(json.dumps(report))
""" % (tiny_config(objective="joint"),)


def run_refused_save(path, limit=0, first=False, wrapper=()):
    result = subprocess.run(list(wrapper) + [sys.executable, "-c", REFUSED_CHILD, str(path), str(limit),
                                             "first" if first else "old"],
                            capture_output=True, text=True, timeout=120, cwd=os.path.dirname(path),
                            env=child_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def save_old_checkpoint(path):
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, tiny_config(seed=99)) as trainer:
        trainer.save(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused_whole(report, path, reason, old):
    assert report["error"] is not None, "the save should have failed"
    assert str(path) in report["error"] and reason in report["error"], report["error"]
    assert report["before"] == report["after"] == old  # the old checkpoint, byte for byte
    assert report["listing"] == [path.name]  # no temporary file left behind


def test_a_save_past_the_file_size_limit_fails_and_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "run.safetensors"
    old = save_old_checkpoint(path)
    report = run_refused_save(path, limit=1 << 20)
    assert_refused_whole(report, path, "File too large", old)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == old


def test_a_save_onto_a_full_filesystem_fails_and_keeps_the_old_checkpoint(tmp_path):
    """A tmpfs with room for one checkpoint, not two, mounted in a mount namespace of the child's own."""
    folder = tmp_path / "small"
    folder.mkdir()
    save_old_checkpoint(tmp_path / "probe.safetensors")  # the child's checkpoints are as large
    size = (tmp_path / "probe.safetensors").stat().st_size
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to mount a small filesystem")
    mounted = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size * 3 // 2} tmpfs {folder}"],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    path = folder / "run.safetensors"
    mount = f"mount -t tmpfs -o size={size * 3 // 2} tmpfs {folder} && exec \"$@\""
    report = run_refused_save(path, first=True, wrapper=("unshare", "-m", "sh", "-c", mount, "sh"))
    assert report["error"] is not None and str(path) in report["error"]
    assert "No space left on device" in report["error"], report["error"]
    assert report["before"] == report["after"] and report["listing"] == [path.name]


def test_a_save_onto_a_read_only_folder_fails_and_keeps_the_old_checkpoint(tmp_path):
    """A read-only bind mount: root's permission to write anything does not reach past it."""
    path = tmp_path / "run.safetensors"
    old = save_old_checkpoint(path)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a read-only bind mount")
    bind = f"mount --bind {tmp_path} {tmp_path} && mount -o remount,ro,bind {tmp_path}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", bind], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {probe.stderr.strip()}")
    report = run_refused_save(path, wrapper=("unshare", "-m", "sh", "-c", bind + ' && exec "$@"', "sh"))
    assert_refused_whole(report, path, "Read-only file system", old)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == old and leftovers(tmp_path) == []


@pytest.mark.parametrize("where, reason", [
    ("file/run.safetensors", "Not a directory"),            # the folder is a regular file
    ("/sys/uform-run.safetensors", "Permission denied"),    # refused even to root
    ("missing/run.safetensors", "No such file or directory"),
    ("folder/", "names a folder"),
])
def test_a_save_to_an_impossible_path_names_the_path_and_the_reason(tmp_path, where, reason):
    (tmp_path / "file").write_bytes(b"a plain file")
    (tmp_path / "folder").mkdir()
    path = where if where.startswith("/") else str(tmp_path / where) + ("/" if where.endswith("/") else "")
    if where.startswith("/sys") and not os.path.isdir("/sys"):
        pytest.skip("no /sys")
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, tiny_config()) as trainer:
        with pytest.raises((uform.StorageError, uform.InvalidArgument)) as caught:
            trainer.save(path)
        assert path in str(caught.value) and reason in str(caught.value), str(caught.value)
        assert trainer.step(pair_batch()).stats.step == 1  # the failed save changed nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
    assert not list((tmp_path / "folder").iterdir())


# ---------------------------------------------------------------------------------------------- #
#  Poisoned steps                                                                                  #
# ---------------------------------------------------------------------------------------------- #


def saved_tensors(trainer, path):
    trainer.save(path)
    with safetensors.safe_open(str(path), "np") as file:
        step = file.metadata()["step"]
    return step, safetensors.numpy.load_file(str(path))


def assert_same_tensors(a, b, prefix=""):
    names = [name for name in a if name.startswith(prefix)]
    assert names and set(names) == {name for name in b if name.startswith(prefix)}
    for name in names:
        assert a[name].tobytes() == b[name].tobytes(), name  # bitwise, NaN patterns included


# An attract edge weighed near the float limit: the contrastive loss overflows.
POISON = dict(relations=dict(attract=uform.Edges(offsets=[0, 1, 1, 1, 1], ids=[2], weights=[3.4e38])))


def test_a_poisoned_batch_changes_nothing_and_the_next_trains_as_if_it_never_came(tmp_path):
    poisoned_batch = dict(pair_batch(), **POISON)
    config = tiny_config(objective=uform.Objective.CONTRASTIVE)
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as poisoned, \
            uform.Trainer.init_ram(cpu, config) as clean:
        for trainer in (poisoned, clean):
            trainer.step(pair_batch())
        weights = poisoned._weights()
        step, before = saved_tensors(poisoned, tmp_path / "before.safetensors")
        for _ in range(3):
            stats = poisoned.step(poisoned_batch).stats
            assert stats.skipped and stats.step == 1 and not np.isfinite(stats.loss)
        assert poisoned._weights().tobytes() == weights.tobytes()
        step_after, after = saved_tensors(poisoned, tmp_path / "after.safetensors")
        assert step_after == step == "1"
        assert_same_tensors(before, after, "adamw.first.")
        assert_same_tensors(before, after, "adamw.second.")
        assert_same_tensors(before, after)
        # The next good step lands exactly where a run that never saw the poison lands.
        for trainer in (poisoned, clean):
            stats = trainer.step(pair_batch()).stats
            assert not stats.skipped and stats.step == 2 and np.isfinite(stats.loss)
        assert poisoned._weights().tobytes() == clean._weights().tobytes()
        poisoned.save(tmp_path / "poisoned.safetensors")
        clean.save(tmp_path / "clean.safetensors")
        assert (tmp_path / "poisoned.safetensors").read_bytes() == (tmp_path / "clean.safetensors").read_bytes()


def test_a_huge_inverse_temperature_skips_every_step_and_touches_nothing(tmp_path):
    config = tiny_config(contrastive=dict(inverse_temperature=3e37))
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
        weights = trainer._weights()
        _, before = saved_tensors(trainer, tmp_path / "before.safetensors")
        for _ in range(4):
            stats = trainer.step(pair_batch()).stats
            assert stats.skipped and stats.step == 0
            assert not (np.isfinite(stats.grad_norm) and np.isfinite(stats.loss))
        assert trainer._weights().tobytes() == weights.tobytes()
        step, after = saved_tensors(trainer, tmp_path / "after.safetensors")
        assert step == "0"
        assert_same_tensors(before, after)
        assert not any(after[name].any() for name in after if name.startswith("adamw."))  # moments still zero


def test_a_learning_rate_divergence_is_skipped_not_written_as_nan(tmp_path):
    """At the largest learning rate the config takes, a run whose loss is weighed near the float limit
    diverges within steps; from the first step whose loss or gradient is no longer finite, every update is
    skipped: the weights and moments stay those of the last good step. At 1e-3 the same run never skips."""
    masked = dict(objective=uform.Objective.MASKED, masking=dict(text_weight=1e35))
    # Items long enough that every step masks some positions, so every step's loss is a number.
    batch = dict(modalities=[TEXT] * 4, contents=[f"item {i}: " + "a small red panda eats bamboo " * 2 for i in range(4)])
    for rate, should_skip in ((1.0, True), (1e-3, False)):
        config = tiny_config(**masked, schedule=dict(steps=1000, warmup_steps=1, learning_rate=rate,
                                                     min_learning_rate=rate))
        with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
            history = []
            last_good = trainer._weights()
            for _ in range(30):
                stats = trainer.step(batch).stats
                weights = trainer._weights()
                assert np.isfinite(weights).all()
                if stats.skipped:
                    assert weights.tobytes() == last_good.tobytes()
                    assert not (np.isfinite(stats.loss) and np.isfinite(stats.grad_norm))
                else:
                    assert np.isfinite(stats.loss) and np.isfinite(stats.grad_norm)
                    last_good = weights
                history.append(stats.skipped)
            assert any(history) == should_skip, history
            if should_skip:
                step, before = saved_tensors(trainer, tmp_path / "diverged.safetensors")
                assert int(step) == history.index(True)  # it stopped at the last good step
                stats = trainer.step(batch).stats
                assert stats.skipped
                _, after = saved_tensors(trainer, tmp_path / "still.safetensors")
                assert_same_tensors(before, after)


# ---------------------------------------------------------------------------------------------- #
#  Steps that score nothing, and failures that are statuses                                        #
# ---------------------------------------------------------------------------------------------- #

EMPTY_STEPS = {
    # Named negatives and no edge: no contrastive cell counts.
    "named negatives, no edges": (tiny_config(objective=uform.Objective.CONTRASTIVE, contrastive=dict(negatives="named")),
                                  dict(modalities=[TEXT] * 2, contents=["a small red panda", "red pandas"])),
    # Every edge weighs zero, and so does every ambient negative.
    "all-zero weights": (tiny_config(objective=uform.Objective.CONTRASTIVE,
                                     contrastive=dict(negatives="named")),
                         dict(modalities=[TEXT] * 2, contents=["a small red panda", "red pandas"],
                              relations=dict(attract=uform.Edges(offsets=[0, 1, 2], ids=[1, 0], weights=[0, 0])))),
    # Masking rare enough that the keyed draws choose no position of a short item (they are fixed by the seed).
    "no masked position": (tiny_config(objective=uform.Objective.MASKED,
                                       masking=dict(token_mask_probability=0.05, token_mean_span=1)),
                           dict(modalities=[TEXT], contents=["abc"])),
}


@pytest.mark.parametrize("case", list(EMPTY_STEPS))
def test_a_step_that_scores_nothing_changes_nothing(tmp_path, case):
    config, empty = EMPTY_STEPS[case]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer, \
            uform.Trainer.init_ram(cpu, config) as clean:
        step, before = saved_tensors(trainer, tmp_path / "before.safetensors")
        stats = trainer.step(empty).stats
        assert stats.skipped and stats.step == 0
        assert stats.masked_positions == 0 and stats.contrastive_rows == 0
        assert np.isnan(stats.loss)
        step_after, after = saved_tensors(trainer, tmp_path / "after.safetensors")
        assert step_after == step == "0"
        assert_same_tensors(before, after)  # weights and both moments, bit for bit
        # The next step that scores trains exactly as it would have without the empty one.
        scoring = dict(modalities=[TEXT] * 4, contents=[letter * 32 for letter in "abcd"],
                       relations=dict(attract=uform.Edges([0, 1, 2, 3, 4], [1, 0, 3, 2])))
        for run in (trainer, clean):
            assert not run.step(scoring).stats.skipped
        assert trainer._weights().tobytes() == clean._weights().tobytes()


def test_a_step_reports_what_it_scored():
    config = tiny_config(masking=dict(token_mask_probability=0.5))
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
        stats = trainer.step(pair_batch()).stats
    assert stats.contrastive_rows == 4  # each item attracts one and repels the other two
    assert 0 < stats.masked_positions < stats.tokens


def test_a_mesh_borrows_its_executor():
    from uform import _native

    executor = _native.ExecutorHandle.for_ram(1)
    mesh = _native.MeshHandle.bootstrap(executor, 0, 1, None, None, 0.0)
    with pytest.raises(uform.Busy, match="executor"):
        executor.free()  # the C library refuses while the mesh lives, whatever Python tracks
    mesh.free()
    executor.free()


OUT_OF_MEMORY = """
import resource, sys
import uform
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
try:
    with uform.Executor.for_ram(threads=1) as cpu:
        uform.Trainer.init_ram(cpu, dict(depth=64, hidden=4096, objective="joint", schedule=dict(steps=10),
                                         batch=dict(max_rows_per_device=8, max_columns_per_row=128)))
except uform.OutOfMemory as error:
    print("refused:", error)
    sys.exit(0)
sys.exit("allocated 13 GB under a 3 GB limit")
"""


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer maps terabytes of shadow memory, which no address-space limit admits")
def test_running_out_of_memory_is_a_status_naming_the_bytes(tmp_path):
    child = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY], capture_output=True, text=True, timeout=120,
                           cwd=str(tmp_path), env=child_environment())
    assert child.returncode == 0, child.stderr + child.stdout
    assert "refused:" in child.stdout and "bytes" in child.stdout
