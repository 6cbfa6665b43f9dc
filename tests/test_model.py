"""The CPU backend against the independent float64 model in `reference.py`: loss values, gradients of
every tensor by finite differences, the losses recomputed from returned embeddings, exact resume,
checkpoints, bad input and poisoned steps."""
import math

import numpy as np
import pytest
import safetensors.numpy

import uform
from reference import cells_of, check_gradients, contrastive_loss, step_losses, tensor_names, unflatten

ITEMS = [b"a small red panda", b"red pandas eat bamboo", b"the sun is a star", b"stars shine at night",
         b"def f(x): return x", b"ok"]
RELATIONS = dict(
    attract=dict(offsets=[0, 1, 2, 3, 4, 4, 4], ids=[1, 0, 3, 2]),
    repel=dict(offsets=[0, 0, 0, 1, 1, 2, 2], ids=[0, 1], weights=[0.5, 2.0]),
    ignore=dict(offsets=[0, 0, 0, 0, 0, 0, 1], ids=[4]),
)
GROUPS = [0, 1, 0, 1, 0, 1]
DEPTH = 2


def config(objective="joint", form=uform.PairLossForm.SIGMOID, dimensions=None, **extra):
    contrastive = dict(pair_loss=form, temperature_groups=2, matryoshka_dimensions=dimensions)
    contrastive.update(extra.pop("contrastive", {}))
    made = dict(depth=DEPTH, hidden=128, objective=objective, seed=5, schedule=dict(steps=20, warmup_steps=2),
                batch=dict(max_rows_per_device=8, max_columns_per_row=32, max_segments_per_device=16),
                contrastive=contrastive)
    made.update(extra)
    return made


def batch(items=ITEMS, relations=RELATIONS, groups=GROUPS):
    return dict(modalities=[uform.Modality.TEXT] * len(items), contents=list(items), relations=relations,
                temperature_groups=groups)


@pytest.fixture
def executor():
    with uform.Executor.for_ram(threads=2) as executor:
        yield executor


def named_weights(trainer, tmp_path, flat):
    path = str(tmp_path / "layout.safetensors")
    trainer.save(path)
    return unflatten(flat, safetensors.numpy.load_file(path), DEPTH)


FORMS = {uform.PairLossForm.SIGMOID: "sigmoid", uform.PairLossForm.BALANCED: "balanced",
         uform.PairLossForm.RANKED: "ranked"}
MASKING = dict(token_mask_probability=0.3, token_mean_span=2.0, replace_fraction=0.5, random_fraction=0.3)
CASES = [
    ("masked", uform.PairLossForm.SIGMOID, None, {}),
    ("masked", uform.PairLossForm.SIGMOID, None, dict(masking=MASKING, text_weight=0.5)),
    ("contrastive", uform.PairLossForm.SIGMOID, [64, 128], {}),
    ("contrastive", uform.PairLossForm.BALANCED, None, {}),
    ("contrastive", uform.PairLossForm.BALANCED, None, dict(negatives="named")),
    ("contrastive", uform.PairLossForm.RANKED, [128, 64], dict(ambient_weight=0.25)),
    ("joint", uform.PairLossForm.SIGMOID, [64, 128], dict(ambient_weight=0.5, text_weight=2.0)),
    ("joint", uform.PairLossForm.RANKED, None, dict(choices_weight=0.7)),
    ("contrastive", uform.PairLossForm.SIGMOID, None, dict(choices_weight=1.5)),
    ("masked", uform.PairLossForm.SIGMOID, None, dict(choices_weight=1.0, masking=MASKING)),
    ("joint", uform.PairLossForm.SIGMOID, None, dict(late=dict(weight=0.6, form="ranked"))),
    ("contrastive", uform.PairLossForm.BALANCED, None, dict(late=dict(weight=1.3, form="sigmoid"), choices_weight=0.5)),
    ("masked", uform.PairLossForm.SIGMOID, None, dict(late=dict(weight=1.0, form="balanced"), masking=MASKING)),
]
# Late interaction: items 0 and 4 are queries, 2 is both, 1 and 3 documents, 5 neither; item 0's
# content is longer than the span of 8 and is cut, the others are padded.
SIDES = [uform.LateInteractionSide.QUERY, uform.LateInteractionSide.DOCUMENT,
         uform.LateInteractionSide.QUERY_AND_DOCUMENT, uform.LateInteractionSide.DOCUMENT,
         uform.LateInteractionSide.QUERY, uform.LateInteractionSide.NONE]
