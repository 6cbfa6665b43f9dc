"""The CUDA backend beside the PyTorch peer (`bench/torch_peer.py`), same geometry, same GPU, one process.

    python bench/gpu.py                      # the three geometries of the performance target
    python bench/gpu.py --geometry 12 512 64 512 --steps 30
    python bench/gpu.py --geometry 12 512 64 512 --determinism fast   # the runs' last bits may vary
    python bench/gpu.py --geometry 12 512 64 512 --in-flight 1        # each step waited for before the next
    UFORM_HOPPER_ATTENTION=0 python bench/gpu.py --geometry 12 512 64 512  # cuDNN's attention on Hopper too
    python bench/gpu.py --geometry 12 512 64 512 --no-peer --profile  # and each kernel's share
    python bench/gpu.py --geometry 12 512 64 512 --no-peer --profile --timeline step.txt  # and one step's kernels
    python bench/gpu.py --geometry 12 512 64 512 --no-peer --trial UFORM_HOPPER_PRODUCTS=0 --rounds 2
                                             # as it is, then with that setting, twice over: an A/B in one process

For each geometry it trains the joint objective as the peer does: `rows` items of `cols` random
bytes, one item per row, about 15 % of positions shown as the mask id, items 2k and 2k + 1
attracting and every other pair repelling under SigLIP's sigmoid loss. It prints one JSON line
per run with tokens/s, the step time (uform's deferred steps kept two submitted, as the peer's
loop keeps its device queued: the next step's batch is packed and queued while the device runs
this one), MFU against a bf16 8192^3 matrix product timed in this run,
uform's host share (the part of a step spent validating, packing and queueing the upload before
the GPU can start: `stats.host_seconds` over the step's time), and
device memory (uform: the free memory its trainer took; the peer: PyTorch's peak), then the
ratio of uform to the compiled peer. `torch` must be installed; the peer's modes are eager and
compiled. A `--trial` runs uform again with its environment variables set (those the library reads
as an executor opens: `UFORM_HOPPER_PRODUCTS`, `UFORM_HOPPER_ATTENTION`, `UFORM_ATTENTION_TURNS`,
`UFORM_DEPENDENT_LAUNCHES`), its JSON line naming it, after a run as it is.
"""
import argparse
import collections
import importlib.util
import json
import os
import sys
import time

import uform
from cpu import peer_step  # bench/ is this script's folder, first on the path

GEOMETRIES = [(12, 512, 64, 512), (12, 512, 128, 512), (12, 768, 64, 512)]


def flops_per_token(depth, hidden, cols):
    """As the peer counts: 6 x the non-embedding parameters, plus attention's products, forward and backward."""
    parameters = depth * (12 * hidden * hidden + 2 * hidden) + hidden + 256 * hidden + 2
    return 6 * parameters + 6 * 2 * depth * cols * hidden


