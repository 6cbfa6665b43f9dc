"""Images in the one encoder: patches under 2D rotary positions beside text in the same rows, masked
patch reconstruction, and image <-> text retrieval that training teaches."""
import numpy as np
import pytest

import uform
from test_media import png_bytes

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230), "yellow": (230, 220, 30)}
SHAPES = ("square", "disk", "bar")


def drawing(shape, color, rng, side=32):
    """A shape of a color at a jittered place and size on a dark background of a jittered shade, as PNG bytes.
    (No pixel noise: reconstruction regresses each patch normalized by its own spread, so noise is unlearnable.)"""
    pixels = np.full((side, side, 3), rng.integers(0, 40), np.uint8)
    y, x = np.mgrid[:side, :side]
    cy, cx, r = rng.integers(11, 21), rng.integers(11, 21), rng.integers(6, 10)
    inside = {"square": (abs(y - cy) <= r) & (abs(x - cx) <= r),
              "disk": (y - cy) ** 2 + (x - cx) ** 2 <= r * r,
              "bar": (abs(y - cy) <= 2) & (abs(x - cx) <= r + 4)}[shape]
    pixels[inside] = COLORS[color]
    return png_bytes(pixels)


def config(objective=uform.Objective.JOINT, **extra):
    made = dict(depth=2, hidden=128, objective=objective, seed=7,
                batch=dict(max_rows_per_device=12, max_columns_per_row=64, image=dict(patch_side=8)),
                schedule=dict(steps=400, warmup_steps=10, learning_rate=2e-3))
    made.update(extra)
    return made


def pairs_step(rng, combos):
    """Each (shape, color) as a caption and a drawing that attract each other both ways."""
    captions = [f"a {color} {shape}" for shape, color in combos]
    images = [drawing(shape, color, rng) for shape, color in combos]
    n = len(combos)
    return dict(modalities=[uform.Modality.TEXT] * n + [uform.Modality.IMAGE] * n, contents=captions + images,
                relations=dict(attract=uform.Edges(list(range(2 * n + 1)), [n + i for i in range(n)] + list(range(n)))))


@pytest.fixture(scope="module")
def cpu():
    with uform.Executor.for_ram(threads=2) as executor:
        yield executor


def test_a_joint_step_reads_images_beside_text(cpu):
    rng = np.random.default_rng(0)
    step = pairs_step(rng, [("disk", "red"), ("bar", "blue")])
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        stats = trainer.step(step).stats
    assert stats.tokens == len("a red disk") + len("a blue bar") + 2 * 16  # 32 x 32 pixels: 4 x 4 patches of 8
    assert 0 < stats.masked_patches < 32 and np.isfinite(stats.image_loss)
    assert stats.loss == pytest.approx(stats.masked_loss + stats.contrastive_loss + stats.image_loss, rel=1e-5)
    assert "png" in uform.capabilities()


def test_only_masked_objectives_hide_patches(cpu):
    step = pairs_step(np.random.default_rng(1), [("square", "green")])
    with uform.Trainer.init_ram(cpu, config(uform.Objective.CONTRASTIVE)) as trainer:
        stats = trainer.step(step).stats
    assert stats.masked_patches == 0 and np.isnan(stats.image_loss)


def test_reconstruction_learns(cpu):
    rng = np.random.default_rng(2)
    images = [drawing(s, c, rng) for s in SHAPES for c in COLORS]
    step = dict(modalities=[uform.Modality.IMAGE] * len(images), contents=images)
    with uform.Trainer.init_ram(cpu, config(uform.Objective.MASKED)) as trainer:
        losses = [trainer.step(step).stats.image_loss for _ in range(40)]
    assert np.mean(losses[-10:]) < 0.92 * losses[0]  # an edge under a hidden patch stays a guess: it levels off


def test_bad_images_are_refused_by_name_and_change_nothing(cpu):
    rng = np.random.default_rng(3)
    good = pairs_step(rng, [("disk", "yellow")])
    broken = dict(good, contents=[good["contents"][0], good["contents"][1][:40]])
    with uform.Trainer.init_ram(cpu, config()) as trainer, uform.Trainer.init_ram(cpu, config()) as twin:
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents\[1\]"):
            trainer.step(broken)
        assert trainer.step(good).stats.loss == twin.step(good).stats.loss
    with uform.Trainer.init_ram(cpu, config(late_interaction=dict(weight=1.0, width=32, max_query_span=8))) as late:
        with pytest.raises(uform.InvalidArgument, match=r"batch\.sides\[1\]: only text items are queries"):
            late.step(dict(good, sides=["query", "query"]))


