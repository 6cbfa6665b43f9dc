"""uform.data: each reader on files made here, the schema checked before a step, bad records skipped or
refused in each format, and the stream's order: keyed on the seed, shared among processes, resumed exactly;
an item the library refuses traced back to its record, and a dataset with no usable record stopped.
"""

import io
import json
import re
import tarfile

import numpy as np
import pytest

import uform
from uform import Modality
from uform.data import BadRecord, Stream, records

JPEG = b"\xff\xd8\xff\xe0" + bytes(range(60))
PNG = b"\x89PNG\r\n\x1a\n" + bytes(40)
CONFIG = dict(depth=1, hidden=128, objective="joint", seed=11, schedule=dict(steps=100),
              batch=dict(max_rows_per_device=4, max_columns_per_row=64))
PAIRS = dict(question="text", answer="text")


def pairs(count, start=0):
    return [dict(question=f"question {i}?", answer=f"the answer is {i}") for i in range(start, start + count)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_tar(path, samples):
    """`samples`: (key, {extension: bytes}), written as WebDataset writes them: a sample's files together."""
    with tarfile.open(path, "w") as archive:
        for key, files in samples:
            for extension, data in files.items():
                member = tarfile.TarInfo(f"{key}.{extension}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
    return str(path)


def take(stream, steps):
    return [next(stream) for _ in range(steps)]


def locations(steps):
    return [step.locations for step in steps]


# ---------------------------------------------------------------------------------------------- #
#  Readers                                                                                         #
# ---------------------------------------------------------------------------------------------- #


def test_jsonl_rows_become_pairs_that_attract_both_ways_and_train(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs(12))
    with Stream(dict(paths=[path], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
        step = next(stream)
    batch = step.batch
    # In file order; pairs of 26 bytes pack two and more to a row of 64 columns, as many as 4 rows hold.
    assert step.locations == [f"{path}:line {i + 1}" for i in range(9)]
    assert [bytes(batch["contents"][i]) for i in range(2)] == [b"question 0?", b"the answer is 0"]
    attract = batch["relations"]["attract"]
    assert list(attract.offsets) == list(range(19)) and list(attract.ids[:6]) == [1, 0, 3, 2, 5, 4]
    assert batch["bags"][:6] == [0, 0, 1, 1, 2, 2]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, CONFIG) as trainer:
        assert trainer.step(batch).stats.contrastive_rows == 18


def test_csv_reads_quoted_fields_negatives_and_weights(tmp_path):
    path = tmp_path / "triplets.csv"
    path.write_text('query,positive,negative,weight\n"red, panda",bamboo eater,"a fox\nin snow",2\n'
                    'tiger,striped cat,house cat,0.5\n')
    dataset = dict(paths=[str(path)], columns=dict(query="text", positive="text"), negatives=dict(negative="text"),
                   weight="weight", shuffle_buffer=0)
    with Stream(dataset, CONFIG) as stream:
        batch = next(stream).batch
    assert [bytes(batch["contents"][i]) for i in range(3)] == [b"red, panda", b"bamboo eater", b"a fox\nin snow"]
    attract, repel = batch["relations"]["attract"], batch["relations"]["repel"]
    assert list(attract.ids[:2]) == [1, 0] and list(attract.offsets[:4]) == [0, 1, 2, 2]
    assert list(repel.offsets[:4]) == [0, 1, 2, 4] and list(repel.ids[:4]) == [2, 2, 0, 1]  # repel both ways
    assert list(attract.weights) == [2, 2, 0.5, 0.5] and list(repel.weights) == [2, 2, 2, 2, 0.5, 0.5, 0.5, 0.5]
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, CONFIG) as trainer:
        assert np.isfinite(trainer.step(batch).stats.loss)


def test_parquet_reads_row_groups_and_resumes_inside_one(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    rows = pairs(30)
    path = str(tmp_path / "pairs.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path, row_group_size=7)
    assert [values["answer"] for _, values, _ in records(dict(paths=[path], columns=PAIRS))] == [r["answer"] for r in rows]
    from uform.data import read_parquet

    keys = [key for key, _ in read_parquet(path, start=12)]
    assert len(keys) == 18 and keys[:3] == ["row 12 (the 13th)", "row 13 (the 14th)", "row 14 (the 15th)"]
    assert keys[-1] == "row 29 (the 30th)"


def test_a_records_location_reads_one_way_only(tmp_path):
    """A line-based file names a record by its line, counted from one as an editor counts, blank lines and a CSV
    row's quoted line breaks included; a Parquet row by its index from zero with its ordinal beside it."""
    from uform.data.readers import counted

    jsonl = tmp_path / "gaps.jsonl"
    jsonl.write_text('\n{"question": "q0", "answer": "a0"}\n\n\n{"question": "q1", "answer": ""}\n')
    csv = tmp_path / "gaps.csv"
    csv.write_text('question,answer\n"q\n0",a0\n\nq1,\n')
    cases = [(jsonl, f"{jsonl}:line 5"), (csv, f"{csv}:line 5")]
    for path, bad in cases:
        with Stream(dict(paths=[str(path)], columns=PAIRS, shuffle_buffer=0, bad_records="refuse"), CONFIG) as stream:
            with pytest.raises(BadRecord, match=f"^{re.escape(bad)}: 'answer' is empty$"):
                next(stream)
    assert [counted("row", n) for n in (0, 1, 2, 3, 10, 11, 12, 20, 21, 22, 110, 111)] == [
        "row 0 (the 1st)", "row 1 (the 2nd)", "row 2 (the 3rd)", "row 3 (the 4th)", "row 10 (the 11th)",
        "row 11 (the 12th)", "row 12 (the 13th)", "row 20 (the 21st)", "row 21 (the 22nd)", "row 22 (the 23rd)",
        "row 110 (the 111th)", "row 111 (the 112th)"]


def test_choices_and_their_targets_come_from_columns(tmp_path):
    path = write_jsonl(tmp_path / "judged.jsonl", [dict(text=f"is {i} even?", label=f"{i} is a number", choices="yn",
                                                        targets=[0.9, 0.1] if i % 2 == 0 else [0.2, 0.8]) for i in range(6)])
    config = dict(CONFIG, batch=dict(CONFIG["batch"], max_choices_per_item=2), choices=dict(weight=1))
    dataset = dict(paths=[path], columns=dict(text="text", label="text"), choices="choices", choice_targets="targets",
                   shuffle_buffer=0)
    with Stream(dataset, config) as stream:
        batch = next(stream).batch
    assert [bytes(batch["choices"][i]) for i in range(2)] == [b"yn", b""]
    assert list(batch["choice_targets"][0]) == pytest.approx([0.9, 0.1])
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
        assert trainer.step(batch).stats.choice_items == len(batch["modalities"]) // 2
    with pytest.raises(uform.InvalidArgument, match="data.choices: .*max_choices_per_item"):
        Stream(dataset, CONFIG)
    table = tmp_path / "judged.csv"  # a CSV cell of targets that is no list of numbers: the cell, as it reads
    table.write_text("text,label,choices,targets\nis 0 even?,0 is a number,yn,0.9 x\n" + "".join(
        f"is {i} even?,{i} is a number,yn,0.5 0.5\n" for i in range(1, 4)))
    with Stream(dict(dataset, paths=[str(table)]), config) as stream:
        (bad,) = next(stream).bad_records
    assert bad == f"{table}:line 2: 'targets' is '0.9 x', not a list of numbers (a JSON list, or numbers between spaces)"
    table.write_text("text,label,text\nq,a,q again\n")  # a named column twice in the header: which, unsaid
    with pytest.raises(uform.InvalidArgument, match=r"data.columns.text: .*judged.csv's header names 'text' 2 times"):
        Stream(dict(dataset, paths=[str(table)], choices=None, choice_targets=None), config)


def test_tar_shards_in_webdataset_layout_pass_images_as_their_bytes(tmp_path):
    shards = [write_tar(tmp_path / f"shard-{n}.tar", [(f"{n}{i:03d}", dict(jpg=JPEG + bytes([i]), txt=f"photo {i}".encode(),
                                                                             json=b"{}")) for i in range(5)])
              for n in range(2)]
    dataset = dict(paths=[str(tmp_path / "shard-*.tar")], columns=dict(jpg="image", txt="text"), shuffle_buffer=0)
    with Stream(dataset, dict(CONFIG, batch=dict(max_rows_per_device=8, max_columns_per_row=64))) as stream:
        step = next(stream)
    batch = step.batch
    # An image takes a whole row until the library says how many patches it makes; the captions share
    # one row, so 8 rows hold 7 pairs.
    assert step.locations == [f"{shards[0]}:0{i:03d}" for i in range(5)] + [f"{shards[1]}:1{i:03d}" for i in range(2)]
    assert batch["modalities"][:2] == [Modality.IMAGE, Modality.TEXT]
    assert bytes(batch["contents"][0]) == JPEG + bytes([0]) and bytes(batch["contents"][1]) == b"photo 0"


def test_folders_of_captioned_files_take_whichever_extension_a_sample_has(tmp_path):
    (tmp_path / "photos" / "more").mkdir(parents=True)
    (tmp_path / "photos" / "cat.jpg").write_bytes(JPEG)
    (tmp_path / "photos" / "cat.txt").write_text("a cat on a mat")
    (tmp_path / "photos" / "more" / "dog.png").write_bytes(PNG)
    (tmp_path / "photos" / "more" / "dog.txt").write_text("a dog in fog")
    dataset = dict(paths=[str(tmp_path / "photos")], columns={"jpg;png": "image", "txt": "text"}, shuffle_buffer=0)
    found = [(location.rsplit(":", 1)[1], values["txt"]) for location, values, _ in records(dataset)]
    assert found == [("cat", "a cat on a mat"), ("more/dog", "a dog in fog")]
    with Stream(dataset, dict(CONFIG, batch=dict(max_rows_per_device=8, max_columns_per_row=64))) as stream:
        batch = next(stream).batch
    assert [bytes(batch["contents"][i]) for i in (0, 2)] == [JPEG, PNG]


def test_image_paths_in_a_table_are_read_beside_it(tmp_path):
    (tmp_path / "images").mkdir()
    from test_media import png_bytes

    png = png_bytes(np.full((24, 40, 3), 200, np.uint8))
    (tmp_path / "images" / "a.png").write_bytes(png)
    path = write_jsonl(tmp_path / "captions.jsonl", [dict(image="images/a.png", caption="an a")])
    with Stream(dict(paths=[path], columns=dict(image="image", caption="text")), CONFIG) as stream:
        batch = next(stream).batch
    assert bytes(batch["contents"][0]) == png
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, CONFIG) as trainer:
        assert trainer.step(batch).stats.items == 2  # the library decodes the image


# ---------------------------------------------------------------------------------------------- #
#  The schema, before any step                                                                     #
# ---------------------------------------------------------------------------------------------- #


def test_a_missing_column_or_key_fails_at_once_naming_it(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", pairs(3))
    (tmp_path / "a.csv").write_text("question,reply\nq,r\n")
    tar = write_tar(tmp_path / "a.tar", [("k0", dict(jpg=JPEG, json=b"{}"))])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "k.jpg").write_bytes(JPEG)
    cases = [(jsonl, dict(question="text", answr="text"), "data.columns.answr: .*a.jsonl's first records have no column 'answr'"),
             (str(tmp_path / "a.csv"), PAIRS, "data.columns.answer: .*a.csv's header has no column 'answer' .*'reply'"),
             (tar, dict(jpg="image", txt="text"), "data.columns.txt: .*a.tar's first records have no file 'txt'"),
             (str(tmp_path / "folder"), dict(jpg="image", txt="text"), "data.columns.txt: .*have no file 'txt'")]
    for path, columns, message in cases:
        with pytest.raises(uform.InvalidArgument, match=message):
            Stream(dict(paths=[path], columns=columns), CONFIG)
    with pytest.raises(uform.InvalidArgument, match=r"data.paths\[0\]: '.*folder' is a folder, which data.format = "
                                                    r"'jsonl' does not read; leave data.format out"):
        Stream(dict(paths=[str(tmp_path / "folder")], columns=dict(jpg="image", txt="text"), format="jsonl"), CONFIG)
    with pytest.raises(uform.InvalidArgument, match=r"data.paths\[0\]: .*no such file"):
        Stream(dict(paths=[str(tmp_path / "absent.jsonl")], columns=PAIRS), CONFIG)
    with pytest.raises(uform.InvalidArgument, match="data.colums: unknown field"):
        Stream(dict(paths=[jsonl], colums=PAIRS), CONFIG)
    with pytest.raises(uform.InvalidArgument, match="data.negatives.question: 'question' is also one of data.columns"):
        Stream(dict(paths=[jsonl], columns=PAIRS, negatives=dict(question="text")), CONFIG)
    with pytest.raises(uform.InvalidArgument, match="data.columns: 'question' alone: the joint objective's"):
        Stream(dict(paths=[jsonl], columns=dict(question="text")), CONFIG)  # as `uform train` refuses it
    Stream(dict(paths=[jsonl], columns=dict(question="text")), dict(CONFIG, objective="masked")).close()
    with pytest.raises(uform.InvalidArgument, match="data.columns.question: 'txt' is not a Modality"):
        Stream(dict(paths=[jsonl], columns=dict(question="txt")), CONFIG)


# ---------------------------------------------------------------------------------------------- #
#  Bad records: skipped and counted with their location, or refused                                #
# ---------------------------------------------------------------------------------------------- #


def bad_datasets(tmp_path):
    """(dataset, the locations of its bad records) in each format; every other record is good."""
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"question": "q0", "answer": "a0"}\nnot json\n{"question": "q2", "answer": " "}\n'
                     '{"question": "q3"}\n{"question": "q4", "answer": "a4"}\n')
    csv = tmp_path / "bad.csv"
    csv.write_text("question,answer\nq0,a0\nq1,\nq2,a2\n")
    tar = write_tar(tmp_path / "bad.tar", [("k0", dict(jpg=JPEG, txt=b"zero")), ("k1", dict(jpg=JPEG)),
                                           ("k2", dict(jpg=b"<html>not found</html>", txt=b"two")),
                                           ("k3", dict(jpg=JPEG, txt=b"\xff\xfe")), ("k4", dict(jpg=JPEG, txt=b"four"))])
    folder = tmp_path / "bad-folder"
    folder.mkdir()
    for key, image, caption in (("a", JPEG, "an a"), ("b", b"", "a b"), ("c", JPEG, ""), ("d", JPEG, None)):
        (folder / f"{key}.jpg").write_bytes(image)
        if caption is not None:
            (folder / f"{key}.txt").write_text(caption)
    cases = [(dict(paths=[str(jsonl)], columns=PAIRS), [f"{jsonl}:line {i}" for i in (2, 3, 4)]),
             (dict(paths=[str(csv)], columns=PAIRS), [f"{csv}:line 3"]),
             (dict(paths=[tar], columns=dict(jpg="image", txt="text")), [f"{tar}:k{i}" for i in (1, 2, 3)]),
             (dict(paths=[str(folder)], columns=dict(jpg="image", txt="text")), [f"{folder}:{k}" for k in "bcd"])]
    try:
        import pyarrow.parquet

        parquet = str(tmp_path / "bad.parquet")
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist([dict(question="q0", answer="a0"),
                                                               dict(question=None, answer="a1")]), parquet)
        cases.append((dict(paths=[parquet], columns=PAIRS), [f"{parquet}:row 1 (the 2nd)"]))
    except ImportError:
        pass
    return cases


