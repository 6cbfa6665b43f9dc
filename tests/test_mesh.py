"""Meshes of several processes on the CPU: processes meet through files under `directory/job`, and a step spread
over them trains as one process of as many simulated devices would, given all their items.

Each test starts its processes with `mesh_worker.py`. Two processes of one device each, given halves of a batch,
must give the very bits that one process of two devices gives with the whole batch: the gathered terms see the same
embeddings, and the gradients are summed in the same device order."""
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import uform
from test_media import picture, png_bytes
from test_model import MASKING

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_worker.py")
# The worker imports the very uform these tests import, wherever it was built.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(uform.__file__)))

TEXTS = [b"a small red panda", b"red pandas eat bamboo", b"the sun is a star", b"stars shine at night",
         b"def f(x): return x", b"ok then", b"rivers run to the sea", b"the sea is salty"]
SIDES = [uform.LateInteractionSide.QUERY, uform.LateInteractionSide.DOCUMENT] * 4
# Bags stay within a process's share: the 2-device split of the whole batch cuts it where the halves meet.
BAGS = [0, 1, 0, 2, 3, 3, 4, 5]
CHOICES = [b"yn", b"", b"abc", b"", b"xy", b"", b"", b"\x00\xff"]
CHOICE_TARGETS = [np.array(t, np.float32) for t in ([0.9, 0.1], [], [0.2, 0.5, 0.3], [], [0.5, 0.5], [], [], [1, 0])]
PNGS = [png_bytes(picture(16 + 8 * (i % 2), 16, seed=i)) for i in range(4)]
STATS = ["loss", "masked_loss", "contrastive_loss", "late_interaction_loss", "choices_loss", "image_loss", "grad_norm",
         "learning_rate", "inverse_temperatures", "biases"]
COUNTS = ["step", "skipped", "tokens", "truncated_items", "masked_positions", "contrastive_rows", "query_rows",
          "choice_items", "masked_patches"]


def config(objective, **extra):
    made = dict(depth=1, hidden=128, objective=objective, seed=7, schedule=dict(steps=20, warmup_steps=1),
                batch=dict(max_rows_per_device=4, max_columns_per_row=32, max_segments_per_device=4),
                contrastive=dict(temperature_groups=2), masking=MASKING)
    made.update(extra)
    return made


def edges(pairs, count):
    """Edges from each item of `pairs` to its partner, both ways."""
    runs = [[] for _ in range(count)]
    for a, b in pairs:
        runs[a].append(b), runs[b].append(a)
    offsets = np.cumsum([0] + [len(run) for run in runs]).tolist()
    return dict(offsets=offsets, ids=[i for run in runs for i in sorted(run)])


def whole_batch(pairs, **extra):
    batch = dict(modalities=[uform.Modality.TEXT] * len(TEXTS), contents=list(TEXTS),
                 temperature_groups=[i % 2 for i in range(len(TEXTS))],
                 relations=dict(attract=edges(pairs, len(TEXTS)), repel=edges([(0, 2)], len(TEXTS))))
    batch.update(extra)
    return batch


def share(batch, first, end):
    """Items [first, end) of a batch whose edges stay among them, as one process's share: ids local to it."""
    part = {key: batch[key][first:end] for key in ("modalities", "contents", "temperature_groups", "sides", "bags",
                                                   "choices", "choice_targets") if key in batch}
    part["relations"] = {}
    for name, relation in batch["relations"].items():
        offsets = relation["offsets"]
        ids = relation["ids"][offsets[first]:offsets[end]]
        assert all(first <= i < end for i in ids), "an edge crosses processes"
        part["relations"][name] = dict(offsets=[o - offsets[first] for o in offsets[first:end + 1]],
                                       ids=[i - first for i in ids])
    return part


def start(tmp_path, index, count, job, timeout=30.0, **plan):
    plan = dict(plan, index=index, count=count, directory=str(tmp_path), job=job, timeout=timeout)
    path = tmp_path / f"plan-{job}-{index}.pickle"
    path.write_bytes(pickle.dumps(plan))
    result = tmp_path / f"result-{job}-{index}.pickle"
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, WORKER, str(path), str(result)], env=environment)
    return process, result


def finish(started, limit=60):
    """Each process's result, once all have exited, within `limit` seconds."""
    results = []
    for process, result in started:
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            for other, _ in started:
                other.kill()
            raise AssertionError("a mesh process hangs")
        results.append(pickle.loads(result.read_bytes()) if result.exists() else dict(exit=process.returncode))
    return results