def test_held_out_image_text_retrieval_rises(cpu, tmp_path):
    """Captions name a shape and a colour; drawings jitter place, size and shade. Training on some drawings
    lets fresh drawings find their captions among all twelve far more often than chance (1/12)."""
    combos = [(s, c) for s in SHAPES for c in COLORS]
    captions = [f"a {c} {s}" for s, c in combos]
    held_out = [drawing(s, c, np.random.default_rng(1000 + i)) for i, (s, c) in enumerate(combos)]
    path = str(tmp_path / "images.safetensors")

    def recall(encoder):
        texts = encoder.embed([uform.Modality.TEXT] * 12, captions).numpy()
        images = encoder.embed([uform.Modality.IMAGE] * 12, held_out).numpy()
        return np.mean(np.argmax(images @ texts.T, axis=1) == np.arange(12))

    rng = np.random.default_rng(4)
    made = config(uform.Objective.CONTRASTIVE, batch=dict(max_rows_per_device=12, max_columns_per_row=64,
                                                          image=dict(patch_side=8)))
    with uform.Trainer.init_ram(cpu, made) as trainer:
        trainer.save(path, weights_only=True)
        with uform.Encoder.load(path, cpu) as encoder:
            before = recall(encoder)
        for _ in range(150):
            trainer.step(pairs_step(rng, combos))
        trainer.save(path, weights_only=True)
    with uform.Encoder.load(path, cpu) as encoder:
        after = recall(encoder)
        twice = encoder.embed([uform.Modality.IMAGE] * 2, held_out[:1] * 2).numpy()
        big = encoder.embed([uform.Modality.IMAGE], [png_bytes(np.zeros((200, 120, 3), np.uint8))])
    assert np.array_equal(twice[0], twice[1])
    assert big.truncated_items == 1  # 25 x 15 patches of 8 do not fit a row of 64: resized to fit
    assert after >= 0.5 > before + 0.2, (before, after)


# ---------------------------------------------------------------------------------------------- #
#  Video and audio: the same layout, their own projections and decoders                           #
# ---------------------------------------------------------------------------------------------- #

from test_media import clip, needs, needs_format, tone, wav_bytes  # noqa: E402


@needs("ffmpeg")
@needs_format("mp4", "wav")
def test_a_step_reads_text_images_video_and_audio_together(cpu, tmp_path):
    """Each kind hides its own tokens and reports its own reconstruction; the total weighs them all."""
    rng = np.random.default_rng(5)
    video = clip(tmp_path, "mp4", frames=8, size="32x32")  # 8 frames of 2 x 2 patches of 16: 4 tubelets of 2 frames
    sound = wav_bytes(tone(0.25, 16000), 16000)  # 4,000 samples: 10 chunks of 400
    step = dict(modalities=["text", "image", "video", "audio"],
                contents=["a red disk", drawing("disk", "red", rng), video, sound],
                relations=dict(attract=uform.Edges([0, 3, 3, 3, 3], [1, 2, 3])))
    made = config(masking=dict(image_weight=0.5, video_weight=2.0, audio_weight=0.25, video_mask_ratio=0.5),
                  batch=dict(max_rows_per_device=12, max_columns_per_row=64, image=dict(patch_side=8)))
    with uform.Trainer.init_ram(cpu, made) as trainer:
        stats = trainer.step(step).stats
    assert stats.tokens == len("a red disk") + 16 + 4 * 4 + 10
    assert all(np.isfinite([stats.image_loss, stats.video_loss, stats.audio_loss]))
    expected = np.nansum([stats.masked_loss, stats.contrastive_loss]) + 0.5 * stats.image_loss + \
        2.0 * stats.video_loss + 0.25 * stats.audio_loss  # a short text may have no masked byte
    assert stats.loss == pytest.approx(expected, rel=1e-5)
    with uform.Trainer.init_ram(cpu, dict(made, objective=uform.Objective.MASKED)) as trainer:
        losses = [trainer.step(dict(step, relations=None)).stats for _ in range(12)]
    assert losses[-1].audio_loss < losses[0].audio_loss  # a pure tone: chunks are learnable


@needs_format("wav")
def test_audio_items_embed_and_refuse_what_they_are_not(cpu, tmp_path):
    path = str(tmp_path / "audio.safetensors")
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        trainer.save(path, weights_only=True)
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents\[0\]"):
            trainer.step(dict(modalities=["audio"], contents=[drawing("disk", "red", np.random.default_rng(0))]))
    with uform.Encoder.load(path, cpu) as encoder:
        long = wav_bytes(tone(2.0, 16000), 16000)  # 80 chunks: cut to the row's 64
        rows = encoder.embed(["audio", "audio"], [long, wav_bytes(tone(0.1, 16000), 16000)])
    assert rows.truncated_items == 1 and np.allclose(np.linalg.norm(rows.numpy(), axis=1), 1, rtol=1e-5)


