"""Writes the seed corpora under `fuzz/corpus/`: batches in the byte format `fuzz/batch.c`
decodes, and checkpoints for `fuzz/checkpoint.c` (one real checkpoint of a tiny model, its header
alone, truncations, small crafted files, and headers in the target's 'Z' form, which it completes
with zeroed tensors).

    python fuzz/make_seeds.py                 # needs the package built: `python setup.py build_ext --inplace`
    python fuzz/make_seeds.py --tiny FOLDER   # only the whole tiny checkpoint, into FOLDER
    python fuzz/make_seeds.py --media         # only the media files (needs cjpeg and ffmpeg)

The small corpora are committed; this script says how they were made and remakes them. The whole
tiny checkpoint (3 MB of weights) is not: `.ci/fuzz` writes it into its copy of the corpus from the
package under test, so the seed always matches the format that package reads. Files named
`finding-*` are not made here: each is the input that found a bug, kept so every run replays it
(see fuzz/RESULTS.md).
"""
import json
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import uform  # noqa: F401 - the installed package, when there is one
except ImportError:
    sys.path.insert(0, os.path.dirname(HERE))  # else the checkout's in-place build


# ---------------------------------------------------------------------------------------------- #
#  Batches: the bytes fuzz/batch.c reads, field by field                                           #
# ---------------------------------------------------------------------------------------------- #

def batch(trainer=0, count=2, lengths=None, attract=None, repel=None, ignore=None, bags=None, groups=None,
          sides=None, modalities=None, embeddings=None, weights=None):
    """One batch: `trainer` 0 joint, 1 contrastive, 2 masked; edges as lists of runs per item."""
    lengths = lengths or [3 + i for i in range(count)]
    flags = (0x02 if bags else 0) | (0x04 if groups else 0) | (0x08 if sides else 0) | (0x20 if embeddings is not None else 0)
    out = bytearray([trainer + 3, flags, count])          # head % 3 picks the trainer
    out += bytes(modalities or [0] * count)               # below 224: text
    out += bytes([16, 0, 0])                              # tape of both, count as given, offsets[0] = 0
    out += bytes(lengths)                                 # each below 232: a step of length % 48
    for labels in (bags, groups, sides):
        if labels:
            out += bytes(labels)
    for runs in (attract, repel, ignore):
        if runs is None:
            out += bytes([0])                             # absent
            continue
        out += bytes([104])                               # well formed
        out += bytes(len(run) for run in runs)            # run lengths (each below 4)
        out += bytes([0])                                 # ids_count as the offsets say
        for run in runs:                                  # a start id below 8, then gaps: id += 1 + gap % 3
            start = run[0] if run else 0
            out += bytes([start])
            previous = start
            for i, id in enumerate(run):
                nxt = run[i + 1] if i + 1 < len(run) else previous + 1
                out += bytes([max(0, nxt - previous - 1)])
                previous = nxt
        out += bytes([200 if weights else 0])
        if weights:
            out += bytes(weights[: sum(len(r) for r in runs)])
    if embeddings is not None:
        out += bytes([embeddings])
    return bytes(out)


BATCHES = {
    "pair": batch(attract=[[1], [0]], embeddings=0),
    "pair_contrastive": batch(trainer=1, attract=[[1], [0]]),
    "masked_one": batch(trainer=2, count=1, lengths=[20]),
    "four_relations": batch(count=4, attract=[[1], [0], [3], [2]], repel=[[2], [], [0], []], ignore=[[0], [], [], [3]]),
    "weighted": batch(count=3, attract=[[1, 2], [0], [0]], weights=[0, 1, 2, 3], embeddings=1),
    "bags_groups": batch(count=4, attract=[[1], [0], [3], [2]], bags=[0, 0, 1, 1], groups=[0, 1, 0, 1], embeddings=2),
    "long_items": batch(count=3, lengths=[47, 47, 40], embeddings=3),
    "sixteen": batch(count=16, lengths=[5] * 16),
    "sides": batch(count=2, sides=[0, 0]),
    "image": batch(count=2, modalities=[0, 225]),
    "empty_item": batch(count=2, lengths=[0, 4]),
}


