"""The CPU backend's operations, one by one, against float64 numpy references.

Forward values are compared with a float64 reference computed on the same float32 inputs.
Backward passes are compared with central finite differences of that float64 reference: for a
random upstream gradient `u`, the backward pass must return d<u, forward(x)>/dx. Tolerances for
float32 results against float64 references: rtol 2e-3, and atol 2e-4 times the largest magnitude
of the expected array (at least 1), so tiny entries of large arrays are judged on the array's
scale. Every operation must also give bitwise equal results on repeated calls and, where the
contract promises it, for every thread count.
"""
import numpy as np
import pytest

from reference import late_interaction_loss

testing = pytest.importorskip("uform._testing")

RTOL, ATOL = 2e-3, 2e-4
HEAD = 64


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol * scale)


def assert_identical(first, second):
    """Bitwise equality of (nested tuples of) arrays and floats, NaNs included."""
    if isinstance(first, tuple):
        assert len(first) == len(second)
        for one, other in zip(first, second):
            assert_identical(one, other)
    else:
        assert np.asarray(first).tobytes() == np.asarray(second).tobytes()


def numeric_gradient(function, x, upstream, epsilon=1e-6):
    """d<upstream, function(x)>/dx by central differences, in float64, one entry at a time."""
    x = np.array(x, dtype=np.float64)
    gradient = np.zeros_like(x)
    flat, flat_gradient = x.reshape(-1), gradient.reshape(-1)
    for index in range(flat.size):
        original = flat[index]
        flat[index] = original + epsilon
        plus = np.sum(upstream * function(x))
        flat[index] = original - epsilon
        minus = np.sum(upstream * function(x))
        flat[index] = original
        flat_gradient[index] = (plus - minus) / (2 * epsilon)
    return gradient


def directional_derivatives(function, x, upstream, count, rng, epsilon=1e-6):
    """(directions, derivatives): <upstream, function(x)> differentiated along random directions."""
    x = np.asarray(x, dtype=np.float64)
    directions = rng.standard_normal((count,) + x.shape)
    derivatives = [
        (np.sum(upstream * function(x + epsilon * d)) - np.sum(upstream * function(x - epsilon * d))) / (2 * epsilon)
        for d in directions
    ]
    return directions, np.array(derivatives)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(20261201)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def rmsnorm_reference(x, gain):
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=1) + 1e-6)
    return x * rstd[:, None] * gain[None, :], rstd


