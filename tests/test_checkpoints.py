"""Hostile checkpoints: files cut short, lying about their lengths, malformed, or well formed but
wrong, each refused through both readers (`Trainer.init_ram(..., resume=)` and `Encoder.load`) with
an error that names what is wrong, and a good checkpoint still loading after all of them."""
import json
import os
import struct

import numpy as np
import pytest

import uform

TEXT = uform.Modality.TEXT
TINY = dict(depth=1, hidden=128, objective=uform.Objective.JOINT, seed=11, schedule=dict(steps=100),
            batch=dict(max_rows_per_device=2, max_columns_per_row=16, max_segments_per_device=4))


@pytest.fixture(scope="module")
def cpu():
    executor = uform.Executor.for_ram(threads=1)
    yield executor
    executor.free()


@pytest.fixture(scope="module")
def good(cpu, tmp_path_factory):
    """A checkpoint of the tiny model after two steps, so both moments hold values."""
    path = str(tmp_path_factory.mktemp("good") / "tiny.safetensors")
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        for _ in range(2):
            trainer.step(dict(modalities=[TEXT] * 2, contents=["red panda", "bamboo"],
                              relations=dict(attract=uform.Edges(offsets=[0, 1, 2], ids=[1, 0]))))
        trainer.save(path)
    return path


class Checkpoint:
    """A checkpoint taken apart: its metadata (with the config parsed beside it), and its tensors in
    file order as [dtype, shape, bytes]."""

    def __init__(self, path):
        with open(path, "rb") as file:
            whole = file.read()
        (length,) = struct.unpack("<Q", whole[:8])
        header = json.loads(whole[8 : 8 + length])
        data = whole[8 + length :]
        self.metadata = header.pop("__metadata__")
        self.config = json.loads(self.metadata["config"])
        ordered = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
        self.tensors = {name: [info["dtype"], info["shape"], data[slice(*info["data_offsets"])]] for name, info in ordered}

    def header(self):
        """The header as safetensors lays it out: the tensors' bytes one after another."""
        header, offset = {"__metadata__": dict(self.metadata)}, 0
        for name, (dtype, shape, data) in self.tensors.items():
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
        return header

    def data(self):
        return b"".join(data for _, _, data in self.tensors.values())

    def write(self, path, header=None, data=None):
        text = header if isinstance(header, bytes) else json.dumps(header or self.header()).encode()
        with open(path, "wb") as file:
            file.write(struct.pack("<Q", len(text)) + text + (self.data() if data is None else data))
        return path


def refused(cpu, path, error, message, resume=True, encoder=True):
    """Both readers refuse `path` with `error`, and the message names the problem."""
    if resume:
        with pytest.raises(error, match=message):
            uform.Trainer.init_ram(cpu, dict(TINY, resume=str(path)))
    if encoder:
        with pytest.raises(error, match=message):
            uform.Encoder.load(str(path), cpu)


def raw(path, data):
    with open(path, "wb") as file:
        file.write(data)
    return path


# ---------------------------------------------------------------------------------------------- #
#  Lengths                                                                                         #
# ---------------------------------------------------------------------------------------------- #


def test_truncated_at_many_lengths(cpu, good, tmp_path):
    with open(good, "rb") as file:
        whole = file.read()
    (length,) = struct.unpack("<Q", whole[:8])
    data_start = 8 + length
    cuts = {
        0: "0 bytes, too short",
        1: "1 bytes, too short",
        7: "7 bytes, too short",
        8: rf"claims a header of {length} bytes, but only 0 bytes follow",
        9: rf"claims a header of {length} bytes, but only 1 bytes follow",
        data_start // 2: rf"claims a header of {length} bytes, but only",
        data_start - 1: rf"claims a header of {length} bytes, but only {length - 1} bytes follow",
        data_start: "runs past the end of the data, 0 bytes: the file is truncated",
        data_start + 1: "runs past the end of the data, 1 bytes",
        data_start + 133120: r"tensor blocks\.0\.attention_norm at bytes \[133120, 133632\) runs past the end",
        len(whole) // 2: "runs past the end of the data",
        len(whole) - 1: r"tensor adamw\.second\.contrastive\.bias at bytes .* runs past the end",
    }
    for cut, message in cuts.items():
        refused(cpu, raw(tmp_path / f"cut{cut}.safetensors", whole[:cut]), uform.InvalidCheckpoint, message)


