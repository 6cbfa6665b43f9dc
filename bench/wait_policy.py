"""OpenMP's wait policy and the CPU step, alone on the cores and beside work that wants them.

    PYTHONPATH=. python bench/wait_policy.py [--loads idle process thread] [--policies ...] [--quiet 0.05]

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, as it loads, so every run is a process of
its own. Policies: `libgomp`, its default (GOMP_SPINCOUNT=300000: waiting workers spin for some ms,
then sleep), `passive` (they sleep at once), `active` (they spin for minutes), and spin counts of
10,000 and 1,000. Loads: none; another process spinning one core; a thread of the same process
decoding zlib "images" into normalized float32 as a data loader would. The step is `bench/cpu.py`'s
joint step with 2 threads. Each run prints a JSON line: the step's median and quartiles in ms, the
process's CPU ms a step (the loader's excluded), the competitor's share of a core, the loader's
items/s, and the cores the machine's other work kept busy meanwhile; then, per configuration, the
median over runs and their range. On a shared machine, `--quiet` waits before each run for the
others to calm down. Results: bench/RESULTS.md, 2026-12-03.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import zlib

# libgomp's own default is spelled out: with neither variable set, `import uform` makes workers passive
POLICIES = {"libgomp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "passive"},
            "active": {"OMP_WAIT_POLICY": "active"}, "spin10k": {"GOMP_SPINCOUNT": "10000"},
            "spin1k": {"GOMP_SPINCOUNT": "1000"}}
LOADS = ["idle", "process", "thread"]
GEOMETRIES = {"small": dict(depth=2, hidden=128, rows=4, cols=256),
              "medium": dict(depth=4, hidden=256, rows=4, cols=512)}


def spin():
    """The competing process: one core's worth of pure Python until it is terminated."""
    while True:
        pass


class Spinner:
    """Another process spinning one core."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, __file__, "--spin"])
        self.items = None

    def cpu(self):  # utime + stime, in seconds
        fields = open(f"/proc/{self.process.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self):
        self.process.terminate()
        self.process.wait()


class Loader:
    """A thread of this process decoding as a data loader would: inflate a 64 KiB image, normalize it
    to float32; zlib and numpy both let go of the GIL."""

    def __init__(self):
        self.items, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()
        self.clock = time.pthread_getcpuclockid(self.thread.ident)

    def run(self):
        import numpy as np

        pixels = np.random.default_rng(0).integers(0, 64, size=(128, 128, 4), dtype=np.uint8)
        packed = zlib.compress(pixels.tobytes(), 6)
        while not self.stop.is_set():
            image = np.frombuffer(zlib.decompress(packed), dtype=np.uint8).astype(np.float32)
            image -= image.mean()
            image /= image.std() + 1e-6
            self.items += 1

    def cpu(self):
        return time.clock_gettime(self.clock)

    def close(self):
        self.stop.set()
        self.thread.join()


def busy_cores():
    """Seconds of CPU the whole machine has spent busy, from /proc/stat."""
    fields = [int(f) for f in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def quiet_cores(seconds=2.0):
    """The cores the machine kept busy over the last `seconds`, this process idle meanwhile."""
    before = busy_cores()
    time.sleep(seconds)
    return (busy_cores() - before) / seconds


def child(policy, load, geometry, steps, warmup, threads):
    make = {"idle": None, "process": Spinner, "thread": Loader}[load]
    competitor = make() if make else None
    try:
        import uform  # after the environment is set and the competitor runs: this loads libgomp

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from cpu import peer_step

        batch, config = peer_step(**GEOMETRIES[geometry])
        times = []
        with uform.Executor.for_ram(threads=threads) as executor, uform.Trainer.init_ram(executor, config) as trainer:
            for step in range(warmup + steps):
                if step == warmup:  # the timed window opens
                    wall, cpu, machine = time.perf_counter(), time.process_time(), busy_cores()
                    other, items = (competitor.cpu(), competitor.items) if competitor else (0.0, None)
                start = time.perf_counter()
                trainer.step(batch)
                times.append(time.perf_counter() - start)
            wall, cpu, machine = time.perf_counter() - wall, time.process_time() - cpu, busy_cores() - machine
            other = competitor.cpu() - other if competitor else 0.0
            items = competitor.items - items if items is not None else None
    finally:
        if competitor:
            competitor.close()
    # the cores that work outside this bench kept busy meanwhile: the machine is shared
    foreign = (machine - cpu - (other if load == "process" else 0.0)) / wall
    if load == "thread":
        cpu -= other  # the process's CPU time counts the loader's: leave the step's own
    times = times[warmup:]
    quartiles = statistics.quantiles(times, n=4)
    return dict(policy=policy, load=load, geometry=geometry, step_ms=statistics.median(times) * 1e3,
                q1_ms=quartiles[0] * 1e3, q3_ms=quartiles[2] * 1e3, cpu_ms=cpu / steps * 1e3,
                competitor_share=other / wall if competitor else None,
                loader_items_s=items / wall if items is not None else None, foreign_cores=foreign)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="rounds over the configurations, each in a fresh order")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=LOADS)
    parser.add_argument("--geometries", nargs="+", choices=GEOMETRIES, default=list(GEOMETRIES))
    parser.add_argument("--quiet", type=float, metavar="CORES",
                        help="before each run, wait until the machine's other work keeps fewer cores busy")
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, metavar=("POLICY", "LOAD", "GEOMETRY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spin:
        return spin()
    if args.child:
        return print(json.dumps(child(*args.child, args.steps, args.warmup, args.threads)), flush=True)
    runs = []
    configurations = [(p, l, g) for g in args.geometries for l in args.loads for p in args.policies]
    for repeat in range(args.repeats):
        # a fresh order each round, so that drift in the machine's other work spreads over all
        random.Random(repeat).shuffle(configurations)
        for policy, load, geometry in configurations:
            while args.quiet is not None and quiet_cores() >= args.quiet:
                time.sleep(5)
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update(POLICIES[policy])
            line = subprocess.run([sys.executable, __file__, "--child", policy, load, geometry,
                                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                                   "--threads", str(args.threads)], env=env, check=True, capture_output=True,
                                  text=True).stdout
            print(line.strip(), flush=True)
            runs.append(json.loads(line))
    print("geometry load policy: median over runs [range]")
    for geometry in args.geometries:
        for load in args.loads:
            for policy in args.policies:
                mine = [r for r in runs if (r["policy"], r["load"], r["geometry"]) == (policy, load, geometry)]
                line = f"{geometry} {load} {policy}:"
                for key, form in (("step_ms", ".2f"), ("cpu_ms", ".2f"), ("competitor_share", ".3f"),
                                  ("loader_items_s", ".0f"), ("foreign_cores", ".2f")):
                    values = [r[key] for r in mine if r[key] is not None]
                    if values:
                        middle, low, high = statistics.median(values), min(values), max(values)
                        line += f" {key} {middle:{form}} [{low:{form}}, {high:{form}}]"
                print(line, flush=True)


if __name__ == "__main__":
    main()
