"""Images in the model against the independent float64 reference (`reference.py`): a step mixing text
and small PNG images, its losses and the gradient of every tensor, the image projection and the patch
decoder among them, by central finite differences. The reference starts from the patches the library
decodes (`uform._testing.image_patches`, held to independent decoders in `test_media.py`); from
there on, which patches hide, their ids, their 2D rotary positions, the projection, the normalized
targets and the regression are its own, written from docs/model.md."""
import math

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import uform
from reference import Image, check_gradients, hide_patches, step_losses, tensor_names, unflatten
from test_media import picture, png_bytes

DEPTH = 2
SIDE = 8  # patch_side: 8 x 8 x 3 = 192 values a patch
COLUMNS = 32
# (height, width): 2 x 3, 3 x 2 and 2 x 2 patches, so a swapped row and column would show.
SIZES = [(16, 24), (24, 16), (16, 16)]
PNGS = [png_bytes(picture(height, width, seed=i)) for i, (height, width) in enumerate(SIZES)]
TEXTS = [b"a small red panda", b"red pandas eat bamboo", b"the sun is a star"]
# Text and images interleaved, so images sit between text items in the packed rows.
CONTENTS = [TEXTS[0], PNGS[0], TEXTS[1], PNGS[1], TEXTS[2], PNGS[2]]
MODALITIES = [uform.Modality.TEXT, uform.Modality.IMAGE] * 3
RELATIONS = dict(
    attract=dict(offsets=[0, 1, 2, 3, 4, 4, 4], ids=[1, 0, 3, 2]),
    repel=dict(offsets=[0, 0, 0, 1, 1, 2, 2], ids=[0, 1], weights=[0.5, 2.0]),
    ignore=dict(offsets=[0, 0, 0, 0, 0, 0, 1], ids=[4]),
)
GROUPS = [0, 1, 0, 1, 0, 1]
SEED, STEP = 5, 3  # the probe follows two steps
FORMS = {uform.PairLossForm.SIGMOID: "sigmoid", uform.PairLossForm.BALANCED: "balanced",
         uform.PairLossForm.RANKED: "ranked"}
CASES = [
    ("joint", uform.PairLossForm.SIGMOID, [64, 128], dict(image_mask_ratio=0.5, image_weight=0.7, text_weight=1.5)),
    ("joint", uform.PairLossForm.RANKED, None, {}),
    ("masked", uform.PairLossForm.SIGMOID, None, dict(image_mask_ratio=0.6, image_weight=2.0)),
    ("contrastive", uform.PairLossForm.BALANCED, [64, 128], {}),
]


@pytest.fixture(scope="module")
def executor():
    """One thread: the numbers are under test here, and test_model.py already steps with two."""
    with uform.Executor.for_ram(threads=1) as executor:
        yield executor


def config(objective, form, dimensions, masking):
    return dict(depth=DEPTH, hidden=128, objective=objective, seed=SEED, schedule=dict(steps=20, warmup_steps=2),
                batch=dict(max_rows_per_device=8, max_columns_per_row=COLUMNS, max_segments_per_device=16,
                           image=dict(patch_side=SIDE)),
                contrastive=dict(pair_loss=form, temperature_groups=2, matryoshka_dimensions=dimensions),
                masking=masking)


def batch():
    return dict(modalities=MODALITIES, contents=CONTENTS, relations=RELATIONS, temperature_groups=GROUPS)


def reference_items():
    """The items as the reference reads them: text as bytes, images as the library decodes them to patches."""
    items = []
    for content, modality in zip(CONTENTS, MODALITIES):
        if modality == uform.Modality.IMAGE:
            patches, grid = uform._testing.image_patches(np.frombuffer(content, np.uint8), patch_side=SIDE, channels=3,
                                                         max_tokens=COLUMNS)
            assert grid["frames"] == 1 and not grid["truncated"]
            items.append(Image(patches.reshape(len(patches), -1), grid["rows"], grid["columns"]))
        else:
            items.append(content)
    return items


def sharpened(executor, trainer_config, tmp_path):
    """A trainer two steps in whose queries and keys are scaled up 4-fold through its checkpoint. At
    initialization attention logits spread by about 0.07, so attention is nearly uniform and rotary
    positions barely touch the loss; here they spread by about 1 and a wrong angle shows."""
    path = str(tmp_path / "sharpened.safetensors")
    with uform.Trainer.init_ram(executor, trainer_config) as trainer:
        for _ in range(STEP - 1):  # leave the initial point, so moments and weights are not special
            trainer.step(batch())
        trainer.save(path)
    tensors = safetensors.numpy.load_file(path)
    with safetensors.safe_open(path, "np") as f:
        metadata = f.metadata()
    for l in range(DEPTH):
        tensors[f"blocks.{l}.qkv"][:256] *= 4  # hidden 128: queries, then keys
    safetensors.numpy.save_file(tensors, path, metadata=metadata)
    return uform.Trainer.init_ram(executor, dict(trainer_config, resume=path))


def named_weights(trainer, tmp_path, flat):
    path = str(tmp_path / "layout.safetensors")
    trainer.save(path)
    return unflatten(flat, safetensors.numpy.load_file(path), DEPTH)


def test_the_images_decode_to_the_grids_the_sizes_give():
    grids = [(item.rows, item.columns) for item in reference_items() if isinstance(item, Image)]
    assert grids == [(2, 3), (3, 2), (2, 2)]