def one_process(trainer_config, batches, devices):
    """Each step's stats and embeddings, and the weights after, on one process of `devices` simulated devices."""
    with uform.Executor.for_ram(threads=1, devices=devices) as executor, \
            uform.Trainer.init_ram(executor, trainer_config) as trainer:
        steps = [trainer.step(b, dict(arena=uform.Arena())) for b in batches]
        return [dict(s.stats) for s in steps], [np.array(s.embeddings) for s in steps], trainer._weights()


def assert_same_bits(a, b, name):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.tobytes() == b.tobytes(), name


PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7)]
CASES = {
    "contrastive, bags": (config("contrastive", contrastive=dict(temperature_groups=2, matryoshka_dimensions=[64, 128])),
                          dict(bags=BAGS)),
    "masked": (config("masked"), {}),
    "joint, late interaction": (config("joint", late_interaction=dict(weight=0.5, width=16, max_query_span=8)),
                                dict(sides=SIDES, relations=dict(attract=edges(PAIRS, 8),  # queries repel documents
                                                                 repel=edges([(0, 3), (4, 7)], 8)))),
    "masked, choices": (config("masked", choices=dict(weight=0.7), batch=dict(max_rows_per_device=4,
                        max_columns_per_row=32, max_segments_per_device=4, max_choices_per_item=4)),
                        dict(choices=CHOICES, choice_targets=CHOICE_TARGETS)),
    "joint, images": (config("joint", batch=dict(max_rows_per_device=8, max_columns_per_row=32,
                                                 max_segments_per_device=4, image=dict(patch_side=8)),
                             masking=dict(MASKING, image_mask_ratio=0.5, image_weight=0.7)),
                      dict(modalities=[uform.Modality.TEXT, uform.Modality.IMAGE] * 4,
                           contents=[c for pair in zip(TEXTS[::2], PNGS * 2) for c in pair])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_train_as_one_process_of_two_devices(tmp_path, case):
    trainer_config, extra = CASES[case]
    whole = whole_batch(PAIRS, **extra)
    batches = [whole, dict(whole, contents=whole["contents"][::-1], modalities=whole["modalities"][::-1]), whole]
    want_stats, want_embeddings, want_weights = one_process(trainer_config, batches, devices=2)
    assert not math.isnan(want_stats[0]["loss"])
    halves = [(0, 4), (4, 8)]
    started = [start(tmp_path, p, 2, "equal", config=trainer_config, arena=True,
                     save=str(tmp_path / f"saved-{p}.safetensors"),
                     batches=[share(b, *halves[p]) for b in batches]) for p in range(2)]
    results = finish(started)
    for p, result in enumerate(results):
        assert "error" not in result, result
        assert result["mesh"] == (p, 2, f"<uform.Mesh {p} of 2>")
        for step, (want, have) in enumerate(zip(want_stats, result["stats"])):
            assert have["items"] == 4  # this process's
            for name in COUNTS:
                assert have[name] == want[name], (step, name)
            for name in STATS:
                if isinstance(want[name], float) and math.isnan(want[name]):
                    assert math.isnan(have[name]), (step, name)
                else:
                    assert_same_bits(have[name], want[name], (step, name))
            first, end = halves[p]
            assert_same_bits(result["embeddings"][step], want_embeddings[step][first:end], (step, "embeddings"))
        assert_same_bits(result["weights"], want_weights, "weights")
    # Only host domain 0 writes; host domain 1's save succeeds and writes nothing.
    assert (tmp_path / "saved-0.safetensors").exists() and not (tmp_path / "saved-1.safetensors").exists()


@pytest.mark.parametrize("processes,devices", [(3, 1), (2, 2)])
def test_any_spread_of_devices_over_processes_trains_alike(tmp_path, processes, devices):
    trainer_config = config("joint", masking=dict(MASKING, text_weight=2.0))
    # The split gives 3 + 3 + 2 items to three devices, and 2 + 2 + 2 + 2 to four.
    runs = [(0, 3), (3, 6), (6, 8)] if processes == 3 else [(0, 4), (4, 8)]
    whole = whole_batch([(0, 1), (3, 4), (6, 7)] if processes == 3 else PAIRS)
    _, _, want_weights = one_process(trainer_config, [whole] * 2, devices=processes * devices)
    started = [start(tmp_path, p, processes, "spread", config=trainer_config, devices=devices,
                     batches=[share(whole, *runs[p])] * 2) for p in range(processes)]
    for result in finish(started):
        assert "error" not in result, result
        assert_same_bits(result["weights"], want_weights, "weights")


# A share the library refuses, and one Python's own checks refuse before it reaches the library, which still takes
# its part in the step's exchange so that the peers' step fails naming it, rather than pair with its next step.
@pytest.mark.parametrize("bad,message", [(dict(contents=[b"fine", b"", b"fine", b"fine"]), "batch.contents[1]: empty"),
                                         (dict(modalities=["text"] * 2), "batch.modalities: 2 entries")])
def test_a_share_refused_anywhere_is_refused_everywhere_and_the_next_step_trains(tmp_path, bad, message):
    trainer_config = config("contrastive")
    whole = whole_batch(PAIRS)
    good = [share(whole, 0, 4), share(whole, 4, 8)]
    started = [start(tmp_path, 0, 2, "refused", config=trainer_config, batches=[good[0]] * 3),
               start(tmp_path, 1, 2, "refused", config=trainer_config, batches=[good[1], dict(good[1], **bad), good[1]])]
    first, second = finish(started)
    assert "error" not in first and "error" not in second, (first, second)
    assert f"host domain 1 refused its share of the step: {message}" in first["stats"][1]["refused"]
    assert second["stats"][1]["refused"].startswith(message)
    assert [s["step"] for s in (first["stats"][0], first["stats"][2])] == [1, 2]
    assert_same_bits(first["weights"], second["weights"], "weights")


def test_a_gather_refused_before_the_library_fails_every_process_alike(tmp_path):
    started = [start(tmp_path, 0, 2, "gathers", gather=[b"zero", b"again"]),
               start(tmp_path, 1, 2, "gathers", gather=["not bytes", b"again"])]
    first, second = finish(started)
    assert second["error"] == ("InvalidArgument", "data: expected bytes, got str")
    assert first["error"] == ("InvalidArgument", "host domain 1 refused its part: data: expected bytes, got str")


def test_processes_counting_otherwise_fail_at_once_naming_both_counts(tmp_path):
    started = [start(tmp_path, 0, 2, "counts", timeout=60), start(tmp_path, 1, 3, "counts", timeout=60)]
    first, second = finish(started)
    assert first["error"] == ("InvalidArgument", f"host_domain_count: 2 here, but host domain 1 came under "
                              f"{tmp_path}/counts counting 3")
    assert second["error"] == ("InvalidArgument", f"host_domain_count: 3 here, but host domain 0 under "
                               f"{tmp_path}/counts counts 2")
    assert first["seconds"] < 20 and second["seconds"] < 20  # not the 60 s timeout


def test_a_second_host_domain_zero_under_one_job_is_refused_while_the_first_meets(tmp_path):
    """Two runs given one directory and job: the second's host domain 0 would take the first's place and its peers."""
    started = [start(tmp_path, 0, 2, "shared", timeout=30)]
    deadline = time.monotonic() + 20
    while not (tmp_path / "shared" / "rendezvous").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with uform.Executor.for_ram(threads=1) as executor:
        with pytest.raises(uform.InvalidArgument, match=f"^job: a host domain 0 is meeting under {tmp_path}/shared "
                                                        "already"):
            uform.Mesh.bootstrap(executor, 0, 2, str(tmp_path), "shared", timeout=5)
    started.append(start(tmp_path, 1, 2, "shared", timeout=30))
    assert all("error" not in result for result in finish(started))


def test_a_config_refused_before_the_library_fails_every_process_at_once(tmp_path):
    started = [start(tmp_path, p, 2, "config", timeout=60, config=config("contrastive", hidden=200 if p else 128),
                     batches=[]) for p in range(2)]
    first, second = finish(started)
    assert second["error"][0] == "InvalidArgument" and second["error"][1].startswith("config.hidden: 200")
    assert first["error"][0] == "InvalidArgument", first
    assert first["error"][1].startswith("host domain 1 could not make its trainer: config.hidden: 200")
    assert first["waited"] < 10  # not the mesh's 60 s timeout


def test_processes_stepping_different_trainers_fail_naming_them(tmp_path):
    """Host domain 1 steps its second trainer while host domain 0 steps its first: of one geometry, their gradients
    would mix without a word."""
    trainer_config, whole = config("contrastive"), whole_batch(PAIRS)
    started = [start(tmp_path, p, 2, "trainers", timeout=30, config=trainer_config, second_first=p == 1,
                     second_config=config("contrastive", seed=5), batches=[share(whole, 4 * p, 4 * p + 4)])
               for p in range(2)]
    first, second = finish(started)
    assert first["error"] == ("PeerError", "mesh: host domain 1 steps its trainer 1 (in the order its trainers were "
                              "made on the mesh) to step 1, this process its trainer 0 to step 1: every process steps "
                              "the same trainer to the same step")
    assert second["error"][0] == "PeerError" and "host domain 0 steps its trainer 0" in second["error"][1], second


def test_processes_of_different_configs_are_refused_naming_the_field(tmp_path):
    started = [start(tmp_path, p, 2, "configs", config=config("contrastive", seed=p), batches=[]) for p in range(2)]
    for result in finish(started):  # the lower host domain first, on every process alike
        assert result["error"] == ("InvalidArgument", "config.seed: 0 on host domain 0, 1 on host domain 1; every "
                                   "process of a mesh trains one model")
    nested = [start(tmp_path, p, 2, "nested", config=config("contrastive", schedule=dict(steps=20 + p)), batches=[])
              for p in range(2)]
    for result in finish(nested):
        assert result["error"][1].startswith("config.schedule.steps: 20 on host domain 0, 21 on host domain 1;")


def test_a_peer_that_never_comes_ends_the_wait_naming_it(tmp_path):
    started = [start(tmp_path, p, 3, "absent", timeout=4.0) for p in range(2)]
    for result in finish(started):
        assert result["error"][0] == "PeerError", result
        assert "host domain 2 of 3 never joined within 4 s" in result["error"][1]
        assert result["seconds"] < 4 + 6
    assert not (tmp_path / "absent" / "rendezvous").exists()


def test_a_peer_waits_for_host_domain_zero_until_its_timeout(tmp_path):
    (result,) = finish([start(tmp_path, 1, 2, "alone", timeout=1.5)])
    assert result["error"][0] == "PeerError"
    assert "host domain 0 never opened the meeting under" in result["error"][1]
    assert "within 1.5 s (no readable" in result["error"][1] and "start it, with the same directory and job" in \
        result["error"][1]
    assert result["seconds"] < 1.5 + 5


def test_stale_files_of_an_earlier_run_do_not_confuse_a_new_one(tmp_path):
    """An earlier run left its file: first pointing where nobody listens, then at a listener of another run."""
    folder = tmp_path / "stale"
    folder.mkdir()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen(8)
    hellos = []

    def serve():  # reads a hello, answers garbage and hangs up, as another run's listener might
        stranger.settimeout(15)
        try:
            while True:
                peer, _ = stranger.accept()
                hellos.append(peer.recv(64))
                peer.sendall(b"\0" * 32)
                peer.close()
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()
    host = socket.gethostname()
    for port in (dead_port, stranger.getsockname()[1]):
        (folder / "rendezvous").write_text(f"uform-mesh 1\nnonce {'ab' * 16}\ncount 2\nport {port}\nhost {host}\n")
        peer = start(tmp_path, 1, 2, "stale", timeout=20.0, config=config("contrastive"),
                     batches=[share(whole_batch(PAIRS), 4, 8)])
        time.sleep(1.0)  # the peer reads the stale file and retries meanwhile
        first = start(tmp_path, 0, 2, "stale", timeout=20.0, config=config("contrastive"),
                      batches=[share(whole_batch(PAIRS), 0, 4)])
        for result in finish([first, peer]):
            assert "error" not in result, result
            assert result["stats"][0]["step"] == 1
    stranger.close()
    assert hellos  # the peer did knock at the stranger's door, and went on


@pytest.mark.parametrize("dying", [1, 0])
def test_a_peer_killed_mid_run_fails_the_others_at_once(tmp_path, dying):
    trainer_config = config("contrastive")
    whole = whole_batch(PAIRS)
    halves = [share(whole, 0, 4), share(whole, 4, 8)]
    started = [start(tmp_path, p, 2, "killed", timeout=30.0, config=trainer_config, batches=[halves[p]] * 3,
                     die_after=1 if p == dying else None) for p in range(2)]
    results = finish(started)
    assert results[dying] == dict(exit=3)
    survivor = results[1 - dying]
    assert survivor["error"][0] == "PeerError", survivor
    assert f"host domain {dying} hung up" in survivor["error"][1]
    assert survivor["seconds"] < 20  # not the 30 s timeout


def test_a_peer_silent_past_the_timeout_fails_the_step_naming_it(tmp_path):
    trainer_config = config("contrastive")
    whole = whole_batch(PAIRS)
    started = [start(tmp_path, p, 2, "silent", timeout=3.0, config=trainer_config,
                     batches=[share(whole, 4 * p, 4 * p + 4)] * 2, stall_after=1 if p else None, stall=6)
               for p in range(2)]
    first, second = finish(started)
    assert first["error"][0] == "PeerError", first
    assert "host domain 1 did not answer within the mesh's timeout" in first["error"][1]
    assert 3 <= first["waited"] < 3 + 2  # the mesh's timeout, not the peer's sleep
    # The silent one finds host domain 0 gone once it speaks again.
    assert second["error"][0] == "PeerError" and "host domain 0 hung up" in second["error"][1], second


@pytest.mark.parametrize("arguments,field", [
    (dict(host_domain_index=2, host_domain_count=2), "host_domain_index"),
    (dict(host_domain_index=0, host_domain_count=2, job="run"), "directory"),
    (dict(host_domain_index=0, host_domain_count=2, directory="/nonexistent/folder", job="run"), "directory"),
    (dict(host_domain_index=0, host_domain_count=2, directory="{tmp}"), "job"),
    (dict(host_domain_index=0, host_domain_count=2, directory="{tmp}", job="a/b"), "job"),
    (dict(host_domain_index=0, host_domain_count=2, directory="{tmp}", job=".."), "job"),
    (dict(host_domain_index=0, host_domain_count=2, directory="{tmp}", job="run", timeout=-1.0), "timeout"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, arguments, field):
    arguments = {key: str(tmp_path) if value == "{tmp}" else value for key, value in arguments.items()}
    with uform.Executor.for_ram(threads=1) as executor:
        started = time.monotonic()
        with pytest.raises(uform.InvalidArgument, match=rf"^{field}"):
            uform.Mesh.bootstrap(executor, **arguments)
        assert time.monotonic() - started < 1  # refused, not waited on


def test_every_process_gathers_every_part_in_host_domain_order(tmp_path):
    """Parts of any size, empty ones too, before the steps and between them, on 3 processes alike."""
    parts = [[b"", b"stop?" * index, bytes(range(256)) * (index + 1)] for index in range(3)]
    trainer_config, _ = CASES["masked"]
    whole = whole_batch(PAIRS, relations=dict(attract=edges(PAIRS, 8)))
    thirds = [[share(whole, 0, 2)], [share(whole, 2, 4)], [share(whole, 4, 8)]]
    started = [start(tmp_path, i, 3, "gather", gather=parts[i], gather_between=[bytes([i])], config=trainer_config,
                     batches=thirds[i]) for i in range(3)]
    results = finish(started)
    expected = [[parts[p][k] for p in range(3)] for k in range(3)] + [[b"\x00", b"\x01", b"\x02"]]
    for result in results:
        assert result.get("error") is None and result["gathered"] == expected
        assert [s["step"] for s in result["stats"]] == [1]


def test_a_mesh_of_one_process_gathers_its_own_part():
    with uform.Executor.for_ram(threads=1) as executor, uform.Mesh.bootstrap(executor) as mesh:
        assert mesh.gather(b"alone") == [b"alone"] and mesh.gather(b"") == [b""]
        assert mesh.gather(np.arange(3, dtype=np.uint16)) == [np.arange(3, dtype=np.uint16).tobytes()]
        with pytest.raises(uform.InvalidArgument, match="data: expected bytes"):
            mesh.gather("text")


def test_meshes_of_several_processes_are_a_capability():
    assert "mesh" in uform.capabilities()
    with uform.Executor.for_ram(threads=1) as executor, uform.Mesh.bootstrap(executor) as alone:
        assert (alone.host_domain_index, alone.host_domain_count) == (0, 1)


def test_processes_must_start_from_one_checkpoint(tmp_path):
    trainer_config = config("contrastive")
    whole = whole_batch(PAIRS)
    paths = [str(tmp_path / f"step-{n}.safetensors") for n in (1, 2)]
    with uform.Executor.for_ram(threads=1, devices=2) as executor, \
            uform.Trainer.init_ram(executor, trainer_config) as trainer:
        for path in paths:
            trainer.step(whole)
            trainer.save(path)
    started = [start(tmp_path, p, 2, "resumed", config=dict(trainer_config, resume=paths[p]), batches=[])
               for p in range(2)]
    for result in finish(started):
        assert result["error"][0] == "InvalidArgument", result
        assert "config.resume: host domain" in result["error"][1] and "starts at step" in result["error"][1]
    # One process that cannot read its checkpoint fails them all, at once, naming it.
    missing = str(tmp_path / "missing.safetensors")
    started = [start(tmp_path, p, 2, "missing", config=dict(trainer_config, resume=paths[1] if p == 0 else missing),
                     batches=[share(whole, 0, 4) if p == 0 else share(whole, 4, 8)]) for p in range(2)]
    first, second = finish(started)
    assert second["error"][0] == first["error"][0] == "StorageError", (first, second)
    assert first["error"][1].startswith("host domain 1 could not make its trainer: ") and "missing" in first["error"][1]
    assert first["seconds"] < 20
    # The same checkpoint on both resumes the run: the next step is the third.
    started = [start(tmp_path, p, 2, "same", config=dict(trainer_config, resume=paths[1]),
                     batches=[share(whole, 4 * p, 4 * p + 4)]) for p in range(2)]
    for result in finish(started):
        assert "error" not in result, result
        assert result["stats"][0]["step"] == 3


def test_abandon_ends_a_wait_for_peers_at_once(tmp_path):
    """From another thread (or a signal handler): the meeting raises PeerError within moments, not at its timeout."""
    timer = threading.Timer(0.5, uform.Mesh.abandon)
    with uform.Executor.for_ram(threads=1) as executor:
        timer.start()
        started = time.monotonic()
        with pytest.raises(uform.PeerError, match="abandoned while waiting for peers"):
            uform.Mesh.bootstrap(executor, 0, 2, str(tmp_path), "abandoned", timeout=60)
        assert time.monotonic() - started < 5
        with uform.Mesh.bootstrap(executor) as mesh:  # a later mesh is not affected
            assert mesh.gather(b"after") == [b"after"]


def test_a_trainer_on_another_executor_is_refused_and_its_peers_fail_at_once(tmp_path):
    started = [start(tmp_path, p, 2, "executors", timeout=60, config=config("contrastive"), batches=[],
                     other_executor=p == 1) for p in range(2)]
    first, second = finish(started)
    assert second["error"] == ("InvalidArgument", "mesh: joined with another executor than this one")
    assert first["error"] == ("InvalidArgument", "host domain 1 could not make its trainer: mesh: joined with another "
                              "executor than this one")
    assert first["waited"] < 10  # not the mesh's 60 s timeout


def test_a_gather_met_by_another_exchange_fails_naming_it(tmp_path):
    """Host domain 1 gathers while host domain 0 makes its trainer: out of step, found out rather than read."""
    started = [start(tmp_path, 0, 2, "astray", timeout=20, config=config("contrastive"), batches=[]),
               start(tmp_path, 1, 2, "astray", timeout=20, gather=[b"astray"])]
    first, second = finish(started)
    assert second["error"][0] == "PeerError"
    assert "host domain 0 is in another exchange (a step?) while this process gathers" in second["error"][1]
    assert first["error"][0] == "PeerError" and "host domain 1 is in another exchange (a gather?)" in first["error"][1]


def test_a_step_met_by_a_gather_fails_on_both_sides_naming_it(tmp_path):
    """Host domain 1 gathers after one step while host domain 0 takes a second: neither reads the other's bytes."""
    trainer_config, whole = config("contrastive"), whole_batch(PAIRS)
    started = [start(tmp_path, 0, 2, "crossed", timeout=20, config=trainer_config, batches=[share(whole, 0, 4)] * 2),
               start(tmp_path, 1, 2, "crossed", timeout=20, config=trainer_config, batches=[share(whole, 4, 8)],
                     gather_between=[b"x" * 64])]
    first, second = finish(started)
    assert first["error"][0] == "PeerError", first
    assert "host domain 1 is in another exchange (a gather?) while this process steps" in first["error"][1]
    assert second["error"][0] == "PeerError", second
    assert "host domain 0 is in another exchange (a step?) while this process gathers" in second["error"][1]


def test_ctrl_c_during_a_meeting_ends_it_and_lets_go_of_the_executor(tmp_path):
    import signal

    executor = uform.Executor.for_ram(threads=1)
    main = threading.main_thread().ident
    timer = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT))  # Ctrl-C, to the waiting thread
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        uform.Mesh.bootstrap(executor, 0, 2, str(tmp_path), "interrupted", timeout=60)
    assert time.monotonic() - started < 5
    executor.free()  # nothing holds it any more
    assert not (tmp_path / "interrupted" / "rendezvous").exists()