def test_header_lengths_that_lie(cpu, good, tmp_path):
    with open(good, "rb") as file:
        whole = file.read()
    (length,) = struct.unpack("<Q", whole[:8])
    rest = len(whole) - 8
    for claimed in (rest + 1, 2**32, 2**63, 2**64 - 1):
        path = raw(tmp_path / "lying.safetensors", struct.pack("<Q", claimed) + whole[8:])
        refused(cpu, path, uform.InvalidCheckpoint, rf"claims a header of {claimed} bytes, but only {rest} bytes follow")
    for claimed in (0, 1):
        path = raw(tmp_path / "small.safetensors", struct.pack("<Q", claimed) + whole[8:])
        refused(cpu, path, uform.InvalidCheckpoint, rf"claims a header of {claimed} bytes; a header takes 2 bytes")
    # A shorter length cuts the JSON, so the parser meets the end of the header mid-value.
    path = raw(tmp_path / "short.safetensors", struct.pack("<Q", length - 100) + whole[8:])
    refused(cpu, path, uform.InvalidCheckpoint, "malformed header at byte")


def test_bytes_after_the_last_tensor(cpu, good, tmp_path):
    with open(good, "rb") as file:
        whole = file.read()
    refused(cpu, raw(tmp_path / "long.safetensors", whole + b"\0" * 12), uform.InvalidCheckpoint,
            "12 bytes after the last tensor belong to no tensor")


# ---------------------------------------------------------------------------------------------- #
#  The header's JSON                                                                               #
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("header, message", [
    (b"{}", "lacks __metadata__"),
    (b"  ", "malformed header at byte 10: the JSON ends where '{' belongs"),
    (b"[]", "malformed header at byte 8: expected '{', found '\\['"),
    (b'{"__metadata__": {"format": "uform/1",}}', "malformed header at byte 46: expected '\"', found '}'"),
    (b'{"__metadata__" {}}', "expected ':', found '{'"),
    (b"{'__metadata__': {}}", "expected '\"', found '''"),
    (b'{"__metadata__": {"format": "uform/1"}} x', "bytes after the header's JSON object"),
    (b'{"__metadata__": {"format": "uform/1"}', "the JSON ends where '}' belongs"),
    (b'{"__metadata__": {"format": "uform/1\\q"}}', r"an unknown escape \\q"),
    (b'{"__metadata__": {"format": "uform/1\\ud800"}}', r"an unpaired surrogate \\ud800"),
    (b'{"__metadata__": {"format": "uform\\u0000/1"}}', r"\\u0000 inside a string"),
    (b'{"__metadata__": {"format": "uform/1\n"}}', r"a raw control character \(0x0a\) inside a string"),
    (b'{"__metadata__": {"format": 1}}', r"__metadata__\.format is not a string"),
    (b'{"__metadata__": []}', "expected '{', found '\\['"),
    (b'{"__metadata__": {}, "__metadata__": {}}', "__metadata__ is given twice"),
    (b'{"__metadata__": {"step": "1", "step": "2"}}', r"__metadata__\.step is given twice"),
    (b'{"__metadata__": {"note": "a", "note": "b"}}', r"__metadata__\.note is given twice"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": tru}}', "'t' does not start a JSON value"),
    (b'{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', "expected a non-negative integer"),
    (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "expected a non-negative integer"),
    (b'{"a": {"dtype": "F32", "shape": [01], "data_offsets": [0, 4]}}', "a number with a leading zero"),
    (b'{"a": {"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 4]}}', r"a number over 2\^64 - 1"),
    (b'{"a": {"dtype": "F32", "shape": [1,2,3,4,5,6,7,8,9], "data_offsets": [0, 4]}}', "shape has more than 8 entries"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}', "data_offsets has more than 2 entries"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}', "data_offsets has 1 entry, not 2"),
    (b'{"a": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', '"dtype" is given twice'),
    (b'{"a": {"shape": [1], "data_offsets": [0, 4]}}', "tensor a lacks its dtype"),
    (b'{"a": {}}', "tensor a lacks its dtype"),
    (b'{"a": {"dtype": "F32", "data_offsets": [0, 4]}}', "tensor a lacks its shape"),
    (b'{"a": {"dtype": "F32", "shape": [1]}}', "tensor a lacks its data_offsets"),
    (b'{"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}', 'dtype "F33" is not one safetensors defines'),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "deep": ' + b"[" * 40 + b"]" * 40 + b"}}",
     "JSON nested deeper than 32"),
    (b'{"' + b"n" * 200 + b'": {}}', "a tensor name of 200 bytes, over 95"),
])
def test_malformed_headers(cpu, tmp_path, header, message):
    path = raw(tmp_path / "bad.safetensors", struct.pack("<Q", len(header)) + header + b"\0" * 8)
    refused(cpu, path, uform.InvalidCheckpoint, message)
    with pytest.raises(uform.InvalidCheckpoint, match=message):  # the note's reader shares the parser
        uform.checkpoint_note(path)


