"""`uform.torch`: a checkpoint as a `torch.nn.Module` answers what `uform.Encoder` answers.

PyTorch is an optional extra, so these tests skip where it is not installed (CI installs `.[test]`
only); the ONNX test also needs `onnx` and `onnxscript`, and checks numbers where `onnxruntime` is.
Both sides compute in float32 on the CPU and agree to float32 rounding: the difference is the order of
additions (OpenBLAS's and PyTorch's products, attention's softmax), measured below 1e-6 on these
models; the tests allow 1e-5. Images, video and audio are decoded by the library for both sides
(`uform.media_tokens`), so there too only the model's arithmetic differs: 2.1e-7 for image and audio
embeddings, 7.2e-7 for video token vectors.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import uform

torch = pytest.importorskip("torch")
import uform.torch as uform_torch  # noqa: E402 - after the skip

TOLERANCE = 1e-5
TEXTS = ["a", " ", "?", "red pandas eat bamboo", "é中文🙂 and a little unicode: ∀x ∈ ℝ", "x" * 200,
         "stars shine at night", "\x00\x01 control bytes", "the quick brown fox " * 5]
SIDES = ["query", "document", "query_and_document", "document", "query", "document", "query", "document",
         "query_and_document"]
CHOICES = ["yn", "ab", "xyz", "yn", bytes(range(256)), "yn", "é", "0123456789", "tf"]


def train(cpu, path, late):
    """A tiny model trained a few steps on the CPU backend, saved whole and weights-only."""
    config = dict(depth=2, hidden=128, objective=uform.Objective.JOINT, seed=11,
                  schedule=dict(steps=100, warmup_steps=2, learning_rate=3e-3),
                  contrastive=dict(matryoshka_dimensions=[64, 128]),
                  batch=dict(max_rows_per_device=8, max_columns_per_row=64))
    batch = dict(modalities=[uform.Modality.TEXT] * 4, contents=["red panda", "bamboo", "bright star", "night sky"],
                 relations=dict(attract=uform.Edges([0, 1, 2, 3, 4], [1, 0, 3, 2])))
    if late:
        config.update(late_interaction=dict(weight=1.0, width=32, max_query_span=12), choices=dict(weight=1.0))
        config["batch"]["max_choices_per_item"] = 4
        batch.update(sides=["query", "document", "query", "document"], choices=["yn", "yn", "ab", "ab"],
                     choice_targets=[np.array([0.7, 0.3], np.float32)] * 4)
    with uform.Trainer.init_ram(cpu, config) as trainer:
        for _ in range(4):
            trainer.step(batch)
        trainer.save(path + ".safetensors")
        trainer.save(path + ".weights.safetensors", weights_only=True)
    return path + ".safetensors", path + ".weights.safetensors"


@pytest.fixture(scope="module")
def cpu():
    with uform.Executor.for_ram(threads=2) as executor:
        yield executor


@pytest.fixture(scope="module")
def checkpoints(cpu, tmp_path_factory):
    folder = tmp_path_factory.mktemp("torch")
    plain, plain_weights = train(cpu, str(folder / "plain"), late=False)
    late, late_weights = train(cpu, str(folder / "late"), late=True)
    return dict(plain=plain, plain_weights=plain_weights, late=late, late_weights=late_weights)


def library_embed(cpu, path, texts):
    with uform.Encoder.load(path, cpu) as encoder:
        return np.array(encoder.embed([uform.Modality.TEXT] * len(texts), texts))


def largest_difference(ours, theirs):
    assert len(ours) == len(theirs)
    differences = [0.0]
    for a, b in zip(ours, theirs):
        a = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        assert a.shape == np.shape(b)
        differences.append(float(np.abs(a - b).max()) if a.size else 0.0)
    return max(differences)


@pytest.mark.parametrize("name", ["plain", "plain_weights", "late", "late_weights"])
def test_embeddings_match_the_encoder(cpu, checkpoints, name):
    path = checkpoints[name]
    expected = library_embed(cpu, path, TEXTS)
    module = uform_torch.load(path)
    assert isinstance(module, torch.nn.Module) and not module.training
    with torch.no_grad():
        embeddings = module.embed(TEXTS)
        prefix = module.embed(TEXTS, dimensions=64)
    assert embeddings.shape == (len(TEXTS), 128) and embeddings.dtype == torch.float32
    assert largest_difference(embeddings, expected) < TOLERANCE
    # A Matryoshka prefix is the first components of the mean, re-normalized, as training scores it.
    widths = expected[:, :64] / np.linalg.norm(expected[:, :64], axis=1, keepdims=True)
    assert largest_difference(prefix, widths) < TOLERANCE
    assert torch.allclose(prefix.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-6)


def test_padding_and_batching_change_nothing(checkpoints):
    module = uform_torch.load(checkpoints["plain"])
    with torch.no_grad():
        alone = torch.cat([module.embed([text]) for text in TEXTS])
        together = module.embed(TEXTS, batch_size=3)
        tokens, lengths, truncated = module.tokenize(TEXTS)
        assert truncated == 2 and int(lengths.max()) == module.max_columns_per_row  # the two long ones, cut to a row
        short = lengths < 40
        padded = torch.nn.functional.pad(tokens[short, :40], (0, 7), value=99)  # wider than needed
        padded[torch.arange(47)[None, :] >= lengths[short][:, None]] = 97  # and what pads does not matter
        noisy = module(padded, lengths[short])
    assert (alone - together).abs().max() < 1e-6
    assert (noisy - together[short]).abs().max() < 1e-6


@pytest.mark.parametrize("name", ["late", "late_weights"])
def test_token_vectors_match_the_encoder(cpu, checkpoints, name):
    path = checkpoints[name]
    module = uform_torch.load(path)
    with uform.Encoder.load(path, cpu) as encoder:
        for sides in [None, SIDES]:
            expected = encoder.embed_tokens([uform.Modality.TEXT] * len(TEXTS), TEXTS, sides=sides)
            with torch.no_grad():
                vectors = module.embed_tokens(TEXTS, sides=sides, batch_size=4)
            assert largest_difference(vectors, expected) < TOLERANCE
    # A query answers max_query_span rows: cut to the span, or padded up to it with QUERY_PAD_ID.
    assert [len(v) for v in vectors[:3]] == [12, 1, 12]
    tokens, lengths, _ = module.tokenize(["hi", "x" * 30], sides=["query", "query"])
    assert lengths.tolist() == [12, 12] and tokens[0, 2:12].tolist() == [uform_torch.QUERY_PAD_ID] * 10


@pytest.mark.parametrize("name", ["plain", "late_weights"])
def test_choices_match_the_encoder(cpu, checkpoints, name):
    path = checkpoints[name]
    module = uform_torch.load(path)
    with uform.Encoder.load(path, cpu) as encoder:
        expected = encoder.text_choose(TEXTS, CHOICES)
    with torch.no_grad():
        probabilities = module.text_choose(TEXTS, CHOICES)
    assert largest_difference(probabilities, expected) < TOLERANCE
    assert all(abs(float(p.sum()) - 1) < 1e-5 for p in probabilities)
    # The choice position follows the content, which is cut one byte shorter to leave it room.
    tokens, lengths, truncated = module.tokenize(["ab", "x" * 200], choosing=True)
    assert lengths.tolist() == [3, 64] and truncated == 1
    assert tokens[0, :3].tolist() == [97, 98, uform_torch.CHOICE_ID] and tokens[1, 63] == uform_torch.CHOICE_ID


def test_state_dict_names_are_the_checkpoints(checkpoints):
    module = uform_torch.load(checkpoints["late"])
    with safe_open(checkpoints["late_weights"], framework="np") as file:
        assert sorted(module.state_dict()) == sorted(file.keys())


def test_fine_tuned_weights_go_back_to_the_library(cpu, checkpoints, tmp_path):
    """A module changed in PyTorch saves a weights-only checkpoint that `uform.Encoder` reads."""
    module = uform_torch.load(checkpoints["late"])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    tokens, lengths, _ = module.tokenize(["red panda", "bamboo"])
    embeddings = module(tokens, lengths)
    (1 - (embeddings[0] * embeddings[1]).sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.blocks.parameters())
    optimizer.step()
    path = str(tmp_path / "tuned.safetensors")
    uform_torch.save(module, path)
    with torch.no_grad():
        ours = module.embed(TEXTS)
    assert largest_difference(ours, library_embed(cpu, path, TEXTS)) < TOLERANCE
    assert largest_difference(ours, library_embed(cpu, checkpoints["late"], TEXTS)) > 1e-3  # it did change
    again = uform_torch.load(path)
    assert again.step == module.step and again.max_query_span == 12
    with torch.no_grad():
        assert torch.equal(again.embed(TEXTS), ours)


def test_saving_keeps_the_checkpoints_note(cpu, tmp_path):
    """A checkpoint's note (where a data stream stands, say) survives a trip through PyTorch; `note=` replaces it."""
    note = '{"cursor": {"epoch": 2, "record": 41}, "source": "données"}'
    path = str(tmp_path / "noted.safetensors")
    with uform.Trainer.init_ram(cpu, dict(depth=1, hidden=128, objective="masked", schedule=dict(steps=10),
                                          batch=dict(max_rows_per_device=2, max_columns_per_row=16))) as trainer:
        trainer.save(path, note=note)
        trainer.save(str(tmp_path / "plain.safetensors"))
    module = uform_torch.load(path)
    assert module.note == note and uform_torch.load(str(tmp_path / "plain.safetensors")).note is None
    kept, replaced, dropped = (str(tmp_path / f"{name}.safetensors") for name in ("kept", "replaced", "dropped"))
    uform_torch.save(module, kept)
    uform_torch.save(module, replaced, note="fine-tuned on the cursor above")
    uform_torch.save(module, dropped, note=None)
    assert uform.checkpoint_note(kept) == note and uform_torch.load(kept).note == note
    assert uform.checkpoint_note(replaced) == "fine-tuned on the cursor above"
    assert uform.checkpoint_note(dropped) is None and uform_torch.load(dropped).note is None
    with uform.Encoder.load(kept, cpu) as encoder:
        assert encoder.hidden == 128
    with pytest.raises(uform.InvalidArgument, match="note: a NUL character at 1"):
        uform_torch.save(module, dropped, note="a\0b")
    with pytest.raises(uform.InvalidArgument, match="note: expected a str or None, got int"):
        uform_torch.save(module, dropped, note=5)