def test_bad_records_are_skipped_and_counted_with_their_location_in_every_format(tmp_path):
    big = dict(CONFIG, batch=dict(max_rows_per_device=64, max_columns_per_row=64))
    for dataset, bad in bad_datasets(tmp_path):
        with Stream(dict(dataset, shuffle_buffer=0), big) as stream:
            step = next(stream)  # one epoch fits one batch; the next epoch's first batch ends it
        assert sorted(message.split(": ")[0] for message in step.bad_records) == bad, step.bad_records
        assert len(step.locations) == len(list(records(dataset))) - len(bad)


def test_a_jsonl_line_with_bytes_that_are_not_utf8_names_its_text_as_csv_does(tmp_path):
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_bytes(b'{"question": "q0", "answer": "a0"}\n{"question": "bad \xff\xfe", "answer": "a1"}\n')
    with Stream(dict(paths=[str(jsonl)], columns=PAIRS, shuffle_buffer=0, bad_records="refuse"), CONFIG) as stream:
        with pytest.raises(BadRecord, match=f"^{re.escape(str(jsonl))}:line 2: 'question' is not UTF-8 text$"):
            next(stream)


def test_a_byte_order_mark_opening_a_jsonl_or_csv_file_is_no_part_of_its_first_record(tmp_path):
    """Windows tools (Excel's "CSV UTF-8", Notepad) begin UTF-8 files with one."""
    jsonl, table = tmp_path / "marked.jsonl", tmp_path / "marked.csv"
    jsonl.write_bytes(b'\xef\xbb\xbf{"question": "q0", "answer": "a0"}\n{"question": "q1", "answer": "a1"}\n')
    table.write_bytes(b"\xef\xbb\xbfquestion,answer\nq0,a0\nq1,a1\n")
    for path in (jsonl, table):
        read = [values for _, values, _ in records(dict(paths=[str(path)], columns=PAIRS))]
        assert read == [dict(question="q0", answer="a0"), dict(question="q1", answer="a1")], path


