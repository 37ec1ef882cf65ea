"""The ``dataset`` task: files (JSONL, Parquet, CSV), save_to_disk folders, column mapping,
prompt template, chat template and BOS, held-out splits, one-line errors, streaming resume.
Every dataset is built on disk by the test."""

from __future__ import annotations

import csv
import json

import pytest
from pydantic import ValidationError

from forgerl.errors import ConfigError
from forgerl_plugins.tasks.dataset import DatasetTask, shuffle_buffered

ROWS = [
    {"question": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3, "idx": f"q{i}"}
    for i in range(20)
]


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path, rows=ROWS):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(path, rows=ROWS):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def task(seed=0, **options):
    options.setdefault("columns", {"prompt": "question", "answer": "solution"})
    return DatasetTask(DatasetTask.Options.model_validate(options), seed=seed)


@pytest.mark.parametrize(
    "writer, name", [(write_jsonl, "p.jsonl"), (write_csv, "p.csv"), (write_parquet, "p.parquet")]
)
def test_each_file_format_gives_the_same_problems(tmp_path, writer, name):
    t = task(
        path=str(writer(tmp_path / name)), columns={"prompt": "question", "answer": "solution", "id": "idx"}
    )
    problems = sorted(t.next_problems(20), key=lambda p: int(p.id[1:]))
    assert [p.id for p in problems] == [f"q{i}" for i in range(20)]
    assert problems[3].prompt == [{"role": "user", "content": "What is 3 + 3?"}]
    assert problems[3].answer == "6"
    assert set(problems[3].metadata) == {"level"}
    assert t.eval_problems() == []


def test_template_system_prompt_and_metadata_columns(tmp_path):
    t = task(path=str(write_jsonl(tmp_path / "p.jsonl")), prompt_template="Level {level}. {prompt} Answer in <answer></answer>.",
             system_prompt="Be brief.", columns={"prompt": "question", "answer": "solution", "metadata": ["idx"]})  # fmt: skip
    p = next(p for p in t.next_problems(20) if p.answer == "4")
    assert p.prompt == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Level 2. What is 2 + 2? Answer in <answer></answer>."}]  # fmt: skip
    assert p.metadata == {"idx": "q2"}


def test_without_the_chat_template_the_prompt_is_plain_text(tmp_path):
    t = task(
        path=str(write_jsonl(tmp_path / "p.jsonl")), chat_template=False, prompt_template="Q: {prompt}\nA:"
    )
    assert all(isinstance(p.prompt, str) and p.prompt.startswith("Q: What is") for p in t.next_problems(5))
    with pytest.raises(ValidationError, match="needs chat_template: true"):
        task(path="x.jsonl", chat_template=False, system_prompt="hi")


def test_a_prompt_that_starts_with_a_bos_token_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl")
    with pytest.raises(ConfigError, match="beginning-of-sequence"):
        task(path=str(path), chat_template=False, prompt_template="<s>{prompt}")
    with pytest.raises(ConfigError, match="row 1: the prompt starts with '<|begin_of_text|>'"):
        task(
            path=str(
                write_jsonl(tmp_path / "b.jsonl", [{"question": "<|begin_of_text|>hi", "solution": "1"}] * 3)
            )
        )


def test_messages_column(tmp_path):
    rows = [
        {"chat": [{"role": "system", "content": "S"}, {"role": "user", "content": f"u{i}"}], "answer": i}
        for i in range(4)
    ]
    t = task(
        path=str(write_jsonl(tmp_path / "c.jsonl", rows)),
        columns={"messages": "chat"},
        system_prompt="ignored",
    )
    p = t.next_problems(4)[0]
    assert p.prompt[0] == {"role": "system", "content": "S"} and p.prompt[1]["role"] == "user"
    with pytest.raises(ValidationError, match="not both"):
        task(path="c.jsonl", columns={"messages": "chat", "prompt": "q"})


def test_wrong_columns_and_types_are_one_line_naming_what_exists(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl"))
    with pytest.raises(ConfigError) as err:
        task(path=path, columns={"prompt": "problem", "answer": "solution"})
    assert str(err.value) == (
        f"{path} row 1: no column 'problem' (columns.prompt); columns: question, solution, level, idx"
    )
    with pytest.raises(ConfigError, match="no column 'nope' \\(prompt_template\\)"):
        task(path=path, prompt_template="{nope} {prompt}")
    with pytest.raises(ConfigError, match="column 'question' is a int, not text"):
        task(path=str(write_jsonl(tmp_path / "n.jsonl", [{"question": 3, "solution": "1"}])))
    with pytest.raises(ConfigError, match="column 'solution' is empty \\(null\\)"):
        task(path=str(write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "solution": None}])))
    with pytest.raises(ConfigError, match="a file, which has no splits"):
        task(path=path, split="test")
    with pytest.raises(ConfigError, match="does not exist"):
        task(path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=":2: not valid JSON"):
        task(path=str(tmp_path / "bad.jsonl"), columns={})
    with pytest.raises(ValidationError, match="is not a column name"):
        task(path=path, prompt_template="{prompt.__class__}")
    with pytest.raises(ValidationError, match="exactly one of path"):
        task()


