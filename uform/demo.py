"""The main job: train a small encoder on a task it builds itself, with nothing to download.

    uform-demo [--steps 1200] [--out runs/demo.safetensors]      # or: python -m uform.demo
    uform-demo --task images [--steps 1500]                        # pictures <-> their captions

`--task signatures` (the default) matches Python signatures with their docstrings. The data set is
built from the standard library of the Python that runs this: every public function, class and
method with a signature and a docstring gives one pair, the signature text (`json.dumps(obj, *,
skipkeys=False, ...)`) and the docstring's first paragraph. A few hundred pairs are held out. The
job measures retrieval on them (for each held-out signature, is its own docstring the nearest of
all held-out docstrings: recall@1) before and after training, trains with the joint objective
(masked bytes plus contrastive pairs) with a progress bar (tqdm), and saves the checkpoint.

`--task images` matches pictures with the sentences that describe them. The job draws each picture
itself (48 x 48 pixels, written as PNG with zlib, which the library decodes): one shape, or two
shapes side by side or one above the other, each of a size, a colour and a kind, described as "a
large red disk left of a small blue triangle" or, as often, "a small blue triangle right of a large
red disk". Matching needs the words read in order: which colour goes with which shape, and which
side each is on. A few hundred two-shape scenes are held out: no picture of those shapes, sizes and
colours in that arrangement is ever drawn for training. The job measures recall@1 both ways (image
to text and text to image among the held-out pairs) before and after training with the contrastive
objective (`--objective joint` adds masked bytes and masked patches), and saves the checkpoint.

Either task runs on a GPU when this build has one, else on the CPU.
"""
import argparse
import collections
import importlib
import inspect
import io
import contextlib
import os
import random
import re
import struct
import sys
import time
import warnings
import zlib

import numpy as np
import tqdm

import uform

# Modules whose import opens windows, starts browsers, prints, or only exists for tests.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
                   "venv", "pydoc_data", "test", "xxlimited", "xxlimited_35", "xxsubtype", "pty", "tty", "curses",
                   "readline", "crypt", "nis", "spwd", "ossaudiodev", "msilib", "winreg", "winsound"}


def first_paragraph(doc):
    paragraph = doc.strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def stdlib_pairs():
    """(signature, docstring) pairs from the standard library, deterministic for one Python version."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # deprecated modules warn when imported or inspected
        return _stdlib_pairs()


def _stdlib_pairs():
    pairs, seen_docs, seen_signatures = [], set(), set()
    for module_name in sorted(getattr(sys, "stdlib_module_names", ())):
        if module_name.startswith("_") or module_name in SKIPPED_MODULES:
            continue
        try:
            module = importlib.import_module(module_name)
        except BaseException:
            continue
        candidates = []
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or getattr(value, "__module__", None) != module_name:
                continue
            if inspect.isclass(value):
                candidates.append((f"{module_name}.{name}", value))
                for method_name, method in sorted(vars(value).items()):
                    if not method_name.startswith("_") and inspect.isroutine(method):
                        candidates.append((f"{module_name}.{name}.{method_name}", method))
            elif inspect.isroutine(value):
                candidates.append((f"{module_name}.{name}", value))
        for qualified_name, value in candidates:
            try:
                # Defaults like `<object object at 0x7f...>` carry addresses, `environ=os.environ` the whole
                # environment (secrets too) and `executable=sys.executable` this Python's path: all dropped, so
                # every run, shell and environment sees the same text.
                signature = f"{qualified_name}{inspect.signature(value)}".replace(repr(os.environ), "os.environ")
                signature = signature.replace(repr(sys.executable), "sys.executable")
                signature = re.sub(r" at 0x[0-9a-fA-F]+", "", signature)
                doc = inspect.getdoc(value)
            except (TypeError, ValueError):
                continue
            if not doc:
                continue
            doc = first_paragraph(doc)
            if len(doc) < 24 or doc in seen_docs or signature in seen_signatures:
                continue
            seen_docs.add(doc)
            seen_signatures.add(signature)
            pairs.append((signature, doc))
    return pairs


class Refused(Exception):
    """Options the demo's data cannot satisfy, said on one line."""