LATE_RELATIONS = dict(
    attract=dict(offsets=[0, 1, 2, 3, 4, 4, 4], ids=[1, 0, 3, 2]),
    repel=dict(offsets=[0, 1, 1, 2, 2, 3, 3], ids=[3, 1, 1], weights=[1.0, 0.5, 2.0]),
)
# Items 0, 2 and 5 offer choices; item 5's three bytes include one its target rules out.
CHOICES = [b"yn", b"", b"abcdefg", b"", b"", b"\x00\xff\x10"]
CHOICE_TARGETS = [np.array([0.9, 0.1], np.float32), np.zeros(0, np.float32),
                  np.array([0.1, 0.2, 0.05, 0.15, 0.3, 0.1, 0.1], np.float32), np.zeros(0, np.float32),
                  np.zeros(0, np.float32), np.array([0.25, 0.0, 0.75], np.float32)]


def settings(objective, form, dimensions, options):
    """The trainer's config for a case, and the reference's keyword arguments for the same case."""
    masking = dict(options.get("masking", {}))
    if "text_weight" in options:
        masking["text_weight"] = options["text_weight"]
    contrastive = dict(negatives=options.get("negatives"), ambient_repulsion_weight=options.get("ambient_weight"))
    reference = dict(objective=objective, form=FORMS[form], dimensions=dimensions,
                     negatives=options.get("negatives", "ambient"), ambient_weight=options.get("ambient_weight", 1.0),
                     masking=options.get("masking"), text_weight=options.get("text_weight", 1.0))
    made = config(objective, form, dimensions, masking=masking, contrastive=contrastive)
    if "late" in options:
        late = options["late"]
        made["late_interaction"] = dict(weight=late["weight"], width=16, max_query_span=8, pair_loss=late["form"])
        reference.update(sides=[int(side) for side in SIDES], late=dict(late, max_query_span=8))
    if "choices_weight" in options:
        made["choices"] = dict(weight=options["choices_weight"])
        made["batch"]["max_choices_per_item"] = 8
        reference.update(choices=CHOICES, choice_targets=CHOICE_TARGETS, choices_weight=options["choices_weight"])
    return made, reference


def case_batch(options):
    """The batch of a case: the items offer CHOICES when the case trains the choices term, and take
    SIDES and LATE_RELATIONS when it trains late interaction."""
    made = batch()
    if "choices_weight" in options:
        made.update(choices=CHOICES, choice_targets=CHOICE_TARGETS)
    if "late" in options:
        made.update(sides=SIDES, relations=LATE_RELATIONS)
    return made