def test_non_utf8_bytes_in_a_name(cpu, good, tmp_path):
    checkpoint = Checkpoint(good)
    text = json.dumps(checkpoint.header()).encode()
    at = text.index(b'"final_norm"') + 1
    broken = text[:at] + b"fin\xff\xfe" + text[at + 3 :]
    refused(cpu, checkpoint.write(tmp_path / "bytes.safetensors", broken), uform.InvalidCheckpoint,
            rf"has a header that is not UTF-8 at byte {8 + at + 3} \(0xff\)")
    # An overlong encoding of '/' and an encoded surrogate are not UTF-8 either.
    for sequence in (b"\xc0\xaf", b"\xed\xa0\x80"):
        broken = text[:at] + sequence + text[at + len(sequence) :]
        refused(cpu, checkpoint.write(tmp_path / "bytes.safetensors", broken), uform.InvalidCheckpoint, "not UTF-8")


def test_escaped_names_are_decoded_not_cut(cpu, good, tmp_path):
    """`\\u0069` is an 'i': a name written with escapes is the same name, so the file loads."""
    checkpoint = Checkpoint(good)
    text = json.dumps(checkpoint.header()).encode().replace(b'"final_norm"', b'"f\\u0069nal_norm"')
    path = checkpoint.write(tmp_path / "escaped.safetensors", text)
    with uform.Encoder.load(str(path), cpu) as encoder:
        assert encoder.hidden == 128


# ---------------------------------------------------------------------------------------------- #
#  Tensors                                                                                         #
# ---------------------------------------------------------------------------------------------- #


def edit_offsets(checkpoint, name, change):
    header = checkpoint.header()
    header[name]["data_offsets"] = change(header[name]["data_offsets"])
    return header