def split(pairs, held_out, seed=0):
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    return shuffled[held_out:], shuffled[:held_out]


def pair_batch(pairs):
    """Items 2k and 2k + 1 are a signature and its docstring; they attract, every other pair repels."""
    contents = [text for pair in pairs for text in pair]
    count = len(contents)
    ids = [i ^ 1 for i in range(count)]
    return dict(modalities=[uform.Modality.TEXT] * count, contents=contents,
                relations=dict(attract=uform.Edges(offsets=list(range(count + 1)), ids=ids)))


def recall_at_1(encoder, pairs):
    """Share of signatures whose own docstring is the nearest docstring, by cosine similarity."""
    signatures = np.asarray(encoder.embed([uform.Modality.TEXT] * len(pairs), [s for s, _ in pairs]))
    docs = np.asarray(encoder.embed([uform.Modality.TEXT] * len(pairs), [d for _, d in pairs]))
    nearest = (signatures.astype(np.float32) @ docs.astype(np.float32).T).argmax(1)
    return float((nearest == np.arange(len(pairs))).mean())


# The images task. A background of a random dark shade, flat shapes and no pixel noise: masked patch
# reconstruction regresses each patch normalized by its own spread, where noise would be unlearnable.
SIDE = 48
COLORS = {"red": (225, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 245), "yellow": (235, 215, 40),
          "white": (235, 235, 235), "purple": (165, 60, 215)}
SHAPES = ("square", "disk", "triangle", "cross")
SIZES = {"small": 5, "large": 9}  # half the shape's side, in pixels
LAYOUTS = {"one": (), "beside": ("left of", "right of"), "stacked": ("above", "below")}


def png_bytes(pixels):
    """An 8-bit RGB PNG of `pixels` (height, width, 3), written with zlib."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels.reshape(pixels.shape[0], -1))  # filter 0 on each row
    header = struct.pack(">IIBBBBB", pixels.shape[1], pixels.shape[0], 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def paint(pixels, thing, center_y, center_x):
    size, color, shape = thing
    r = SIZES[size]
    y, x = np.mgrid[:pixels.shape[0], :pixels.shape[1]]
    dy, dx = y - center_y, x - center_x
    inside = {"square": (abs(dy) <= r) & (abs(dx) <= r),
              "disk": dy * dy + dx * dx <= r * r,
              "triangle": (abs(dy) <= r) & (2 * abs(dx) <= dy + r),
              "cross": ((abs(dy) <= r // 3) & (abs(dx) <= r)) | ((abs(dx) <= r // 3) & (abs(dy) <= r))}[shape]
    pixels[inside] = COLORS[color]


def random_scene(rng):
    """A scene's key: (layout, things), each thing a (size, color, shape); the first is left or on top."""
    layout = rng.choice(list(LAYOUTS))
    first = (rng.choice(list(SIZES)), rng.choice(list(COLORS)), rng.choice(SHAPES))
    if layout == "one":
        return layout, (first,)
    second = first
    while second[1:] == first[1:]:  # two shapes of one colour and kind would leave "which is which" open
        second = (rng.choice(list(SIZES)), rng.choice(list(COLORS)), rng.choice(SHAPES))
    return layout, (first, second)


def draw(scene, rng):
    """The scene as a caption (either word order) and a PNG, its places and background shade drawn from `rng`."""
    layout, things = scene
    pixels = np.full((SIDE, SIDE, 3), rng.randrange(40), np.uint8)
    named = ["a " + " ".join(thing) for thing in things]
    if layout == "one":
        paint(pixels, things[0], rng.randrange(12, SIDE - 12), rng.randrange(12, SIDE - 12))
        return named[0], png_bytes(pixels)
    # The near shape's centre sits in the first third, the far one's in the last: two large ones never touch.
    near, far = rng.randrange(10, 16), rng.randrange(SIDE - 14, SIDE - 9)
    across = [rng.randrange(10, SIDE - 9) for _ in things]
    for thing, along, other in zip(things, (near, far), across):
        paint(pixels, thing, *((other, along) if layout == "beside" else (along, other)))
    forward, backward = LAYOUTS[layout]
    caption = (f"{named[0]} {forward} {named[1]}" if rng.random() < 0.5 else f"{named[1]} {backward} {named[0]}")
    return caption, png_bytes(pixels)