@pytest.mark.parametrize("objective,form,dimensions,options", CASES)
def test_losses_and_every_gradient_match_the_float64_reference(executor, tmp_path, objective, form, dimensions,
                                                                options):
    trainer_config, reference = settings(objective, form, dimensions, options)
    with uform.Trainer.init_ram(executor, trainer_config) as trainer:
        for _ in range(2):  # leave the initial point, so moments and weights are not special
            trainer.step(case_batch(options))
        weights = named_weights(trainer, tmp_path, trainer._weights())
        stats, flat_gradients = trainer._probe(case_batch(options))
        gradients = named_weights(trainer, tmp_path, flat_gradients)

    def loss(w):
        relations = LATE_RELATIONS if "late" in options else RELATIONS
        return step_losses(w, ITEMS, depth=DEPTH, seed=5, step=3, relations=relations, groups=GROUPS, **reference)

    total, masked, contrastive, chose, late, image = loss(weights)
    assert stats.loss == pytest.approx(total, rel=2e-4)
    assert math.isnan(image) and math.isnan(stats.image_loss) and stats.masked_patches == 0  # text alone
    if objective != "contrastive":
        assert stats.masked_loss == pytest.approx(masked, rel=2e-4)
    else:
        assert math.isnan(stats.masked_loss)
    if objective != "masked":
        assert stats.contrastive_loss == pytest.approx(contrastive, rel=2e-4)
    else:
        assert math.isnan(stats.contrastive_loss)
    if "choices_weight" in options:
        assert stats.choices_loss == pytest.approx(chose, rel=2e-4) and stats.choice_items == 3
    else:
        assert math.isnan(stats.choices_loss) and stats.choice_items == 0
    if "late" in options:
        assert stats.late_interaction_loss == pytest.approx(late, rel=2e-4)
        assert stats.query_rows == (2 if options["late"]["form"] == "ranked" else 3)
    else:
        assert math.isnan(stats.late_interaction_loss) and stats.query_rows == 0

    slopes = check_gradients(lambda w: loss(w)[0], weights, gradients, tensor_names(DEPTH, "late" in options), seed=1)
    assert sum(abs(slope) > 1e-6 for slope in slopes.values()) >= 5  # the directions really moved the loss


@pytest.mark.parametrize("form", list(FORMS))
def test_contrastive_loss_recomputes_from_returned_embeddings(executor, form):
    arena = uform.Arena()
    with uform.Trainer.init_ram(executor, config("contrastive", form, [32, 128])) as trainer:
        trainer.step(batch())
        stepped = trainer.step(batch(), dict(arena=arena))
    z = np.asarray(stepped.embeddings, dtype=np.float64)
    assert z.shape == (len(ITEMS), 128)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1, rtol=1e-5)
    labels, weights = cells_of(len(ITEMS), RELATIONS)
    log_t = np.log(np.array(stepped.stats.inverse_temperatures, dtype=np.float64))
    bias = np.array(stepped.stats.biases, dtype=np.float64)
    expected = contrastive_loss(z, np.array(GROUPS), log_t, bias, labels, weights, FORMS[form], [32, 128])
    assert stepped.stats.contrastive_loss == pytest.approx(expected, rel=1e-4)


def test_temperatures_and_biases_are_learned_per_group(executor):
    with uform.Trainer.init_ram(executor, config("contrastive")) as trainer:
        first = trainer.step(batch()).stats
        assert first.inverse_temperatures == pytest.approx([10, 10]) and first.biases == pytest.approx([-10, -10])
        later = [trainer.step(batch()).stats for _ in range(3)][-1]
    assert later.inverse_temperatures != first.inverse_temperatures
    assert later.biases[0] != later.biases[1]  # each group follows its own gradient


def run(executor, steps, batches, **extra):
    losses = []
    with uform.Trainer.init_ram(executor, config(**extra)) as trainer:
        for b in batches[:steps]:
            losses.append(trainer.step(b).stats.loss)
        return losses, trainer._weights()


def shuffled_batches(count):
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(count):
        order = rng.permutation(len(ITEMS))
        batches.append(batch(items=[ITEMS[i] for i in order], relations=None, groups=None))
    return batches