def test_held_out_by_fraction_file_and_split(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl"))
    a, b = task(path=path, eval_fraction=0.25, seed=1), task(path=path, eval_fraction=0.25, seed=7)
    assert [p.id for p in a.eval_problems()] == [
        p.id for p in b.eval_problems()
    ]  # eval_seed, not the run seed
    assert len(a.eval_problems()) == 5 and a.train_size == 15
    assert not {p.prompt[0]["content"] for p in a.eval_problems()} & {
        p.prompt[0]["content"] for p in a.next_problems(15)
    }
    other = task(path=path, eval_fraction=0.25, eval_seed=3)
    assert [p.id for p in other.eval_problems()] != [p.id for p in a.eval_problems()]
    held = task(path=path, eval_path=str(write_csv(tmp_path / "h.csv", ROWS[:3])))
    assert held.train_size == 20 and [p.answer for p in held.eval_problems()] == ["0", "2", "4"]
    with pytest.raises(ValidationError, match="one way, not eval_path and eval_fraction"):
        task(path=path, eval_path=path, eval_fraction=0.1)


def test_save_to_disk_folder_with_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:16]),
                          "test": datasets.Dataset.from_list(ROWS[16:])}).save_to_disk(str(folder))  # fmt: skip
    t = task(path=str(folder), eval_split="test")
    assert t.train_size == 16 and sorted(p.answer for p in t.eval_problems()) == ["32", "34", "36", "38"]
    with pytest.raises(ConfigError, match="has no split 'validation'; splits: train, test"):
        task(path=str(folder), eval_split="validation")
    streamed = task(path=str(folder), split="test", streaming=True)
    assert [p.answer for p in streamed.next_problems(5)] == ["32", "34", "36", "38", "32"]


