"""The data path's throughput on the CPU, beside the step rate it must feed.

    python bench/data.py [--records 20000] [--step-ms 25.8]

It writes two datasets into a temporary folder, then times `uform.data.Stream` over one epoch of
each at the GPU benchmark's geometry (64 rows of 512 columns per device): the items a second its one
thread reads, decodes, packs and assembles into step batches, while this thread only takes them.

* text pairs in JSONL: a question of ~40 bytes and an answer of ~90;
* image-caption pairs in tar shards of 1,000 samples in WebDataset's layout: a 16 KiB file that
  begins like a JPEG, and a caption of ~50 bytes. The library decodes images, so here the stream
  reads the file's bytes and checks its signature, which is what it does in training.

Beside each it prints the items a GPU step takes at that geometry and the items a second the GPU
asks for at `--step-ms` (bench/RESULTS.md's step time at depth 12, hidden 512 on one H200), and
how many times over one core of the reader keeps up.
"""
import argparse
import io
import json
import os
import platform
import tarfile
import tempfile
import time

import numpy as np

from uform.data import Stream

CONFIG = dict(depth=12, hidden=512, objective="joint", schedule=dict(steps=1),
              batch=dict(max_rows_per_device=64, max_columns_per_row=512))


def write_text_pairs(folder, count):
    path = os.path.join(folder, "pairs.jsonl")
    rng = np.random.default_rng(0)
    with open(path, "w") as lines:
        for i in range(count):
            words = rng.integers(0, 10_000, size=14)
            lines.write(json.dumps(dict(question=f"what does item {i} say about {words[0]} and {words[1]}?",
                                        answer=" ".join(f"word{w}" for w in words[2:]))) + "\n")
    return [path], dict(question="text", answer="text")


def write_image_shards(folder, count, per_shard=1000, image_bytes=16 << 10):
    rng = np.random.default_rng(0)
    paths = []
    for shard in range(0, count, per_shard):
        path = os.path.join(folder, f"images-{shard // per_shard:04d}.tar")
        with tarfile.open(path, "w") as archive:
            for i in range(shard, min(count, shard + per_shard)):
                image = b"\xff\xd8\xff\xe0" + rng.integers(0, 256, size=image_bytes, dtype=np.uint8).tobytes()
                caption = f"a photograph of item {i} with {rng.integers(100)} things in it".encode()
                for extension, data in (("jpg", image), ("txt", caption)):
                    member = tarfile.TarInfo(f"{i:08d}.{extension}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
        paths.append(path)
    return paths, dict(jpg="image", txt="text")


def measure(paths, columns, records):
    """(items a second, items a step, steps) over one epoch of the stream, its thread ahead of this one."""
    dataset = dict(paths=paths, columns=columns, shuffle_buffer=1024, prefetch=4)
    items = steps = seen = 0
    start = time.perf_counter()
    with Stream(dataset, CONFIG) as stream:
        for step in stream:
            if seen + len(step.locations) > records:  # the next epoch has begun
                break
            seen += len(step.locations)
            items += len(step.batch["modalities"])
            steps += 1
    seconds = time.perf_counter() - start
    return items / seconds, items / max(steps, 1), steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--step-ms", type=float, default=25.8)
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; one reader thread")
    with tempfile.TemporaryDirectory() as folder:
        for name, write in (("text pairs, JSONL", write_text_pairs), ("image-caption pairs, tar", write_image_shards)):
            paths, columns = write(folder, args.records)
            rate, per_step, steps = measure(paths, columns, args.records)
            needed = per_step / (args.step_ms / 1000)
            print(json.dumps(dict(data=name, records=args.records, steps=steps, items_per_second=round(rate),
                                  items_per_step=round(per_step, 1), gpu_asks_items_per_second=round(needed),
                                  keeps_up=round(rate / needed, 2))))


if __name__ == "__main__":
    main()
