"""An independent float64 numpy model of what uform computes (docs/model.md, SPEC §4–§5).

Written from the documents, not from the C code: the tests hold the C library to it. It reads the
weights by their checkpoint names, packs nothing (attention per item is the same computation),
and redraws the masking and the hidden image patches from the documented keyed draws. An image
item starts from its decoded patches (`Image`): decoding is tested on its own, against Pillow's
and the codecs' own tools.
"""
import collections
import math

import numpy as np

MASK_ID = 256
CHOICE_ID = 257  # the position after an item's content whose decoder logits choose
QUERY_PAD_ID = 258  # pads a query's rows up to max_query_span
PATCH_ID = 259  # a shown image patch, whose projection adds to this row
NONE, QUERY, DOCUMENT, BOTH = 0, 1, 2, 3  # late-interaction sides
LATE_NAMES = ["late_interaction.token_head", "late_interaction.log_inverse_temperature", "late_interaction.bias"]
M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------------
# Keyed draws
# ------------------------------------------------------------------------------------------------

def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def key(seed, stream, step, item, index):
    return mix(mix(mix(mix(mix(seed) ^ stream) ^ step) ^ item) ^ index)


def uniform(k):
    return np.float32((k >> 40) * (1.0 / 16777216.0))


SPAN, CORRUPT, BYTE, PATCH = 2, 3, 4, 5


def mask_item(data, seed, step, item, token_mask_probability=0.15, token_mean_span=3.0, replace_fraction=0.8,
              random_fraction=0.1):
    """Returns (ids the model sees, chosen positions) for one text item."""
    probability, mean_span, replace, random = token_mask_probability, token_mean_span, replace_fraction, random_fraction
    ids = list(data)
    chosen = []
    start_probability = np.float32(np.float32(probability) / np.float32(mean_span))
    continue_log = math.log(1.0 - 1.0 / mean_span) if mean_span > 1 else 0.0
    left = 0
    for p in range(len(data)):
        k = key(seed, SPAN, step, item, p)
        if not left and uniform(k) < start_probability:
            u = ((k & 0xFFFFFF) + 1.0) / 16777217.0
            left = 1 + int(min(math.floor(math.log(u) / continue_log), 1e6)) if mean_span > 1 else 1
        if not left:
            continue
        left -= 1
        chosen.append(p)
        draw = uniform(key(seed, CORRUPT, step, item, p))
        if draw < np.float32(replace):
            ids[p] = MASK_ID
        elif draw < np.float32(replace) + np.float32(random):
            ids[p] = key(seed, BYTE, step, item, p) >> 56
    return ids, chosen


Image = collections.namedtuple("Image", "patches rows columns")
Image.__doc__ = "An image item: its patches (rows * columns, patch values) in raster order, as decoded."
Video = collections.namedtuple("Video", "tubelets frames rows columns")
Video.__doc__ = "A video item: its tubelets (frames * rows * columns, values) by time, then row, then column."
Audio = collections.namedtuple("Audio", "chunks")
Audio.__doc__ = "An audio item: its chunks (count, samples), as decoded."


def hide_patches(count, seed, step, item, image_mask_ratio=0.75):
    """Which of an image's `count` patches a training step hides: one keyed draw per patch."""
    return [bool(uniform(key(seed, PATCH, step, item, p)) < np.float32(image_mask_ratio)) for p in range(count)]


def normalized_patches(patches):
    """Each patch's values less their mean, over sqrt(population variance + 1e-6): MAE's targets."""
    patches = np.asarray(patches, np.float64)
    mean = patches.mean(-1, keepdims=True)
    return (patches - mean) / np.sqrt(patches.var(-1, keepdims=True) + 1e-6)


# ------------------------------------------------------------------------------------------------
# The encoder
# ------------------------------------------------------------------------------------------------

def rmsnorm(x, gain):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * gain


def text_angles(tokens):
    """(tokens, 32): pair i of position t turns by t * 10000^(-2i/64)."""
    return np.arange(tokens, dtype=np.float64)[:, None] * 10000.0 ** (-2.0 * np.arange(32) / 64)