def test_resume_names_a_changed_media_shape_even_of_as_many_values(cpu, tmp_path):
    path = str(tmp_path / "eight.safetensors")
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        trainer.save(path)
    shapes = dict(max_rows_per_device=12, max_columns_per_row=64)
    changed = config(resume=path, batch=dict(shapes, image=dict(patch_side=16)))
    with pytest.raises(uform.InvalidCheckpoint, match=r"batch\.image\.patch_side = 8, the config asks for 16"):
        uform.Trainer.init_ram(cpu, changed)
    # 2 frames of 16 x 16 x 3 and 8 frames of 8 x 8 x 3 are both 1,536 values, laid out differently.
    scrambled = config(resume=path, batch=dict(shapes, image=dict(patch_side=8), video=dict(patch_side=8, tube_frames=8)))
    with pytest.raises(uform.InvalidCheckpoint, match=r"batch\.video\.patch_side = 16, the config asks for 8"):
        uform.Trainer.init_ram(cpu, scrambled)
    strided = config(resume=path, batch=dict(shapes, image=dict(patch_side=8), video=dict(frame_stride=3)))
    uform.Trainer.init_ram(cpu, strided).free()  # which frames are read may change; how they are cut may not


# ---------------------------------------------------------------------------------------------- #
#  Media decoded ahead of their step                                                               #
# ---------------------------------------------------------------------------------------------- #


def test_a_batch_decoded_ahead_steps_exactly_as_the_batch(cpu):
    rng = np.random.default_rng(4)
    steps = [pairs_step(rng, [("disk", "red"), ("bar", "green"), ("square", "blue")]) for _ in range(3)]
    with uform.Trainer.init_ram(cpu, config()) as trainer, uform.Trainer.init_ram(cpu, config()) as twin:
        probed, probed_ahead = trainer._probe(steps[0]), trainer._probe(trainer.decode(steps[0]))
        assert probed[0].loss == probed_ahead[0].loss and probed[0].masked_patches == probed_ahead[0].masked_patches
        assert np.array_equal(probed[1], probed_ahead[1])
        for step in steps:
            decoded = trainer.decode(step)
            assert trainer.step(decoded).stats.loss == twin.step(step).stats.loss
            decoded.free()
            decoded.free()  # harmless twice
        assert np.array_equal(trainer._weights(), twin._weights())
        with pytest.raises(uform.InvalidHandle, match="decoded batch: used after free"):
            trainer.step(decoded)
        queued = trainer.decode(steps[0])
        landing = [trainer.deferred().step(queued) for _ in range(2)]
        queued.free()  # the steps submitted with it still run; then it lets go
        assert all(np.isfinite(answer.wait().stats.loss) for answer in landing)
        with pytest.raises(uform.InvalidHandle, match="decoded batch: used after free"):
            trainer.step(queued)
        text = trainer.decode(dict(modalities=[uform.Modality.TEXT], contents=["only words"]))
        assert np.isfinite(trainer.step(text).stats.loss)  # holds no tokens, steps as its batch


def test_decoding_refuses_bad_media_by_item_and_another_trainers_batch(cpu):
    good = pairs_step(np.random.default_rng(5), [("disk", "yellow")])
    with uform.Trainer.init_ram(cpu, config()) as trainer, uform.Trainer.init_ram(cpu, config()) as other:
        before = other._weights()
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents\[1\]"):
            trainer.decode(dict(good, contents=[good["contents"][0], good["contents"][1][:40]]))
        with pytest.raises(uform.InvalidArgument, match="another trainer"):
            other.step(trainer.decode(good))
        many = dict(modalities=[uform.Modality.IMAGE] * 49, contents=[good["contents"][1]] * 49)  # 49 x 16 > 12 x 64
        with pytest.raises(uform.InvalidArgument, match=r"the media alone take 784 tokens, more than 1 device of "
                                                        r"config\.batch\.max_rows_per_device = 12 rows of 64 columns "
                                                        r"hold \(768\)"):
            trainer.decode(many)
        assert np.array_equal(other._weights(), before)


def test_deferred_steps_decode_one_step_ahead_on_a_thread_of_their_own(cpu, monkeypatch):
    rng = np.random.default_rng(6)
    steps = [pairs_step(rng, [("disk", "blue"), ("square", "red")]) for _ in range(4)]
    steps.insert(2, dict(modalities=[uform.Modality.TEXT] * 2, contents=["words", "alone"]))
    threads = []
    submit = uform._Lookahead.submit

    def recording(self, decode):
        return submit(self, lambda: (threads.append(uform.threading.current_thread().name), decode())[1])

    monkeypatch.setattr(uform._Lookahead, "submit", recording)
    with uform.Trainer.init_ram(cpu, config()) as trainer, uform.Trainer.init_ram(cpu, config()) as twin:
        deferred = [trainer.deferred().step(step) for step in steps]
        losses = [answer.wait().stats.loss for answer in deferred]
        assert losses == [twin.step(step).stats.loss for step in steps]
        assert np.array_equal(trainer._weights(), twin._weights())
    assert len(threads) == 4 and all(name.startswith("uform-decode") for name in threads)