def held_out_scenes(count, seed):
    """`count` distinct two-shape scenes, each drawn once: (keys, [(caption, png), ...])."""
    things = len(SIZES) * len(COLORS) * len(SHAPES)
    scenes = (len(LAYOUTS) - 1) * things * (things - len(SIZES))
    if not 0 < count <= scenes:
        raise Refused(f"--held-out: {count} scenes asked, {scenes} distinct two-shape scenes exist")
    rng, keys = random.Random(seed), []
    while len(keys) < count:
        scene = random_scene(rng)
        if scene[0] != "one" and scene not in keys:
            keys.append(scene)
    return set(keys), [draw(scene, rng) for scene in keys]


def training_scenes(held_out, seed):
    """An endless stream of (caption, png) pairs, none of a held-out scene."""
    rng = random.Random(seed)
    while True:
        scene = random_scene(rng)
        if scene not in held_out:
            yield draw(scene, rng)


def image_pair_batch(pairs):
    """Captions first, then their pictures; each caption and its picture attract, every other pair repels."""
    count = len(pairs)
    ids = [count + i for i in range(count)] + list(range(count))
    return dict(modalities=[uform.Modality.TEXT] * count + [uform.Modality.IMAGE] * count,
                contents=[caption for caption, _ in pairs] + [image for _, image in pairs],
                relations=dict(attract=uform.Edges(offsets=list(range(2 * count + 1)), ids=ids)))


def image_recall_at_1(encoder, pairs):
    """(image -> text, text -> image): the share of pictures whose own caption is the nearest caption, and back."""
    captions = np.asarray(encoder.embed([uform.Modality.TEXT] * len(pairs), [c for c, _ in pairs]), np.float32)
    images = np.asarray(encoder.embed([uform.Modality.IMAGE] * len(pairs), [i for _, i in pairs]), np.float32)
    similarity, expected = images @ captions.T, np.arange(len(pairs))
    return float((similarity.argmax(1) == expected).mean()), float((similarity.argmax(0) == expected).mean())


# Defaults per task, then per device: a GPU trains a deeper, wider model on larger steps in the time two
# cores train the small one.
DEFAULTS = {
    "signatures": dict(steps=(1200, 1500), pairs_per_step=(32, 64), held_out=(400, 400), depth=(2, 6),
                       hidden=(256, 512), learning_rate=(1e-3, 1e-3), objective=("joint", "joint"),
                       out=os.path.join("runs", "demo.safetensors")),
    "images": dict(steps=(1500, 3000), pairs_per_step=(32, 64), held_out=(256, 256), depth=(2, 4),
                   hidden=(128, 256), learning_rate=(2e-3, 1e-3), objective=("contrastive", "contrastive"),
                   out=os.path.join("runs", "demo-images.safetensors")),
}