def test_data_offsets_overlapping_reversed_or_past_the_end(cpu, good, tmp_path):
    checkpoint = Checkpoint(good)
    path = tmp_path / "offsets.safetensors"
    overlapping = edit_offsets(checkpoint, "blocks.0.attention_norm", lambda o: [o[0] - 4, o[1] - 4])
    refused(cpu, checkpoint.write(path, overlapping), uform.InvalidCheckpoint,
            r"tensor blocks\.0\.attention_norm at bytes \[133116, 133628\) overlaps tensor text\.embedding at \[0, 133120\)")
    reversed_ = edit_offsets(checkpoint, "final_norm", lambda o: [o[1], o[0]])
    refused(cpu, checkpoint.write(path, reversed_), uform.InvalidCheckpoint,
            r"tensor final_norm has data_offsets \[\d+, \d+\], which run backwards")
    size = len(checkpoint.data())
    past = edit_offsets(checkpoint, "adamw.second.contrastive.bias", lambda o: [size, size + 4])
    refused(cpu, checkpoint.write(path, past), uform.InvalidCheckpoint,
            rf"tensor adamw\.second\.contrastive\.bias at bytes \[{size}, {size + 4}\) runs past the end of the data")
    far = edit_offsets(checkpoint, "final_norm", lambda o: [2**64 - 8, 2**64 - 4])
    refused(cpu, checkpoint.write(path, far), uform.InvalidCheckpoint, "tensor final_norm at bytes .* runs past the end")
    gap = edit_offsets(checkpoint, "contrastive.bias", lambda o: [o[0] + 4, o[1] + 4])
    refused(cpu, checkpoint.write(path, gap), uform.InvalidCheckpoint,
            r"4 bytes at \[\d+, \d+\) before tensor contrastive\.bias belong to no tensor")
    short = edit_offsets(checkpoint, "final_norm", lambda o: [o[0], o[1] - 4])
    refused(cpu, checkpoint.write(path, short), uform.InvalidCheckpoint,
            r"tensor final_norm spans 508 bytes, but its shape \[128\] of F32 needs 512")


def test_huge_shapes_whose_product_overflows(cpu, good, tmp_path):
    checkpoint = Checkpoint(good)
    header = checkpoint.header()
    header["final_norm"]["shape"] = [2**40, 2**40]
    refused(cpu, checkpoint.write(tmp_path / "huge.safetensors", header), uform.InvalidCheckpoint,
            r"tensor final_norm has shape \[1099511627776, 1099511627776\], whose size overflows 64 bits")
    header["final_norm"]["shape"] = [2**62]
    refused(cpu, checkpoint.write(tmp_path / "huge.safetensors", header), uform.InvalidCheckpoint,
            "whose size overflows 64 bits")
    header["final_norm"]["shape"] = [2**61, 0]  # empty, so it holds no bytes, not 512
    refused(cpu, checkpoint.write(tmp_path / "huge.safetensors", header), uform.InvalidCheckpoint,
            r"spans 512 bytes, but its shape \[2305843009213693952, 0\] of F32 needs 0")


def test_wrong_dtypes_and_ranks(cpu, good, tmp_path):
    path = tmp_path / "dtype.safetensors"
    for dtype, shape, shown in (("F16", [260, 256], r"F16 \[260, 256\]"), ("I64", [260, 64], r"I64 \[260, 64\]"),
                                ("F32", [260 * 128], r"F32 \[33280\]"), ("F32", [260, 128, 1], r"F32 \[260, 128, 1\]"),
                                ("F32", [128, 260], r"F32 \[128, 260\]")):
        checkpoint = Checkpoint(good)
        checkpoint.tensors["text.embedding"][:2] = [dtype, shape]
        refused(cpu, checkpoint.write(path), uform.InvalidCheckpoint,
                rf"holds text\.embedding as {shown}, the model needs F32 \[260, 128\]")
    checkpoint = Checkpoint(good)
    checkpoint.tensors["adamw.first.final_norm"][1] = [1, 128]
    refused(cpu, checkpoint.write(path), uform.InvalidCheckpoint,
            r"holds adamw\.first\.final_norm as F32 \[1, 128\], the model needs F32 \[128\]")


