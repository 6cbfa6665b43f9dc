"""The CPU reference of the mesh: `Executor.for_ram(devices=N)` spreads each step over N simulated devices,
and a run's losses and weights equal one device's whatever the split, up to the order of float32 sums.

Tolerances, measured over these cases on 2, 3 and 4 devices for three steps: the first step's losses are equal but
for a few ulps (the gathered terms see the very same embeddings; only weight gradients are summed in another order).
After that the weights differ by at most 3.5e-5: AdamW divides each gradient by its own running scale, so an element
whose gradient is nearly zero moves by a share of the learning rate (1e-3 here) that the order of summation decides.
The weights are compared at atol 1e-4, a tenth of the learning rate. The losses they give differ by at most 2.4e-6
relative (compared at rtol 1e-5, atol 1e-6), the unit embeddings by at most 8e-6 (compared at atol 3e-5)."""
import math

import numpy as np
import pytest
import safetensors.numpy

import uform
from test_media import picture, png_bytes
from test_model import CHOICE_TARGETS, CHOICES, GROUPS, ITEMS, LATE_RELATIONS, MASKING, RELATIONS, SIDES

# Bag 0 spans items 0 to 2 and bag 2 items 3 and 4: on four devices one device idles.
BAGS = [0, 1, 0, 2, 2, 3]
PNGS = [png_bytes(picture(height, width, seed=i)) for i, (height, width) in enumerate([(16, 24), (24, 16), (16, 16)])]
STATS = ["loss", "masked_loss", "contrastive_loss", "late_interaction_loss", "choices_loss", "image_loss"]
COUNTS = ["items", "tokens", "truncated_items", "masked_positions", "contrastive_rows", "choice_items", "query_rows",
          "masked_patches"]
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
WEIGHT_TOLERANCE = dict(rtol=0, atol=1e-4)
EMBEDDING_TOLERANCE = dict(rtol=0, atol=3e-5)


def config(objective="joint", **extra):
    made = dict(depth=1, hidden=128, objective=objective, seed=5, schedule=dict(steps=20, warmup_steps=2),
                batch=dict(max_rows_per_device=8, max_columns_per_row=32, max_segments_per_device=8),
                contrastive=dict(temperature_groups=2), masking=MASKING)
    for key, value in extra.items():
        made[key] = dict(made[key], **value) if isinstance(made.get(key), dict) else value
    return made


def batch(**extra):
    made = dict(modalities=[uform.Modality.TEXT] * len(ITEMS), contents=list(ITEMS), relations=RELATIONS,
                temperature_groups=GROUPS)
    made.update(extra)
    return made


IMAGE_BATCH = batch(modalities=[uform.Modality.TEXT, uform.Modality.IMAGE] * 3,
                    contents=[ITEMS[0], PNGS[0], ITEMS[1], PNGS[1], ITEMS[2], PNGS[2]])
CASES = {
    "contrastive, bags, Matryoshka": (config("contrastive", contrastive=dict(matryoshka_dimensions=[64, 128])),
                                      batch(bags=BAGS)),
    "contrastive, balanced, named": (config("contrastive", contrastive=dict(pair_loss="balanced", negatives="named")),
                                     batch()),
    "contrastive, ranked, ambient": (config("contrastive", contrastive=dict(pair_loss="ranked",
                                                                            ambient_repulsion_weight=0.25)),
                                     batch(bags=BAGS)),
    "masked": (config("masked"), batch()),
    "joint": (config("joint", masking=dict(text_weight=2.0)), batch(bags=BAGS)),
    "late interaction": (config("joint", late_interaction=dict(weight=0.6, width=16, max_query_span=8)),
                         batch(sides=SIDES, relations=LATE_RELATIONS)),
    "choices": (config("masked", choices=dict(weight=0.7), batch=dict(max_choices_per_item=8)),
                batch(choices=CHOICES, choice_targets=CHOICE_TARGETS)),
    "image": (config("joint", batch=dict(image=dict(patch_side=8)),
                     masking=dict(image_mask_ratio=0.5, image_weight=0.7)), IMAGE_BATCH),
}


def run(devices, trainer_config, batches, arena=False):
    """Steps `batches` on `devices` simulated devices: each step's stats (and embeddings), and the weights after."""
    steps = []
    with uform.Executor.for_ram(threads=2, devices=devices) as executor, \
            uform.Trainer.init_ram(executor, trainer_config) as trainer:
        for b in batches:
            stepped = trainer.step(b, dict(arena=uform.Arena()) if arena else None)
            steps.append((stepped.stats, np.array(stepped.embeddings) if arena else None))
        return steps, trainer._weights()


