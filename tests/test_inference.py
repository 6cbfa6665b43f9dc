"""Inference that serves the choices term: `Encoder.text_choose` answers what training scores, in
the shape `choice_targets` takes, so one model's probabilities can train another."""
import math

import numpy as np
import pytest

import uform

TEXTS = ["is the sun a star?", "do red pandas eat bamboo?", "is water dry?", "can fish fly?", "is ice cold?",
         "do birds have feathers?"]
CHOICES = ["yn", "yn", "yn", "yn", "yn", "yn"]


def config(seed=3, **extra):
    made = dict(depth=2, hidden=128, objective=uform.Objective.CONTRASTIVE, seed=seed,
                schedule=dict(steps=400, warmup_steps=5, learning_rate=3e-3),
                batch=dict(max_rows_per_device=8, max_columns_per_row=64, max_choices_per_item=4),
                choices=dict(weight=1.0))
    made.update(extra)
    return made


def step(texts, choices, targets):
    return dict(modalities=[uform.Modality.TEXT] * len(texts), contents=texts, choices=choices,
                choice_targets=[np.asarray(t, np.float32) for t in targets])


@pytest.fixture(scope="module")
def cpu():
    with uform.Executor.for_ram(threads=2) as executor:
        yield executor


def test_probabilities_are_what_training_scores(cpu, tmp_path):
    path = str(tmp_path / "teacher.safetensors")
    targets = [[0.8, 0.2], [0.3, 0.7], [0.5, 0.5], [1.0, 0.0], [0.1, 0.9], [0.6, 0.4]]
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        for _ in range(3):
            trainer.step(step(TEXTS, CHOICES, targets))
        trainer.save(path, weights_only=True)
        stats, _ = trainer._probe(step(TEXTS, CHOICES, targets))  # contrastive: nothing is masked
    with uform.Encoder.load(path, cpu) as encoder:
        probabilities = encoder.text_choose(TEXTS, CHOICES)
        deferred = encoder.deferred().text_choose(TEXTS, CHOICES).wait()
    assert [p.dtype for p in probabilities] == [np.float32] * len(TEXTS)
    assert all(p.shape == (2,) and p.sum() == pytest.approx(1.0, rel=1e-6) for p in probabilities)
    assert all(np.array_equal(a, b) for a, b in zip(probabilities, deferred))
    expected = np.mean([-(np.asarray(t) * np.log(p.astype(np.float64))).sum() for t, p in zip(targets, probabilities)])
    assert stats.choices_loss == pytest.approx(expected, rel=1e-5)


def test_a_student_learns_the_teachers_probabilities(cpu, tmp_path):
    """Distillation: a second model trained only on the first's answers converges to them."""
    path = str(tmp_path / "teacher.safetensors")
    rng = np.random.default_rng(0)
    with uform.Trainer.init_ram(cpu, config(seed=1)) as teacher:
        targets = [rng.dirichlet([1, 1]) for _ in TEXTS]
        for _ in range(40):
            teacher.step(step(TEXTS, CHOICES, targets))
        teacher.save(path, weights_only=True)
    with uform.Encoder.load(path, cpu) as encoder:
        taught = encoder.text_choose(TEXTS, CHOICES)

    def divergence(student):
        return float(np.mean([(t * np.log(t / s)).sum() for t, s in zip(taught, student)]))

    student_path = str(tmp_path / "student.safetensors")
    with uform.Trainer.init_ram(cpu, config(seed=2)) as student:
        student.save(student_path, weights_only=True)
        with uform.Encoder.load(student_path, cpu) as encoder:
            before = divergence(encoder.text_choose(TEXTS, CHOICES))
        for _ in range(120):
            student.step(step(TEXTS, CHOICES, taught))  # the teacher's answers, as they land
        student.save(student_path, weights_only=True)
    with uform.Encoder.load(student_path, cpu) as encoder:
        after = divergence(encoder.text_choose(TEXTS, CHOICES))
    assert after < 0.1 * before and after < 0.01, (before, after)