def kernel_shares(trainer, batch, torch, in_flight, steps=8, timeline=None):
    """Each kernel's device time a step over `steps` steps under torch's profiler (which sees every
    library's kernels in the process), largest first, then the device's idle time between kernels
    and its largest gaps with the kernels on either side, printed to stderr."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        timed_steps(trainer, batch, steps, 0, in_flight)
    rows = [(getattr(e, "self_device_time_total", 0), e.count, e.key) for e in profiled.key_averages()]
    rows = sorted((r for r in rows if r[0] > 0), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"kernels: {total / steps / 1e3:.2f} ms a step", file=sys.stderr)
    for micros, count, name in rows[:30]:
        print(f"{100 * micros / total:5.1f} %  {micros / steps:8.1f} us  {count // steps:4d} calls  {name[:110]}",
              file=sys.stderr)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in profiled.events()
                   if e.device_type == DeviceType.CUDA)
    gaps = sorted(((b[0] - a[1], a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]), reverse=True)
    print(f"idle between kernels: {sum(g[0] for g in gaps) / steps / 1e3:.2f} ms a step "
          f"({len(gaps) / steps:.0f} gaps); the largest:", file=sys.stderr)
    for micros, before, after in gaps[:12]:
        print(f"  {micros:8.1f} us  after {before[:60]}  before {after[:60]}", file=sys.stderr)
    host_calls(profiled, steps, timeline)


def host_calls(profiled, steps, timeline=None):
    """The CUDA calls the host made, and which of the device's gaps it caused: a gap is the host's when
    the kernel after it was launched less than 2 us before it began (the device had nothing queued).
    `timeline` names a file for one step's kernels, each with the gap before it and its time in us."""
    try:
        events = [(e.name(), e.device_type(), e.start_ns(), e.duration_ns(), e.correlation_id())
                  for e in profiled.profiler.kineto_results.events()]
    except AttributeError:
        return
    from torch.autograd import DeviceType

    calls, launched, kernels = {}, {}, []
    for name, device, start, duration, correlation in events:
        if device == DeviceType.CPU and name.startswith(("cuda", "cu")):
            total, count = calls.get(name, (0, 0))
            calls[name] = (total + duration, count + 1)
            launched[correlation] = start + duration
        elif device == DeviceType.CUDA:
            kernels.append((start, start + duration, correlation, name))
    print("host CUDA calls a step:", file=sys.stderr)
    for name, (total, count) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {total / steps / 1e3:8.1f} us  {count / steps:6.1f} calls  {name[:80]}", file=sys.stderr)
    kernels.sort()
    starved, queued, late = 0, 0, {}
    for a, b in zip(kernels, kernels[1:]):
        gap = b[0] - a[1]
        if gap <= 0:
            continue
        if b[2] in launched and launched[b[2]] > b[0] - 2000:
            starved += gap
            key = (a[3][:50], b[3][:50])
            late[key] = late.get(key, 0) + gap
        else:
            queued += gap
    print(f"gaps the host caused: {starved / steps / 1e6:.2f} ms a step; with the next kernel queued: "
          f"{queued / steps / 1e6:.2f} ms a step; the host's largest, summed by neighbours:", file=sys.stderr)
    for (before, after), gap in sorted(late.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {gap / steps / 1e3:8.1f} us  after {before}  before {after}", file=sys.stderr)
    if timeline:  # one whole step, between the second and third downloads of the stats
        ends = [i for i, k in enumerate(kernels) if k[3].startswith("Memcpy DtoH")]
        with open(timeline, "w") as file:
            for a, b in zip(kernels[ends[1]:ends[-1]], kernels[ends[1] + 1:ends[-1] + 1]):
                host = "host" if b[2] in launched and launched[b[2]] > b[0] - 2000 else ""
                file.write(f"{(b[0] - a[1]) / 1e3:8.1f} {(b[1] - b[0]) / 1e3:8.1f} {host:4} {b[3][:100]}\n")


def timed_steps(trainer, batch, steps, warmup, in_flight):
    """Seconds a step over `steps` after `warmup`, keeping `in_flight` deferred steps submitted (1: each waited for
    before the next is submitted, as a blocking loop does), and the timed steps' stats."""
    deferred, pending, landed, times = trainer.deferred(), collections.deque(), [], []
    for step in range(warmup + steps):
        if step == warmup:
            while pending:
                pending.popleft().wait()
            start = time.perf_counter()
        pending.append(deferred.step(batch))
        while len(pending) >= in_flight:
            landed.append(pending.popleft().wait().stats)
            times.append(time.perf_counter())
    while pending:
        landed.append(pending.popleft().wait().stats)
        times.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(times[-steps:], times[-steps + 1:]))
    print(f"steps landed every {1e3 * gaps[0]:.2f} to {1e3 * gaps[-1]:.2f} ms, median {1e3 * gaps[len(gaps) // 2]:.2f}",
          file=sys.stderr)
    return (time.perf_counter() - start) / steps, landed[-steps:]