def test_bad_records_are_refused_when_asked_naming_the_first(tmp_path):
    for dataset, bad in bad_datasets(tmp_path):
        with Stream(dict(dataset, shuffle_buffer=0, bad_records="refuse"), CONFIG) as stream:
            with pytest.raises(BadRecord, match=f"^({'|'.join(map(re.escape, bad))}): "):
                next(stream)
            with pytest.raises(StopIteration):  # a refused stream stays stopped
                next(stream)


def test_a_refused_record_stops_the_stream_at_its_own_batch_not_before(tmp_path):
    """Every batch before the refused record's comes out first: a step is handed out once its last batch is
    packed, before the next batch is read on. (A batch ends when a record does not fit it, so one refused as
    it would begin the next batch stops the run before the batch it would have closed.)"""
    rows = pairs(40)
    with Stream(dict(paths=[write_jsonl(tmp_path / "good.jsonl", rows)], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
        good = take(stream, 3)
    second_of_third = int(good[2].locations[1].rsplit(":line ", 1)[1]) - 1  # a row of its own line
    rows[second_of_third] = dict(rows[second_of_third], answer="")
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with Stream(dict(paths=[path], columns=PAIRS, shuffle_buffer=0, bad_records="refuse"), CONFIG) as stream:
        before = take(stream, 2)
        assert locations(before) == [[location.replace("good", "bad") for location in step.locations]
                                     for step in good[:2]]
        assert before[1].cursor == dict(good[1].cursor, shards=[path])
        with pytest.raises(BadRecord, match=rf"^{re.escape(path)}:line {second_of_third + 1}: 'answer' is empty"):
            next(stream)


def test_a_shard_that_breaks_off_ends_with_a_bad_record_saying_where(tmp_path):
    whole = write_tar(tmp_path / "whole.tar", [(f"k{i}", dict(jpg=JPEG, txt=f"caption {i}".encode())) for i in range(10)])
    with tarfile.open(whole) as archive:
        members = archive.getmembers()
    data = open(whole, "rb").read()
    columns, big = dict(jpg="image", txt="text"), dict(CONFIG, batch=dict(max_rows_per_device=64, max_columns_per_row=64))
    # Cut inside a header, exactly between members, and inside a caption's bytes (a download cut short).
    for name, end, good in (("header", members[12].offset + 100, 6), ("boundary", members[12].offset, 6),
                            ("data", members[13].offset_data + 3, 6)):
        path = tmp_path / f"cut-{name}.tar"
        path.write_bytes(data[:end])
        with Stream(dict(paths=[str(path)], columns=columns, shuffle_buffer=0), big) as stream:
            step = next(stream)
        assert len(step.locations) == good, name
        assert any(re.match(rf"{re.escape(str(path))}:byte offset \d+: the shard breaks off here \(.+\); any records after "
                            "this point are lost", message) for message in step.bad_records), step.bad_records
        if name == "data":  # the sample whose caption was cut is bad too, saying so
            assert any(message.startswith(f"{path}:k6: 'txt' is cut short") for message in step.bad_records)
        with Stream(dict(paths=[str(path)], columns=columns, shuffle_buffer=0, bad_records="refuse"), big) as stream:
            with pytest.raises(BadRecord, match="breaks off here|cut short"):
                next(stream)
    with Stream(dict(paths=[whole], columns=columns, shuffle_buffer=0), big) as stream:
        assert next(stream).bad_records == []  # an archive with its end marker ends quietly


def test_a_shard_of_another_layout_is_refused_naming_it(tmp_path):
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", pairs(3))
    with pytest.raises(uform.InvalidArgument, match=r"^data.paths: .*pairs.jsonl: no tar archive \("):
        Stream(dict(paths=[jsonl], columns=PAIRS, format="tar"), CONFIG)
    whole = write_tar(tmp_path / "a.tar", [("k0", dict(jpg=JPEG, txt=b"zero"))])
    with pytest.raises(uform.InvalidArgument, match=r"^data.paths: .*a.tar: its first line is no JSON object"):
        Stream(dict(paths=[whole], columns=dict(jpg="image", txt="text"), format="jsonl"), CONFIG)
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    parquet = tmp_path / "pairs.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(pairs(50)), str(parquet))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(parquet.read_bytes()[:300])
    with pytest.raises(uform.InvalidArgument, match=r"^data.paths: .*cut.parquet: no Parquet file \("):
        Stream(dict(paths=[str(cut)], columns=PAIRS), CONFIG)
    with pytest.raises(uform.InvalidArgument, match=r"^data.paths: .*pairs.jsonl: no Parquet file \("):
        Stream(dict(paths=[jsonl], columns=PAIRS, format="parquet"), CONFIG)


def test_paths_given_with_dot_dot_are_shown_tidied(tmp_path):
    """Locations and a resumed stream's refusal show a path without its `..`, unless that is all that differs."""
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "a.jsonl", pairs(4))
    write_jsonl(tmp_path / "b.jsonl", pairs(4))
    spelled = str(tmp_path / "sub" / ".." / "a.jsonl")
    with Stream(dict(paths=[spelled], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
        step = next(stream)
    assert step.locations == [f"{tmp_path / 'a.jsonl'}:line {i + 1}" for i in range(4)]
    assert [location for location, _, _ in records(dict(paths=[spelled], columns=PAIRS))] == step.locations
    for other, then, now in ((str(tmp_path / "sub" / ".." / "b.jsonl"), tmp_path / "a.jsonl", tmp_path / "b.jsonl"),
                             (str(tmp_path / "a.jsonl"), spelled, tmp_path / "a.jsonl")):
        with pytest.raises(uform.InvalidArgument, match=re.escape(f"at shard 0: {str(then)!r} then, {str(now)!r} now")):
            Stream(dict(paths=[other], columns=PAIRS, shuffle_buffer=0), CONFIG, cursor=step.cursor)


def test_a_long_csv_field_is_read_as_a_long_jsonl_value_is(tmp_path):
    """Past the csv module's default limit of 128 KiB a field is still a record's, cut to a row as any long text."""
    path = tmp_path / "long.csv"
    path.write_text("question,answer\nq0,a0\nq1," + "x" * 200_000 + "\nq2,a2\n")
    big = dict(CONFIG, batch=dict(max_rows_per_device=64, max_columns_per_row=64))
    with Stream(dict(paths=[str(path)], columns=PAIRS, shuffle_buffer=0), big) as stream:
        step = next(stream)
    assert step.locations == [f"{path}:line {line}" for line in (2, 3, 4)] and not step.bad_records  # header: line 1
    assert [values["answer"] for _, values, _ in records(dict(paths=[str(path)], columns=PAIRS))][1] == "x" * 200_000


# ---------------------------------------------------------------------------------------------- #
#  The order: keyed on the seed, packed, shared among processes, resumed exactly                   #
# ---------------------------------------------------------------------------------------------- #


@pytest.fixture
def shards(tmp_path):
    """Three JSONL shards of 20, 15 and 25 pairs: 60 records, a few epochs in the steps below."""
    return [write_jsonl(tmp_path / f"part-{n}.jsonl", pairs(count, 100 * n)) for n, count in enumerate((20, 15, 25))]


def stream_of(shards, process_index=0, process_count=1, cursor=None, seed=11, shuffle_buffer=8, **data):
    dataset = dict(paths=shards, columns=PAIRS, shuffle_buffer=shuffle_buffer, **data)
    return Stream(dataset, dict(CONFIG, seed=seed), process_index, process_count, cursor)


def test_the_order_is_keyed_on_the_seed_and_every_epoch_holds_every_record_once(shards):
    with stream_of(shards) as first, stream_of(shards) as again, stream_of(shards, seed=12) as other:
        steps = take(first, 40)
        assert locations(steps) == locations(take(again, 40))
        assert locations(steps) != locations(take(other, 40))
    seen = [location for step in steps for location in step.locations]
    assert sorted(seen[:60]) == sorted(location for location, _, _ in records(dict(paths=shards, columns=PAIRS)))
    assert seen[:60] != sorted(seen[:60])
    assert steps[-1].cursor["epoch"] >= 1


def test_packing_fills_a_devices_rows_as_the_library_packs_them(shards):
    config = dict(CONFIG, batch=dict(max_rows_per_device=3, max_columns_per_row=40, max_segments_per_device=5))
    with Stream(dict(paths=shards, columns=PAIRS), config) as stream, \
            uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, config) as trainer:
        for step in take(stream, 6):  # ~27 bytes a pair: rows of 40 hold one pair and a half, segments cap at 2 pairs
            assert len(step.locations) == 2
            trainer.step(step.batch)
    with stream_of(shards, max_groups_per_step=1) as stream:
        assert [len(step.locations) for step in take(stream, 3)] == [1, 1, 1]


def test_a_bad_first_record_or_a_hidden_file_leaves_the_schema_to_the_records_after_it(tmp_path):
    """A first record that is no JSON object, or lacks a column, is a bad record, not a misspelt column; files a
    file manager leaves (`.DS_Store`) are no record at all."""
    rows = [json.dumps(row) for row in pairs(6)]
    path = tmp_path / "a.jsonl"
    path.write_text("[1, 2]\n" + json.dumps(dict(question="only a question")) + "\n" + "\n".join(rows) + "\n")
    with Stream(dict(paths=[str(path)], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
        step = next(stream)
    assert [message.split(": ")[0] for message in step.bad_records] == [f"{path}:line 1", f"{path}:line 2"]
    assert step.locations[0] == f"{path}:line 3"
    with pytest.raises(uform.InvalidArgument, match=r"a.jsonl's first records have no column 'answr' \(it has "
                                                    r"'question', 'answer'\)"):
        Stream(dict(paths=[str(path)], columns=dict(question="text", answr="text")), CONFIG)
    folder = tmp_path / "photos"
    folder.mkdir()
    for name, data in (("a.png", PNG), ("a.txt", b"a caption"), (".DS_Store", b"\0\1"), ("b.png", PNG),
                       ("b.txt", b"another")):
        (folder / name).write_bytes(data)
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "c.txt").write_text("a notebook's copy")
    assert [location for location, _, _ in records(dict(paths=[str(folder)], columns=dict(png="image", txt="text")))] \
        == [f"{folder}:a", f"{folder}:b"]


def test_a_csv_quote_never_closed_ends_the_shard_saying_so(tmp_path):
    """The csv module reads every line after a stray quote into one field, silently; the shard breaks off there,
    named, so the records read into it are not lost unsaid. A field that spans lines and closes is a record."""
    path = tmp_path / "stray.csv"
    path.write_text('question,answer\nq0,a0\n"q1 opens a quote,a1\n' + "".join(f"q{i},a{i}\n" for i in range(2, 50)))
    big = dict(CONFIG, batch=dict(max_rows_per_device=64, max_columns_per_row=64))
    with Stream(dict(paths=[str(path)], columns=PAIRS, shuffle_buffer=0), big) as stream:
        step = next(stream)
    assert step.locations == [f"{path}:line 2"]
    (bad,) = step.bad_records
    assert bad.startswith(f"{path}:line 3: the shard breaks off here (a quote opened in this record is never closed, "
                          "so the file's last 49 lines were read into it)"), bad
    path.write_text('question,answer\n"q0 spans\ntwo lines",a0\nq1,"a1 too\n"\n')
    assert [values for _, values, _ in records(dict(paths=[str(path)], columns=PAIRS))] == [
        dict(question="q0 spans\ntwo lines", answer="a0"), dict(question="q1", answer="a1 too\n")]


def test_a_record_too_big_for_a_step_leaves_the_batches_around_it_whole(tmp_path):
    """The batch before such a record is handed out whole; the record is bad; the next batch starts after it,
    holds nothing twice and keeps max_groups_per_step, and a stream resumed between them reads the same."""
    rows = [dict(pairs(1, i)[0], hard=[]) for i in range(10)]
    rows[3]["hard"] = [f"a long hard negative, number {n}, well over half a row" for n in range(20)]
    dataset = dict(paths=[write_jsonl(tmp_path / "big.jsonl", rows)], columns=PAIRS, negatives=dict(hard="text"),
                   shuffle_buffer=0, max_groups_per_step=3)
    config = dict(CONFIG, batch=dict(max_rows_per_device=8, max_columns_per_row=64))
    with Stream(dataset, config) as stream:
        steps = [next(stream) for _ in range(3)]
    lines = [[int(location.rsplit(" ", 1)[1]) for location in step.locations] for step in steps]
    assert lines == [[1, 2, 3], [5, 6, 7], [8, 9, 10]]
    assert [len(step.bad_records) for step in steps] == [0, 1, 0] and "line 4: its 22 items" in steps[1].bad_records[0]
    with Stream(dataset, config, cursor=steps[0].cursor) as resumed:
        assert [step.locations for step in (next(resumed), next(resumed))] == [steps[1].locations, steps[2].locations]


def test_a_resumed_stream_continues_exactly_mid_epoch_and_across_epochs(shards):
    with stream_of(shards) as whole:
        expected = take(whole, 30)
    for stop in (3, 11, 17):  # inside a block, at another, past an epoch's end
        with stream_of(shards, cursor=expected[stop - 1].cursor) as resumed:
            assert locations(take(resumed, 30 - stop)) == locations(expected[stop:])
    with pytest.raises(uform.InvalidArgument, match="data.shuffle_buffer: the stream being resumed read"):
        stream_of(shards, cursor=expected[0].cursor, shuffle_buffer=4)
    with pytest.raises(uform.InvalidArgument, match=r"data.paths: the stream being resumed read 3 shards, now 2, "
                                                    r"the first difference at shard 2: '.*' then, None now"):
        stream_of(shards[:2], cursor=expected[0].cursor)
    with pytest.raises(uform.InvalidArgument, match=r"^cursor: lacks shard, offset, skip, batch, seed, shuffle_buffer, "
                                                    r"shards; a StepBatch.cursor holds every one of epoch, shard, "):
        stream_of(shards, cursor={"epoch": 0})
    partial = {name: value for name, value in expected[0].cursor.items() if name != "seed"}
    with pytest.raises(uform.InvalidArgument, match=r"^cursor: lacks seed; "):
        stream_of(shards, cursor=partial)
    with pytest.raises(uform.InvalidArgument, match=r"^cursor.shard: 3 is past the last of the 3 shards"):
        stream_of(shards, cursor=dict(expected[0].cursor, shard=3))
    with pytest.raises(uform.InvalidArgument, match=r"^process_count: 0; "):
        stream_of(shards, 0, 0)


def test_processes_share_the_one_sequence_and_resume_onto_another_count(shards):
    with stream_of(shards) as alone:
        sequence = locations(take(alone, 24))  # one process: every device batch in turn
    with stream_of(shards, 0, 2) as first, stream_of(shards, 1, 2) as second:
        pairs_of_steps = list(zip(take(first, 6), take(second, 6)))
    assert [batch for a, b in pairs_of_steps for batch in (a.locations, b.locations)] == sequence[:12]
    cursor = pairs_of_steps[-1][0].cursor
    assert cursor == pairs_of_steps[-1][1].cursor  # every process answers the same cursor
    # Resumed onto three processes, then onto one: no batch repeats, none is skipped.
    streams = [stream_of(shards, index, 3, cursor) for index in range(3)]
    steps = [take(stream, 2) for stream in streams]
    for stream in streams:
        stream.close()
    assert [steps[index][step].locations for step in range(2) for index in range(3)] == sequence[12:18]
    with stream_of(shards, cursor=steps[0][-1].cursor) as alone:
        assert locations(take(alone, 6)) == sequence[18:24]


def test_an_error_in_the_thread_surfaces_at_the_next_batch(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs(3))
    with stream_of([path]) as stream:
        next(stream)
    header = tmp_path / "header.csv"  # its header names the columns, so it passes the check made before any read
    header.write_text("question,answer\n")
    with stream_of([str(header)]) as stream, pytest.raises(uform.InvalidArgument,
                                                            match=f"data.paths: {re.escape(str(header))} holds no records"):
        next(stream)
    empty = tmp_path / "empty.jsonl"  # no first record at all: refused before the stream starts, and a run its folder
    empty.write_text("\n")
    with pytest.raises(uform.InvalidArgument, match=f"data.paths: {re.escape(str(empty))} holds no records"):
        stream_of([str(empty)])


# ---------------------------------------------------------------------------------------------- #
#  A dataset with no usable record, tar files in directory order, what the library refuses         #
# ---------------------------------------------------------------------------------------------- #


def test_an_epoch_without_a_usable_batch_stops_the_stream_counting_its_bad_records(tmp_path):
    empty = write_jsonl(tmp_path / "empty-answers.jsonl", [dict(question=f"q{i}", answer=" ") for i in range(30)])
    with stream_of([empty]) as stream, pytest.raises(
            uform.InvalidArgument, match=r"data.paths: a whole epoch of .*empty-answers.jsonl made no usable batch: "
                                         r"30 bad records; the first: .*:line \d+: 'answer' is empty"):
        next(stream)
    # Records that pass the scan but whose files are missing: every batch is assembled empty.
    texts = write_jsonl(tmp_path / "texts.jsonl", pairs(30))
    dataset = dict(paths=[texts], columns=dict(question="image", answer="text"), shuffle_buffer=0)
    with Stream(dataset, CONFIG) as stream:
        with pytest.raises(uform.InvalidArgument, match=r"made no usable batch: 30 bad records; the first: "
                                                        r".*texts.jsonl:line 1: 'question' names no file \('question 0\?'\)"):
            for _ in range(40):
                assert next(stream).batch is None


def directory_ordered_tar(path, names):
    """A tar of `names` in the given order, under `./` as `tar cf SHARD -C FOLDER .` writes them."""
    with tarfile.open(path, "w") as archive:
        for name in names:
            data = JPEG if name.endswith(".jpg") else name.encode()
            member = tarfile.TarInfo(f"./{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return str(path)


def test_a_tar_whose_samples_are_split_apart_is_refused_suggesting_name_order(tmp_path):
    split = directory_ordered_tar(tmp_path / "split.tar", ["emu.jpg", "gnu.jpg", "cat.jpg", "gnu.txt", "cat.txt", "emu.txt"])
    columns = dict(jpg="image", txt="text")
    with pytest.raises(uform.InvalidArgument, match=r"split.tar: './gnu.txt' returns to sample 'gnu' after sample "
                                                    r"'cat'; .*tar --sort=name"):
        Stream(dict(paths=[split], columns=columns), CONFIG)
    ordered = directory_ordered_tar(tmp_path / "ordered.tar", ["cat.jpg", "cat.txt", "emu.jpg", "emu.txt"])
    assert [location for location, _, _ in records(dict(paths=[ordered], columns=columns))] == [
        f"{ordered}:cat", f"{ordered}:emu"]  # no `./` in a key


def test_an_item_the_library_refuses_is_mapped_back_to_its_record_and_left_out(tmp_path):
    from test_media import png_bytes

    rng = np.random.default_rng(0)
    rows = []
    for i in range(5):
        png = png_bytes(rng.integers(0, 256, (20, 30, 3)).astype(np.uint8))
        (tmp_path / f"{i}.png").write_bytes(png if i != 3 else png[:8] + bytes(40))  # a signature, then garbage
        rows.append(dict(image=f"{i}.png", caption=f"picture {i}"))
    path = write_jsonl(tmp_path / "captions.jsonl", rows)
    config = dict(CONFIG, batch=dict(max_rows_per_device=16, max_columns_per_row=64))
    dataset = dict(paths=[path], columns=dict(caption="text", image="image"), shuffle_buffer=0)
    with Stream(dataset, config) as stream, uform.Executor.for_ram(threads=1) as cpu, \
            uform.Trainer.init_ram(cpu, config) as trainer:
        step = next(stream)
        assert len(step.locations) == 5
        with pytest.raises(uform.InvalidArgument, match=r"^batch.contents\[7\]: not a readable PNG") as refused:
            trainer.step(step.batch)
        retried = stream.without_refused(step, refused.value)
        assert retried.locations == [f"{path}:line {i}" for i in (1, 2, 3, 5)]
        assert retried.bad_records == [f"{path}:line 4: 'image': {str(refused.value)[len('batch.contents[7]: '):]}"]
        assert trainer.step(retried.batch).stats.items == 8
        assert stream.without_refused(retried, uform.InvalidArgument("batch.relations: 9 edges exceed ...")) is None
    with Stream(dict(dataset, bad_records="refuse"), config) as stream:
        with pytest.raises(BadRecord, match=rf"^{re.escape(path)}:line 4: 'image': not a readable PNG"):
            stream.without_refused(next(stream), refused.value)


def test_a_stream_decoding_ahead_decodes_every_batch_and_drops_a_bad_picture_before_its_step(tmp_path):
    import zlib
    import struct

    def png(seed):
        pixels = np.random.default_rng(seed).integers(0, 255, (16, 16, 3), np.uint8)
        raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

        def chunk(kind, body):
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        header = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")

    folder = tmp_path / "pictures"
    folder.mkdir()
    rows = []
    for k in range(12):
        picture = png(k) if k != 5 else png(k)[:60]  # signature right, the rest cut: only the decoder finds out
        (folder / f"{k:02d}.png").write_bytes(picture)
        rows.append(dict(caption=f"picture number {k}", picture=str(folder / f"{k:02d}.png")))
    table = write_jsonl(tmp_path / "pictures.jsonl", rows)
    config = dict(CONFIG, batch=dict(CONFIG["batch"], image=dict(patch_side=8)))
    dataset = dict(paths=[table], columns=dict(caption="text", picture="image"), shuffle_buffer=1)
    with uform.Executor.for_ram(threads=1) as executor, uform.Trainer.init_ram(executor, config) as trainer, \
            Stream(dataset, config) as stream:
        stream.decode_ahead(trainer.decode)
        steps = take(stream, 3)
        assert all(step.decoded and isinstance(step.batch, uform.Decoded) for step in steps if step.batch is not None)
        bad = [record for step in steps for record in step.bad_records]
        assert bad == [f"{table}:line 6: 'picture': not a readable PNG image: the file ends early"]
        assert all(np.isfinite(trainer.step(step.batch).stats.loss) for step in steps if step.batch is not None)


def test_a_bad_media_record_says_what_its_bytes_are_when_they_are_another_kind(tmp_path):
    wav = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(32)
    tar = write_tar(tmp_path / "mixed.tar", [("k0", dict(jpg=JPEG, txt=b"zero")), ("k1", dict(jpg=wav, txt=b"one")),
                                             ("k2", dict(jpg=b"<html>", txt=b"two"))])
    big = dict(CONFIG, batch=dict(max_rows_per_device=64, max_columns_per_row=64))
    with Stream(dict(paths=[tar], columns=dict(jpg="image", txt="text"), shuffle_buffer=0), big) as stream:
        bad = next(stream).bad_records
    assert bad == [f"{tar}:k1: 'jpg': declared image, but {len(wav)} bytes that are no image file (the bytes are audio)",
                   f"{tar}:k2: 'jpg': declared image, but 6 bytes that are no image file (they begin b'<html>')"]


def test_a_null_value_is_said_to_be_null_not_missing(tmp_path):
    rows = [dict(question="q", answer="a", hard=["h"], score=1), dict(question="q", answer=None, hard=["h"], score=1),
            dict(question="q", hard=["h"], score=1), dict(question="q", answer="a", hard=["h", None], score=1),
            dict(question="q", answer="a", hard=None, score=1), dict(question="q", answer="a", hard=["h"], score=None)]
    path = write_jsonl(tmp_path / "nulls.jsonl", rows)
    dataset = dict(paths=[path], columns=PAIRS, negatives=dict(hard="text"), weight="score", shuffle_buffer=0)
    with Stream(dataset, CONFIG) as stream:
        bad = next(stream).bad_records
    assert bad == [f"{path}:line 2: 'answer' is null", f"{path}:line 3: no 'answer'", f"{path}:line 4: 'hard' holds a null",
                   f"{path}:line 6: 'score' is null"]
    rows = [dict(question="q0", answer="a0", hard=["h"]), dict(question="q1", answer="a1"),
            dict(question="q2", answer="a2", hard=None), dict(question="q3", answer="a3", hard=[])]
    csv = tmp_path / "hard.csv"  # hard negatives are optional record by record: absent, null, empty, none
    csv.write_text("question,answer,hard\nq0,a0,h\nq1,a1,\n")
    for shard in (write_jsonl(tmp_path / "optional.jsonl", rows), str(csv)):
        with Stream(dict(paths=[shard], columns=PAIRS, negatives=dict(hard="text"), shuffle_buffer=0), CONFIG) as stream:
            step = next(stream)
        assert not step.bad_records and [len(group.items) for group in step.groups] == [3] + [2] * (len(step.groups) - 1)
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    table = str(tmp_path / "nulls.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([dict(question="q", answer="a"), dict(question="q", answer=None)]),
                                table)
    csv = tmp_path / "short.csv"
    csv.write_text("question,answer\nq,a\nq\n")
    for shard, message in ((table, f"{table}:row 1 (the 2nd): 'answer' is null"), (str(csv), f"{csv}:line 3: no 'answer'")):
        with Stream(dict(paths=[shard], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
            assert next(stream).bad_records == [message]


def test_a_value_that_is_not_text_is_named_with_what_it_holds(tmp_path):
    path = write_jsonl(tmp_path / "typed.jsonl", [dict(question="q", answer="a"), dict(question=5, answer="a"),
                                                  dict(question="q", answer=["a", "b"])])
    with Stream(dict(paths=[path], columns=PAIRS, shuffle_buffer=0), CONFIG) as stream:
        bad = next(stream).bad_records
    assert f"{path}:line 2: 'question' holds int 5, not text" in bad, bad
    assert f"{path}:line 3: 'answer' holds list ['a', 'b'], not text" in bad, bad