def test_missing_extra_and_duplicate_tensors(cpu, good, tmp_path):
    path = tmp_path / "tensors.safetensors"
    for name in ("final_norm", "adamw.second.blocks.0.qkv", "contrastive.bias"):
        checkpoint = Checkpoint(good)
        del checkpoint.tensors[name]
        refused(cpu, checkpoint.write(path), uform.InvalidCheckpoint, rf"lacks the tensor {name.replace('.', '[.]')}")
    checkpoint = Checkpoint(good)
    checkpoint.tensors["blocks.1.attention_norm"] = ["F32", [128], bytes(512)]
    refused(cpu, checkpoint.write(path), uform.InvalidCheckpoint,
            r"holds the tensor blocks\.1\.attention_norm, which a model of depth 1, hidden 128 and 1 temperature groups lacks")
    # Written by hand: a JSON object with one name twice, the second over other bytes.
    checkpoint = Checkpoint(good)
    checkpoint.tensors["zzz"] = ["F32", [128], bytes(512)]
    text = json.dumps(checkpoint.header()).encode().replace(b'"zzz"', b'"final_norm"')
    refused(cpu, checkpoint.write(path, text), uform.InvalidCheckpoint, "gives the tensor final_norm twice")


def test_values_that_no_run_saves(cpu, good, tmp_path):
    path = tmp_path / "values.safetensors"
    for name, value, message in (("blocks.0.qkv", np.nan, r"holds nan in blocks\.0\.qkv at element 5; values must be finite"),
                                 ("adamw.first.text.decoder", np.inf, r"holds inf in adamw\.first\.text\.decoder at element 5"),
                                 ("adamw.second.final_norm", -1.0,
                                  r"holds -1 in adamw\.second\.final_norm at element 5; second moments must be finite and not negative")):
        checkpoint = Checkpoint(good)
        values = np.frombuffer(checkpoint.tensors[name][2], np.float32).copy()
        values[5] = value
        checkpoint.tensors[name][2] = values.tobytes()
        moment = name.startswith("adamw.")
        refused(cpu, checkpoint.write(path), uform.InvalidCheckpoint, message, encoder=not moment)
        if moment:  # an encoder reads the weights alone: a moment's values are the resumed run's to judge
            with uform.Encoder.load(str(path), cpu) as encoder:
                assert np.isfinite(np.asarray(encoder.embed([TEXT], ["red panda"]))).all()


# ---------------------------------------------------------------------------------------------- #
#  Metadata and the config in it                                                                   #
# ---------------------------------------------------------------------------------------------- #


def with_metadata(checkpoint, **changes):
    for key, value in changes.items():
        if value is None:
            checkpoint.metadata.pop(key)
        else:
            checkpoint.metadata[key] = value
    return checkpoint


@pytest.mark.parametrize("changes, message", [
    (dict(format=None), r"lacks __metadata__\.format"),
    (dict(format="uform/2"), 'has format "uform/2", not "uform/1"'),
    (dict(format="x" * 40), r'__metadata__\.format is 40 bytes long, not "uform/1"'),
    (dict(step=None), r"lacks its step in __metadata__\.step"),
    (dict(step=""), r'__metadata__\.step "" is not a step count'),
    (dict(step="12a"), r'__metadata__\.step "12a" is not a step count'),
    (dict(step="-1"), r'__metadata__\.step "-1" is not a step count'),
    (dict(step=" 1"), r'__metadata__\.step " 1" is not a step count'),
    (dict(step="18446744073709551616"), r'__metadata__\.step "18446744073709551616" is not a step count'),
    (dict(step="9223372036854775808"), r"__metadata__\.step 9223372036854775808 is past 2\^63"),
    (dict(step="1" * 40), r'__metadata__\.step "1111111111111111111111111111111\.\.\." is not a step count'),
    (dict(config=None), r"lacks its config in __metadata__\.config"),
    (dict(config="x" * 5000), r"__metadata__\.config is 5000 bytes, over 4095"),
    (dict(note=["a cursor"]), r"__metadata__\.note is not a string"),
])
def test_metadata(cpu, good, tmp_path, changes, message):
    checkpoint = with_metadata(Checkpoint(good), **changes)
    refused(cpu, checkpoint.write(tmp_path / "metadata.safetensors"), uform.InvalidCheckpoint, message)


def config_text(checkpoint, text):
    header = checkpoint.header()
    header["__metadata__"]["config"] = text
    return header