def test_bad_choices_are_refused_by_name(cpu, tmp_path):
    path = str(tmp_path / "model.safetensors")
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        trainer.save(path, weights_only=True)
    with uform.Encoder.load(path, cpu) as encoder:
        for texts, choices, message in [(["a", "b"], ["yn", ""], r"choices\[1\]: empty"),
                                        (["a"], ["yny"], r"choices\[0\]: byte 121 is offered twice"),
                                        (["a", "b"], ["yn"], r"choices: 1 entry, expected 2, one per text"),
                                        (["a", ""], ["yn", "yn"], r"^texts\[1\]: empty")]:
            with pytest.raises(uform.InvalidArgument, match=message):
                encoder.text_choose(texts, choices)
        assert encoder.text_choose([], []) == []
        long = encoder.text_choose(["x" * 200, "short"], ["ab", "ab"])  # cut to fit a row beside its choice position
        assert len(long) == 2 and all(math.isclose(p.sum(), 1.0, rel_tol=1e-6) for p in long)
        assert long.truncated_items == 1
        every = encoder.text_choose(["all of them"], [bytes(range(256))])[0]
        assert every.shape == (256,) and every.sum() == pytest.approx(1.0, rel=1e-5)


QUERIES = ["red panda diet", "bright stars", "fast cars"]
DOCUMENTS = ["red pandas eat bamboo and fruit", "stars shine at night", "cars drive fast on roads",
             "bamboo grows quickly"]


def late_step():
    """Queries 0-2 attract documents 3-5 and repel document 6; every item has its side."""
    sides = [uform.LateInteractionSide.QUERY] * 3 + [uform.LateInteractionSide.DOCUMENT] * 4
    return dict(modalities=[uform.Modality.TEXT] * 7, contents=QUERIES + DOCUMENTS, sides=sides,
                relations=dict(attract=uform.Edges([0, 1, 2, 3, 3, 3, 3, 3], [3, 4, 5]),
                               repel=uform.Edges([0, 1, 2, 3, 3, 3, 3, 3], [6, 6, 6])))


def test_token_vectors_are_what_training_scores(cpu, tmp_path):
    from reference import late_interaction_loss

    path = str(tmp_path / "late.safetensors")
    made = config(late_interaction=dict(weight=1.0, width=32, max_query_span=12), choices=None)
    made["batch"]["max_choices_per_item"] = 0
    with uform.Trainer.init_ram(cpu, made) as trainer:
        for _ in range(3):
            trainer.step(late_step())
        trainer.save(path)
        stats, _ = trainer._probe(late_step())
    import safetensors.numpy
    tensors = safetensors.numpy.load_file(path)
    with uform.Encoder.load(path, cpu) as encoder:
        queries = encoder.embed_tokens(["text"] * 3, QUERIES, sides=["query"] * 3)
        documents = encoder.embed_tokens(["text"] * 4, DOCUMENTS)  # no sides: documents
        deferred = encoder.deferred().embed_tokens(["text"] * 4, DOCUMENTS).wait()
        with pytest.raises(uform.InvalidArgument, match=r"sides\[1\]: none has no token vectors"):
            encoder.embed_tokens(["text"] * 2, QUERIES[:2], sides=["query", "none"])
        # Refused while sizing, before any vector is computed, and counted alike in both passes.
        with pytest.raises(uform.InvalidArgument, match=r"sides\[1\]: only text items are queries"):
            encoder.embed_tokens(["text", "image"], ["a", b"\xff\xd8"], sides=["query", "query"])
        with pytest.raises(uform.InvalidArgument, match=r"contents\[1\]: empty"):
            encoder.embed_tokens(["text"] * 2, ["a", ""])
        cut = encoder.embed_tokens(["text"] * 3, ["q" * 13, "q" * 12, "d" * 65], sides=["query", "query", "document"])
    assert cut.truncated_items == 2 and [len(v) for v in cut] == [12, 12, 64]
    assert [q.shape for q in queries] == [(12, 32)] * 3  # cut or padded to the span
    assert [d.shape for d in documents] == [(len(d), 32) for d in DOCUMENTS]
    assert all(np.array_equal(a, b) for a, b in zip(documents, deferred))
    vectors = np.concatenate(queries + documents).astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, rtol=1e-5)
    starts = np.concatenate([[0], np.cumsum([len(v) for v in queries + documents])])
    spans = [(int(starts[i]), int(starts[i + 1] - starts[i])) for i in range(7)]
    rows = [(q, [(3 + q, 1, 1.0), (6, 2, 1.0)]) for q in range(3)]
    expected = late_interaction_loss(vectors, spans, rows, float(tensors["late_interaction.log_inverse_temperature"][0]),
                                     float(tensors["late_interaction.bias"][0]), "ranked")
    assert stats.late_interaction_loss == pytest.approx(expected, rel=1e-5)