def assert_same_run(expected, got):
    (expected_steps, expected_weights), (got_steps, got_weights) = expected, got
    for (want, want_embeddings), (have, have_embeddings) in zip(expected_steps, got_steps):
        assert have.step == want.step and have.skipped == want.skipped
        for name in COUNTS:
            assert getattr(have, name) == getattr(want, name), name
        for name in STATS:
            a, b = getattr(want, name), getattr(have, name)
            assert math.isnan(a) == math.isnan(b), name
            if not math.isnan(a):
                np.testing.assert_allclose(b, a, **LOSS_TOLERANCE, err_msg=name)
        np.testing.assert_allclose(have.grad_norm, want.grad_norm, rtol=1e-5)
        if want_embeddings is not None:
            np.testing.assert_allclose(have_embeddings, want_embeddings, **EMBEDDING_TOLERANCE)
    np.testing.assert_allclose(got_weights, expected_weights, **WEIGHT_TOLERANCE)


@pytest.mark.parametrize("case", list(CASES))
def test_losses_and_weights_do_not_depend_on_the_split(case):
    trainer_config, b = CASES[case]
    one = run(1, trainer_config, [b] * 3, arena=True)
    for devices in (2, 3, 4):
        assert_same_run(one, run(devices, trainer_config, [b] * 3, arena=True))


def test_one_device_is_the_plain_executor_bit_for_bit():
    trainer_config, b = CASES["late interaction"]
    with uform.Executor.for_ram(threads=2) as executor, uform.Trainer.init_ram(executor, trainer_config) as trainer:
        plain = [trainer.step(b).stats.loss for _ in range(2)], trainer._weights()
    for devices in (1, 0, None):
        steps, weights = run(devices, trainer_config, [b] * 2)
        assert [s.loss for s, _ in steps] == plain[0]
        assert np.array_equal(weights, plain[1])


@pytest.mark.parametrize("devices", [-1, 65, 1.5, "2"])
def test_devices_are_checked_by_name(devices):
    with pytest.raises(uform.InvalidArgument, match="devices"):
        uform.Executor.for_ram(threads=1, devices=devices)


def test_a_batch_too_big_for_one_device_trains_on_several():
    small = config("contrastive", batch=dict(max_rows_per_device=3, max_segments_per_device=4))
    items = ITEMS + [b"pandas climb trees", b"night falls"]
    eight = batch(contents=items, modalities=[uform.Modality.TEXT] * 8, relations=None, temperature_groups=None)
    four = dict(eight, contents=items[:4], modalities=eight["modalities"][:4])  # each item fills a row of 32
    with uform.Executor.for_ram(threads=2) as executor, uform.Trainer.init_ram(executor, small) as trainer:
        with pytest.raises(uform.InvalidArgument, match=r"config\.batch\.max_segments_per_device = 4"):
            trainer.step(eight)
        with pytest.raises(uform.InvalidArgument, match=r"config\.batch\.max_rows_per_device = 3"):
            trainer.step(four)
    roomy = config("contrastive", batch=dict(max_rows_per_device=8, max_segments_per_device=8))
    assert_same_run(run(1, roomy, [four] * 2), run(2, small, [four] * 2))
    assert_same_run(run(1, roomy, [eight] * 2), run(3, small, [eight] * 2))


def test_a_bag_bigger_than_a_device_is_refused_by_name():
    with uform.Executor.for_ram(threads=2, devices=2) as executor, \
            uform.Trainer.init_ram(executor, config("contrastive", batch=dict(max_segments_per_device=4))) as trainer:
        with pytest.raises(uform.InvalidArgument, match=r"batch\.bags: items 0 to 4 .*max_segments_per_device = 4"):
            trainer.step(batch(bags=[7, 1, 2, 3, 7, 4]))
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents: 9 items exceed 2 devices"):
            trainer.step(batch(contents=ITEMS + ITEMS[:3], modalities=[uform.Modality.TEXT] * 9, relations=None,
                               temperature_groups=None))
        eight = batch(contents=ITEMS + ITEMS[:2], modalities=[uform.Modality.TEXT] * 8, relations=None,
                      temperature_groups=None)
        with pytest.raises(uform.InvalidArgument, match=r"batch\.bags: 8 items do not fit 2 devices"):
            trainer.step(dict(eight, bags=[0, 1, 0, 2, 3, 4, 2, 5]))  # runs of 3 and 4 items, then one left over
        assert trainer.step(dict(eight, bags=[0, 1, 0, 2, 3, 4, 5, 6])).stats.items == 8
        assert trainer.step(batch(bags=BAGS)).stats.step == 2  # still usable


