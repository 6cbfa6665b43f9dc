"""The CPU backend beside the PyTorch peer, same geometry, same process, same cores.

    python bench/cpu.py [--peer bench/torch_peer.py] [--threads 2]

For each geometry it trains the joint objective as the peer does: `rows` items of `cols` random
bytes each (one item per row), 15 % of positions shown as the mask id, items 2k and 2k + 1
attracting and every other pair repelling under SigLIP's sigmoid loss. It prints one JSON line per
run (tokens/s, step time) and the ratio uform / peer. The peer runs eager in float32 on the CPU;
`torch` must be installed (`pip install torch`); the peer is `bench/torch_peer.py`.
"""
import argparse
import importlib.util
import json
import os
import time

import numpy as np

import uform

GEOMETRIES = [dict(depth=2, hidden=128, rows=16, cols=64), dict(depth=4, hidden=256, rows=16, cols=128)]


def peer_step(depth, hidden, rows, cols):
    """The peer's step in uform's words: (batch, config). `bench/gpu.py` trains the same."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=rows * cols, dtype=np.uint8)
    offsets = np.arange(0, rows * cols + 1, cols, dtype=np.uint64)
    batch = dict(modalities=[uform.Modality.TEXT] * rows, contents=uform.Tape(data, offsets),
                 relations=dict(attract=uform.Edges(offsets=list(range(rows + 1)), ids=[i ^ 1 for i in range(rows)])))
    config = dict(depth=depth, hidden=hidden, objective=uform.Objective.JOINT,
                  batch=dict(max_rows_per_device=rows, max_columns_per_row=cols, max_segments_per_device=rows),
                  masking=dict(token_mask_probability=0.15, token_mean_span=1, replace_fraction=1.0,
                               random_fraction=1e-9),
                  schedule=dict(steps=1000, learning_rate=1e-3))
    return batch, config


def uform_run(depth, hidden, rows, cols, steps, warmup, threads):
    batch, config = peer_step(depth, hidden, rows, cols)
    with uform.Executor.for_ram(threads=threads) as executor, uform.Trainer.init_ram(executor, config) as trainer:
        for step in range(warmup + steps):
            if step == warmup:
                start = time.perf_counter()
            stats = trainer.step(batch).stats
        seconds = (time.perf_counter() - start) / steps
    return dict(peer="uform", device="cpu", depth=depth, hidden=hidden, rows=rows, cols=cols, threads=threads,
                step_ms=seconds * 1e3, tokens_per_s=rows * cols / seconds, loss=stats.loss)


def load_peer(path):
    spec = importlib.util.spec_from_file_location("torch_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", default=os.path.join(here, "torch_peer.py"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    peer = load_peer(args.peer)
    import torch

    torch.set_num_threads(args.threads)
    for geometry in GEOMETRIES:
        ours = uform_run(**geometry, steps=args.steps, warmup=args.warmup, threads=args.threads)
        print(json.dumps(ours), flush=True)
        theirs = peer.run("eager", **geometry, steps=args.steps, warmup=args.warmup, peak=None, device="cpu")
        print(json.dumps(theirs), flush=True)
        print(json.dumps(dict(geometry, ratio=ours["tokens_per_s"] / theirs["tokens_per_s"])), flush=True)


if __name__ == "__main__":
    main()