def volume_angles(frames, rows, columns):
    """(frames * rows * columns, 32): pairs 3k, 3k + 1, 3k + 2 turn by the tubelet's time, row and column, all
    at 10000^(-6k/64)."""
    time, within = np.divmod(np.arange(frames * rows * columns), rows * columns)
    coordinates = np.stack([time, within // columns, within % columns], 1).astype(np.float64)
    pairs = np.arange(32)
    return coordinates[:, pairs % 3] * 10000.0 ** (-2.0 * (pairs - pairs % 3) / 64)


def grid_angles(rows, columns):
    """(rows * columns, 32) in raster order: pairs 2k turn by the patch's row and pairs 2k + 1 by its column,
    both at 10000^(-4k/64)."""
    row, column = np.divmod(np.arange(rows * columns, dtype=np.float64), columns)
    frequencies = 10000.0 ** (-4.0 * np.arange(16) / 64)
    angles = np.empty((rows * columns, 32))
    angles[:, 0::2] = row[:, None] * frequencies
    angles[:, 1::2] = column[:, None] * frequencies
    return angles


def rope(x, angles):
    """x: (tokens, heads, 64), each interleaved pair i of token t rotated by angles[t, i]."""
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def linear(x, weight):
    """x @ weight.T, summed by numpy's own loops: at these sizes BLAS's threads cost more than they save."""
    return np.einsum("...i,oi->...o", x, weight)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def encode(weights, ids, depth, angles=None, added=None):
    """Final-norm states (tokens, hidden) of one item; `angles` (tokens, 32) turn an image's pairs, text's
    by default, and `added` (tokens, hidden) adds to the embedding rows (shown patches' projections)."""
    x = weights["text.embedding"][np.asarray(ids)]
    if added is not None:
        x = x + added
    tokens, hidden = x.shape
    heads = hidden // 64
    angles = text_angles(tokens) if angles is None else angles
    for l in range(depth):
        b = f"blocks.{l}."
        n = rmsnorm(x, weights[b + "attention_norm"])
        q, k, v = np.split(linear(n, weights[b + "qkv"]), 3, axis=-1)
        q = rope(q.reshape(tokens, heads, 64), angles)
        k = rope(k.reshape(tokens, heads, 64), angles)
        v = v.reshape(tokens, heads, 64)
        scores = np.einsum("thd,shd->hts", q, k) / 8.0
        scores -= scores.max(-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", p, v).reshape(tokens, hidden)
        x = x + linear(a, weights[b + "out"])
        n = rmsnorm(x, weights[b + "mlp_norm"])
        x = x + linear(gelu(linear(n, weights[b + "up"])), weights[b + "down"])
    return rmsnorm(x, weights["final_norm"])


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------

def softplus(x):
    return np.logaddexp(0.0, x)


def cells_of(count, relations, negatives="ambient", ambient_weight=1.0):
    """(labels, weights): labels +1 attract, -1 repel or ambient, 0 ignored."""
    labels = np.zeros((count, count))
    weights = np.zeros((count, count))
    if negatives == "ambient":
        labels[:] = -1
        weights[:] = ambient_weight
    np.fill_diagonal(labels, 0)
    np.fill_diagonal(weights, 0)
    for name, label in (("attract", 1), ("repel", -1), ("ignore", 0)):
        edges = relations.get(name)
        if edges is None:
            continue
        offsets, ids = edges["offsets"], edges["ids"]
        edge_weights = edges.get("weights")
        for i in range(count):
            for e in range(offsets[i], offsets[i + 1]):
                labels[i, ids[e]] = label
                weights[i, ids[e]] = 0.0 if label == 0 else (1.0 if edge_weights is None else edge_weights[e])
    return labels, weights


def pair_losses(scores, labels, weights, form):
    """Per-row losses and which rows count, for one score matrix (SPEC §5)."""
    rows = []
    counted = []
    for s, y, w in zip(scores, labels, weights):
        attract, repel = (y > 0), (y < 0)
        wa, wr = w * attract, w * repel
        if form == "sigmoid":
            total = wa.sum() + wr.sum()
            rows.append((wa * softplus(-s)).sum() + (wr * softplus(s)).sum())
            counted.append(total > 0)
        elif form == "balanced":
            loss = 0.0
            if wa.sum() > 0:
                loss += (wa * softplus(-s)).sum() / wa.sum()
            if wr.sum() > 0:
                loss += (wr * softplus(s)).sum() / wr.sum()
            rows.append(loss)
            counted.append(wa.sum() > 0 or wr.sum() > 0)
        elif form == "ranked":
            if wa.sum() > 0 and wr.sum() > 0:
                pairwise = softplus(-(s[:, None] - s[None, :]))  # [p, n]
                rows.append((wa[:, None] * wr[None, :] * pairwise).sum() / (wa.sum() * wr.sum()))
                counted.append(True)
            else:
                rows.append(0.0)
                counted.append(False)
        else:
            raise ValueError(form)
    return np.array(rows), np.array(counted, dtype=bool)


def maxsim(query, document):
    """S(q, d): the sum over the query's rows of their largest dot product with a document row."""
    return float((query @ document.T).max(axis=1).sum())


def late_interaction_loss(vectors, spans, rows, log_t, bias, form="ranked"):
    """The late-interaction term: `rows` [(query span, [(document span, cell, weight)])], cell 1
    attract and 2 repel, over token vectors taken as they are (unit or not)."""
    losses = []
    for query, named in rows:
        if not named:
            continue
        q = vectors[spans[query][0]:spans[query][0] + spans[query][1]]
        scores = np.array([maxsim(q, vectors[spans[d][0]:spans[d][0] + spans[d][1]]) for d, _, _ in named])
        labels = np.array([1.0 if cell == 1 else -1.0 for _, cell, _ in named])
        weights = np.array([w for _, _, w in named], dtype=np.float64)
        row, counted = pair_losses((np.exp(log_t) * scores + bias)[None, :], labels[None, :], weights[None, :], form)
        if counted[0]:
            losses.append(row[0])
    return float(np.mean(losses)) if losses else float("nan")


def contrastive_loss(pooled, groups, log_t, bias, labels, weights, form="sigmoid", dimensions=None):
    """The contrastive term over raw mean-pooled embeddings (items, hidden)."""
    dimensions = dimensions or [pooled.shape[1]]
    per_dimension = []
    for m in dimensions:
        z = pooled[:, :m] / np.linalg.norm(pooled[:, :m], axis=1, keepdims=True)
        t = np.exp(log_t[groups])[:, None]
        scores = t * (z @ z.T) + bias[groups][:, None]
        rows, counted = pair_losses(scores, labels, weights, form)
        if counted.any():
            per_dimension.append(rows[counted].mean())
    return float(np.mean(per_dimension)) if per_dimension else float("nan")


def cross_entropy(logits, targets):
    logits = logits - logits.max(-1, keepdims=True)
    log_probabilities = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-log_probabilities[np.arange(len(targets)), targets].mean())


def choose(logits, offered, targets):
    """-sum t log q over one item's offered bytes, q their softmax alone."""
    picked = np.asarray(logits, np.float64)[list(offered)]
    log_q = picked - picked.max() - np.log(np.exp(picked - picked.max()).sum())
    return float(-(np.asarray(targets, np.float64) * log_q).sum())


def step_losses(weights, items, *, depth, objective, seed, step, relations=None, groups=None, form="sigmoid",
                dimensions=None, negatives="ambient", ambient_weight=1.0, masking=None, text_weight=1.0,
                choices=None, choice_targets=None, choices_weight=1.0, sides=None, late=None, image_mask_ratio=0.75,
                image_weight=1.0, video_mask_ratio=0.9, video_weight=1.0, audio_mask_ratio=0.5, audio_weight=1.0,
                media=None):
    """(total, masked, contrastive, choices, late interaction, image) of one step over items, each a
    byte string (text) or an `Image`, as uform defines them. An item offering choices (bytes) ends
    with CHOICE_ID, which pooling counts and masking skips. `late` (weight, max_query_span, form)
    scores the items' `sides`: a query is cut to the span and padded up to it with QUERY_PAD_ID, and
    its rows and a document's (the choice position aside) go through the token head to unit length.
    Outside the contrastive objective an image's patches hide by keyed draws: a hidden one shows
    MASK_ID and adds no projection, and the patch decoder regresses its normalized values there. Video
    tubelets and audio chunks do the same with their own tensors, ratios and weights; `media`, a dict when
    given, receives each kind's loss."""
    masking = masking or {}
    states, pooled, decoded, targets, chose, scored = [], [], [], [], [], []
    predicted, regressed = {"image": [], "video": [], "audio": []}, {"image": [], "video": [], "audio": []}
    ratios = dict(image=image_mask_ratio, video=video_mask_ratio, audio=audio_mask_ratio)
    for i, data in enumerate(items):
        side = sides[i] if sides else NONE
        offered = choices[i] if choices else b""
        if isinstance(data, (Image, Video, Audio)):
            if isinstance(data, Image):
                kind, angles = "image", grid_angles(data.rows, data.columns)
                values = np.asarray(data.patches, np.float64).reshape(data.rows * data.columns, -1)
            elif isinstance(data, Video):
                kind, angles = "video", volume_angles(data.frames, data.rows, data.columns)
                values = np.asarray(data.tubelets, np.float64).reshape(data.frames * data.rows * data.columns, -1)
            else:
                values = np.asarray(data.chunks, np.float64)
                kind, angles = "audio", text_angles(len(values))
            hidden = np.zeros(len(values), dtype=bool) if objective == "contrastive" else \
                np.array(hide_patches(len(values), seed, step, i, ratios[kind]))
            ids = np.where(hidden, MASK_ID, PATCH_ID)
            added = np.where(hidden[:, None], 0.0, values @ weights[f"{kind}.projection"].T)
            final = encode(weights, ids, depth, angles, added)
            predicted[kind] += list(final[hidden])
            regressed[kind] += list(normalized_patches(values[hidden]))
        else:
            if side in (QUERY, BOTH):
                data = data[:late["max_query_span"]]
            if objective == "contrastive":
                ids, chosen = list(data), []
            else:
                ids, chosen = mask_item(data, seed, step, i, **masking)
            ids = list(ids)
            if side in (QUERY, BOTH):
                ids += [QUERY_PAD_ID] * (late["max_query_span"] - len(ids))
            final = encode(weights, ids + [CHOICE_ID] * (len(offered) > 0), depth)
            for p in chosen:
                decoded.append(final[p])
                targets.append(data[p])
            if offered:
                chose.append(choose(final[-1] @ weights["text.decoder"].T, offered, choice_targets[i]))
        if side != NONE:
            vectors = final[:len(ids)] @ weights["late_interaction.token_head"].T
            scored.append(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
        else:
            scored.append(None)
        states.append(final)
        pooled.append(final.mean(0))
    losses = {kind: float(((np.array(predicted[kind]) @ weights[f"{kind}.decoder"].T - np.array(regressed[kind])) ** 2)
                          .mean()) if predicted[kind] else float("nan") for kind in predicted}
    if media is not None:
        media.update(losses)
    image = losses["image"]
    masked = float("nan")
    if objective != "contrastive" and targets:
        masked = cross_entropy(np.array(decoded) @ weights["text.decoder"].T, np.array(targets))
    contrastive = float("nan")
    if objective != "masked":
        labels, cell_weights = cells_of(len(items), relations or {}, negatives, ambient_weight)
        groups = np.zeros(len(items), dtype=int) if groups is None else np.asarray(groups)
        contrastive = contrastive_loss(np.array(pooled), groups, weights["contrastive.log_inverse_temperature"],
                                       weights["contrastive.bias"], labels, cell_weights, form, dimensions)
    chose = float(np.mean(chose)) if chose else float("nan")
    late_loss = float("nan")
    if late:
        spans, vectors, rows, at = {}, [], [], 0
        for i, rows_of in enumerate(scored):
            if rows_of is not None:
                spans[i] = (at, len(rows_of))
                vectors.append(rows_of)
                at += len(rows_of)
        for i in range(len(items)):
            if sides[i] not in (QUERY, BOTH):
                continue
            named = []
            for cell, kind in ((1, "attract"), (2, "repel")):
                edges = (relations or {}).get(kind)
                if not edges:
                    continue
                weights_of = edges.get("weights")
                for k in range(edges["offsets"][i], edges["offsets"][i + 1]):
                    if sides[edges["ids"][k]] in (DOCUMENT, BOTH):
                        named.append((edges["ids"][k], cell, 1.0 if weights_of is None else weights_of[k]))
            if named:
                rows.append((i, named))
        table = [spans.get(i, (0, 0)) for i in range(len(items))]
        late_loss = late_interaction_loss(np.concatenate(vectors), table, rows,
                                          float(weights["late_interaction.log_inverse_temperature"][0]),
                                          float(weights["late_interaction.bias"][0]), late["form"])
    parts = []
    if not math.isnan(masked):
        parts.append(text_weight * masked)
    if not math.isnan(contrastive):
        parts.append(contrastive)
    if not math.isnan(chose):
        parts.append(choices_weight * chose)
    if not math.isnan(late_loss):
        parts.append(late["weight"] * late_loss)
    for kind, weight in (("image", image_weight), ("video", video_weight), ("audio", audio_weight)):
        if not math.isnan(losses[kind]):
            parts.append(weight * losses[kind])
    return (sum(parts) if parts else float("nan")), masked, contrastive, chose, late_loss, image


def tensor_names(depth, late=False):
    """Every weight's name in checkpoint order (docs/model.md); `late`: with the token head."""
    names = ["text.embedding"]
    for l in range(depth):
        names += [f"blocks.{l}.{part}" for part in ("attention_norm", "qkv", "out", "mlp_norm", "up", "down")]
    names += ["final_norm", "text.decoder"]
    names += [f"{kind}.{part}" for kind in ("image", "video", "audio") for part in ("projection", "decoder")]
    names += ["contrastive.log_inverse_temperature", "contrastive.bias"]
    return names + (LATE_NAMES if late else [])


def check_gradients(loss, weights, gradients, names, seed):
    """Holds each named float32 gradient, along one random direction (drawn in `names` order from `seed`),
    to central differences of `loss(weights)` (the float64 total); answers {name: the differences' slope}.
    The tolerance scales with the terms' magnitude: float32 gradients against float64 differences."""
    rng, epsilon, slopes = np.random.default_rng(seed), 1e-5, {}
    for name in names:
        direction = rng.standard_normal(weights[name].shape)
        plus, minus = dict(weights), dict(weights)
        plus[name] = weights[name] + epsilon * direction
        minus[name] = weights[name] - epsilon * direction
        numeric = (loss(plus) - loss(minus)) / (2 * epsilon)
        terms = gradients[name] * direction
        tolerance = 2e-3 * abs(numeric) + 2e-3 * np.sqrt((terms**2).sum()) + 1e-7
        assert abs(terms.sum() - numeric) <= tolerance, (name, terms.sum(), numeric)
        slopes[name] = numeric
    return slopes


def unflatten(flat, checkpoint, depth):
    """Splits the trainer's flat buffer (16-float aligned tensors, checkpoint order) into named float64 arrays."""
    tensors, offset = {}, 0
    for name in tensor_names(depth, LATE_NAMES[0] in checkpoint):
        shape = checkpoint[name].shape
        size = int(np.prod(shape))
        tensors[name] = flat[offset:offset + size].reshape(shape).astype(np.float64)
        offset += (size + 15) // 16 * 16
    return tensors