def test_resume_is_bitwise_exact(executor, tmp_path):
    batches = shuffled_batches(6)
    straight = str(tmp_path / "straight.safetensors")
    with uform.Trainer.init_ram(executor, config()) as trainer:
        losses = [trainer.step(b).stats.loss for b in batches]
        trainer.save(straight)
    half = str(tmp_path / "half.safetensors")
    with uform.Trainer.init_ram(executor, config()) as trainer:
        resumed = [trainer.step(b).stats.loss for b in batches[:3]]
        trainer.save(half)
    resumed_path = str(tmp_path / "resumed.safetensors")
    with uform.Trainer.init_ram(executor, config(resume=half)) as trainer:
        steps = [trainer.step(b).stats for b in batches[3:]]
        trainer.save(resumed_path)
    resumed += [s.loss for s in steps]
    assert [s.step for s in steps] == [4, 5, 6]
    assert resumed == losses  # bit for bit
    a, b = safetensors.numpy.load_file(straight), safetensors.numpy.load_file(resumed_path)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_checkpoint_reads_with_safetensors(executor, tmp_path):
    path = str(tmp_path / "run.safetensors")
    with uform.Trainer.init_ram(executor, config()) as trainer:
        trainer.step(batch())
        trainer.save(path)
    tensors = safetensors.numpy.load_file(path)
    names = tensor_names(DEPTH)
    assert set(tensors) == set(names) | {f"adamw.{m}.{n}" for m in ("first", "second") for n in names}
    assert tensors["blocks.0.qkv"].shape == (384, 128) and tensors["blocks.1.down"].shape == (128, 512)
    assert tensors["text.embedding"].shape == (260, 128) and tensors["contrastive.bias"].shape == (2,)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert np.abs(tensors["adamw.second.blocks.0.up"]).sum() > 0
    with safetensors.safe_open(path, "np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "uform/1" and metadata["step"] == "1" and '"hidden": 128' in metadata["config"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_resume_refuses_another_geometry(executor, tmp_path):
    path = str(tmp_path / "run.safetensors")
    with uform.Trainer.init_ram(executor, config()) as trainer:
        trainer.save(path)
    wider = config(resume=path)
    wider["hidden"] = 256
    with pytest.raises(uform.InvalidCheckpoint, match="hidden"):
        uform.Trainer.init_ram(executor, wider)
    deeper = config(resume=path)
    deeper["depth"] = 3
    with pytest.raises(uform.InvalidCheckpoint, match="depth"):
        uform.Trainer.init_ram(executor, deeper)
    with pytest.raises(uform.StorageError, match="missing.safetensors"):
        uform.Trainer.init_ram(executor, config(resume=str(tmp_path / "missing.safetensors")))


def edges(offsets, ids, weights=None):
    return dict(offsets=offsets, ids=ids, weights=weights)


BAD_BATCHES = [
    ("offsets too short", dict(relations=dict(attract=edges([0, 1], [1]))), "attract.offsets"),
    ("offsets decrease", dict(relations=dict(attract=edges([0, 2, 1, 2, 2, 2, 2], [1, 2]))), "attract.offsets"),
    ("id out of range", dict(relations=dict(attract=edges([0, 1, 1, 1, 1, 1, 1], [9]))), "attract.ids"),
    ("ids not ascending", dict(relations=dict(repel=edges([0, 2, 2, 2, 2, 2, 2], [3, 1]))), "repel.ids"),
    ("negative weight", dict(relations=dict(repel=edges([0, 1, 1, 1, 1, 1, 1], [2], [-1.0]))), "repel.weights"),
    ("nan weight", dict(relations=dict(repel=edges([0, 1, 1, 1, 1, 1, 1], [2], [float("nan")]))), "repel.weights"),
    ("self attract", dict(relations=dict(attract=edges([0, 1, 1, 1, 1, 1, 1], [0]))), "attract.ids"),
    ("attract and repel", dict(relations=dict(attract=edges([0, 1, 1, 1, 1, 1, 1], [3]),
                                              repel=edges([0, 1, 1, 1, 1, 1, 1], [3]))), "relations"),
    ("weights length", dict(relations=dict(attract=edges([0, 1, 1, 1, 1, 1, 1], [3], [1.0, 2.0]))), "weights"),
    ("modalities length", dict(modalities=[uform.Modality.TEXT] * 5), "modalities"),
    ("unknown modality", dict(modalities=["smell"] * 6), "modalit"),
    ("empty item", dict(contents=ITEMS[:5] + [b""]), "contents"),
    ("group out of range", dict(temperature_groups=[0, 1, 2, 0, 1, 0]), "temperature_groups"),
    ("too many items", dict(contents=ITEMS * 3, modalities=[uform.Modality.TEXT] * 18, temperature_groups=None,
                            relations=None), "max_segments_per_device"),
    ("too many rows", dict(contents=[b"x" * 40] * 9, modalities=[uform.Modality.TEXT] * 9, relations=None,
                           temperature_groups=None), "max_rows_per_device"),
    ("sides without late interaction", dict(sides=[uform.LateInteractionSide.QUERY] * 6), "sides"),
    ("choices without the term", dict(choices=["yn"] * 6, choice_targets=[np.array([0.5, 0.5], np.float32)] * 6),
     "choice"),
]


def test_bad_batches_are_refused_by_name_and_change_nothing(executor):
    good = shuffled_batches(3)
    clean_losses, clean_weights = run(executor, 3, good)
    with uform.Trainer.init_ram(executor, config()) as trainer:
        losses = []
        for i, b in enumerate(good):
            for label, change, field in BAD_BATCHES[i::3]:
                bad = batch()
                bad.update(change)
                with pytest.raises(uform.InvalidArgument, match=field):
                    trainer.step(bad)
            losses.append(trainer.step(b).stats.loss)
        assert losses == clean_losses
        assert np.array_equal(trainer._weights(), clean_weights)
        assert trainer.step(good[0]).stats.step == 4


def targets(*rows):
    return [np.array(row, np.float32) for row in rows]


NONE = [0.0] * 0
BAD_CHOICES = [
    ("targets shorter", dict(choices=["yn"] + [""] * 5, choice_targets=targets([1.0], *[NONE] * 5)),
     r"batch\.choice_targets\[0\]: 1 targets for 2 choices"),
    ("targets on an item offering none", dict(choices=[""] * 6, choice_targets=targets([1.0], *[NONE] * 5)),
     r"batch\.choice_targets\[0\]: 1 targets for 0 choices"),
    ("non-finite target", dict(choices=["", "yn"] + [""] * 4,
                               choice_targets=targets(NONE, [float("nan"), 1.0], *[NONE] * 4)),
     r"batch\.choice_targets\[1\]\[0\]: nan"),
    ("negative target", dict(choices=["yn"] + [""] * 5, choice_targets=targets([1.5, -0.5], *[NONE] * 5)),
     r"batch\.choice_targets\[0\]\[1\]: -0\.5"),
    ("targets not summing to one", dict(choices=["yn"] + [""] * 5, choice_targets=targets([0.5, 0.49], *[NONE] * 5)),
     r"batch\.choice_targets\[0\]: the targets sum to 0\.99"),
    ("a byte offered twice", dict(choices=["yny"] + [""] * 5, choice_targets=targets([0.5, 0.25, 0.25], *[NONE] * 5)),
     r"batch\.choices\[0\]: byte 121 is offered twice"),
    ("too many choices", dict(choices=["abcdefghi"] + [""] * 5, choice_targets=targets([1 / 9] * 9, *[NONE] * 5)),
     r"batch\.choices\[0\]: 9 choices exceed config\.batch\.max_choices_per_item = 8"),
    ("choices without targets", dict(choices=["yn"] + [""] * 5), r"batch\.choice_targets: required"),
    ("choices without an entry per item", dict(choices=["yn"], choice_targets=targets([0.5, 0.5])),
     r"batch\.choices: 1 entry, expected 6, one per item"),
]


@pytest.mark.parametrize("label,change,message", BAD_CHOICES, ids=[case[0] for case in BAD_CHOICES])
def test_bad_choices_are_refused_by_name_and_change_nothing(executor, label, change, message):
    made = dict(config(), choices=dict(weight=1.0))
    made["batch"]["max_choices_per_item"] = 8
    good = dict(batch(), choices=CHOICES, choice_targets=CHOICE_TARGETS)
    with uform.Trainer.init_ram(executor, made) as trainer, uform.Trainer.init_ram(executor, made) as clean:
        with pytest.raises(uform.InvalidArgument, match=message):
            trainer.step(dict(batch(), **change))
        assert trainer.step(good).stats.loss == clean.step(good).stats.loss
        assert np.array_equal(trainer._weights(), clean._weights())


BAD_LATE = [
    ("query tokens", dict(max_query_tokens_per_device=20),
     r"batch\.sides: 24 query tokens exceed config\.late_interaction\.max_query_tokens_per_device = 20"),
    ("documents", dict(max_documents_per_device=2),
     r"batch\.sides: 3 documents exceed config\.late_interaction\.max_documents_per_device = 2"),
    ("document tokens", dict(max_document_tokens_per_device=30),
     r"batch\.sides: \d+ document tokens exceed config\.late_interaction\.max_document_tokens_per_device = 30"),
]


@pytest.mark.parametrize("label,limits,message", BAD_LATE, ids=[case[0] for case in BAD_LATE])
def test_late_interaction_limits_are_refused_by_name_and_change_nothing(executor, label, limits, message):
    late = dict(weight=1.0, width=16, max_query_span=8)
    good = dict(batch(), sides=SIDES, relations=LATE_RELATIONS)
    with uform.Trainer.init_ram(executor, config(late_interaction=dict(late, **limits))) as trainer, \
            uform.Trainer.init_ram(executor, config(late_interaction=late)) as clean:
        with pytest.raises(uform.InvalidArgument, match=message):
            trainer.step(good)
        assert trainer.step(dict(good, sides=None)).stats.step == 1  # the refused step changed nothing
        clean.step(dict(good, sides=None))
        assert np.array_equal(trainer._weights(), clean._weights())


def test_late_interaction_configs_are_refused_by_name(executor):
    for late, message in [(dict(weight=1.0, width=12), "config.late_interaction.width: 12"),
                          (dict(weight=1.0, max_query_span=40), "config.late_interaction.max_query_span: 40"),
                          (dict(weight=1.0, inverse_temperature=-1.0), "config.late_interaction.inverse_temperature"),
                          (dict(weight=float("nan")), "config.late_interaction.weight")]:
        with pytest.raises(uform.InvalidArgument, match=message):
            uform.Trainer.init_ram(executor, config(late_interaction=late))


def test_the_token_head_is_checkpointed_and_resumes(executor, tmp_path):
    made = config(late_interaction=dict(weight=1.0, width=16, max_query_span=8))
    step = dict(batch(), sides=SIDES, relations=LATE_RELATIONS)
    path = str(tmp_path / "late.safetensors")
    with uform.Trainer.init_ram(executor, made) as trainer:
        trainer.step(step)
        trainer.save(path)
        expected = [trainer.step(step).stats.loss for _ in range(2)]
    tensors = safetensors.numpy.load_file(path)
    assert tensors["late_interaction.token_head"].shape == (16, 128)
    assert "late_interaction.log_inverse_temperature" in tensors and "late_interaction.bias" in tensors
    with uform.Trainer.init_ram(executor, dict(made, resume=path)) as resumed:
        assert [resumed.step(step).stats.loss for _ in range(2)] == expected
        resumed.save(path, weights_only=True)
    full = str(tmp_path / "full.safetensors")
    with uform.Trainer.init_ram(executor, made) as trainer:
        trainer.save(full)
    with pytest.raises(uform.InvalidCheckpoint, match=r"has a late-interaction token head, the config trains none "
                                                      r"\(late_interaction\.weight = 0\); set config\.late_interaction\.weight "
                                                      r"above 0 to resume from it$"):
        uform.Trainer.init_ram(executor, dict(made, late_interaction=None, resume=full))
    with pytest.raises(uform.InvalidCheckpoint, match=r"late_interaction\.width = 16, the config asks for 8; set "
                                                      r"config\.late_interaction\.width = 16 to resume from it$"):
        uform.Trainer.init_ram(executor, dict(made, late_interaction=dict(weight=1.0, width=8, max_query_span=8),
                                              resume=full))
    # A span set without the term trains no head, and its checkpoints load and resume.
    plain = str(tmp_path / "plain.safetensors")
    unweighted = dict(made, late_interaction=dict(max_query_span=8))
    with uform.Trainer.init_ram(executor, unweighted) as trainer:
        trainer.save(plain)
    with pytest.raises(uform.InvalidCheckpoint, match=r"has no late-interaction token head, the config trains one "
                                                      r"\(late_interaction\.weight > 0\); set config\.late_interaction\.weight "
                                                      r"to 0 to resume from it$"):
        uform.Trainer.init_ram(executor, dict(made, resume=plain))
    uform.Trainer.init_ram(executor, dict(unweighted, resume=plain)).free()
    uform.Encoder.load(plain, executor).free()
    with uform.Encoder.load(path, executor) as encoder:  # the token head travels in the weights-only file too
        assert np.asarray(encoder.embed(["text"] * 2, ["red panda", "bamboo"])).shape == (2, 128)


def test_the_seeds_reranker_example_steps(executor):
    """The seed's second example at a CPU's size (depth 2, hidden 128, 8 rows of 64 columns), with a
    repelled document beside the attracted one so the ranked form has a pair to rank."""
    reranker = uform.Trainer.init_ram(executor, dict(
        depth=2, hidden=128, objective=uform.Objective.CONTRASTIVE, schedule=dict(steps=100000),
        batch=dict(max_rows_per_device=8, max_columns_per_row=64, max_choices_per_item=16),
        late_interaction=dict(weight=1, pair_loss=uform.PairLossForm.RANKED), choices=dict(weight=1)))
    with reranker:
        stats = reranker.step(dict(
            modalities=[uform.Modality.TEXT] * 3,
            contents=["red panda diet", "Red pandas eat bamboo.", "Stars shine at night."],
            sides=[uform.LateInteractionSide.QUERY, uform.LateInteractionSide.DOCUMENT,
                   uform.LateInteractionSide.DOCUMENT],
            choices=["yn", "", ""],
            choice_targets=[np.array([0.9, 0.1], np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32)],
            relations=dict(attract=dict(offsets=[0, 1, 2, 2], ids=[1, 0]), repel=dict(offsets=[0, 1, 1, 1], ids=[2])),
        )).stats
    assert stats.step == 1 and stats.query_rows == 1 and stats.choice_items == 1
    assert all(math.isfinite(v) for v in (stats.contrastive_loss, stats.late_interaction_loss, stats.choices_loss))
    assert stats.loss == pytest.approx(stats.contrastive_loss + stats.late_interaction_loss + stats.choices_loss,
                                       rel=1e-5)


def test_too_many_edges_is_refused(executor):
    with uform.Trainer.init_ram(executor, config(contrastive=dict(max_edges_per_device=3))) as trainer:
        with pytest.raises(uform.InvalidArgument, match="max_edges_per_device"):
            trainer.step(batch())


BAD_CONFIGS = [
    (dict(hidden=200), "hidden"),
    (dict(depth=0), "depth"),
    (dict(schedule=dict()), "steps"),
    (dict(objective="sleep"), "objective"),
    (dict(batch=dict(max_rowz=3)), "max_rowz"),
    (dict(masking=dict(token_mask_probability=1.5)), "token_mask_probability"),
    (dict(contrastive=dict(matryoshka_dimensions=[64, 512])), "matryoshka_dimensions"),
    (dict(contrastive=dict(temperature_groups=1000)), "temperature_groups"),
    (dict(late_interaction=dict(width=12)), "width"),
    (dict(schedule=dict(steps=10, warmup_steps=11)), "warmup_steps"),
]


@pytest.mark.parametrize("change,field", BAD_CONFIGS)
def test_bad_configs_are_refused_by_name(executor, change, field):
    bad = config()
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(bad.get(key), dict) and key != "schedule":
            bad[key] = {**bad[key], **value}
        else:
            bad[key] = value
    with pytest.raises(uform.InvalidArgument, match=field):
        uform.Trainer.init_ram(executor, bad)


def test_a_poisoned_step_is_skipped_and_training_goes_on(executor):
    poisoned = batch(relations=dict(attract=edges([0, 1, 1, 1, 1, 1, 1], [2], [3.4e38])))
    with uform.Trainer.init_ram(executor, config("contrastive")) as trainer:
        trainer.step(batch())
        before = trainer._weights()
        stats = trainer.step(poisoned).stats
        assert stats.skipped and stats.step == 1
        assert not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm))
        assert np.array_equal(trainer._weights(), before)  # bitwise untouched
        stats = trainer.step(batch()).stats
        assert not stats.skipped and stats.step == 2 and math.isfinite(stats.loss)
        assert not np.array_equal(trainer._weights(), before)


