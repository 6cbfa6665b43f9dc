"""The main job: train a small encoder to match Python signatures with their docstrings.

    uform-demo [--steps 1200] [--out runs/demo.safetensors]      # or: python -m uform.demo

The data set is built from the standard library of the Python that runs this: every public
function, class and method with a signature and a docstring gives one pair, the signature text
(`json.dumps(obj, *, skipkeys=False, ...)`) and the docstring's first paragraph. A few hundred
pairs are held out. The job measures retrieval on them (for each held-out signature, is its own
docstring the nearest of all held-out docstrings: recall@1) before and after training, trains
with the joint objective (masked bytes plus contrastive pairs) with a progress bar (tqdm), and saves the
checkpoint. It runs on a GPU when this build has one, else on the CPU.
"""
import argparse
import importlib
import inspect
import io
import contextlib
import os
import random
import re
import sys
import time
import warnings

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
                # Defaults like `<object object at 0x7f...>` carry addresses: drop them, so every run sees the same text.
                signature = re.sub(r" at 0x[0-9a-fA-F]+", "", f"{qualified_name}{inspect.signature(value)}")
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # A GPU trains a deeper, wider model on larger steps in the time two cores train the small one.
    gpu = "vram" in uform.capabilities()
    parser.add_argument("--steps", type=int, default=1500 if gpu else 1200)
    parser.add_argument("--pairs-per-step", type=int, default=64 if gpu else 32)
    parser.add_argument("--held-out", type=int, default=400)
    parser.add_argument("--depth", type=int, default=6 if gpu else 2)
    parser.add_argument("--hidden", type=int, default=512 if gpu else 256)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--objective", choices=[o.value for o in uform.Objective], default="joint")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads; all cores when absent")
    parser.add_argument("--out", default=os.path.join("runs", "demo.safetensors"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"uform {uform.__version__}: building signature/docstring pairs from Python {sys.version.split()[0]}'s "
          "standard library", flush=True)
    pairs = stdlib_pairs()
    train, held_out = split(pairs, args.held_out, args.seed)
    print(f"{len(pairs)} pairs: {len(train)} to train on, {len(held_out)} held out; depth {args.depth}, hidden "
          f"{args.hidden} on the {'GPU' if gpu else 'CPU'}", flush=True)

    if gpu:
        executor = uform.Executor.for_vram()
        init = uform.Trainer.init_vram
    else:
        executor = uform.Executor.for_ram(threads=args.threads)
        init = uform.Trainer.init_ram
    config = uform.TrainerConfig(
        depth=args.depth, hidden=args.hidden, objective=uform.Objective(args.objective), seed=args.seed,
        batch=uform.BatchShape(max_rows_per_device=2 * args.pairs_per_step, max_columns_per_row=128,
                               max_segments_per_device=2 * args.pairs_per_step),
        schedule=uform.Schedule(learning_rate=args.learning_rate, steps=args.steps, warmup_steps=max(1, args.steps // 20)),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with executor, init(executor, config) as trainer:
        trainer.save(args.out)
        with uform.Encoder.load(args.out, executor) as encoder:
            before = recall_at_1(encoder, held_out)
        print(f"recall@1 on {len(held_out)} held-out pairs before training: {before:.3f}", flush=True)

        order = random.Random(args.seed + 1)
        # A bar where stderr is a terminal; elsewhere (a log, a pipe) a line every tenth of the run.
        bar = tqdm.tqdm(total=args.steps, unit="step", disable=None)
        start, tokens, smoothed = time.perf_counter(), 0, None
        cursor, shuffled = len(train), []
        for step in range(1, args.steps + 1):
            if cursor + args.pairs_per_step > len(shuffled):
                shuffled, cursor = order.sample(train, len(train)), 0
            chosen = shuffled[cursor:cursor + args.pairs_per_step]
            cursor += args.pairs_per_step
            stats = trainer.step(pair_batch(chosen)).stats
            tokens += stats.tokens
            smoothed = stats.loss if smoothed is None else 0.9 * smoothed + 0.1 * stats.loss
            state = (f"loss {smoothed:.3f} (masked {stats.masked_loss:.3f}, contrastive {stats.contrastive_loss:.3f}) "
                     f"{tokens / (time.perf_counter() - start) / 1e3:.1f}k tok/s")
            bar.set_postfix_str(state, refresh=False)
            bar.update()
            if bar.disable and (step == args.steps or step % max(1, args.steps // 10) == 0):
                print(f"{step}/{args.steps} {state}", file=sys.stderr, flush=True)
        bar.close()
        seconds = time.perf_counter() - start
        trainer.save(args.out)
        with uform.Encoder.load(args.out, executor) as encoder:
            after = recall_at_1(encoder, held_out)
    print(f"recall@1 on {len(held_out)} held-out pairs after {args.steps} steps ({seconds:.0f} s): {after:.3f} "
          f"(before: {before:.3f}, chance: {1 / len(held_out):.3f})")
    print(f"checkpoint: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