def rope_reference(qkv, positions, sign=1.0):
    qkv = np.array(qkv, dtype=np.float64)
    hidden = qkv.shape[1] // 3
    frequencies = 10000.0 ** (-2.0 * np.arange(HEAD // 2) / HEAD)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * frequencies[None, :]
    cosines, sines = np.cos(angles), sign * np.sin(angles)
    for head in range(2 * hidden // HEAD):  # the queries' heads, then the keys'
        block = qkv[:, head * HEAD : (head + 1) * HEAD]
        even, odd = block[:, 0::2].copy(), block[:, 1::2].copy()
        block[:, 0::2] = even * cosines - odd * sines
        block[:, 1::2] = even * sines + odd * cosines
    return qkv


def attention_reference(qkv, segments):
    qkv = np.asarray(qkv, dtype=np.float64)
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    out, lse = np.zeros((tokens, hidden)), np.zeros((hidden // HEAD, tokens))
    for start, length in segments:
        rows = slice(start, start + length)
        for head in range(hidden // HEAD):
            columns = slice(head * HEAD, (head + 1) * HEAD)
            q, k = qkv[rows, columns], qkv[rows, hidden:][:, columns]
            v = qkv[rows, 2 * hidden :][:, columns]
            scores = q @ k.T / 8.0
            largest = scores.max(axis=1, keepdims=True)
            weights = np.exp(scores - largest)
            sums = weights.sum(axis=1, keepdims=True)
            out[rows, columns] = weights / sums @ v
            lse[head, rows] = (largest + np.log(sums))[:, 0]
    return out, lse


def gelu_reference(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def pool_reference(states, segments):
    return np.stack([states[start : start + length].mean(axis=0) for start, length in segments])


def cross_entropy_reference(logits, targets):
    logits = np.asarray(logits, dtype=np.float64)
    largest = logits.max(axis=1, keepdims=True)
    log_sums = largest[:, 0] + np.log(np.exp(logits - largest).sum(axis=1))
    return np.mean(log_sums - logits[np.arange(len(targets)), targets])


def softplus(x):
    return np.logaddexp(0.0, x)


def contrastive_reference(pooled, log_inverse_temperature, bias, cells, weights, groups, dimensions, form):
    """SPEC section 5, written plainly: the mean over dimensions of the mean over counting rows."""
    pooled = np.asarray(pooled, dtype=np.float64)
    groups = np.zeros(len(pooled), dtype=np.int64) if groups is None else np.asarray(groups)
    temperature = np.exp(np.asarray(log_inverse_temperature, dtype=np.float64))[groups]
    shift = np.asarray(bias, dtype=np.float64)[groups]
    losses = []
    for width in dimensions:
        prefix = pooled[:, :width]
        z = prefix / np.linalg.norm(prefix, axis=1, keepdims=True)
        scores = temperature[:, None] * (z @ z.T) + shift[:, None]
        rows = []
        for i in range(len(pooled)):
            attract = np.where(cells[i] == 1, weights[i], 0.0).astype(np.float64)
            repel = np.where(cells[i] == 2, weights[i], 0.0).astype(np.float64)
            attract_sum, repel_sum = attract.sum(), repel.sum()
            s = scores[i]
            if form == "sigmoid":
                if attract_sum + repel_sum > 0:
                    rows.append(np.sum(attract * softplus(-s)) + np.sum(repel * softplus(s)))
            elif form == "balanced":
                if attract_sum > 0 or repel_sum > 0:
                    row = np.sum(attract * softplus(-s)) / attract_sum if attract_sum > 0 else 0.0
                    row += np.sum(repel * softplus(s)) / repel_sum if repel_sum > 0 else 0.0
                    rows.append(row)
            elif attract_sum > 0 and repel_sum > 0:  # ranked: [p, n] holds s_n - s_p
                pairs = attract[:, None] * repel[None, :] * softplus(s[None, :] - s[:, None])
                rows.append(pairs.sum() / (attract_sum * repel_sum))
        if rows:
            losses.append(np.mean(rows))
    return np.mean(losses) if losses else np.nan


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 63, 64, 1000])
def test_memory_is_zeroed_and_round_trips(size):
    data = bytes(range(256)) * 4
    fresh, uploaded, zeroed = testing.memory_roundtrip(data[:size])
    assert testing.backend_name() == "ram"
    assert not fresh.any() and not zeroed.any()
    assert uploaded.tobytes() == data[:size]


# ---------------------------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_transposed", [False, True])
@pytest.mark.parametrize("b_transposed", [False, True])
@pytest.mark.parametrize("m, n, k", [(37, 29, 19), (5, 70, 33), (130, 3, 8), (1, 1, 1)])
def test_matmul(rng, a_transposed, b_transposed, m, n, k):
    a, b, c = f32(rng, m, k), f32(rng, k, n), f32(rng, m, n)
    a_stored = np.ascontiguousarray(a.T) if a_transposed else a
    b_stored = np.ascontiguousarray(b.T) if b_transposed else b
    expected = a.astype(np.float64) @ b.astype(np.float64)
    fresh = testing.matmul(a_stored, b_stored, None, a_transposed, b_transposed)
    assert_close(fresh, expected)  # without c, d is overwritten: its NaNs are gone
    accumulated = testing.matmul(a_stored, b_stored, c, a_transposed, b_transposed, accumulate=True)
    assert_close(accumulated, expected + c)
    residual = testing.matmul(a_stored, b_stored, c, a_transposed, b_transposed)
    assert_close(residual, expected + c)


def test_matmul_with_empty_inner_dimension_keeps_c(rng):
    c = f32(rng, 4, 6)
    assert_close(testing.matmul(np.zeros((4, 0), np.float32), np.zeros((0, 6), np.float32), c, accumulate=True), c)
    assert_close(testing.matmul(np.zeros((4, 0), np.float32), np.zeros((0, 6), np.float32), c), c)
    assert not testing.matmul(np.zeros((4, 0), np.float32), np.zeros((0, 6), np.float32)).any()


# ---------------------------------------------------------------------------------------------
# Embedding, normalization, rotary positions
# ---------------------------------------------------------------------------------------------


def test_embedding(rng):
    vocabulary, hidden = 11, 128
    table = f32(rng, vocabulary, hidden)
    ids = np.array([3, 0, 3, 10, 7, 3, 1], dtype=np.uint32)  # repeats must add up
    assert_identical(testing.embedding_forward(table, ids), table[ids])
    d_table, d_out = f32(rng, vocabulary, hidden), f32(rng, len(ids), hidden)
    result = testing.embedding_backward(d_table, d_out, ids)
    numeric = numeric_gradient(lambda t: t[ids], table, d_out)
    assert_close(result, d_table + numeric)


def test_rmsnorm(rng):
    tokens, hidden = 7, 128
    x = f32(rng, tokens, hidden) * np.linspace(0.1, 5, tokens, dtype=np.float32)[:, None]
    gain = (1 + 0.3 * rng.standard_normal(hidden)).astype(np.float32)
    out, rstd = testing.rmsnorm_forward(x, gain)
    expected_out, expected_rstd = rmsnorm_reference(x.astype(np.float64), gain.astype(np.float64))
    assert_close(out, expected_out)
    assert_close(rstd, expected_rstd)

    d_out, d_x, d_gain = f32(rng, tokens, hidden), f32(rng, tokens, hidden), f32(rng, hidden)
    result_x, result_gain = testing.rmsnorm_backward(d_x, d_gain, d_out, x, gain, rstd)
    assert_close(result_x, d_x + numeric_gradient(lambda v: rmsnorm_reference(v, gain)[0], x, d_out))
    assert_close(result_gain, d_gain + numeric_gradient(lambda g: rmsnorm_reference(x, g)[0], gain, d_out))


def segment_positions(segments, tokens):
    positions = np.zeros(tokens, dtype=np.uint32)
    for start, length in segments:
        positions[start : start + length] = np.arange(length)
    return positions


def test_rope_restarts_per_segment_and_backward_is_its_adjoint(rng):
    tokens, hidden = 9, 128
    segments = [(0, 3), (3, 5), (8, 1)]
    positions = segment_positions(segments, tokens)
    qkv = f32(rng, tokens, 3 * hidden)
    rotated = testing.rope_forward(qkv, positions)
    assert_close(rotated, rope_reference(qkv, positions))
    assert_identical(rotated[:, 2 * hidden :], qkv[:, 2 * hidden :])  # values never rotate
    for start, _ in segments:  # position 0 of every segment is the identity
        assert_identical(rotated[start], qkv[start])

    d_rotated = f32(rng, tokens, 3 * hidden)
    d_qkv = testing.rope_backward(d_rotated, positions)
    assert_close(d_qkv, numeric_gradient(lambda v: rope_reference(v, positions), qkv, d_rotated))
    adjoint = np.sum(d_qkv.astype(np.float64) * qkv), np.sum(d_rotated.astype(np.float64) * rotated)
    assert adjoint[0] == pytest.approx(adjoint[1], rel=1e-5)
    assert_close(testing.rope_backward(rotated, positions), qkv)  # the inverse rotation


def test_rope_far_positions(rng):
    tokens, hidden = 6, 128
    positions = np.array([0, 1, 511, 2047, 4095, 65535], dtype=np.uint32)
    qkv = f32(rng, tokens, 3 * hidden)
    assert_close(testing.rope_forward(qkv, positions), rope_reference(qkv, positions))


def grid_rope_reference(qkv, rows, columns):
    """An image patch's rotation, as docs/model.md words it: pairs 2k turn with the row and pairs 2k + 1 with the
    column, both at 10000^(-4k/64)."""
    qkv = np.array(qkv, dtype=np.float64)
    hidden = qkv.shape[1] // 3
    frequencies = 10000.0 ** (-4.0 * (np.arange(HEAD // 2) // 2) / HEAD)
    coordinates = np.where(np.arange(HEAD // 2) % 2 == 0, np.asarray(rows)[:, None], np.asarray(columns)[:, None])
    angles = coordinates.astype(np.float64) * frequencies[None, :]
    for head in range(2 * hidden // HEAD):
        block = qkv[:, head * HEAD : (head + 1) * HEAD]
        even, odd = block[:, 0::2].copy(), block[:, 1::2].copy()
        block[:, 0::2] = even * np.cos(angles) - odd * np.sin(angles)
        block[:, 1::2] = even * np.sin(angles) + odd * np.cos(angles)
    return qkv


def grid_positions(rows, columns):
    """The position words of image patches: the top bit, the row from bit 15, the column."""
    return (np.uint32(1 << 31) | np.asarray(rows, np.uint32) << 15 | np.asarray(columns, np.uint32)).astype(np.uint32)


def test_rope_turns_image_patches_by_row_and_column(rng):
    tokens, hidden = 7, 128
    rows, columns = np.array([0, 0, 1, 3, 17, 0, 200]), np.array([0, 1, 0, 2, 5, 9, 300])
    positions = grid_positions(rows, columns)
    qkv = f32(rng, tokens, 3 * hidden)
    rotated = testing.rope_forward(qkv, positions)
    assert_close(rotated, grid_rope_reference(qkv, rows, columns))
    assert_identical(rotated[0], qkv[0])  # the patch at (0, 0) is not turned
    assert_close(testing.rope_backward(rotated, positions), qkv)
    text = testing.rope_forward(qkv, rows.astype(np.uint32))  # a text token at the row's position turns otherwise
    assert not np.allclose(text[3:5], rotated[3:5])


def test_rope_turns_video_tubelets_by_time_row_and_column(rng):
    """Pairs 3k, 3k + 1, 3k + 2 turn with time, row and column at 10000^(-6k/64), as docs/model.md says."""
    tokens, hidden = 6, 128
    times, rows, columns = np.array([0, 1, 0, 7, 4095, 3]), np.array([0, 0, 2, 5, 9, 511]), np.array([0, 3, 0, 1, 2, 511])
    positions = (np.uint32(3 << 30) | times.astype(np.uint32) << 18 | rows.astype(np.uint32) << 9
                 | columns.astype(np.uint32)).astype(np.uint32)
    qkv = f32(rng, tokens, 3 * hidden)
    pairs = np.arange(HEAD // 2)
    frequencies = 10000.0 ** (-2.0 * (pairs - pairs % 3) / HEAD)
    coordinates = np.stack([times, rows, columns], 1)[:, pairs % 3].astype(np.float64)
    angles = coordinates * frequencies[None, :]
    expected = np.array(qkv, dtype=np.float64)
    for head in range(2 * hidden // HEAD):
        block = expected[:, head * HEAD : (head + 1) * HEAD]
        even, odd = block[:, 0::2].copy(), block[:, 1::2].copy()
        block[:, 0::2] = even * np.cos(angles) - odd * np.sin(angles)
        block[:, 1::2] = even * np.sin(angles) + odd * np.cos(angles)
    rotated = testing.rope_forward(qkv, positions)
    assert_close(rotated, expected)
    assert_identical(rotated[0], qkv[0])
    assert_close(testing.rope_backward(rotated, positions), qkv)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

SEGMENTS = [(0, 4), (4, 1), (5, 3)]  # token 8 belongs to no segment


def test_attention_forward_stays_within_segments(rng):
    tokens, hidden = 9, 128
    qkv = f32(rng, tokens, 3 * hidden, scale=2.0)
    sentinel_out = np.full((tokens, hidden), 7.0, np.float32)
    sentinel_lse = np.full((hidden // HEAD, tokens), 7.0, np.float32)
    out, lse = testing.attention_forward(qkv, SEGMENTS, sentinel_out, sentinel_lse)
    expected_out, expected_lse = attention_reference(qkv, SEGMENTS)
    assert_close(out[:8], expected_out[:8])
    assert_close(lse[:, :8], expected_lse[:, :8])
    assert (out[8] == 7).all() and (lse[:, 8] == 7).all()  # tokens outside segments are untouched
    assert_identical(out[4], qkv[4, 2 * hidden :])  # a lone token attends to itself alone

    # Changing one segment's tokens changes nothing in another segment.
    changed = qkv.copy()
    changed[5:8] = f32(rng, 3, 3 * hidden)
    changed_out, changed_lse = testing.attention_forward(changed, SEGMENTS)
    assert_identical(changed_out[:5], out[:5])
    assert_identical(changed_lse[:, :5], lse[:, :5])


def test_attention_backward(rng):
    tokens, hidden = 9, 128
    qkv = f32(rng, tokens, 3 * hidden, scale=2.0)
    out, lse = testing.attention_forward(qkv, SEGMENTS)
    d_out = f32(rng, tokens, hidden)
    d_qkv = testing.attention_backward(d_out, out, lse, qkv, SEGMENTS)
    numeric = numeric_gradient(lambda v: attention_reference(v, SEGMENTS)[0], qkv, d_out)
    assert_close(d_qkv, numeric)
    assert not d_qkv[8].any()  # written, and zero where no segment reaches


def test_attention_backward_given_positions_is_the_gradient_before_the_turn(rng):
    """The model turns q and k (rope_forward) before attention; its backward pass takes the inverse turn itself."""
    tokens, hidden = 9, 128
    positions = np.array([0, 1, 2, 3, 0, 0, 1, 2, 40], np.uint32)
    qkv, d_out = f32(rng, tokens, 3 * hidden, scale=2.0), f32(rng, tokens, hidden)
    turned = testing.rope_forward(qkv, positions)
    out, lse = testing.attention_forward(turned, SEGMENTS)
    d_qkv = testing.attention_backward(d_out, out, lse, turned, SEGMENTS, positions=positions)
    again = testing.attention_backward(d_out, out, lse, turned, SEGMENTS, positions=positions, again=True)
    assert np.array_equal(again, d_qkv)  # told its positions are the last call's, as later layers are
    numeric = numeric_gradient(lambda v: attention_reference(rope_reference(v, positions), SEGMENTS)[0], qkv, d_out)
    assert_close(d_qkv, numeric)
    assert not d_qkv[8].any()


def test_attention_long_segments_cross_query_blocks(rng):
    tokens, hidden = 300, 128
    segments = [(0, 200), (200, 1), (201, 99)]
    qkv = f32(rng, tokens, 3 * hidden, scale=1.5)
    out, lse = testing.attention_forward(qkv, segments)
    expected_out, expected_lse = attention_reference(qkv, segments)
    assert_close(out, expected_out)
    assert_close(lse, expected_lse)
    d_out = f32(rng, tokens, hidden)
    d_qkv = testing.attention_backward(d_out, out, lse, qkv, segments)
    forward = lambda v: attention_reference(v, segments)[0]
    directions, numeric = directional_derivatives(forward, qkv, d_out, 4, rng)
    analytic = np.einsum("dij,ij->d", directions, d_qkv.astype(np.float64))
    assert_close(analytic, numeric)


# ---------------------------------------------------------------------------------------------
# Element-wise and row operations
# ---------------------------------------------------------------------------------------------


def test_gelu(rng):
    x = np.concatenate([f32(rng, 500, scale=3.0), np.array([0, -12, 12, -40, 40, 1e-4], np.float32)])
    assert_close(testing.gelu_forward(x), gelu_reference(x.astype(np.float64)))
    d_out = f32(rng, x.size)
    epsilon = 1e-6
    wide = x.astype(np.float64)
    numeric = d_out * (gelu_reference(wide + epsilon) - gelu_reference(wide - epsilon)) / (2 * epsilon)
    d_in = testing.gelu_backward(d_out, x)
    assert_close(d_in, numeric)
    assert_identical(testing.gelu_backward(d_out, x, in_place=True), d_in)


def test_gather_and_scatter_rows(rng):
    x = f32(rng, 10, 96)
    rows = np.array([7, 2, 9, 0], dtype=np.uint32)
    assert_identical(testing.gather_rows(x, rows), x[rows])
    d_in, d_out = f32(rng, 10, 96), f32(rng, 4, 96)
    numeric = numeric_gradient(lambda v: v[rows], x, d_out)
    assert_close(testing.scatter_rows(d_in, d_out, rows), d_in + numeric)


def test_pool(rng):
    tokens, hidden = 9, 128
    states = f32(rng, tokens, hidden)
    segments = [(0, 4), (4, 1), (6, 3)]  # token 5 belongs to no segment
    pooled = testing.pool_forward(states, segments)
    assert_close(pooled, pool_reference(states.astype(np.float64), segments))
    d_states, d_pooled = f32(rng, tokens, hidden), f32(rng, len(segments), hidden)
    numeric = numeric_gradient(lambda v: pool_reference(v, segments), states, d_pooled)
    result = testing.pool_backward(d_states, d_pooled, segments)
    assert_close(result, d_states + numeric)
    assert_identical(result[5], d_states[5])


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def test_cross_entropy(rng):
    count, classes, scale = 7, 260, 0.7
    logits = f32(rng, count, classes, scale=4.0)
    logits[2] += 300.0  # large logits stay finite
    targets = rng.integers(0, classes, count).astype(np.uint32)
    loss, d_logits = testing.cross_entropy(logits, targets, scale)
    assert loss == pytest.approx(cross_entropy_reference(logits, targets), rel=1e-6)
    numeric = numeric_gradient(lambda v: scale * cross_entropy_reference(v, targets), logits, 1.0)
    assert_close(d_logits, numeric)


def test_patch_loss(rng):
    """The targets are a hidden token's values as decoded: the loss normalizes each row (SPEC section 5)."""
    count, width, scale = 5, 48, 0.7
    predictions, targets = f32(rng, count, width), 3 + 2 * f32(rng, count, width)
    rows = targets.astype(np.float64)
    normalized = (rows - rows.mean(1, keepdims=True)) / np.sqrt(rows.var(1, keepdims=True) + 1e-6)

    def reference(p):
        return scale * np.mean((np.asarray(p, np.float64) - normalized) ** 2)

    loss, d_predictions = testing.patch_loss(predictions, targets, scale)
    assert loss * scale == pytest.approx(reference(predictions), rel=1e-6)
    assert_close(d_predictions, numeric_gradient(reference, predictions, 1.0))
    empty, _ = testing.patch_loss(np.zeros((0, width), np.float32), np.zeros((0, width), np.float32))
    assert np.isnan(empty)


def test_cross_entropy_without_rows_is_nan_and_writes_nothing():
    d_logits = np.full((3, 5), 2.0, np.float32)
    loss, result = testing.cross_entropy(np.zeros((0, 5), np.float32), np.zeros(0, np.uint32), 1.0, d_logits)
    assert np.isnan(loss)
    assert_identical(result, d_logits)


def choices_case(rng):
    """Rows offering 2, 1, 7, 40 and all 256 bytes, in shuffled orders, with targets summing to one."""
    offered = [bytes(rng.permutation(256)[:k].astype(np.uint8)) for k in (2, 1, 7, 40, 256)]
    targets = [rng.dirichlet(np.ones(len(b))).astype(np.float32) for b in offered]
    targets[2][3] = 0  # a choice the target rules out
    targets[2] /= targets[2].sum()
    logits = f32(rng, len(offered), 256, scale=3.0)
    logits[3] += 200.0  # large logits stay finite
    return logits, offered, targets


def choices_reference(logits, offered, targets):
    """Mean over rows of -sum t log softmax(logits at the offered bytes), and each row's softmax."""
    losses, probabilities = [], []
    for row, choices, target in zip(np.asarray(logits, np.float64), offered, targets):
        picked = row[list(choices)]
        log_q = picked - picked.max() - np.log(np.exp(picked - picked.max()).sum())
        losses.append(-(np.asarray(target, np.float64) * log_q).sum())
        probabilities.append(np.exp(log_q))
    return float(np.mean(losses)), probabilities


def test_choices(rng):
    logits, offered, targets = choices_case(rng)
    scale = 0.7
    loss, d_logits, probabilities = testing.choices(logits, offered, targets, scale)
    expected, expected_probabilities = choices_reference(logits, offered, targets)
    assert loss == pytest.approx(expected, rel=1e-6)
    for actual, wanted in zip(probabilities, expected_probabilities):
        assert_close(actual, wanted)
        assert actual.sum() == pytest.approx(1.0, rel=1e-5)
    numeric = numeric_gradient(lambda v: scale * choices_reference(v, offered, targets)[0], logits, 1.0)
    assert_close(d_logits, numeric)
    for row, choices in enumerate(offered):  # bytes a row does not offer get exactly zero
        others = np.setdiff1d(np.arange(256), np.frombuffer(choices, np.uint8))
        assert not d_logits[row, others].any()
    _, _, alone = testing.choices(logits, offered)  # inference: probabilities without targets
    assert_identical(tuple(alone), tuple(probabilities))


def test_choices_without_rows_is_nan():
    loss, _, _ = testing.choices(np.zeros((0, 256), np.float32), [], [])
    assert np.isnan(loss)


def test_normalize_rows(rng):
    x = f32(rng, 6, 24, scale=2.0)
    x[3] = 0  # a zero row stays zero and passes no gradient
    out = testing.normalize_rows(x)
    expected = x / np.maximum(np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True), 1e-300)
    assert_close(out, expected)
    assert not out[3].any()
    d_out = f32(rng, 6, 24)
    d_x = testing.normalize_rows_backward(d_out, out, x)
    numeric = numeric_gradient(lambda v: v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300), x, d_out)
    numeric[3] = 0
    assert_close(d_x, numeric)


def late_interaction_case(rng, width=16):
    """Seven scored items: queries 0 and 1, documents 2-5, item 6 both; rows of every kind."""
    lengths = [4, 3, 5, 2, 6, 1, 3]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    spans = [(int(a), int(b)) for a, b in zip(starts, lengths)]
    vectors = f32(rng, sum(lengths), width)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    rows = [(0, [(2, 1, 1.0), (3, 2, 1.0), (4, 2, 0.5)]),  # one attract, two repels
            (1, [(4, 1, 2.0), (5, 1, 1.0), (6, 2, 1.5)]),
            (6, [(2, 2, 1.0)]),  # a repel alone: counts under sigmoid and balanced, not ranked
            (0, [(5, 1, 0.0), (3, 2, 1.0)])]  # an attract weighing nothing
    return vectors, spans, rows


@pytest.mark.parametrize("form", ["sigmoid", "balanced", "ranked"])
def test_late_interaction(rng, form):
    vectors, spans, rows = late_interaction_case(rng)
    log_t, bias, scale = 0.3, -0.7, 0.8
    loss, d_vectors, d_log_t, d_bias = testing.late_interaction(vectors, spans, rows, log_t, bias, form, scale)

    def reference(v, t=log_t, b=bias):
        return late_interaction_loss(np.asarray(v, np.float64), spans, rows, t, b, form)

    assert loss == pytest.approx(reference(vectors), rel=1e-6)
    assert_close(d_vectors, numeric_gradient(lambda v: scale * reference(v), vectors, 1.0))
    epsilon = 1e-6
    assert d_log_t == pytest.approx(scale * (reference(vectors, log_t + epsilon) - reference(vectors, log_t - epsilon))
                                    / (2 * epsilon), rel=1e-4, abs=1e-6)
    assert d_bias == pytest.approx(scale * (reference(vectors, b=bias + epsilon) - reference(vectors, b=bias - epsilon))
                                   / (2 * epsilon), rel=1e-4, abs=1e-6)


def test_late_interaction_without_counted_rows_is_nan(rng):
    vectors, spans, _ = late_interaction_case(rng)
    loss, d_vectors, d_log_t, d_bias = testing.late_interaction(vectors, spans, [(0, [(2, 1, 1.0)])], form="ranked")
    assert np.isnan(loss) and not d_vectors.any() and d_log_t == 0 and d_bias == 0


IGNORED, ATTRACT, REPEL = 0, 1, 2


def contrastive_case(rng, items=7, hidden=128):
    """Cells covering every kind of row: rows that count in some forms and not in others."""
    pooled = (f32(rng, items, hidden) + 0.7 * f32(rng, 1, hidden)).astype(np.float32)  # shared part: varied cosines
    cells = np.full((items, items), REPEL, np.uint8)
    weights = np.full((items, items), 0.5, np.float32)  # ambient negatives
    cells[0, 1], weights[0, 1] = ATTRACT, 1.0
    cells[0, 2] = IGNORED
    cells[1, 0], weights[1, 0] = ATTRACT, 2.0
    cells[1, 3], weights[1, 3] = ATTRACT, 0.7
    weights[1, 4] = 0.0  # a repel cell of zero weight
    cells[2, :] = IGNORED  # counts nowhere
    cells[4, :] = ATTRACT  # attracts alone: no ranked pair
    weights[4, :] = rng.uniform(0.1, 2.0, items)
    cells[5, 6], weights[5, 6] = ATTRACT, 0.0  # its attract half weighs nothing
    cells[6, 0], weights[6, 0] = ATTRACT, 1.3
    cells[6, 3], weights[6, 3] = IGNORED, 4.0  # weights of ignored cells never count
    cells[3, 5], weights[3, 5] = REPEL, 2.5
    np.fill_diagonal(cells, IGNORED)
    log_inverse_temperature = np.log(np.array([3.0, 5.0, 1.5], np.float32)).astype(np.float32)
    bias = np.array([-1.0, 0.5, -2.0], np.float32)
    groups = np.array([0, 1, 2, 0, 1, 2, 0], np.uint32)[:items]
    return pooled, log_inverse_temperature, bias, cells, weights, groups


@pytest.mark.parametrize("form", ["sigmoid", "balanced", "ranked"])
def test_contrastive(rng, form):
    pooled, log_t, bias, cells, weights, groups = contrastive_case(rng)
    dimensions, scale = [32, 128, 64], 0.8
    starts = f32(rng, *pooled.shape), f32(rng, 3), f32(rng, 3)
    loss, d_pooled, d_log_t, d_bias, normalized = testing.contrastive(
        pooled, log_t, bias, cells, weights, groups, dimensions, form, scale, *starts)

    def reference(p=pooled, t=log_t, b=bias):
        return contrastive_reference(p, t, b, cells, weights, groups, dimensions, form)

    assert loss == pytest.approx(reference(), rel=1e-6)
    wide = pooled.astype(np.float64)
    assert_close(normalized, wide / np.linalg.norm(wide, axis=1, keepdims=True))
    assert_close(d_pooled, starts[0] + numeric_gradient(lambda p: scale * reference(p=p), pooled, 1.0))
    assert_close(d_log_t, starts[1] + numeric_gradient(lambda t: scale * reference(t=t), log_t, 1.0))
    assert_close(d_bias, starts[2] + numeric_gradient(lambda b: scale * reference(b=b), bias, 1.0))
    if form == "ranked":  # the bias cancels in every ranked pair
        assert_identical(d_bias, starts[2])


def test_contrastive_single_group_and_no_counting_rows(rng):
    pooled, log_t, bias, cells, weights, _ = contrastive_case(rng)
    loss, d_pooled, d_log_t, d_bias, _ = testing.contrastive(
        pooled, log_t[:1], bias[:1], cells, weights, None, [128], "sigmoid")
    assert loss == pytest.approx(contrastive_reference(pooled, log_t[:1], bias[:1], cells, weights, None, [128],
                                                       "sigmoid"), rel=1e-6)
    assert d_log_t[0] != 0 and d_bias[0] != 0

    lonely = np.where(cells == ATTRACT, IGNORED, cells).astype(np.uint8)  # no row has an attract
    loss, d_pooled, d_log_t, d_bias, normalized = testing.contrastive(
        pooled, log_t, bias, lonely, weights, None, [64, 128], "ranked")
    assert np.isnan(loss)
    assert not d_pooled.any() and not d_log_t.any() and not d_bias.any()
    assert np.isfinite(normalized).all()


# ---------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------


def test_adamw_matches_numpy_over_steps(rng):
    count = 1000
    weights, first, second = f32(rng, count), np.zeros(count, np.float32), np.zeros(count, np.float32)
    settings = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1, gradient_scale=0.5)
    for step in range(1, 4):
        gradients = f32(rng, count)
        s = settings
        g = gradients.astype(np.float64) * s["gradient_scale"]
        expected_first = s["beta1"] * first + (1 - s["beta1"]) * g
        expected_second = s["beta2"] * second + (1 - s["beta2"]) * g * g
        corrected = (expected_first / (1 - s["beta1"] ** step)) / (
            np.sqrt(expected_second / (1 - s["beta2"] ** step)) + s["epsilon"])
        expected = weights - s["learning_rate"] * (corrected + s["weight_decay"] * weights.astype(np.float64))
        weights, first, second, _ = testing.adamw(weights, gradients, first, second, step=step, **settings)
        assert_close(first, expected_first)
        assert_close(second, expected_second)
        assert_close(weights, expected, rtol=1e-5, atol=1e-6)


def test_nan_inputs_stay_nan():
    """The vectorized exponential shifts a NaN's bits: unsigned, so UBSan (`.ci/sanitize`) sees no overflow."""
    x = np.array([np.nan, -np.nan, 1.0, -np.inf, np.inf], np.float32)
    assert np.isnan(testing.gelu_forward(x)[:2]).all()
    loss, gradient = testing.cross_entropy(np.array([[np.nan, 0.0, 1.0]], np.float32), np.array([1], np.uint32))
    assert np.isnan(loss) and np.isnan(gradient).all()


@pytest.mark.parametrize("count", [0, 1, 4095, 4096 * 3 + 17, 4096 * 1024 + 5])
def test_sum_squares(rng, count):
    x = f32(rng, count)
    assert testing.sum_squares(x) == pytest.approx(np.sum(x.astype(np.float64) ** 2), rel=1e-12, abs=0)


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


def operations(rng):
    """Each operation on random inputs, as a function of the thread count."""
    tokens, hidden = 150, 128
    segments = [(0, 70), (70, 3), (73, 77)]
    qkv = f32(rng, tokens, 3 * hidden)
    out, lse = testing.attention_forward(qkv, segments)
    x, gain, d_out = f32(rng, tokens, hidden), f32(rng, hidden), f32(rng, tokens, hidden)
    _, rstd = testing.rmsnorm_forward(x, gain)
    ids = rng.integers(0, 20, tokens).astype(np.uint32)
    logits, targets = f32(rng, 40, 260), rng.integers(0, 260, 40).astype(np.uint32)
    contrastive = contrastive_case(rng)
    zeros = np.zeros((tokens, hidden), np.float32)
    long = f32(rng, 4096 * 9 + 3)
    return {
        "attention_forward": lambda t: testing.attention_forward(qkv, segments, threads=t),
        "attention_backward": lambda t: testing.attention_backward(d_out, out, lse, qkv, segments, threads=t),
        "rmsnorm_forward": lambda t: testing.rmsnorm_forward(x, gain, threads=t),
        "rmsnorm_backward": lambda t: testing.rmsnorm_backward(zeros, gain, d_out, x, gain, rstd, threads=t),
        "sum_squares": lambda t: testing.sum_squares(long, threads=t),
        "contrastive_sigmoid": lambda t: testing.contrastive(*contrastive, [64, 128], "sigmoid", threads=t),
        "contrastive_balanced": lambda t: testing.contrastive(*contrastive, [64, 128], "balanced", threads=t),
        "contrastive_ranked": lambda t: testing.contrastive(*contrastive, [64, 128], "ranked", threads=t),
        "embedding_backward": lambda t: testing.embedding_backward(np.zeros((20, hidden), np.float32), d_out, ids,
                                                                   threads=t),
        "cross_entropy": lambda t: testing.cross_entropy(logits, targets, 0.5, threads=t),
        "rope_forward": lambda t: testing.rope_forward(qkv, np.arange(tokens), threads=t),
        "gelu_backward": lambda t: testing.gelu_backward(d_out, x, threads=t),
        "pool_forward": lambda t: testing.pool_forward(x, segments, threads=t),
        "adamw": lambda t: testing.adamw(x, d_out, x, np.abs(x), 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 3, threads=t),
        "matmul": lambda t: testing.matmul(x, x, a_transposed=True, threads=t),
    }


OPERATIONS = ["attention_forward", "attention_backward", "rmsnorm_forward", "rmsnorm_backward", "sum_squares",
              "contrastive_sigmoid", "contrastive_balanced", "contrastive_ranked", "embedding_backward",
              "cross_entropy", "rope_forward", "gelu_backward", "pool_forward", "adamw", "matmul"]


@pytest.mark.parametrize("name", OPERATIONS)
def test_repeated_calls_are_bitwise_identical(rng, name):
    operation = operations(rng)[name]
    assert_identical(operation(2), operation(2))


THREAD_INDEPENDENT = ["attention_forward", "attention_backward", "rmsnorm_forward", "rmsnorm_backward", "sum_squares",
                      "contrastive_sigmoid", "contrastive_balanced", "contrastive_ranked", "embedding_backward",
                      "cross_entropy", "rope_forward", "gelu_backward", "pool_forward", "adamw"]


@pytest.mark.parametrize("name", THREAD_INDEPENDENT)
def test_thread_count_changes_nothing(rng, name):
    operation = operations(rng)[name]
    single = operation(1)
    for threads in (2, 3):
        assert_identical(operation(threads), single)