def test_a_device_over_its_rows_is_named_with_the_items_the_split_gave_it():
    """Four rows fit two devices of two, but an equal count of items puts three long ones on the first."""
    tight = config("contrastive", batch=dict(max_rows_per_device=2, max_segments_per_device=4))
    long, short = b"x" * 40, b"ab"  # a long item fills a row of 32 columns; the short ones share one
    items = dict(modalities=[uform.Modality.TEXT] * 6, contents=[long] * 3 + [short] * 3)
    with uform.Executor.for_ram(threads=2, devices=2) as executor, uform.Trainer.init_ram(executor, tight) as trainer:
        with pytest.raises(uform.InvalidArgument, match=r"item 2 does not fit.*max_rows_per_device = 2 .*"
                                                        r"on device 0 of 2, given items 0 to 2 by the split"):
            trainer.step(items)
        assert trainer.step(dict(items, contents=[short] * 6)).stats.step == 1  # still usable


def test_memory_counts_every_device():
    taken = {}
    for devices in (1, 3):
        with uform.Executor.for_ram(threads=1, devices=devices) as executor, \
                uform.Trainer.init_ram(executor, config("contrastive")) as trainer:
            taken[devices] = trainer._handle().memory()
    assert taken[1] > 0 and taken[3] == 3 * taken[1]


def test_bad_items_are_named_by_their_index_in_the_step():
    with uform.Executor.for_ram(threads=2, devices=3) as executor, \
            uform.Trainer.init_ram(executor, config("contrastive", contrastive=dict(max_edges_per_device=6))) as trainer:
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents\[4\]: empty"):
            trainer.step(batch(contents=ITEMS[:4] + [b""] + ITEMS[5:]))
        with pytest.raises(uform.InvalidArgument, match=r"batch\.temperature_groups\[5\]: 2 is not below"):
            trainer.step(batch(temperature_groups=[0, 1, 0, 1, 0, 2]))
        with pytest.raises(uform.InvalidArgument, match=r"batch\.relations\.attract\.ids\[0\]: 6 is not below"):
            trainer.step(batch(relations=dict(attract=dict(offsets=[0, 1, 1, 1, 1, 1, 1], ids=[6]))))
        # Ten edges fit three devices of six, but the first device's two items name them all.
        crowded = dict(repel=dict(offsets=[0, 5, 10, 10, 10, 10, 10], ids=[1, 2, 3, 4, 5, 0, 2, 3, 4, 5]))
        with pytest.raises(uform.InvalidArgument, match=r"10 edges of items 0 to 1, on device 0, exceed "
                                                        r"config\.contrastive\.max_edges_per_device = 6"):
            trainer.step(batch(relations=crowded))
        assert trainer.step(batch()).stats.step == 1


def test_a_poisoned_step_is_skipped_on_every_device():
    poisoned = batch(relations=dict(attract=dict(offsets=[0, 1, 1, 1, 1, 1, 1], ids=[5], weights=[3.4e38])))
    with uform.Executor.for_ram(threads=2, devices=2) as executor, \
            uform.Trainer.init_ram(executor, config("contrastive")) as trainer:
        trainer.step(batch())
        before = trainer._weights()
        stats = trainer.step(poisoned).stats
        assert stats.skipped and stats.step == 1
        assert np.array_equal(trainer._weights(), before)
        assert not trainer.step(batch()).stats.skipped


@pytest.mark.parametrize("first,second", [(2, 1), (1, 3)])
def test_checkpoints_resume_on_any_number_of_devices(tmp_path, first, second):
    trainer_config, b = CASES["joint"]
    straight = run(1, trainer_config, [b] * 4)
    path = str(tmp_path / "half.safetensors")
    with uform.Executor.for_ram(threads=2, devices=first) as executor, \
            uform.Trainer.init_ram(executor, trainer_config) as trainer:
        steps = [(trainer.step(b).stats, None) for _ in range(2)]
        trainer.save(path)
    assert safetensors.numpy.load_file(path)
    with uform.Executor.for_ram(threads=2, devices=second) as executor, uform.Encoder.load(path, executor) as encoder:
        assert np.asarray(encoder.embed(b["modalities"], b["contents"])).shape == (len(ITEMS), 128)
    resumed = run(second, dict(trainer_config, resume=path), [b] * 2)
    assert_same_run(straight, (steps + resumed[0], resumed[1]))