@pytest.mark.parametrize("edit, message", [
    (lambda c: "{", r"malformed __metadata__\.config at byte 1: the JSON ends where '\"' belongs"),
    (lambda c: "[]", r"malformed __metadata__\.config at byte 0: expected '\{', found '\['"),
    (lambda c: json.dumps(c) + "x", r"malformed __metadata__\.config at byte \d+: bytes after the config's JSON object"),
    (lambda c: json.dumps(dict(c, depth="1")), r"config\.depth is not an integer in \[0, 2\^32\)"),
    (lambda c: json.dumps(dict(c, depth=1.0)), r"config\.depth is not an integer in \[0, 2\^32\)"),
    (lambda c: json.dumps(dict(c, depth=-1)), r"config\.depth is not an integer in \[0, 2\^32\)"),
    (lambda c: json.dumps(dict(c, hidden=2**32 + 128)), r"config\.hidden is not an integer in \[0, 2\^32\)"),
    (lambda c: json.dumps(dict(c, batch=dict(c["batch"], max_rows_per_device=[2]))),
     r"config\.batch\.max_rows_per_device is not an integer"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "depth"}), r"has no config\.depth in its metadata, or 0"),
    (lambda c: json.dumps(dict(c, depth=0)), r"has no config\.depth in its metadata, or 0, where a model needs one"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden"}), r"has no config\.hidden in its metadata"),
    (lambda c: json.dumps(dict(c, contrastive={})), r"has no config\.contrastive\.temperature_groups in its metadata"),
    (lambda c: json.dumps(c)[:-1] + ', "depth": 1}', r"config\.depth is given twice"),
    (lambda c: json.dumps(dict(c, note=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])),
     "JSON nested deeper than 32"),
])
def test_malformed_configs(cpu, good, tmp_path, edit, message):
    checkpoint = Checkpoint(good)
    refused(cpu, checkpoint.write(tmp_path / "config.safetensors", config_text(checkpoint, edit(checkpoint.config))),
            uform.InvalidCheckpoint, message)


def test_a_config_claiming_another_geometry(cpu, good, tmp_path):
    checkpoint = Checkpoint(good)
    path = tmp_path / "geometry.safetensors"
    deeper = config_text(checkpoint, json.dumps(dict(checkpoint.config, depth=2)))
    checkpoint.write(path, deeper)
    refused(cpu, path, uform.InvalidCheckpoint, r"has depth = 2, the config asks for 1", encoder=False)
    refused(cpu, path, uform.InvalidCheckpoint, r"lacks the tensor blocks\.1\.attention_norm", resume=False)
    wider = config_text(checkpoint, json.dumps(dict(checkpoint.config, hidden=256)))
    checkpoint.write(path, wider)
    refused(cpu, path, uform.InvalidCheckpoint, r"has hidden = 256, the config asks for 128", encoder=False)
    refused(cpu, path, uform.InvalidCheckpoint, r"holds text\.embedding as F32 \[260, 128\], the model needs F32 \[260, 256\]",
            resume=False)
    groups = config_text(checkpoint, json.dumps(dict(checkpoint.config, contrastive=dict(temperature_groups=3))))
    checkpoint.write(path, groups)
    refused(cpu, path, uform.InvalidCheckpoint, r"has contrastive\.temperature_groups = 3, the config asks for 1", encoder=False)
    # What the encoder builds from the file is checked as a trainer's config would be.
    for change, message in ((dict(hidden=200), r"records a config no trainer takes: config\.hidden: 200"),
                            (dict(depth=300), r"records a config no trainer takes: config\.depth: 300"),
                            (dict(contrastive=dict(temperature_groups=65)),
                             r"records a config no trainer takes: config\.contrastive\.temperature_groups: 65"),
                            (dict(batch=dict(max_rows_per_device=1, max_columns_per_row=2**20)),
                             r"config\.batch\.max_columns_per_row: 1048576 is over 16384, the longest row an encoder embeds")):
        checkpoint.write(path, config_text(checkpoint, json.dumps(dict(checkpoint.config, **change))))
        refused(cpu, path, uform.InvalidCheckpoint, message, resume=False)


