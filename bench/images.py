"""A mixed step of captions and images, beside a PyTorch peer that computes the same function.

    python bench/images.py                   # depth 12 / hidden 512, 112 captions + 112 PNGs of 224 x 224
    python bench/images.py --device cpu --depth 2 --hidden 128 --pairs 8 --image-side 64 --steps 2 --warmup 1 \
        --threads 1                          # the math checked on the CPU, both in float32

Each step holds `pairs` captions (64 to 128 bytes of ASCII text) and as many images (`image-side`
squared RGB pictures drawn with numpy, PNG-encoded with zlib); caption k and image k attract each
other both ways and every other pair repels (SigLIP's sigmoid loss over mean-pooled unit
vectors). Items alternate caption, image, caption, ... and uform packs them first fit into rows of
`cols` positions; `max_rows_per_device` is the rows that packing takes, printed with the token
count. uform trains the joint objective: masked bytes (15 % in spans of mean 3), 75 % of each
image's patches hidden and regressed per patch normalized (MSE), the contrastive term; it decodes
the PNGs inside every step.

The peer is the program a user would write in PyTorch for the same function: captions as one
batch padded to the longest with a key-padding mask, images as one batch of pre-decoded patch
tensors (the float patches uform makes, taken once through `uform._testing.image_patches`); the
same encoder over both (RMSNorm, rotary positions, 2D for patches, SDPA attention within each
item, tanh GELU MLP), the byte decoder's cross-entropy at the masked bytes, the patch decoder's
MSE at the hidden patches against per-patch normalized values, the sigmoid loss over mean-pooled
rows; bf16 autocast, fused AdamW (decay on matrices), gradients clipped to 1, eager and
`torch.compile`d. It masks exactly what uform's first step masks, from the same keyed draws
(`libuform/src/internal.h`, redrawn here), and starts from uform's initial weights (a fresh
trainer's, saved weights-only), so the first step's three losses must agree (to bf16 rounding on
the GPU, float32 rounding on the CPU); they are printed side by side, and the run stops if the
peer's masked bytes and hidden patches do not number what uform's first step reports. Later steps:
uform redraws its masks per step, the peer keeps the first step's (about the same counts and cost);
uform's learning rate warms up over its schedule while the peer's stays at 1e-3, so the last
losses are not comparable, only the first.

Decoding: uform's step time includes decoding the PNGs on every host core (its host share,
`stats.host_seconds` over the step, as in bench/gpu.py). A second uform line ("decoded ahead")
submits deferred steps two at a time, so each batch's PNGs decode while the step before it trains,
as `uform train` does; its host share is then validation and packing alone. The peer's step excludes decoding; its
decode of the same PNGs with zlib and numpy into the same patches, on one thread, is timed apart
(`decode_ms` a step) and added in `step_ms_with_decode`, the serial loop a user would write
without a loader. The setup line also times uform's own decoder over the same files on one thread
(`uform_decode_ms`) and `Encoder.embed`'s throughput over the images alone (`uform_embed_images_per_s`,
four copies of the step's images, each chunk's PNGs decoding while the one before embeds), and the ratio line gives the ratio with uform's host time taken out of its
step (`ratio_less_uform_host`: the step's device-side part, since a step returns after its
update). `--image-side` must be a whole number of patches: the peer's decode does not resize.

One JSON line per measurement: the setup (tokens, rows), uform, the peer's modes, the first-step
check, the ratio to the compiled peer. MFU counts the same useful FLOPs for both (no padding),
against a bf16 8192^3 product timed in the same process.
"""
import argparse
import importlib.util
import json
import math
import os
import struct
import tempfile
import time
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import uform
from uform import _testing

MASK_ID, PATCH_ID = 256, 259
M64 = (1 << 64) - 1
SPAN, CORRUPT, BYTE, PATCH = 2, 3, 4, 5  # uform_stream_t
WORDS = ("a photo of the small large red green blue yellow dark bright round square disk bar stripe "
         "shape on in over under beside near left right top bottom corner centre background with two three "
         "and some bold pale shadow drawing picture painted plain faded soft sharp edge line").split()


# ------------------------------------------------------------------------------------------------
# The step's data
# ------------------------------------------------------------------------------------------------