@pytest.mark.parametrize("objective,form,dimensions,options", CASES)
def test_image_losses_and_every_gradient_match_the_float64_reference(executor, tmp_path, objective, form, dimensions,
                                                                      options):
    items = reference_items()
    with sharpened(executor, config(objective, form, dimensions, dict(options)), tmp_path) as trainer:
        weights = named_weights(trainer, tmp_path, trainer._weights())
        stats, flat_gradients = trainer._probe(batch())
        gradients = named_weights(trainer, tmp_path, flat_gradients)

    ratio = options.get("image_mask_ratio", 0.75)
    reference = dict(depth=DEPTH, objective=objective, seed=SEED, step=STEP, relations=RELATIONS, groups=GROUPS,
                     form=FORMS[form], dimensions=dimensions, text_weight=options.get("text_weight", 1.0),
                     image_mask_ratio=ratio, image_weight=options.get("image_weight", 1.0))

    def loss(w):
        return step_losses(w, items, **reference)

    total, masked, contrastive, _, _, image = loss(weights)
    hidden = sum(sum(hide_patches(item.rows * item.columns, SEED, STEP, i, ratio))
                 for i, item in enumerate(items) if isinstance(item, Image))
    patches = sum(item.rows * item.columns for item in items if isinstance(item, Image))
    assert stats.tokens == sum(map(len, TEXTS)) + patches
    assert stats.loss == pytest.approx(total, rel=2e-4)
    if objective != "contrastive":
        assert 0 < hidden < patches  # both the projection and the decoder are in play
        assert stats.masked_patches == hidden
        assert stats.image_loss == pytest.approx(image, rel=2e-4)
        assert stats.masked_loss == pytest.approx(masked, rel=2e-4)
    else:
        assert stats.masked_patches == 0 and math.isnan(stats.image_loss) and math.isnan(image)
        assert math.isnan(stats.masked_loss)
    if objective != "masked":
        assert stats.contrastive_loss == pytest.approx(contrastive, rel=2e-4)
    else:
        assert math.isnan(stats.contrastive_loss)

    slopes = check_gradients(lambda w: loss(w)[0], weights, gradients, tensor_names(DEPTH), seed=1)
    for name in ["image.projection"] + (["image.decoder"] if objective != "contrastive" else []):
        assert abs(slopes[name]) > 1e-6, name  # the image's own tensors moved the loss
    assert sum(abs(slope) > 1e-6 for slope in slopes.values()) >= 5  # the directions really moved the loss


# ---------------------------------------------------------------------------------------------- #
#  Video and audio: the same, with their own projections, decoders and positions                 #
# ---------------------------------------------------------------------------------------------- #

from reference import Audio, Video  # noqa: E402
from test_media import clip, needs, needs_format, tone, wav_bytes  # noqa: E402


@needs("ffmpeg")
@needs_format("mp4", "wav")
@pytest.mark.parametrize("objective", ["joint", "contrastive"])
def test_video_and_audio_losses_and_every_gradient_match_the_float64_reference(executor, tmp_path, objective):
    video = clip(tmp_path, "mp4", frames=4, size="16x8")  # 2 tubelets of 2 frames x (1 x 2 patches of 8)
    sound = wav_bytes(tone(0.05, 16000), 16000)  # 800 samples: 4 chunks of 200
    contents = [b"a small red panda", video, b"red pandas eat bamboo", sound]
    modalities = ["text", "video", "text", "audio"]
    tubelets, grid = uform._testing.video_tubelets(np.frombuffer(video, np.uint8), patch_side=SIDE, tube_frames=2,
                                                   max_tokens=COLUMNS)
    chunks, _ = uform._testing.audio_chunks(np.frombuffer(sound, np.uint8), chunk_samples=200, max_tokens=COLUMNS)
    items = [contents[0], Video(tubelets.reshape(len(tubelets), -1), grid["frames"], grid["rows"], grid["columns"]),
             contents[2], Audio(chunks.reshape(len(chunks), -1))]
    assert (grid["frames"], grid["rows"], grid["columns"], len(chunks)) == (2, 1, 2, 4)
    relations = dict(attract=dict(offsets=[0, 1, 2, 3, 4], ids=[1, 0, 3, 2]))
    masking = dict(video_mask_ratio=0.5, video_weight=0.7, audio_mask_ratio=0.5, audio_weight=1.3)
    made = dict(config(objective, uform.PairLossForm.SIGMOID, None, masking),
                batch=dict(max_rows_per_device=8, max_columns_per_row=COLUMNS, max_segments_per_device=16,
                           video=dict(patch_side=SIDE, tube_frames=2), audio=dict(chunk_samples=200)))
    step = dict(modalities=modalities, contents=contents, relations=relations, temperature_groups=[0, 1, 0, 1])
    with uform.Trainer.init_ram(executor, made) as trainer:
        for _ in range(STEP - 1):
            trainer.step(step)
        weights = named_weights(trainer, tmp_path, trainer._weights())
        stats, flat_gradients = trainer._probe(step)
        gradients = named_weights(trainer, tmp_path, flat_gradients)
    reference = dict(depth=DEPTH, objective=objective, seed=SEED, step=STEP, relations=relations, groups=[0, 1, 0, 1],
                     form="sigmoid", **masking)

    def loss(w, media=None):
        return step_losses(w, items, media=media, **reference)

    media = {}
    total = loss(weights, media)[0]
    assert stats.loss == pytest.approx(total, rel=2e-4)
    for kind in ("video", "audio"):
        if objective == "joint":
            assert getattr(stats, f"{kind}_loss") == pytest.approx(media[kind], rel=2e-4)
        else:
            assert math.isnan(getattr(stats, f"{kind}_loss")) and math.isnan(media[kind])
    slopes = check_gradients(lambda w: loss(w)[0], weights, gradients, tensor_names(DEPTH), seed=2)
    own = ["video.projection", "audio.projection"] + (["video.decoder", "audio.decoder"] if objective == "joint" else [])
    for name in own:
        assert abs(slopes[name]) > 1e-6, name  # each kind's own tensors moved the loss