def test_a_refused_resume_names_what_to_do_next(cpu, good, tmp_path):
    """Resuming, a config that differs from the checkpoint's names the field to set as the checkpoint has it, and a file
    no run resumes from says to take another; an encoder, with no run to mend, hears the reason alone."""
    checkpoint = Checkpoint(good)
    path = tmp_path / "geometry.safetensors"
    for change, then in ((dict(depth=2), "set config.depth = 2 to resume from it"),
                         (dict(contrastive=dict(temperature_groups=3)),
                          "set config.contrastive.temperature_groups = 3 to resume from it")):
        checkpoint.write(path, config_text(checkpoint, json.dumps(dict(checkpoint.config, **change))))
        with pytest.raises(uform.InvalidCheckpoint, match=rf"^resume: the checkpoint .*, the config asks for 1; "
                                                          rf"{then.replace('.', '[.]')}$"):
            uform.Trainer.init_ram(cpu, dict(TINY, resume=str(path)))
    whole = open(good, "rb").read()
    cut = raw(tmp_path / "cut.safetensors", whole[: len(whole) - 100])
    for damaged, error in ((cut, uform.InvalidCheckpoint), (tmp_path / "missing.safetensors", uform.StorageError)):
        with pytest.raises(error, match=r"^resume: .*; resume from another checkpoint$"):
            uform.Trainer.init_ram(cpu, dict(TINY, resume=str(damaged)))
        with pytest.raises(error) as refused:
            uform.Encoder.load(str(damaged), cpu)
        assert str(refused.value).startswith("path: ") and "another checkpoint" not in str(refused.value)


def test_only_the_configs_own_fields_are_read(cpu, good, tmp_path):
    """Keys inside strings or nested objects do not count: the first reader searched the text for
    `"depth": ` and took a nested object's depth for the run's."""
    checkpoint = Checkpoint(good)
    decoy = dict(note='"depth": 2, "hidden": 256', other=dict(depth=7, hidden=9), **checkpoint.config)
    path = checkpoint.write(tmp_path / "decoy.safetensors", config_text(checkpoint, json.dumps(decoy)))
    with uform.Trainer.init_ram(cpu, dict(TINY, resume=str(path))) as trainer:
        pair = dict(modalities=[TEXT] * 2, contents=["x", "y"], relations=dict(attract=uform.Edges([0, 1, 2], [1, 0])))
        assert trainer.step(pair).stats.step == 3
    with uform.Encoder.load(str(path), cpu) as encoder:
        assert encoder.hidden == 128


# ---------------------------------------------------------------------------------------------- #
#  Files that are not files, and the good one after all of that                                   #
# ---------------------------------------------------------------------------------------------- #


def test_a_folder_is_a_storage_error(cpu, tmp_path):
    refused(cpu, tmp_path, uform.StorageError, "is not a regular file")
    refused(cpu, tmp_path / "missing.safetensors", uform.StorageError, r"cannot open .*missing\.safetensors")


def test_the_good_checkpoint_still_loads(cpu, good, tmp_path):
    items = ["red panda", "bamboo"]
    with uform.Trainer.init_ram(cpu, dict(TINY, resume=good)) as trainer:
        assert trainer.step(dict(modalities=[TEXT] * 2, contents=items)).stats.step == 3
    with uform.Encoder.load(good, cpu) as encoder:
        vectors = np.asarray(encoder.embed([TEXT] * 2, items))
    assert vectors.shape == (2, 128)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # Rewritten through our own layout code, the same tensors and metadata still load.
    again = Checkpoint(good).write(tmp_path / "again.safetensors")
    with uform.Encoder.load(str(again), cpu) as encoder:
        assert np.allclose(np.asarray(encoder.embed([TEXT] * 2, items)), vectors, atol=1e-6)