def png_bytes(pixels):
    """An 8-bit RGB PNG of `pixels` (height, width, 3), every row unfiltered, compressed with zlib."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + row.tobytes() for row in pixels.reshape(pixels.shape[0], -1))
    header = struct.pack(">IIBBBBB", pixels.shape[1], pixels.shape[0], 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) +
            chunk(b"IEND", b""))


def drawing(rng, side):
    """A smooth background gradient with one to three flat shapes of random colors, as PNG bytes."""
    y, x = np.mgrid[:side, :side].astype(np.float32) / side
    low, high = rng.integers(0, 120, 3), rng.integers(60, 256, 3)
    t = (y * rng.uniform(0.2, 1) + x * rng.uniform(0, 0.8))[..., None]
    pixels = (low + (high - low) * t / t.max()).astype(np.uint8)
    for _ in range(rng.integers(1, 4)):
        cy, cx, r = rng.integers(0, side, 2).tolist() + [int(rng.integers(side // 10, side // 3))]
        yy, xx = np.mgrid[:side, :side]
        inside = [(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r, (abs(yy - cy) <= r) & (abs(xx - cx) <= r),
                  (abs(yy - cy) <= r // 4 + 1) & (abs(xx - cx) <= 2 * r)][rng.integers(0, 3)]
        pixels[inside] = rng.integers(0, 256, 3)
    return png_bytes(pixels)


def caption(rng):
    length = int(rng.integers(64, 129))
    words = []
    while len(" ".join(words)) < length:
        words.append(WORDS[rng.integers(0, len(WORDS))])
    return " ".join(words)[:length].encode()


def make_step(pairs, image_side, seed=0):
    """Items 2k (caption) and 2k + 1 (image) attract each other; every other pair repels."""
    rng = np.random.default_rng(seed)
    captions = [caption(rng) for _ in range(pairs)]
    images = [drawing(rng, image_side) for _ in range(pairs)]
    contents = [item for pair in zip(captions, images) for item in pair]
    n = 2 * pairs
    return dict(modalities=[uform.Modality.TEXT, uform.Modality.IMAGE] * pairs, contents=contents,
                relations=dict(attract=uform.Edges(offsets=list(range(n + 1)), ids=[i ^ 1 for i in range(n)]))), \
        captions, images


def first_fit_rows(lengths, cols):
    fills = []
    for length in lengths:
        row = next((r for r, fill in enumerate(fills) if fill + length <= cols), None)
        if row is None:
            fills.append(length)
        else:
            fills[row] += length
    return len(fills)


def config(args, rows):
    return dict(depth=args.depth, hidden=args.hidden, objective=uform.Objective.JOINT, seed=args.seed,
                batch=dict(max_rows_per_device=rows, max_columns_per_row=args.cols,
                           max_segments_per_device=2 * args.pairs, image=dict(patch_side=args.patch_side)),
                schedule=dict(steps=100000))


# ------------------------------------------------------------------------------------------------
# uform's keyed draws (libuform/src/internal.h, libuform/src/batch.c), redrawn for the peer
# ------------------------------------------------------------------------------------------------

def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def uform_key(seed, stream, step, item, index):
    return mix(mix(mix(mix(mix(seed) ^ stream) ^ step) ^ item) ^ index)


def uform_uniform(key):
    return np.float32((key >> 40) * (1.0 / 16777216.0))


def mask_text(data, seed, step, item, probability, mean_span, replace, random):
    """(ids the model sees, chosen positions) of one text item, as `uform_mask_text` draws them."""
    ids, chosen, left = list(data), [], 0
    start_probability = np.float32(np.float32(probability) / np.float32(mean_span))
    continue_log = math.log(1.0 - 1.0 / mean_span) if mean_span > 1 else 0.0
    for p in range(len(data)):
        k = uform_key(seed, SPAN, step, item, p)
        if not left and uform_uniform(k) < start_probability:
            u = ((k & 0xFFFFFF) + 1.0) / 16777217.0
            left = 1 + int(min(math.floor(math.log(u) / continue_log), 1e6)) if mean_span > 1 else 1
        if not left:
            continue
        left -= 1
        chosen.append(p)
        draw = uform_uniform(uform_key(seed, CORRUPT, step, item, p))
        if draw < np.float32(replace):
            ids[p] = MASK_ID
        elif draw < np.float32(np.float32(replace) + np.float32(random)):
            ids[p] = uform_key(seed, BYTE, step, item, p) >> 56
    return ids, chosen


def hidden_patches(seed, step, item, count, ratio):
    """Which of an image's patches `uform_place_patches` hides."""
    return np.array([uform_uniform(uform_key(seed, PATCH, step, item, p)) < np.float32(ratio) for p in range(count)])