def test_pictures_are_documents_of_one_token_vector_a_patch(cpu, tmp_path):
    from reference import late_interaction_loss
    from test_images import drawing
    from test_media import png_bytes

    rng = np.random.default_rng(8)
    pictures = [drawing(shape, color, rng) for shape, color in (("disk", "red"), ("bar", "blue"), ("square", "green"))]
    captions = ["a red disk", "a blue bar", "a green square"]
    sides = [uform.LateInteractionSide.QUERY] * 3 + [uform.LateInteractionSide.DOCUMENT] * 3
    step = dict(modalities=[uform.Modality.TEXT] * 3 + [uform.Modality.IMAGE] * 3, contents=captions + pictures,
                sides=sides, relations=dict(attract=uform.Edges([0, 1, 2, 3, 3, 3, 3], [3, 4, 5]),
                                            repel=uform.Edges([0, 1, 2, 3, 3, 3, 3], [4, 5, 3])))
    made = config(late_interaction=dict(weight=1.0, width=32, max_query_span=16), choices=None)
    made["batch"].update(max_choices_per_item=0, image=dict(patch_side=8))
    path = str(tmp_path / "pictures.safetensors")
    with uform.Trainer.init_ram(cpu, made) as trainer:
        for _ in range(3):
            trainer.step(step)
        trainer.save(path)
        stats, _ = trainer._probe(step)
    import safetensors.numpy
    tensors = safetensors.numpy.load_file(path)
    with uform.Encoder.load(path, cpu) as encoder:
        queries = encoder.embed_tokens(["text"] * 3, captions, sides=["query"] * 3)
        documents = encoder.embed_tokens(["image"] * 3, pictures)
        large = encoder.embed_tokens(["text", "image"], ["words", png_bytes(np.zeros((128, 96, 3), np.uint8))])
        with pytest.raises(uform.InvalidArgument, match=r"contents\[1\]"):  # found while sizing
            encoder.embed_tokens(["image"] * 2, [pictures[0], pictures[1][:50]])
    assert [d.shape for d in documents] == [(16, 32)] * 3  # 32 x 32 pixels: 4 x 4 patches of 8
    assert large.truncated_items == 1 and len(large[1]) <= 64 and len(large[0]) == 5  # shrunk to fit a row
    vectors = np.concatenate(list(queries) + list(documents)).astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, rtol=1e-5)
    spans = [(16 * i, 16) for i in range(6)]
    rows = [(q, [(3 + q, 1, 1.0), (3 + (q + 1) % 3, 2, 1.0)]) for q in range(3)]
    expected = late_interaction_loss(vectors, spans, rows, float(tensors["late_interaction.log_inverse_temperature"][0]),
                                     float(tensors["late_interaction.bias"][0]), "ranked")
    assert stats.late_interaction_loss == pytest.approx(expected, rel=1e-5)


def test_token_vectors_need_a_token_head(cpu, tmp_path):
    path = str(tmp_path / "plain.safetensors")
    with uform.Trainer.init_ram(cpu, config()) as trainer:
        trainer.save(path, weights_only=True)
    with uform.Encoder.load(path, cpu) as encoder:
        with pytest.raises(uform.InvalidArgument, match="no token head; a run trains one with late_interaction.weight"):
            encoder.embed_tokens(["text"], ["hello"])
        with pytest.raises(uform.InvalidArgument, match=r"sides\[0\]"):
            encoder.embed_tokens(["text"], ["hello"], sides=["sideways"])


NOT_AN_IMAGE = b"GIF89a" + bytes(20)