def uform_run(depth, hidden, rows, cols, steps, warmup, peak, torch, determinism, in_flight, profile=False):
    batch, config = peer_step(depth, hidden, rows, cols)
    config = dict(config, determinism=determinism)
    free_before = torch.cuda.mem_get_info()[0]
    with uform.Executor.for_vram() as executor, uform.Trainer.init_vram(executor, config) as trainer:
        seconds, landed = timed_steps(trainer, batch, steps, warmup, in_flight)
        host, stats = sum(s.host_seconds for s in landed), landed[-1]
        held = free_before - torch.cuda.mem_get_info()[0]
        if profile:
            kernel_shares(trainer, batch, torch, in_flight, timeline=profile if isinstance(profile, str) else None)
    tokens_per_s = rows * cols / seconds
    # The library's own attention runs on Hopper's 9.0 unless told not to; cuDNN's elsewhere.
    own = os.environ.get("UFORM_HOPPER_ATTENTION") != "0" and torch.cuda.get_device_capability() == (9, 0)
    return dict(peer="uform", determinism=determinism, attention="own" if own else "cudnn", in_flight=in_flight, depth=depth, hidden=hidden, rows=rows, cols=cols, step_ms=seconds * 1e3,
                tokens_per_s=tokens_per_s, mfu=tokens_per_s * flops_per_token(depth, hidden, cols) / 1e12 / peak,
                host_share=host / steps / seconds, peak_bf16_tflops=peak, device_memory_bytes=held, loss=stats.loss)


def with_environment(trial, run):
    """run() with the trial's variables ("NAME=VALUE NAME=VALUE") set, then the environment as it was."""
    settings = dict(pair.split("=", 1) for pair in trial.split())
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        return run()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def load_peer():
    spec = importlib.util.spec_from_file_location("torch_peer", os.path.join(os.path.dirname(__file__), "torch_peer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", type=int, nargs=4, action="append", metavar=("DEPTH", "HIDDEN", "ROWS", "COLS"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-peer", action="store_true", help="time uform alone")
    parser.add_argument("--profile", action="store_true", help="then print each kernel's share of 3 more steps")
    parser.add_argument("--timeline", help="with --profile: write one step's kernels, each with the gap before it, here")
    parser.add_argument("--in-flight", type=int, default=2,
                        help="deferred steps kept submitted (1: each waited for, as a blocking loop does)")
    parser.add_argument("--determinism", choices=["bitwise", "fast"], default="bitwise", help="uform's TrainerConfig.determinism")
    parser.add_argument("--trial", action="append", default=[], metavar="'NAME=VALUE ...'",
                        help="also time uform with these environment variables set (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="how many times to time uform as it is and each trial")
    args = parser.parse_args()
    for trial in args.trial:
        if not trial.split() or not all("=" in pair and pair.split("=")[0] for pair in trial.split()):
            parser.error(f"--trial {trial!r}: give NAME=VALUE pairs, separated by spaces")
    peer = load_peer()
    import torch

    peak = peer.peak_bf16_tflops()
    for depth, hidden, rows, cols in args.geometry or GEOMETRIES:
        steps_ms = collections.defaultdict(list)  # each trial's step times, "" as it is
        for _ in range(args.rounds):
            for trial in [""] + args.trial:
                try:
                    run = with_environment(trial, lambda: uform_run(
                        depth, hidden, rows, cols, args.steps, args.warmup, peak, torch, args.determinism,
                        args.in_flight, args.profile and (args.timeline or True)))
                except uform.Error as error:
                    if not trial:
                        raise
                    print(json.dumps(dict(trial=trial, error=f"{type(error).__name__}: {error}")), flush=True)
                    continue  # a trial that fails says so; the others still run
                print(json.dumps(dict(run, trial=trial) if trial else run), flush=True)
                steps_ms[trial].append(run["step_ms"])
                if not trial:
                    ours = run  # the ratio below is to the last run as it is
        if args.trial:  # each trial's median step beside the median as it is
            median = {trial: sorted(times)[len(times) // 2] for trial, times in steps_ms.items()}
            print(json.dumps(dict(depth=depth, hidden=hidden, rows=rows, cols=cols, median_step_ms=median,
                                  change_ms={t: median[t] - median[""] for t in median if t})), flush=True)
        if args.no_peer:
            continue
        for mode in ("eager", "compile"):
            theirs = peer.run(mode, depth, hidden, rows, cols, args.steps, args.warmup, peak)
            print(json.dumps(theirs), flush=True)
        print(json.dumps(dict(depth=depth, hidden=hidden, rows=rows, cols=cols,
                              ratio_to_compiled=ours["tokens_per_s"] / theirs["tokens_per_s"])), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