# ------------------------------------------------------------------------------------------------
# The peer
# ------------------------------------------------------------------------------------------------

def decode_png(data, patch_side):
    """The peer's decode of the bench's PNGs (8-bit RGB, unfiltered rows): (patches, patch_side^2 * 3) floats
    in [-1, 1], patches in raster order, each (y, x, channel), as uform makes them for a picture whose sides
    are whole patches (its resize is then the identity)."""
    at, idat = 8, []
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[at + 8:at + 16])
        elif kind == b"IDAT":
            idat.append(data[at + 8:at + 8 + length])
        at += 12 + length
    rows = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any() and height % patch_side == 0 and width % patch_side == 0
    pixels = rows[:, 1:].reshape(height // patch_side, patch_side, width // patch_side, patch_side, 3)
    patches = pixels.transpose(0, 2, 1, 3, 4).reshape(-1, patch_side * patch_side * 3)
    return (patches.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)


def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def rope_tables(coordinates):
    """(cos, sin) of shape (tokens, 32): `coordinates` (tokens,) for text, (tokens, 2) rows and columns for
    patches, whose pair 2k turns with the row and 2k + 1 with the column at frequency 10000^(-4k/64)."""
    pairs = np.arange(32)
    if coordinates.ndim == 1:
        angles = coordinates[:, None] * 10000.0 ** (-2.0 * pairs / 64)
    else:
        angles = np.where(pairs % 2 == 0, coordinates[:, :1], coordinates[:, 1:]) * 10000.0 ** (-2.0 * (pairs & ~1) / 64)
    return torch.tensor(np.cos(angles), dtype=torch.float32), torch.tensor(np.sin(angles), dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.heads = hidden // 64
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        items, length, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(items, length, 3, self.heads, 64).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(items, length, hidden))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Peer(nn.Module):
    NAMES = {"embed.weight": "text.embedding", "norm.weight": "final_norm", "decoder.weight": "text.decoder",
             "projection.weight": "image.projection", "patch_decoder.weight": "image.decoder",
             "log_inverse_temperature": "contrastive.log_inverse_temperature", "bias": "contrastive.bias"}

    def __init__(self, depth, hidden, patch):
        super().__init__()
        self.embed = nn.Embedding(260, hidden)
        self.projection = nn.Linear(patch, hidden, bias=False)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.decoder = nn.Linear(hidden, 256, bias=False)
        self.patch_decoder = nn.Linear(hidden, patch, bias=False)
        self.log_inverse_temperature = nn.Parameter(torch.zeros(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def load(self, weights):
        names = dict(self.NAMES)
        for l in range(len(self.blocks)):
            for ours, theirs in (("norm1", "attention_norm"), ("qkv", "qkv"), ("out", "out"), ("norm2", "mlp_norm"),
                                 ("up", "up"), ("down", "down")):
                names[f"blocks.{l}.{ours}.weight"] = f"blocks.{l}.{theirs}"
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                parameter.copy_(torch.from_numpy(weights[names[name]]).reshape(parameter.shape))
        return self

    def encode(self, x, cos, sin, mask=None):
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)


def peer_loss(model, b):
    """(total, (masked, contrastive, image)) of one step: `b` holds the step's tensors (`peer_batch`)."""
    # Captions: one padded batch, keys past each caption's end masked off.
    text = model.encode(model.embed(b["text_ids"]), b["text_cos"], b["text_sin"], b["key_mask"])
    # Images: the patch id's row plus the projection at shown patches; the mask id's row alone at hidden ones.
    x = model.embed(b["image_ids"]) + model.projection(b["patches"]) * b["shown"]
    image = model.encode(x, b["image_cos"], b["image_sin"])
    hidden = text.shape[-1]
    logits = model.decoder(text.reshape(-1, hidden)[b["masked_index"]]).float()
    masked = F.cross_entropy(logits, b["masked_targets"])
    values = b["patches"].reshape(-1, b["patches"].shape[-1])[b["hidden_index"]]
    mean = values.mean(-1, keepdim=True)
    targets = (values - mean) / torch.sqrt(values.var(-1, correction=0, keepdim=True) + 1e-6)
    predicted = model.patch_decoder(image.reshape(-1, hidden)[b["hidden_index"]]).float()
    image_loss = F.mse_loss(predicted, targets)
    pooled = torch.cat([(text.float() * b["valid"]).sum(1) / b["lengths"], image.float().mean(1)])
    z = F.normalize(pooled, dim=-1)
    scores = z @ z.T * model.log_inverse_temperature.exp() + model.bias
    labels = b["labels"]
    contrastive = -(F.logsigmoid(labels * scores) * (labels != 0)).sum() / labels.shape[0]
    return masked + image_loss + contrastive, (masked, contrastive, image_loss)


def peer_batch(captions, patches, seed, masking, device):
    """The peer's tensors for uform's first step (step number 1): the same masked bytes and hidden patches."""
    pairs = len(captions)
    longest = max(len(c) for c in captions)
    ids = np.zeros((pairs, longest), np.int64)
    targets = np.zeros((pairs, longest), np.int64)
    chosen = np.zeros((pairs, longest), bool)
    valid = np.zeros((pairs, longest), bool)
    for k, data in enumerate(captions):
        seen, positions = mask_text(data, seed, 1, 2 * k, masking["token_mask_probability"],
                                    masking["token_mean_span"], masking["replace_fraction"], masking["random_fraction"])
        ids[k, :len(data)] = seen
        targets[k, :len(data)] = list(data)
        chosen[k, positions] = True
        valid[k, :len(data)] = True
    count = patches.shape[1]
    hidden = np.stack([hidden_patches(seed, 1, 2 * k + 1, count, masking["image_mask_ratio"]) for k in range(pairs)])
    side = int(round(math.sqrt(count)))
    grid = np.stack(np.divmod(np.arange(count), side), 1).astype(np.float64)
    text_cos, text_sin = rope_tables(np.arange(longest, dtype=np.float64))
    image_cos, image_sin = rope_tables(grid)
    labels = -torch.ones(2 * pairs, 2 * pairs)
    index = torch.arange(pairs)
    labels[index, index + pairs] = labels[index + pairs, index] = 1
    labels.fill_diagonal_(0)
    tensors = dict(
        text_ids=torch.tensor(ids), key_mask=torch.tensor(valid)[:, None, None, :],
        valid=torch.tensor(valid, dtype=torch.float32)[..., None],
        lengths=torch.tensor(valid.sum(1, keepdims=True), dtype=torch.float32),
        masked_index=torch.tensor(np.flatnonzero(chosen)), masked_targets=torch.tensor(targets.reshape(-1)[chosen.reshape(-1)]),
        image_ids=torch.tensor(np.where(hidden, MASK_ID, PATCH_ID)), patches=torch.tensor(patches),
        shown=torch.tensor(~hidden, dtype=torch.float32)[..., None], hidden_index=torch.tensor(np.flatnonzero(hidden)),
        text_cos=text_cos, text_sin=text_sin, image_cos=image_cos, image_sin=image_sin, labels=labels)
    return {name: t.to(device) for name, t in tensors.items()}, int(chosen.sum()), int(hidden.sum())


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------

def useful_flops(depth, hidden, patch, caption_lengths, patches_per_image, masked, hidden_patches_count):
    """A step's FLOPs on real tokens, forward and backward: 6 x the products' parameters per token, the heads
    where they read, the projection (forward and its weight's gradient), attention within each item."""
    items = list(caption_lengths) + [patches_per_image] * (len(caption_lengths))
    tokens = sum(items)
    shown = len(caption_lengths) * patches_per_image - hidden_patches_count
    dense = 6 * depth * 12 * hidden * hidden * tokens
    heads = 6 * 256 * hidden * masked + 6 * patch * hidden * hidden_patches_count + 4 * patch * hidden * shown
    attention = 12 * depth * hidden * sum(length * length for length in items)
    return dense + heads + attention


def sync(gpu):
    if gpu:
        torch.cuda.synchronize()


def run_uform(args, init, executor, made, step, gpu):
    """uform's step twice: blocking steps, each decoding its PNGs, then deferred steps two in flight, each
    batch's PNGs decoded while the step before it trains (`Trainer.deferred`'s lookahead)."""
    free_before = torch.cuda.mem_get_info()[0] if gpu else None
    with init(executor, made) as trainer:
        first = trainer.step(step).stats
        host = 0.0
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                start = time.perf_counter()
            stats = trainer.step(step).stats
            host += stats.host_seconds if i >= args.warmup else 0.0
        seconds = (time.perf_counter() - start) / args.steps
        held = free_before - torch.cuda.mem_get_info()[0] if gpu else None
        deferred, flight, ahead_host = trainer.deferred(), [], 0.0
        for i in range(args.warmup + args.steps + 1):
            if i == args.warmup + 1:  # from the first step whose decoding overlapped the one before it
                start = time.perf_counter()
            if i < args.warmup + args.steps:
                flight.append(deferred.step(step))
            if len(flight) == 2 or i == args.warmup + args.steps:
                landed = flight.pop(0).wait().stats
                ahead_host += landed.host_seconds if i > args.warmup + 1 else 0.0
        while flight:
            landed = flight.pop(0).wait().stats
            ahead_host += landed.host_seconds
        ahead_seconds = (time.perf_counter() - start) / args.steps
    blocking = dict(peer="uform", step_ms=seconds * 1e3, host_share=host / args.steps / seconds,
                    device_memory_bytes=held,
                    first_losses=dict(masked=first.masked_loss, contrastive=first.contrastive_loss,
                                      image=first.image_loss, total=first.loss),
                    last_loss=stats.loss)
    ahead = dict(peer="uform, decoded ahead", step_ms=ahead_seconds * 1e3,
                 host_share=ahead_host / args.steps / ahead_seconds, last_loss=landed.loss)
    return blocking, ahead, first


def run_peer(args, mode, weights, batch, patch, gpu):
    model = Peer(args.depth, args.hidden, patch).load(weights).to(args.device)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([dict(params=matrices, weight_decay=0.1), dict(params=others, weight_decay=0.0)],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=gpu)
    loss_fn = torch.compile(peer_loss) if mode == "compile" else peer_loss
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for i in range(1 + args.warmup + args.steps):
        if i == 1 + args.warmup:
            sync(gpu)
            start = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=gpu):
            loss, terms = loss_fn(model, batch)
        if i == 0:
            first = [t.item() for t in terms] + [loss.item()]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(gpu)
    seconds = (time.perf_counter() - start) / args.steps
    return dict(peer="torch", mode=mode, step_ms=seconds * 1e3,
                first_losses=dict(zip(("masked", "contrastive", "image", "total"), first)), last_loss=loss.item(),
                peak_memory_bytes=torch.cuda.max_memory_allocated() if gpu else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=112, help="captions (and as many images) a step")
    parser.add_argument("--cols", type=int, default=512, help="max_columns_per_row")
    parser.add_argument("--image-side", type=int, default=224, help="pixels a side of each square image")
    parser.add_argument("--patch-side", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7, help="uform's config.seed, which keys the masking")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for uform and torch")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="the peer eager only")
    args = parser.parse_args()
    if args.image_side % args.patch_side:
        parser.error("--image-side must be a whole number of patches (the peer's decode does not resize)")
    from safetensors import safe_open

    gpu = args.device == "cuda"
    torch.set_num_threads(args.threads)
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("torch_peer", os.path.join(here, "torch_peer.py"))
    torch_peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_peer)
    peak = torch_peer.peak_bf16_tflops() if gpu else None

    step, captions, images = make_step(args.pairs, args.image_side)
    patches = []
    for k, data in enumerate(images):
        values, _ = _testing.image_patches(np.frombuffer(data, np.uint8), args.patch_side, 3, args.cols,
                                              field=f"images[{k}]")
        patches.append(values.reshape(len(values), -1))
    patches = np.stack(patches)  # (pairs, patches per image, patch)
    per_image, patch = patches.shape[1:]
    lengths = [len(c) if i % 2 == 0 else per_image for i, c in enumerate(step["contents"])]
    rows = first_fit_rows(lengths, args.cols)
    made = config(args, rows)

    # The peer's decode of the same PNGs, timed on one thread, and checked against uform's patches; beside it
    # uform's own decoder over the same files (through the test hook, so with a copy out), also one thread.
    decoded = np.stack([decode_png(data, args.patch_side) for data in images])
    decode_difference = float(np.abs(decoded - patches).max())
    start = time.perf_counter()
    for _ in range(3):
        torch.tensor(np.stack([decode_png(data, args.patch_side) for data in images])).to(args.device)
    sync(gpu)
    decode_ms = (time.perf_counter() - start) / 3 * 1e3
    start = time.perf_counter()
    for _ in range(3):
        for data in images:
            _testing.image_patches(np.frombuffer(data, np.uint8), args.patch_side, 3, args.cols)
    uform_decode_ms = (time.perf_counter() - start) / 3 * 1e3

    executor = uform.Executor.for_vram() if gpu else uform.Executor.for_ram(threads=args.threads)
    init = uform.Trainer.init_vram if gpu else uform.Trainer.init_ram
    with executor, tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "initial.safetensors")
        with init(executor, made) as trainer:
            trainer.save(path, weights_only=True)
        with safe_open(path, "numpy") as f:
            weights = {name: f.get_tensor(name) for name in f.keys()}
            derived = json.loads(f.metadata()["config"])
        ours, ahead, first = run_uform(args, init, executor, made, step, gpu)
        with uform.Encoder.load(path, executor) as encoder:  # inference: each chunk's PNGs decode as the last embeds
            pictures = images * 4
            encoder.embed(["image"] * len(images), images)
            start = time.perf_counter()
            encoder.embed(["image"] * len(pictures), pictures)
            embed_seconds = time.perf_counter() - start
    batch, masked, hidden = peer_batch(captions, patches, derived["seed"], derived["masking"], args.device)
    tokens = sum(lengths)
    flops = useful_flops(args.depth, args.hidden, patch, lengths[::2], per_image, masked, hidden)
    setup = dict(task="setup", pairs=args.pairs, items=2 * args.pairs, tokens=first.tokens, rows=rows, cols=args.cols,
                 caption_bytes=sum(lengths[::2]), patches_per_image=per_image, png_bytes=sum(map(len, images)),
                 masked_positions=[first.masked_positions, masked], masked_patches=[first.masked_patches, hidden],
                 peer_padded_text_tokens=args.pairs * max(lengths[::2]), peer_decode_matches=decode_difference,
                 peer_decode_ms=decode_ms, uform_decode_ms=uform_decode_ms, gflop_per_step=flops / 1e9,
                 uform_embed_images_per_s=len(pictures) / embed_seconds)
    print(json.dumps(setup), flush=True)
    assert first.tokens == tokens and first.masked_positions == masked and first.masked_patches == hidden, \
        "the peer's masking differs from uform's first step"

    results = [ours, ahead]
    for mode in ("eager", "compile") if gpu and not args.no_compile else ("eager",):
        results.append(run_peer(args, mode, weights, batch, patch, gpu))
        results[-1].update(decode_ms=decode_ms, step_ms_with_decode=results[-1]["step_ms"] + decode_ms)
        if gpu:
            torch.cuda.empty_cache()
    for result in results:
        seconds = result["step_ms"] / 1e3
        result.update(task="train", device=args.device, depth=args.depth, hidden=args.hidden, tokens=tokens,
                      tokens_per_s=tokens / seconds, mfu=flops / seconds / 1e12 / peak if peak else None,
                      peak_bf16_tflops=peak)
        print(json.dumps(result), flush=True)
    check = dict(task="first_step_losses", uform=ours["first_losses"])
    for result in results[2:]:
        theirs = result["first_losses"]
        check[result["mode"]] = theirs
        check[result["mode"] + "_relative_difference"] = {
            name: abs(theirs[name] - value) / abs(value) for name, value in ours["first_losses"].items()}
    print(json.dumps(check), flush=True)
    best = min(results[2:], key=lambda r: r["step_ms"])
    host_ms = ours["host_share"] * ours["step_ms"]
    print(json.dumps(dict(task="ratio", against=best["mode"], ratio=best["step_ms"] / ours["step_ms"],
                          ratio_decoded_ahead=best["step_ms"] / ahead["step_ms"],
                          ratio_with_peer_decode=best["step_ms_with_decode"] / ours["step_ms"],
                          uform_host_ms=host_ms, ratio_less_uform_host=best["step_ms"] / (ours["step_ms"] - host_ms))),
          flush=True)


if __name__ == "__main__":
    main()