def test_truncated_items_are_counted(executor):
    long = batch(items=[b"y" * 50, b"short"], relations=None, groups=None)
    with uform.Trainer.init_ram(executor, config()) as trainer:
        stats = trainer.step(long).stats
    assert stats.truncated_items == 1 and stats.tokens == 32 + 5 and stats.items == 2


def test_schedule_warms_up_then_follows_the_cosine(executor):
    rates = []
    schedule = dict(steps=10, warmup_steps=2, learning_rate=1e-2, min_learning_rate=1e-3)
    with uform.Trainer.init_ram(executor, config(schedule=schedule)) as trainer:
        for _ in range(12):
            rates.append(trainer.step(batch()).stats.learning_rate)
    expected = [1e-2 * s / 2 if s <= 2 else 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (s - 2) / 8))
                for s in range(1, 11)] + [1e-3, 1e-3]
    assert rates == pytest.approx(expected, rel=1e-5)


def test_update_is_clipped_adamw_over_the_reported_gradients(executor, tmp_path):
    """One update from fresh moments, recomputed in numpy from the probed gradients and the documented rules."""
    schedule = dict(steps=10, warmup_steps=1, learning_rate=0.05)
    with uform.Trainer.init_ram(executor, config(schedule=schedule)) as trainer:
        before = trainer._weights().astype(np.float64)
        stats, gradients = trainer._probe(batch())
        stepped = trainer.step(batch()).stats
        after = trainer._weights().astype(np.float64)
        path = str(tmp_path / "names.safetensors")
        trainer.save(path)
    assert stepped.grad_norm == pytest.approx(stats.grad_norm) and stepped.loss == stats.loss
    norm = np.sqrt((gradients.astype(np.float64) ** 2).sum())
    assert norm == pytest.approx(stats.grad_norm, rel=1e-5) and norm > 1  # clipping is in play
    g = gradients.astype(np.float64) / norm  # clipped to norm 1
    first, second = 0.1 * g, 0.05 * g * g
    update = (first / 0.1) / (np.sqrt(second / 0.05) + 1e-8)
    decays = np.zeros_like(before)
    offset = 0
    for name in tensor_names(DEPTH):
        shape = safetensors.numpy.load_file(path)[name].shape
        size = int(np.prod(shape))
        decays[offset:offset + size] = len(shape) == 2
        offset += (size + 15) // 16 * 16
    expected = before - 0.05 * (update + 0.1 * decays * before)
    np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-6)