# ---------------------------------------------------------------------------------------------- #
#  Checkpoints                                                                                     #
# ---------------------------------------------------------------------------------------------- #

def safetensors(header, data=b""):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def tiny_checkpoint(path):
    import uform

    config = dict(depth=1, hidden=128, objective=uform.Objective.JOINT, schedule=dict(steps=100),
                  batch=dict(max_rows_per_device=2, max_columns_per_row=16, max_segments_per_device=4))
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
        trainer.step(dict(modalities=[uform.Modality.TEXT] * 2, contents=["ab", "cd"],
                          relations=dict(attract=uform.Edges(offsets=[0, 1, 2], ids=[1, 0]))))
        trainer.save(path)


# ---------------------------------------------------------------------------------------------- #
#  Media: a six-byte header fuzz/media.c reads (kind, patch side, channels, max tokens, tubelet     #
#  and stride, rate and chunk), then a small file of each format, made by Debian's encoders         #
# ---------------------------------------------------------------------------------------------- #

def media(folder):
    import shutil
    import subprocess
    import zlib

    def run(*arguments, data=None):
        return subprocess.run(arguments, input=data, capture_output=True, check=True).stdout

    def made(*arguments, suffix):
        with tempfile.TemporaryDirectory() as scratch:
            target = os.path.join(scratch, "seed." + suffix)
            run(*[word.replace("TARGET", target) for word in arguments])
            with open(target, "rb") as file:
                return file.read()

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = bytes((x * 8 + y * 3 + c * 40) % 256 for y in range(24) for x in range(32) for c in range(3))
    raw = b"".join(b"\x00" + pixels[y * 96:(y + 1) * 96] for y in range(24))
    seeds = {"png": bytes([0, 7, 0, 16, 0, 0]) + b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(
        ">IIBBBBB", 32, 24, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")}
    ppm = b"P6\n32 24\n255\n" + pixels
    lavfi = ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i"]
    makers = {
        "jpeg": (bytes([0, 7, 1, 16, 0, 0]), lambda: run("cjpeg", "-quality", "50", data=ppm), "cjpeg"),
        "jpeg_progressive": (bytes([0, 15, 2, 8, 0, 0]), lambda: run("cjpeg", "-progressive", data=ppm), "cjpeg"),
        "webp": (bytes([0, 7, 0, 16, 0, 0]), lambda: made(*lavfi, "testsrc2=size=32x24", "-frames:v", "1",
                                                           "-c:v", "libwebp", "TARGET", suffix="webp"), "ffmpeg"),
        "wav": (bytes([1, 0, 0, 16, 0, 0]), lambda: made(*lavfi, "sine=duration=0.05:sample_rate=8000", "-ac", "2",
                                                          "TARGET", suffix="wav"), "ffmpeg"),
        "flac": (bytes([1, 0, 0, 16, 0, 64]), lambda: made(*lavfi, "sine=duration=0.1:sample_rate=8000", "TARGET",
                                                            suffix="flac"), "ffmpeg"),
        "mp3": (bytes([1, 0, 0, 16, 0, 2]), lambda: made(*lavfi, "sine=duration=0.1", "-b:a", "32k", "TARGET",
                                                          suffix="mp3"), "ffmpeg"),
        "ogg": (bytes([1, 0, 0, 16, 0, 1]), lambda: made(*lavfi, "sine=duration=0.1", "-c:a", "libopus", "TARGET",
                                                          suffix="ogg"), "ffmpeg"),
        "mp4": (bytes([2, 7, 0, 16, 1, 0]), lambda: made(*lavfi, "testsrc2=size=32x24:rate=5", "-frames:v", "3",
                                                          "-c:v", "libx264", "-pix_fmt", "yuv420p", "TARGET",
                                                          suffix="mp4"), "ffmpeg"),
        "webm": (bytes([2, 7, 0, 16, 1, 0]), lambda: made(*lavfi, "testsrc2=size=32x24:rate=5", "-frames:v", "3",
                                                           "-c:v", "libvpx-vp9", "TARGET", suffix="webm"), "ffmpeg"),
        "mkv": (bytes([2, 7, 0, 16, 65, 0]), lambda: made(*lavfi, "testsrc2=size=32x24:rate=5", "-frames:v", "3",
                                                           "-c:v", "libaom-av1", "-cpu-used", "8", "TARGET",
                                                           suffix="mkv"), "ffmpeg"),
    }
    for name, (header, make, program) in makers.items():
        if shutil.which(program):
            seeds[name] = header + make()
        else:
            print(f"make_seeds.py: no {program}: no media seed {name}")
    os.makedirs(folder, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(folder, name), "wb") as file:
            file.write(data)


def main():
    if sys.argv[1:2] == ["--tiny"]:
        return tiny_checkpoint(os.path.join(sys.argv[2], "tiny"))
    if sys.argv[1:2] == ["--media"]:
        return media(os.path.join(HERE, "corpus", "media"))
    batches = os.path.join(HERE, "corpus", "batch")
    checkpoints = os.path.join(HERE, "corpus", "checkpoint")
    os.makedirs(batches, exist_ok=True)
    os.makedirs(checkpoints, exist_ok=True)
    for name, data in BATCHES.items():
        with open(os.path.join(batches, name), "wb") as file:
            file.write(data)

    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(os.path.join(folder, "tiny.safetensors"))
        with open(os.path.join(folder, "tiny.safetensors"), "rb") as file:
            whole = file.read()
    (length,) = struct.unpack("<Q", whole[:8])
    header = json.loads(whole[8 : 8 + length])
    metadata = header["__metadata__"]
    small = {  # beside "tiny", the whole checkpoint, which loads: the encoder embeds, resume resumes
        "header_only": whole[: 8 + length],
        "truncated_in_data": whole[: 8 + length + 4096],
        "truncated_in_header": whole[: 8 + length // 2],
        "length_only": whole[:8],
        "empty_header": safetensors({}),
        "metadata_only": safetensors({"__metadata__": metadata}),
        "one_tensor": safetensors({"__metadata__": metadata,
                                   "final_norm": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                                  struct.pack("<2f", 1.0, 2.0)),
        "odd_dtypes": safetensors({"a": {"dtype": "F16", "shape": [2, 1], "data_offsets": [0, 4]},
                                   "b": {"dtype": "I64", "shape": [], "data_offsets": [4, 12]}}, bytes(12)),
        # 'Z': the target appends the tiny model's tensors as zeros, so mutations land on the header.
        "zeros_header": b"Z" + whole[: 8 + length],
        "zeros_minimal_config": b"Z" + safetensors(dict(header, __metadata__=dict(
            metadata, config=json.dumps({"depth": 1, "hidden": 128, "contrastive": {"temperature_groups": 1}})))),
        "zeros_note": b"Z" + safetensors(dict(header, __metadata__=dict(
            metadata, note=json.dumps({"step": 1, "cursor": {"shard": "caf\u00e9 \U0001F600"}}) + '\n"\\'))),
    }
    # Headers one edit away from loading, each refused by a check that random edits of JSON text
    # rarely reach: another dtype of the same size, a tensor the geometry lacks, overlapping
    # offsets, rows longer than an encoder packs.
    def edited(change):
        copy = json.loads(json.dumps(header))
        change(copy)
        return b"Z" + safetensors(copy)

    def extra(h):  # empty, so the data keeps its size
        end = max(info["data_offsets"][1] for name, info in h.items() if name != "__metadata__")
        h["blocks.1.final_norm"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}

    def overlap(h):
        h["blocks.0.attention_norm"]["data_offsets"] = [o - 4 for o in h["blocks.0.attention_norm"]["data_offsets"]]

    def columns(h):
        config = json.loads(h["__metadata__"]["config"])
        config["batch"].update(max_rows_per_device=1, max_columns_per_row=65536)
        h["__metadata__"]["config"] = json.dumps(config)

    small.update({
        "zeros_f16_embedding": edited(lambda h: h["text.embedding"].update(dtype="F16", shape=[260, 256])),
        "zeros_extra_tensor": edited(extra),
        "zeros_overlap": edited(overlap),
        "zeros_long_rows": edited(columns),
    })
    for name, data in small.items():
        with open(os.path.join(checkpoints, name), "wb") as file:
            file.write(data)


if __name__ == "__main__":
    main()
