"""What the host costs between steps on one GPU: the same batch fed four ways, 20 steps each, twice.

    python bench/between_steps.py

A dict each step (normalized and pinned every time), one `Decoded` reused (nothing to normalize),
and both again as deferred steps submitted two ahead; then what normalizing a batch and the
executor's worker hop cost alone. Prints the step time and `stats.host_seconds` (packing and upload).
"""
import time
import timeit

import uform
from cpu import peer_step  # bench/ is this script's folder, first on the path
from uform.batch import normalize_batch


def timed(trainer, feed, ahead, steps=20, warmup=5):
    for _ in range(warmup):
        trainer.step(feed)
    deferred, host, start = trainer.deferred(), 0.0, time.perf_counter()
    pending = [deferred.step(feed) for _ in range(min(ahead, steps))]
    for i in range(steps):
        stats = pending.pop(0).wait().stats if ahead else trainer.step(feed).stats
        host += stats.host_seconds
        if ahead and i + ahead < steps:
            pending.append(deferred.step(feed))
    return (time.perf_counter() - start) / steps * 1e3, host / steps * 1e3


def main():
    batch, config = peer_step(12, 512, 64, 512)
    with uform.Executor.for_vram() as executor, uform.Trainer.init_vram(executor, config) as trainer:
        decoded = trainer.decode(batch)
        for _ in range(2):
            for name, feed, ahead in (("dict", batch, 0), ("decoded", decoded, 0), ("dict, 2 ahead", batch, 2),
                                      ("decoded, 2 ahead", decoded, 2)):
                step_ms, host_ms = timed(trainer, feed, ahead)
                print(f"{name:17s} step {step_ms:7.3f} ms  host_seconds {host_ms:6.3f} ms", flush=True)
        worker, n = trainer._worker(), 200
        print(f"normalize_batch {timeit.timeit(lambda: normalize_batch(batch), number=n) / n * 1e6:.1f} us")
        print(f"worker hop {timeit.timeit(lambda: worker.run(lambda: None, 'noop'), number=n) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()