@pytest.mark.parametrize("note", ["x" * (uform.MAX_NOTE_BYTES + 1), "é" * (uform.MAX_NOTE_BYTES // 2) + "x"])
def test_a_note_over_the_limit_is_refused_as_trainer_save_refuses_it(cpu, tmp_path, note):
    path = str(tmp_path / "kept.safetensors")
    with uform.Trainer.init_ram(cpu, dict(depth=1, hidden=128, objective="masked", schedule=dict(steps=10),
                                          batch=dict(max_rows_per_device=2, max_columns_per_row=16))) as trainer:
        trainer.save(path, weights_only=True, note="the old one")
        with pytest.raises(uform.InvalidArgument) as refused:
            trainer.save(str(tmp_path / "other.safetensors"), note=note)
    assert str(refused.value) == f"note: {uform.MAX_NOTE_BYTES + 1} bytes, over the {uform.MAX_NOTE_BYTES} a checkpoint holds"
    module = uform_torch.load(path)
    with pytest.raises(uform.InvalidArgument) as also:
        uform_torch.save(module, path, note=note)
    assert str(also.value) == str(refused.value)
    assert uform.checkpoint_note(path) == "the old one"  # the file stays as it was
    longest = note[:-1] if note.startswith("x") else note[:-2] + "xy"
    uform_torch.save(module, path, note=longest)
    assert uform.checkpoint_note(path) == longest


def test_a_file_that_cannot_be_read_raises_storage_error_as_the_library_does(cpu, tmp_path):
    for path in (str(tmp_path / "missing.safetensors"), str(tmp_path)):
        with pytest.raises(uform.StorageError) as library:
            uform.Encoder.load(path, cpu)
        with pytest.raises(uform.StorageError) as ours:
            uform_torch.load(path)
        assert str(ours.value) == str(library.value)
        assert str(ours.value) == (f"path: cannot open {path}: No such file or directory" if path.endswith("missing.safetensors")
                                   else f"path: {path} is not a regular file")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(uform.InvalidCheckpoint):  # readable, but no checkpoint
        uform_torch.load(str(tmp_path / "empty.safetensors"))


def test_save_refuses_what_load_would_refuse_and_writes_nothing(cpu, checkpoints, tmp_path):
    """A module whose checkpoint `load` or `uform.Encoder.load` would refuse is refused before the write."""
    path = tmp_path / "refused.safetensors"

    def refused(change, message):
        module = uform_torch.load(checkpoints["late"])
        with torch.no_grad():
            change(module)
        with pytest.raises(uform.InvalidArgument) as raised:
            uform_torch.save(module, str(path))
        assert str(raised.value) == message
        assert os.listdir(tmp_path) == []

    refused(lambda m: m.blocks[1].qkv[3, 5].fill_(float("nan")),
            "module: blocks.1.qkv[3, 5] = nan is not a finite float32; a checkpoint holds only finite values")
    refused(lambda m: m.final_norm[7].fill_(float("-inf")),
            "module: final_norm[7] = -inf is not a finite float32; a checkpoint holds only finite values")
    refused(lambda m: setattr(m, "final_norm", torch.nn.Parameter(torch.ones(64))),
            "module: final_norm has shape [64], its config needs [128]")
    refused(lambda m: setattr(m, "extra", torch.nn.Parameter(torch.ones(4))),
            "module: holds the tensor extra, which its config does not make; a checkpoint holding it is refused")
    refused(lambda m: setattr(m, "late_interaction", None),
            "module: lacks the tensor late_interaction.log_inverse_temperature, which its config needs")

    def overflowing(module):  # named as the module holds it, not as the inf the cast makes
        module.double()
        module.final_norm[2] = 1e300

    refused(overflowing, "module: final_norm[2] = 1e+300 is not a finite float32; a checkpoint holds only finite values")
    module = uform_torch.load(checkpoints["late"]).double()
    uform_torch.save(module, str(path))  # finite doubles are written as float32
    with uform.Encoder.load(str(path), cpu) as encoder:
        assert encoder.hidden == 128


def test_save_raises_storage_error_naming_the_path_as_trainer_save_does(cpu, checkpoints, tmp_path):
    module = uform_torch.load(checkpoints["plain_weights"])
    path = str(tmp_path / "nope" / "x.safetensors")
    with uform.Trainer.init_ram(cpu, dict(depth=1, hidden=128, objective="masked", schedule=dict(steps=10),
                                          batch=dict(max_rows_per_device=2, max_columns_per_row=16))) as trainer:
        with pytest.raises(uform.StorageError) as library:
            trainer.save(path)
        with pytest.raises(uform.InvalidArgument) as library_folder:
            trainer.save(str(tmp_path))
    with pytest.raises(uform.StorageError) as ours:
        uform_torch.save(module, path)
    assert str(ours.value) == str(library.value) == f"path: cannot write {path}: No such file or directory"
    with pytest.raises(uform.InvalidArgument) as ours_folder:
        uform_torch.save(module, tmp_path)
    assert str(ours_folder.value) == str(library_folder.value) == f"path: {tmp_path} names a folder, not a file"
    assert os.listdir(tmp_path) == []  # no temporary file left behind


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_saved_files_have_the_mode_trainer_save_gives(cpu, checkpoints, tmp_path, umask):
    module = uform_torch.load(checkpoints["plain_weights"])
    previous = os.umask(umask)
    try:
        uform_torch.save(module, str(tmp_path / "ours.safetensors"))
        with uform.Trainer.init_ram(cpu, dict(depth=1, hidden=128, objective="masked", schedule=dict(steps=10),
                                              batch=dict(max_rows_per_device=2, max_columns_per_row=16))) as trainer:
            trainer.save(str(tmp_path / "library.safetensors"))
    finally:
        os.umask(previous)
    ours, library = (os.stat(tmp_path / name).st_mode & 0o777 for name in ("ours.safetensors", "library.safetensors"))
    assert ours == library == 0o644 & ~umask
    uform_torch.save(module, str(tmp_path / "ours.safetensors"))  # replacing a file works too
    assert sorted(os.listdir(tmp_path)) == ["library.safetensors", "ours.safetensors"]


def test_bfloat16_stays_close(checkpoints):
    with torch.no_grad():
        exact = uform_torch.load(checkpoints["plain"]).embed(TEXTS)
        brief = uform_torch.load(checkpoints["plain"], dtype=torch.bfloat16).embed(TEXTS)
    assert brief.dtype == torch.bfloat16
    assert float((brief.float() * exact).sum(1).min()) > 0.99


def rewrite(source, destination, change_tensors=None, change_metadata=None):
    with safe_open(source, framework="np") as file:
        metadata = dict(file.metadata())
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    if change_tensors:
        change_tensors(tensors)
    if change_metadata:
        change_metadata(metadata)
    save_file(tensors, destination, metadata=metadata)
    return destination


def test_what_this_module_does_not_build_is_refused_by_name(checkpoints, tmp_path):
    source = checkpoints["plain_weights"]
    head = rewrite(source, str(tmp_path / "head.safetensors"),
                   lambda t: t.update({"reranker.head": np.zeros((1, 128), np.float32)}))
    with pytest.raises(uform.InvalidCheckpoint, match="holds the tensor reranker.head, which uform.torch does not"):
        uform_torch.load(head)
    missing = rewrite(source, str(tmp_path / "missing.safetensors"), lambda t: t.pop("blocks.1.up"))
    with pytest.raises(uform.InvalidCheckpoint, match="lacks the tensor blocks.1.up"):
        uform_torch.load(missing)
    shaped = rewrite(source, str(tmp_path / "shaped.safetensors"),
                     lambda t: t.update({"final_norm": np.ones(64, np.float32)}))
    with pytest.raises(uform.InvalidCheckpoint, match=r"holds final_norm as F32 \[64\], the model needs F32 \[128\]"):
        uform_torch.load(shaped)
    moment = rewrite(source, str(tmp_path / "moment.safetensors"),
                     lambda t: t.update({"adamw.first.final_norm": np.ones(128, np.float32)}))
    with pytest.raises(uform.InvalidCheckpoint, match="weights_only is \"true\" yet holds the moment"):
        uform_torch.load(moment)
    formatted = rewrite(source, str(tmp_path / "format.safetensors"), None, lambda m: m.update(format="uform/9"))
    with pytest.raises(uform.InvalidCheckpoint, match="__metadata__.format = 'uform/9'"):
        uform_torch.load(formatted)
    with pytest.raises(uform.InvalidCheckpoint, match="not a readable safetensors file"):
        uform_torch.load(__file__)

    def unshaped(metadata):  # a run records every media shape it derived; the module restates none of them
        config = json.loads(metadata["config"])
        del config["batch"]["video"]["tube_frames"]
        metadata["config"] = json.dumps(config)

    with pytest.raises(uform.InvalidCheckpoint, match=r"unshaped.safetensors has config.batch.video.tube_frames = None"):
        uform_torch.load(rewrite(source, str(tmp_path / "unshaped.safetensors"), None, unshaped))


def test_bad_inputs_are_refused_by_name(checkpoints):
    plain = uform_torch.load(checkpoints["plain"])
    with pytest.raises(uform.InvalidArgument, match="no token head"):
        plain.embed_tokens(["a"])
    with pytest.raises(uform.InvalidArgument, match=r"items\[1\]: empty"):
        plain.embed(["a", ""])
    with pytest.raises(uform.InvalidArgument, match=r"items\[0\]: cannot be encoded as UTF-8"):
        plain.embed(["\ud800"])
    for width in (129, 32, 100):  # a width the run did not train is no Matryoshka prefix
        with pytest.raises(uform.InvalidArgument, match=f"^dimensions: {width} is not a width this checkpoint's run "
                                                        r"trained: 64, 128 \(its contrastive.matryoshka_dimensions"):
            plain.embed(["a"], dimensions=width)
    with pytest.raises(uform.InvalidArgument, match=r"^batch_size: 1.5 is not a positive int"):
        plain.embed(["a"], batch_size=1.5)
    assert torch.equal(plain.embed([np.frombuffer(b"red panda", np.uint8)]), plain.embed(["red panda"]))
    with pytest.raises(uform.InvalidArgument, match=r"choices\[0\]: byte 121 is offered twice"):
        plain.text_choose(["a"], ["yny"])
    with pytest.raises(uform.InvalidArgument, match=r"choices\[1\]: empty"):
        plain.text_choose(["a", "b"], ["yn", ""])
    with pytest.raises(uform.InvalidArgument, match=r"sides\[0\]: none has no token vectors"):
        uform_torch.load(checkpoints["late"]).embed_tokens(["a"], sides=["none"])
    assert plain.embed([]).shape == (0, 128) and plain.text_choose([], []) == []
    with pytest.raises(uform.InvalidArgument, match=r"texts\[1\]: empty"):
        plain.text_choose(["a", ""], ["yn", "yn"])


def test_tensor_level_inputs_are_refused_naming_the_argument_and_the_limit(checkpoints):
    """What PyTorch would answer with an error of its own (a size mismatch, an index out of range) or with
    NaN (an empty item) is refused up front, for every tensor-level verb."""
    module = uform_torch.load(checkpoints["late"])
    tokens, lengths, _ = module.tokenize(["red panda", "bamboo"])
    wide = torch.zeros((2, module.max_columns_per_row + 1), dtype=torch.int64)
    cases = [((wide, torch.tensor([3, 3])), r"^tokens: 65 positions a row, over the checkpoint's max_columns_per_row = 64$"),
             ((tokens.masked_fill(tokens == ord("b"), 300), lengths), r"^tokens\[1, 0\]: 300 is not an id in \[0, 260\)"),
             ((tokens.masked_fill(tokens == ord("d"), -1), lengths), r"^tokens\[0, 2\]: -1 is not an id in \[0, 260\)"),
             ((tokens, torch.tensor([9, 0])), r"^lengths\[1\]: 0 is not in \[1, seq = 9\]; every item has at least one"),
             ((tokens, torch.tensor([10, 6])), r"^lengths\[0\]: 10 is not in \[1, seq = 9\]"),
             ((tokens, lengths[:1]), r"^lengths: 1 entry, expected 2, one per row of tokens$"),
             ((tokens.float(), lengths), r"^tokens: expected a \(batch, seq\) tensor of int64 or int32, got torch.float32"),
             ((tokens[0], lengths), r"^tokens: expected a \(batch, seq\) tensor of int64 or int32, got torch.int64 of shape \(9,\)"),
             ((tokens.tolist(), lengths), r"^tokens: expected a \(batch, seq\) tensor of int64 or int32, got list$")]
    with torch.no_grad():
        for verb in (module.forward, module.states, module.token_vectors, module.choice_logits):
            for arguments, message in cases:
                with pytest.raises(uform.InvalidArgument, match=message):
                    verb(*arguments)
        padded = torch.cat([tokens, torch.full((2, 3), uform_torch.MEDIA_ID)], dim=1)  # any id pads
        assert torch.allclose(module(padded, lengths), module(tokens, lengths), atol=1e-6)


def test_onnx_export_computes_the_same(checkpoints, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")  # torch.onnx's exporter writes the graph through it
    module = uform_torch.load(checkpoints["plain_weights"])
    example = module.tokenize(["an example", "b"])
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=module.max_columns_per_row)
    path = str(tmp_path / "encoder.onnx")
    torch.onnx.export(module, (example.tokens, example.lengths), path, input_names=["tokens", "lengths"],
                      output_names=["embeddings"], dynamic_shapes={"tokens": {0: batch, 1: seq}, "lengths": {0: batch}},
                      dynamo=True)
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    other = module.tokenize(TEXTS)  # another batch and length than the example's
    (answer,) = session.run(None, {"tokens": other.tokens.numpy(), "lengths": other.lengths.numpy()})
    with torch.no_grad():
        assert np.abs(answer - module.embed(TEXTS).numpy()).max() < TOLERANCE


def test_importing_uform_does_not_import_torch(tmp_path):
    root = os.path.dirname(os.path.dirname(uform.__file__))
    environment = dict(os.environ, PYTHONPATH=root)
    check = "import sys, uform; assert 'torch' not in sys.modules, 'uform imported torch'"
    subprocess.run([sys.executable, "-c", check], check=True, cwd=tmp_path, env=environment)
    absent = ("import sys; sys.modules['torch'] = None\n"
              "try:\n    import uform.torch\nexcept ImportError as error:\n    print(error)")
    printed = subprocess.run([sys.executable, "-c", absent], check=True, cwd=tmp_path, env=environment,
                             capture_output=True, text=True).stdout
    assert "uform.torch needs PyTorch: pip install torch (the CPU build: pip install torch --index-url " in printed
    assert "uform[" not in printed


# ---------------------------------------------------------------------------------------------- #
#  Images, video and audio: decoded by the library, embedded by the module                       #
# ---------------------------------------------------------------------------------------------- #

from test_media import clip, needs, needs_format, picture, png_bytes, tone, wav_bytes  # noqa: E402

MEDIA_CONFIG = dict(depth=2, hidden=128, objective=uform.Objective.JOINT, seed=7,
                    schedule=dict(steps=100, warmup_steps=2, learning_rate=3e-3),
                    contrastive=dict(matryoshka_dimensions=[64, 128]),
                    batch=dict(max_rows_per_device=8, max_columns_per_row=64, image=dict(patch_side=8),
                               video=dict(patch_side=8, tube_frames=2), audio=dict(chunk_samples=200)),
                    late_interaction=dict(weight=1.0, width=32, max_query_span=12))
# (height, width): 2 x 3 and 3 x 2 patches (a swapped row and column would show), 13 x 4, and 15 x 15 shrunk to 8 x 8.
PICTURES = [(16, 24), (24, 16), (100, 30), (120, 120)]


def pictures():
    return [png_bytes(picture(height, width, seed=i)) for i, (height, width) in enumerate(PICTURES)]


def sounds():
    """4 chunks of 200 samples; 1 s of stereo at 22.05 kHz, 80 chunks at 16 kHz, cut to a row's 64."""
    return [wav_bytes(tone(0.05, 16000), 16000), wav_bytes(tone(1.0, 22050, channels=2), 22050)]


@pytest.fixture(scope="module")
def media_checkpoint(cpu, tmp_path_factory):
    """A tiny model trained a few steps on text, images and sound, saved weights-only with its queries and
    keys scaled 4-fold. At this size attention is nearly uniform, so positions would barely move an embedding;
    sharpened, a wrong rotary angle shows far above the tolerance (`test_media_positions_matter`)."""
    if "png" not in uform.capabilities() or "wav" not in uform.capabilities():
        pytest.skip("this build does not decode PNG and WAV")
    images, audio = pictures(), sounds()
    contents = ["red panda", images[0], "bamboo", images[1], audio[0], images[2], "night sky", audio[1]]
    modalities = ["text", "image", "text", "image", "audio", "image", "text", "audio"]
    batch = dict(modalities=modalities, contents=contents,
                 relations=dict(attract=uform.Edges(list(range(9)), [1, 0, 3, 2, 5, 4, 7, 6])),
                 sides=["query", "document", "query", "document", "document", "document", "query", "document"])
    path = str(tmp_path_factory.mktemp("media") / "media.safetensors")
    with uform.Trainer.init_ram(cpu, MEDIA_CONFIG) as trainer:
        for _ in range(4):
            trainer.step(batch)
        trainer.save(path, weights_only=True)
    with safe_open(path, framework="np") as file:
        metadata = dict(file.metadata())
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    for block in range(2):
        tensors[f"blocks.{block}.qkv"][:256] *= 4  # hidden 128: the queries' rows, then the keys'
    save_file(tensors, path, metadata=metadata)
    return path


def media_items():
    images, audio = pictures(), sounds()
    contents = [images[0], "red panda", audio[0], images[1], images[2], "a star", audio[1], images[3]]
    return contents, ["image", "text", "audio", "image", "image", "text", "audio", "image"]


def library_items(cpu, path, contents, modalities, sides=None):
    with uform.Encoder.load(path, cpu) as encoder:
        embeddings = np.array(encoder.embed(modalities, contents))
        vectors = encoder.embed_tokens(modalities, contents, sides=sides)
    return embeddings, vectors


def test_image_and_audio_embeddings_match_the_encoder(cpu, media_checkpoint):
    contents, modalities = media_items()
    expected, _ = library_items(cpu, media_checkpoint, contents, modalities)
    module = uform_torch.load(media_checkpoint)
    with torch.no_grad():
        embeddings = module.embed(contents, modalities)
        together = module.embed(contents, [uform.Modality(kind) for kind in modalities], batch_size=3)
        prefix = module.embed(contents, modalities, dimensions=64)
    assert embeddings.shape == (len(contents), 128)
    assert largest_difference(embeddings, expected) < TOLERANCE
    assert (embeddings - together).abs().max() < 1e-6  # other batches, other padding, the same answers
    widths = expected[:, :64] / np.linalg.norm(expected[:, :64], axis=1, keepdims=True)
    assert largest_difference(prefix, widths) < TOLERANCE
    # The items do differ: an image is not its neighbour, and a sound is not a text.
    assert float((embeddings[0] @ embeddings[3]).abs()) < 0.999 and float((embeddings[1] @ embeddings[2])) < 0.999


@needs("ffmpeg")
@needs_format("mp4")
def test_video_embeddings_match_the_encoder(cpu, media_checkpoint, tmp_path):
    """Tubelets of 2 frames, 3 x 4 patches a frame: 5 frames make 3 tubelets, the last repeating its frame,
    and 50 frames 25, of which the 5 that fill a row of 64 tokens are kept; a tall clip has 5 x 2 patches."""
    short = clip(tmp_path, "mp4", frames=5, size="32x24")
    long = clip(tmp_path, "mp4", frames=50, size="32x24")
    tall = clip(tmp_path, "mp4", frames=3, size="16x40")
    module = uform_torch.load(media_checkpoint)
    assert [uform.media_tokens("video", video, module.config["batch"])[1] for video in (short, long, tall)] == [
        (3, 3, 4), (5, 3, 4), (2, 5, 2)]
    contents, modalities = [short, "a clip", long, tall], ["video", "text", "video", "video"]
    expected, expected_vectors = library_items(cpu, media_checkpoint, contents, modalities)
    with torch.no_grad():
        embeddings = module.embed(contents, modalities, batch_size=2)
        vectors = module.embed_tokens(contents, modalities, batch_size=3)
    assert largest_difference(embeddings, expected) < TOLERANCE
    assert [len(v) for v in vectors] == [36, 6, 60, 20] and largest_difference(vectors, expected_vectors) < TOLERANCE
    moved = moved_by_text_positions(module, contents, modalities)
    assert moved[1] == 0 and moved[[0, 2, 3]].min() > 100 * TOLERANCE  # tubelets turn by time, row and column


OTHER_SHAPES = dict(image=dict(patch_side=4, channels=1), video=dict(patch_side=4, tube_frames=3, channels=1),
                    audio=dict(chunk_samples=160, sample_rate=8000))


@needs_format("png", "wav")
def test_other_media_shapes_embed_as_the_encoder_does(cpu, tmp_path):
    """Each kind's projection is as wide as the checkpoint's shapes make its tokens: gray patches of 4 x 4,
    tubelets of 3 gray frames, chunks of 160 samples at 8 kHz embed as `uform.Encoder` embeds them."""
    config = dict(MEDIA_CONFIG, batch=dict(MEDIA_CONFIG["batch"], **OTHER_SHAPES))
    contents, modalities = media_items()
    path = str(tmp_path / "shaped.safetensors")
    with uform.Trainer.init_ram(cpu, config) as trainer:
        for _ in range(2):
            trainer.step(dict(modalities=modalities, contents=contents))
        trainer.save(path, weights_only=True)
    module = uform_torch.load(path)
    widths = [module.image.projection.shape[1], module.video.projection.shape[1], module.audio.projection.shape[1]]
    assert widths == [4 * 4 * 1, 3 * 4 * 4 * 1, 160]
    if shutil.which("ffmpeg") and "mp4" in uform.capabilities():  # 3 tubelets of 3 x 4 patches
        contents, modalities = contents + [clip(tmp_path, "mp4", frames=7, size="16x12")], modalities + ["video"]
    for kind, width in zip(("image", "video", "audio"), widths):
        for item in (item for item, modality in zip(contents, modalities) if modality == kind):
            assert uform.media_tokens(kind, item, module.config["batch"])[0].shape[1] == width
    expected, expected_vectors = library_items(cpu, path, contents, modalities)
    with torch.no_grad():
        embeddings = module.embed(contents, modalities, batch_size=3)
        vectors = module.embed_tokens(contents, modalities, batch_size=4)
    assert largest_difference(embeddings, expected) < TOLERANCE
    assert [len(v) for v in vectors] == [len(v) for v in expected_vectors]
    assert largest_difference(vectors, expected_vectors) < TOLERANCE


def test_media_token_vectors_match_the_encoder(cpu, media_checkpoint):
    """An image or a sound is a document of one row per patch or chunk; text beside it may be a query."""
    contents, modalities = media_items()
    sides = ["document", "query", "document", "document", "document", "query_and_document", "document", "document"]
    module = uform_torch.load(media_checkpoint)
    for given in (None, sides):
        _, expected = library_items(cpu, media_checkpoint, contents, modalities, sides=given)
        with torch.no_grad():
            vectors = module.embed_tokens(contents, modalities, sides=given, batch_size=5)
        assert [len(v) for v in vectors] == [len(v) for v in expected]
        assert largest_difference(vectors, expected) < TOLERANCE
    assert [len(v) for v in vectors] == [6, 12, 4, 6, 52, 12, 64, 64]


def moved_by_text_positions(module, contents, modalities):
    """How far each item's embedding moves when every token turns as a text byte at its index."""
    tokens, lengths, media = module._pack(module._rows(contents, modalities))
    as_text = (torch.arange(tokens.shape[1])[:, None] * 32 + torch.arange(32)).expand(len(contents), -1, -1)
    with torch.no_grad():
        right = module(tokens, lengths, media)
        assert torch.equal(right, module.embed(contents, modalities, batch_size=len(contents)))
        return (right - module(tokens, lengths, media._replace(rotary=as_text))).abs().max(1).values


def test_media_positions_matter(media_checkpoint):
    """The comparisons above check the rotary positions: read at text's positions, an image embeds
    differently, by far more than the tolerance (a video: `test_video_embeddings_match_the_encoder`)."""
    contents, modalities = media_items()
    moved = moved_by_text_positions(uform_torch.load(media_checkpoint), contents, modalities)
    assert moved[[1, 5]].max() == 0  # texts turn as they did
    assert moved[[0, 3, 4, 7]].min() > 100 * TOLERANCE  # images turn by row and column, not by index
    assert moved[[2, 6]].max() == 0  # an audio chunk turns as a text byte at its index


def test_media_projections_learn_in_pytorch(media_checkpoint):
    """Gradients reach each kind's projection through the tokens it adds, so media fine-tune in PyTorch."""
    contents, modalities = media_items()
    module = uform_torch.load(media_checkpoint)
    embeddings = module.embed(contents, modalities)
    (1 - (embeddings[0] * embeddings[2]).sum()).backward()  # an image toward a sound
    assert float(module.image.projection.grad.abs().max()) > 0 and float(module.audio.projection.grad.abs().max()) > 0
    unused = module.video.projection.grad  # no video among the items: its empty product adds nothing
    assert (unused is None or not unused.any()) and module.image.decoder.grad is None


def test_text_read_as_items_embeds_as_text(checkpoints):
    module = uform_torch.load(checkpoints["late"])
    with torch.no_grad():
        assert torch.equal(module.embed(TEXTS, ["text"] * len(TEXTS)), module.embed(TEXTS))
        assert all(torch.equal(a, b) for a, b in zip(module.embed_tokens(TEXTS, ["text"] * len(TEXTS), SIDES),
                                                     module.embed_tokens(TEXTS, sides=SIDES)))


def test_packed_items_are_what_the_item_level_verbs_read(media_checkpoint):
    module = uform_torch.load(media_checkpoint)
    contents, modalities = media_items()
    with torch.no_grad():
        packed = module.pack(contents, modalities)
        assert torch.allclose(module(*packed), module.embed(contents, modalities), atol=1e-6)
        vectors = module.token_vectors(*packed)
        assert all(torch.allclose(vectors[i, :len(v)], v, atol=1e-6)
                   for i, v in enumerate(module.embed_tokens(contents, modalities)))
        assert module.pack(["a", "bc"]).media is None


def test_media_that_do_not_fit_the_tokens_are_refused_by_name(media_checkpoint):
    """Left out, short, doubled or placed on text, media tokens would be embedded wrong without a word; PyTorch's
    own errors would name no argument."""
    module = uform_torch.load(media_checkpoint)
    tokens, lengths, media = module.pack([pictures()[0], "ab", sounds()[0]], ["image", "text", "audio"])
    values, places, rotary = media
    image = values[0].shape[0]  # 6 patches in row 0
    seq = tokens.shape[1]

    def replaced(values=values, places=places, rotary=rotary):
        return uform_torch.Media(tuple(values), tuple(places), rotary)

    cases = [(None, r"^tokens\[0, 0\]: MEDIA_ID \(259\) with no media to give its value; `pack` builds"),
             ("x", r"^media: expected a uform.torch.Media \(values, places, rotary\), got str"),
             (replaced(values=values[:2]), r"^media.values: expected 3 tensors \(image, video, audio\), got tuple"),
             (replaced(values=(values[0][:5], values[1], values[2])), r"^media.places\[0\]: 6 entries, expected 5"),
             (replaced(values=(values[0][:, :7], values[1], values[2])),
              r"^media.values\[0\]: expected floats \(image tokens, 192\), got torch.float32 of shape \(6, 7\)"),
             (replaced(places=(places[0].int(), places[1], places[2])), r"^media.places\[0\]: expected a \(tokens,\) "
                                                                          "tensor of int64, got torch.int32"),
             (replaced(places=(places[0] * 0, places[1], places[2])), r"^media.places: tokens\[0, 0\] is named by 6 places"),
             (replaced(places=(places[0] + seq, places[1], places[2])),
              r"^media.places: tokens\[0, 0\] holds MEDIA_ID within its item, and no place names it"),
             (replaced(places=(places[0] + 100 * seq, places[1], places[2])), r"^media.places\[0\]\[0\]: \d+ is not a place"),
             (replaced(rotary=None), r"^media.rotary: expected a \(3, \d+, 32\) tensor of int64, got NoneType"),
             (replaced(rotary=rotary.clamp(max=0) - 1), r"^media.rotary\[0, 0, 0\]: -1 is not an angle's index")]
    with torch.no_grad():
        for verb in (module.forward, module.states, module.token_vectors):
            for media_given, message in cases:
                with pytest.raises(uform.InvalidArgument, match=message):
                    verb(tokens, lengths, media_given)
        shifted = torch.cat([tokens[1:2], tokens[:1], tokens[2:]])  # row 1 now holds the image, row 0 the text
        with pytest.raises(uform.InvalidArgument, match=r"^media.places: tokens\[0, 0\] is named, but holds 97, not MEDIA_ID"):
            module(shifted, torch.stack([lengths[1], lengths[0], lengths[2]]), media)
        assert module(tokens, lengths, media).shape == (3, 128)


def test_save_keeps_a_runs_checkpoint(checkpoints, tmp_path):
    module = uform_torch.load(checkpoints["plain"])
    with pytest.raises(uform.InvalidArgument, match=r"holds a whole checkpoint, from which a run resumes; this "
                                                    "weights-only save would lose its moments"):
        uform_torch.save(module, checkpoints["plain"])
    weights = str(tmp_path / "weights.safetensors")
    shutil.copy(checkpoints["plain_weights"], weights)
    uform_torch.save(module, weights.encode())  # over weights only, by a bytes path: nothing of a run's is lost
    assert torch.equal(uform_torch.load(weights.encode()).final_norm, module.final_norm)
    with pytest.raises(uform.InvalidArgument, match=r"^path: expected a str, bytes or os.PathLike, got NoneType"):
        uform_torch.load(None)
    with pytest.raises(uform.InvalidArgument, match=r"^dtype: expected a floating torch.dtype"):
        uform_torch.load(weights, dtype=torch.int32)


def test_bad_media_are_refused_by_name(media_checkpoint):
    module = uform_torch.load(media_checkpoint)
    image, sound = pictures()[0], sounds()[0]
    with pytest.raises(uform.InvalidArgument, match=r"items\[1\]: declared an image, but the bytes are audio \(wav\)"):
        module.embed(["a", sound], ["text", "image"])
    with pytest.raises(uform.InvalidArgument, match=r"items\[0\]: not an image file"):
        module.embed([b"GIF89a" + bytes(20)], ["image"])
    with pytest.raises(uform.InvalidArgument, match=r"items\[0\]: expected the bytes of an encoded image file"):
        module.embed(["a red panda"], ["image"])
    with pytest.raises(uform.InvalidArgument, match=r"modalities: 1 entry, expected 2, one per item"):
        module.embed([image, "a"], ["image"])
    with pytest.raises(uform.InvalidArgument, match=r"modalities: expected a list of Modality, got str"):
        module.embed([image], "image")
    with pytest.raises(uform.InvalidArgument, match=r"modalities\[1\]: 'picture' is not a Modality"):
        module.embed([image, image], ["image", "picture"])
    with pytest.raises(uform.InvalidArgument, match=r"sides\[0\]: only text items are queries"):
        module.embed_tokens([image, "a"], ["image", "text"], sides=["query", "query"])
    with pytest.raises(uform.InvalidArgument, match=r"items\[2\]: empty"):
        module.embed([image, "a", ""], ["image", "text", "text"])