def test_epochs_and_exact_resume_in_memory(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl"))
    full = task(path=path, seed=4)
    straight = [p.id for p in full.next_problems(50)]
    first = task(path=path, seed=4)
    head = [p.id for p in first.next_problems(23)]
    resumed = task(path=path, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [p.id for p in resumed.next_problems(27)] == straight
    assert sorted(straight[:20]) == sorted(straight[20:40])  # each epoch visits every row once
    with pytest.raises(ConfigError, match="seed 4, this run uses seed 5"):
        task(path=path, seed=5).load_state_dict(first.state_dict())


@pytest.mark.parametrize("buffer", [0, 7])
def test_streaming_resumes_at_the_same_row(tmp_path, buffer):
    path = str(write_parquet(tmp_path / "p.parquet"))
    opts = {
        "path": path,
        "streaming": True,
        "shuffle_buffer": buffer,
        "columns": {"prompt": "question", "answer": "solution", "id": "idx"},
    }
    straight = [p.id for p in task(seed=2, **opts).next_problems(50)]
    assert sorted(straight[:20]) == sorted(f"q{i}" for i in range(20))
    assert (straight[:20] == [f"q{i}" for i in range(20)]) == (buffer == 0)
    if buffer:
        assert straight[:20] != straight[20:40], "each epoch has its own order"
    for cut in (1, 19, 20, 33):
        first = task(seed=2, **opts)
        head = [p.id for p in first.next_problems(cut)]
        resumed = task(seed=2, **opts)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [p.id for p in resumed.next_problems(50 - cut)] == straight, cut
    with pytest.raises(ConfigError, match="streaming: true; resume with the same setting"):
        task(seed=2, path=path, columns=opts["columns"]).load_state_dict(first.state_dict())


def test_streaming_groups_stay_whole(tmp_path):
    """Each call gives distinct problems in one piece: the loop makes a group of each, so a
    group never mixes two rows (the TRL streaming bug mixed rows into groups, #3213)."""
    path = str(write_jsonl(tmp_path / "p.jsonl"))
    t = task(path=path, streaming=True, columns={"prompt": "question", "answer": "solution", "id": "idx"})
    batches = [t.next_problems(6) for _ in range(6)]
    flat = [p for b in batches for p in b]
    assert all(p.answer == str(2 * int(p.id[1:])) for p in flat), "a prompt and its answer come from one row"
    assert [p.id for p in flat] == [f"q{i % 20}" for i in range(36)]


def test_shuffle_buffer_is_a_permutation_fixed_by_its_seed():
    import random

    a = list(shuffle_buffered(iter(range(100)), 10, random.Random("s")))
    assert sorted(a) == list(range(100)) and a != list(range(100))
    assert a == list(shuffle_buffered(iter(range(100)), 10, random.Random("s")))


def test_a_dataset_by_name_from_the_local_cache_and_never_the_network(tmp_path, monkeypatch):
    """The cache is laid out as ``datasets`` leaves it after a load with network access
    (``<owner>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow``): the test prepares
    a folder of data files into a cache of its own, then files it under the name."""
    import shutil

    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    src = tmp_path / "sums"
    src.mkdir()
    write_jsonl(src / "train.jsonl", ROWS[:8])
    write_jsonl(src / "test.jsonl", ROWS[8:10])
    folder = task(path=str(src), eval_split="test")  # a folder of data files, read by datasets
    assert folder.train_size == 8 and [p.answer for p in folder.eval_problems()] == ["16", "18"]
    datasets.load_dataset(str(src), cache_dir=str(cache))
    (prepared,) = (cache / "sums" / "default" / "0.0.0").glob("*/dataset_info.json")
    filed = cache / "acme___sums" / "default" / "0.0.0" / prepared.parent.name
    shutil.copytree(prepared.parent, filed)
    t = task(name="acme/sums", eval_split="test")
    assert t.train_size == 8 and [p.answer for p in t.eval_problems()] == ["16", "18"]
    assert t.eval_problems()[0].id == "acme/sums:test:0"
    with pytest.raises(ConfigError, match="has no split 'validation'; splits: "):
        task(name="acme/sums", split="validation")
    with pytest.raises(
        ConfigError, match="'acme/nope' is not readable from the local Hugging Face cache .* never downloads"
    ):
        task(name="acme/nope")


def test_hostile_csv(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text('question,solution\n"What?",1,extra\n')
    with pytest.raises(ConfigError, match="x.csv:2: 3 fields, the header names 2"):
        task(path=str(path))
    path.write_text("question,solution\nq\n")
    with pytest.raises(ConfigError, match="column 'solution' is empty \\(null\\), not text"):
        task(path=str(path))
    path.write_bytes(b"question,solution\n\xff\xfe,1\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        task(path=str(path))


def test_options_mean_the_same_after_travelling_as_a_dump(tmp_path):
    """A run's trainer gets the options re-validated from a dump, where every field is set:
    a default split must still read a file, and a messages column must not meet a prompt one."""
    path = str(write_jsonl(tmp_path / "p.jsonl"))
    for options in ({"path": path, "columns": {"prompt": "question", "answer": "solution"}},
                    {"path": path, "columns": {"messages": "chat", "answer": "solution"}}):  # fmt: skip
        validated = DatasetTask.Options.model_validate(options)
        assert DatasetTask.Options.model_validate(validated.model_dump()) == validated
    travelled = DatasetTask.Options.model_validate(
        DatasetTask.Options.model_validate(
            {"path": path, "columns": {"prompt": "question", "answer": "solution"}}
        ).model_dump()
    )
    assert DatasetTask(travelled).train_size == 20


def test_an_images_column_puts_image_parts_before_the_text(tmp_path):
    rows = [{"question": f"q{i}", "solution": "s", "pic": ["a.png", "data:image/png;base64,AAAA"] if i else "a.png"}
            for i in range(2)]  # fmt: skip
    t = task(path=str(write_jsonl(tmp_path / "i.jsonl", rows)),
             columns={"prompt": "question", "answer": "solution", "images": "pic"})  # fmt: skip
    by_id = {p.id: p for p in t.next_problems(2)}
    [one] = [p for p in by_id.values() if p.prompt[-1]["content"][-1]["text"] == "q0"]
    [two] = [p for p in by_id.values() if p.prompt[-1]["content"][-1]["text"] == "q1"]
    assert one.prompt[-1]["content"][0] == {"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}}
    assert [p["image_url"]["url"] for p in two.prompt[-1]["content"][:2]] == [str(tmp_path / "a.png"),
                                                                             "data:image/png;base64,AAAA"]
    assert "pic" not in one.metadata, "the images column is mapped, not metadata"
    bad = [{"question": "q", "solution": "s", "pic": 7}]
    with pytest.raises(ConfigError, match="column 'pic' must hold an image reference"):
        task(path=str(write_jsonl(tmp_path / "b.jsonl", bad)),
             columns={"prompt": "question", "answer": "solution", "images": "pic"}).next_problems(1)
    parts = [{"chat": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "answer": 1}]
    with pytest.raises(ConfigError, match="unknown content part type 'input_audio'"):
        task(path=str(write_jsonl(tmp_path / "m.jsonl", parts)), columns={"messages": "chat"}).next_problems(1)