def test_refusals_name_what_the_caller_passed(cpu, tmp_path):
    """An encoder's caller passes `modalities` and `contents` (`texts` to choose), not a batch: its refusals name
    those, counting items as the caller does, past the first pass too. A trainer's still name `batch`."""
    made = config(late_interaction=dict(weight=1.0, width=32, max_query_span=16))
    made["batch"].update(max_rows_per_device=2)  # a pass of 64 tokens: 40 items take several
    texts = [f"item {i}" for i in range(40)]
    path = str(tmp_path / "model.safetensors")
    with uform.Trainer.init_ram(cpu, made) as trainer:
        trainer.save(path, weights_only=True)
        with pytest.raises(uform.InvalidArgument, match=r"^batch\.contents\[1\]: empty"):
            trainer.step(dict(modalities=["text"] * 2, contents=["a", ""]))
        pictured = dict(modalities=["text", "image"], contents=["a", NOT_AN_IMAGE])
        for verb in (trainer.step, trainer.decode):
            with pytest.raises(uform.InvalidArgument, match=r"^batch\.contents\[1\]: not an image file"):
                verb(pictured)
    empty = texts[:37] + [""] + texts[38:]
    mixed = texts[:38] + [NOT_AN_IMAGE] + texts[39:]
    data = "".join(texts).encode()
    offsets = np.cumsum([0] + [len(text) for text in texts]).astype(np.uint64)
    offsets[38] = offsets[37] - 1
    with uform.Encoder.load(path, cpu) as encoder:
        for verb in (encoder.embed, encoder.embed_tokens):
            with pytest.raises(uform.InvalidArgument, match=r"^contents\[37\]: empty"):
                verb(["text"] * 40, empty)
            with pytest.raises(uform.InvalidArgument, match=r"^contents\[38\]: not an image file"):
                verb(["text"] * 38 + ["image", "text"], mixed)
        with pytest.raises(uform.InvalidArgument, match=r"^contents\.offsets\[38\]: \d+ is below the offset before"):
            encoder.embed(["text"] * 40, uform.Tape(data, offsets))
        with pytest.raises(uform.InvalidArgument, match=r"^texts\[37\]: empty"):
            encoder.text_choose(empty, ["yn"] * 40)



def identifier_pairs(count, rng):
    """(query, document): a document is 16 distinct identifiers (single bytes 0x80-0xFF, as product
    codes), its query two of them. Finding the document means matching identifiers exactly."""
    symbols = np.arange(0x80, 0x100, dtype=np.uint8)
    pairs = []
    for _ in range(count):
        document = rng.choice(symbols, 16, replace=False)
        pairs.append((bytes(rng.choice(document, 2, replace=False)), bytes(document)))
    return pairs


def identifier_step(pairs, late):
    n = len(pairs)
    repel = [sorted(n + (i + k) % n for k in (1, 2, 3)) for i in range(n)]  # three other documents
    made = dict(modalities=["text"] * (2 * n), contents=[q for q, _ in pairs] + [d for _, d in pairs],
                relations=dict(attract=uform.Edges(list(range(n + 1)) + [n] * n, [n + i for i in range(n)]),
                               repel=uform.Edges([0] + [3 * (i + 1) for i in range(n)] + [3 * n] * n, sum(repel, []))))
    if late:
        made["sides"] = ["query"] * n + ["document"] * n
    return made


def test_late_interaction_retrieves_what_pooling_cannot(cpu, tmp_path):
    """Two models see the same 300 steps of identifier lookups; on 100 held-out documents, MaxSim over
    token vectors finds the right one far more often than pooled embeddings do."""
    held_out = identifier_pairs(100, np.random.default_rng(9))
    queries, documents = [q for q, _ in held_out], [d for _, d in held_out]
    recall = {}
    for late in (False, True):
        made = dict(depth=2, hidden=128, objective=uform.Objective.CONTRASTIVE, seed=1,
                    schedule=dict(steps=300, warmup_steps=10, learning_rate=3e-4),
                    batch=dict(max_rows_per_device=16, max_columns_per_row=32, max_segments_per_device=32),
                    contrastive=dict(negatives=uform.Negatives.NAMED, pair_loss=uform.PairLossForm.RANKED))
        if late:
            made["late_interaction"] = dict(weight=1.0, width=32, max_query_span=4)
        path = str(tmp_path / f"late-{late}.safetensors")
        rng = np.random.default_rng(1)
        with uform.Trainer.init_ram(cpu, made) as trainer:
            for _ in range(300):
                trainer.step(identifier_step(identifier_pairs(16, rng), late))
            trainer.save(path, weights_only=True)
        with uform.Encoder.load(path, cpu) as encoder:
            if late:
                q = encoder.embed_tokens(["text"] * 100, queries, ["query"] * 100)
                d = encoder.embed_tokens(["text"] * 100, documents)
                scores = np.array([[(a @ b.T).max(axis=1).sum() for b in d] for a in q])
            else:
                scores = np.asarray(encoder.embed(["text"] * 100, queries)) @ np.asarray(
                    encoder.embed(["text"] * 100, documents)).T
        recall[late] = float((scores.argmax(axis=1) == np.arange(100)).mean())
    assert recall[True] >= 0.3 and recall[True] >= 2 * recall[False] + 0.1, recall