def defaults_help(name):
    def one(value):
        return value if isinstance(value, str) or value[0] != value[1] else value[0]
    return "default " + "; ".join(f"{task}: {value[0]} on the CPU, {value[1]} on a GPU" if isinstance(value, tuple)
                                  else f"{task}: {value}" for task, value in ((t, one(v[name])) for t, v in DEFAULTS.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="uform-demo", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = "vram" in uform.capabilities()
    parser.add_argument("--task", choices=list(DEFAULTS), default="signatures",
                        help="signatures <-> docstrings, or drawn pictures <-> their captions (default signatures)")
    parser.add_argument("--steps", type=int, help=defaults_help("steps"))
    parser.add_argument("--pairs-per-step", type=int, help=defaults_help("pairs_per_step"))
    parser.add_argument("--held-out", type=int, help=defaults_help("held_out"))
    parser.add_argument("--depth", type=int, help=defaults_help("depth"))
    parser.add_argument("--hidden", type=int, help=defaults_help("hidden"))
    parser.add_argument("--learning-rate", type=float, help=defaults_help("learning_rate"))
    parser.add_argument("--objective", choices=[o.value for o in uform.Objective], help=defaults_help("objective"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads; all cores when absent")
    parser.add_argument("--out", help=f"the checkpoint; {defaults_help('out')}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    given_out = args.out is not None
    for name, values in DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, values if isinstance(values, str) else values[gpu])
    for name in ("steps", "pairs_per_step", "held_out", "depth", "hidden"):
        least = 2 if name == "held_out" else 1  # recall among one held-out pair is 1 whatever the model
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is below {least}")
    if args.hidden % 128:  # refused now, as the trainer would refuse it once the data is built
        parser.error(f"--hidden: {args.hidden} is not a multiple of 128")
    folder = os.path.dirname(os.path.abspath(args.out))
    if given_out and not os.path.isdir(folder):  # refused now, as `Trainer.save` would refuse it after training
        parser.error(f"--out: its folder {folder} does not exist")
    os.makedirs(folder, exist_ok=True)  # the default's `runs/`
    try:
        return run_images(args, gpu) if args.task == "images" else run_signatures(args, gpu)
    except (Refused, uform.InvalidArgument) as error:  # what the options ask that the data or the library cannot do
        parser.exit(2, f"uform-demo: {error}\n")



def run_signatures(args, gpu):
    print(f"uform {uform.__version__}: building signature/docstring pairs from Python {sys.version.split()[0]}'s "
          "standard library", flush=True)
    pairs = stdlib_pairs()
    train, held_out = split(pairs, args.held_out, args.seed)
    if len(train) < args.pairs_per_step:
        raise Refused(f"--held-out {args.held_out} leaves {len(train)} of the {len(pairs)} pairs to train on, fewer "
                      f"than --pairs-per-step {args.pairs_per_step}")
    print(f"{len(pairs)} pairs: {len(train)} to train on, {len(held_out)} held out; depth {args.depth}, hidden "
          f"{args.hidden} on the {'GPU' if gpu else 'CPU'}", flush=True)

    order = random.Random(args.seed + 1)

    def batches():
        while True:
            shuffled = order.sample(train, len(train))
            for start in range(0, len(shuffled) - args.pairs_per_step + 1, args.pairs_per_step):
                yield pair_batch(shuffled[start:start + args.pairs_per_step])

    def measure(encoder):
        return recall_at_1(encoder, held_out)

    batch = uform.BatchShape(max_rows_per_device=2 * args.pairs_per_step, max_columns_per_row=128,
                             max_segments_per_device=2 * args.pairs_per_step)
    before, after, seconds = train_and_measure(args, gpu, batch, batches(), measure, "{:.3f}".format)
    print(f"recall@1 on {len(held_out)} held-out pairs after {args.steps} steps ({seconds:.0f} s): {after:.3f} "
          f"(before: {before:.3f}, chance: {1 / len(held_out):.3f})")
    print(f"checkpoint: {args.out}")
    return 0


def run_images(args, gpu):
    held_out_keys, held_out = held_out_scenes(args.held_out, args.seed)
    print(f"uform {uform.__version__}: drawing {SIDE} x {SIDE} pictures of {len(SHAPES)} shapes in {len(COLORS)} "
          f"colours and {len(SIZES)} sizes, alone, side by side or stacked, each with its caption "
          f"(\"{held_out[0][0]}\"); {len(held_out)} two-shape scenes held out, never drawn for training; depth "
          f"{args.depth}, hidden {args.hidden} on the {'GPU' if gpu else 'CPU'}", flush=True)
    stream = training_scenes(held_out_keys, args.seed + 1)

    def batches():
        while True:
            yield image_pair_batch([next(stream) for _ in range(args.pairs_per_step)])

    def measure(encoder):
        return image_recall_at_1(encoder, held_out)

    # A caption is at most 56 bytes; a picture, 6 x 6 patches of 8 pixels: one row of 64 fits either.
    batch = uform.BatchShape(max_rows_per_device=2 * args.pairs_per_step, max_columns_per_row=64,
                             max_segments_per_device=2 * args.pairs_per_step, image=uform.ImageShape(patch_side=8))
    before, after, seconds = train_and_measure(args, gpu, batch, batches(), measure,
                                               lambda both: "image -> text {:.3f}, text -> image {:.3f}".format(*both))
    print(f"recall@1 on {len(held_out)} held-out pairs after {args.steps} steps ({seconds:.0f} s): image -> text "
          f"{after[0]:.3f}, text -> image {after[1]:.3f} (before: {before[0]:.3f}, {before[1]:.3f}; chance: "
          f"{1 / len(held_out):.3f})")
    print(f"checkpoint: {args.out}")
    return 0


def in_flight(trainer, batches, steps):
    """Each step's stats as it lands, two deferred steps kept submitted: on a GPU the next step is queued while the
    device runs this one, and a batch's images are decoded while the step before it trains."""
    deferred, pending = trainer.deferred(), collections.deque()
    for _ in range(steps):
        pending.append(deferred.step(next(batches)))
        if len(pending) == 2:
            yield pending.popleft().wait().stats
    while pending:
        yield pending.popleft().wait().stats


def train_and_measure(args, gpu, batch, batches, measure, describe):
    """Trains `args.steps` steps of `batches`, measuring the saved checkpoint before and after (`describe` words
    the first measure): (before, after, seconds)."""
    if gpu:
        executor = uform.Executor.for_vram()
        init = uform.Trainer.init_vram
    else:
        executor = uform.Executor.for_ram(threads=args.threads)
        init = uform.Trainer.init_ram
    config = uform.TrainerConfig(
        depth=args.depth, hidden=args.hidden, objective=uform.Objective(args.objective), seed=args.seed, batch=batch,
        schedule=uform.Schedule(learning_rate=args.learning_rate, steps=args.steps, warmup_steps=max(1, args.steps // 20)),
    )
    with executor, init(executor, config) as trainer:
        trainer.save(args.out)
        with uform.Encoder.load(args.out, executor) as encoder:
            before = measure(encoder)
        print(f"recall@1 on {args.held_out} held-out pairs before training: {describe(before)}", flush=True)

        # A bar where stderr is a terminal; elsewhere (a log, a pipe) a line every tenth of the run.
        bar = tqdm.tqdm(total=args.steps, unit="step", disable=None)
        start, tokens, smoothed = time.perf_counter(), 0, None
        for step, stats in enumerate(in_flight(trainer, batches, args.steps), 1):
            tokens += stats.tokens
            smoothed = stats.loss if smoothed is None else 0.9 * smoothed + 0.1 * stats.loss
            terms = [f"masked {stats.masked_loss:.3f}"] if not np.isnan(stats.masked_loss) else []
            terms += [f"patches {stats.image_loss:.3f}"] if not np.isnan(stats.image_loss) else []
            terms += [f"contrastive {stats.contrastive_loss:.3f}"]
            state = f"loss {smoothed:.3f} ({', '.join(terms)}) {tokens / (time.perf_counter() - start) / 1e3:.1f}k tok/s"
            bar.set_postfix_str(state, refresh=False)
            bar.update()
            if bar.disable and (step == args.steps or step % max(1, args.steps // 10) == 0):
                print(f"{step}/{args.steps} {state}", file=sys.stderr, flush=True)
        bar.close()
        seconds = time.perf_counter() - start
        trainer.save(args.out)
        with uform.Encoder.load(args.out, executor) as encoder:
            after = measure(encoder)
    return before, after, seconds


if __name__ == "__main__":
    sys.exit(main())
