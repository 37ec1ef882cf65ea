"""The built-in tasks: arithmetic (generated) and file (JSONL/Parquet)."""

from __future__ import annotations

import json
import sys

import pytest

from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.registry.plugins import build_registry
from forgerl_plugins.tasks.arithmetic import ArithmeticTask
from forgerl_plugins.tasks.file import FileTask


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def arith(seed=0, **kw):
    return ArithmeticTask(ArithmeticTask.Options(**kw), seed=seed)


def key(p):
    return (p.metadata["a"], p.metadata["op"], p.metadata["b"])


# ------------------------------------------------------------------ arithmetic


def test_arithmetic_prompt_is_a_chat_with_the_tag_and_an_integer_answer(registry):
    task = registry.require("task", "arithmetic").build({"tag": "final"}, seed=3)
    (p,) = task.next_problems(1)
    a, op, b = key(p)
    assert p.prompt == [
        {
            "role": "user",
            "content": f"What is {a} {op} {b}? "
            "Think briefly, then give the final answer inside <final></final>.",
        }
    ]
    assert p.answer == str(a + b), p
    assert 1 <= a <= 20 and 1 <= b <= 20 and op == "+"


def test_arithmetic_answers_are_right_for_every_operation():
    task = arith(operations=["+", "-", "*"], min_value=0, max_value=99)
    problems = task.next_problems(300)
    assert {p.metadata["op"] for p in problems} == {"+", "-", "*"}
    for p in problems:
        a, op, b = key(p)
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert p.answer == str(expected), p
        assert 0 <= a <= 99 and 0 <= b <= 99
        if op == "-":
            assert a >= b, f"negative result without allow_negative: {p}"


def test_arithmetic_stream_is_deterministic_and_seed_dependent():
    first = [key(p) for p in arith(seed=1).next_problems(50)]
    again = [key(p) for p in arith(seed=1).next_problems(50)]
    other = [key(p) for p in arith(seed=2).next_problems(50)]
    assert first == again
    assert first != other


def test_arithmetic_resume_continues_with_the_same_problems():
    task = arith(seed=5)
    task.next_problems(7)
    state = json.loads(json.dumps(task.state_dict()))  # must survive a JSON checkpoint
    expected = task.next_problems(10)

    resumed = arith(seed=5)
    resumed.load_state_dict(state)
    got = resumed.next_problems(10)
    assert [(p.id, key(p)) for p in got] == [(p.id, key(p)) for p in expected]
    # Calling in different chunk sizes gives the same stream.
    chunked = arith(seed=5)
    stream = [p.id for _ in range(17) for p in chunked.next_problems(1)]
    assert stream == [p.id for p in arith(seed=5).next_problems(17)]


def test_arithmetic_refuses_a_state_from_another_seed():
    state = arith(seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed 1"):
        arith(seed=2).load_state_dict(state)


def test_arithmetic_eval_split_is_fixed_distinct_and_never_trained_on():
    a, b = arith(seed=0), arith(seed=123)
    eval_a = [(p.id, key(p)) for p in a.eval_problems()]
    assert eval_a == [(p.id, key(p)) for p in b.eval_problems()], "eval split must not depend on the run seed"
    assert eval_a == [(p.id, key(p)) for p in a.eval_problems()]
    assert len(eval_a) == 64 and len({k for _, k in eval_a}) == 64
    held = {k for _, k in eval_a}
    # 1..20 with + has 400 problems; 64 held out, so 6000 draws would hit them often if allowed.
    trained = {key(p) for p in a.next_problems(6000)}
    assert not trained & held, f"held-out problems in training: {sorted(trained & held)[:5]}"
    assert len(trained) == 400 - 64


def test_arithmetic_too_small_a_space_for_the_eval_split_is_a_config_error():
    with pytest.raises(ConfigError, match="only 9 distinct problems"):
        arith(min_value=1, max_value=3)
    assert len(arith(min_value=1, max_value=3, eval_size=4).eval_problems()) == 4


def test_arithmetic_options_are_validated(registry):
    backend = registry.get("task", "arithmetic")
    with pytest.raises(Exception, match="unknown operations"):
        backend.validate_options({"operations": ["/"]})
    with pytest.raises(Exception, match="must not exceed"):
        backend.validate_options({"min_value": 9, "max_value": 3})


# ------------------------------------------------------------------------ file


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n):
    return [{"prompt": f"q{i}", "answer": i, "level": i % 3} for i in range(n)]


def file_task(path, seed=0, **kw):
    return FileTask(FileTask.Options(path=str(path), **kw), seed=seed)


def test_file_rows_become_problems_with_chat_prompts_and_metadata(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "id": "a1", "level": "easy"},
            {
                "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
                "answer": "2",
            },
        ],
    )
    task = file_task(path, eval_fraction=0, system_prompt="You are a calculator.")
    by_answer = {p.answer: p for p in task.next_problems(2)}
    p4 = by_answer["4"]
    assert p4.id == "a1"
    assert p4.prompt == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert dict(p4.metadata) == {"level": "easy"}
    p2 = by_answer["2"]
    assert p2.id == "d.jsonl:1"
    assert p2.prompt[0] == {"role": "system", "content": "Be brief."}, "an existing system message is kept"
    assert len(p2.prompt) == 2


def test_file_epochs_cover_every_row_in_a_seeded_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    task = file_task(path, seed=1, eval_fraction=0)
    epoch0 = [p.answer for p in task.next_problems(10)]
    epoch1 = [p.answer for p in task.next_problems(10)]
    assert sorted(epoch0, key=int) == [str(i) for i in range(10)]
    assert sorted(epoch1, key=int) == [str(i) for i in range(10)]
    assert epoch0 != epoch1, "each epoch is reshuffled"
    assert epoch0 != [str(i) for i in range(10)], "the order is shuffled"
    assert epoch0 == [p.answer for p in file_task(path, seed=1, eval_fraction=0).next_problems(10)]
    assert epoch0 != [p.answer for p in file_task(path, seed=2, eval_fraction=0).next_problems(10)]


def test_file_resume_across_an_epoch_boundary(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(7))
    task = file_task(path, seed=3, eval_fraction=0)
    task.next_problems(12)
    state = json.loads(json.dumps(task.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 5, state
    expected = [p.id for p in task.next_problems(9)]
    resumed = file_task(path, seed=3, eval_fraction=0)
    resumed.load_state_dict(state)
    assert [p.id for p in resumed.next_problems(9)] == expected


def test_file_resume_refuses_a_changed_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(7))
    state = file_task(path, eval_fraction=0).state_dict()
    write_jsonl(path, rows(9))
    with pytest.raises(ConfigError, match="file changed"):
        file_task(path, eval_fraction=0).load_state_dict(state)


def test_file_eval_fraction_is_deterministic_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, b = file_task(path, seed=0, eval_fraction=0.2), file_task(path, seed=9, eval_fraction=0.2)
    held = [p.id for p in a.eval_problems()]
    assert held == [p.id for p in b.eval_problems()], "held-out rows must not depend on the run seed"
    assert len(held) == 10 and a.train_size == 40
    trained = {p.id for p in a.next_problems(80)}
    assert len(trained) == 40 and not trained & set(held)


def test_file_eval_path_is_used_whole(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(5))
    held = write_jsonl(tmp_path / "eval.jsonl", rows(3))
    task = file_task(train, eval_path=str(held))
    assert [p.id for p in task.eval_problems()] == ["eval.jsonl:0", "eval.jsonl:1", "eval.jsonl:2"]
    assert task.train_size == 5


def test_file_user_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        file_task(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: not valid JSON"):
        file_task(bad)
    lst = write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ConfigError, match=r"list\.jsonl:1: expected a JSON object"):
        file_task(lst)
    no_answer = write_jsonl(tmp_path / "na.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    with pytest.raises(ConfigError, match=r"row 2: no field 'answer'"):
        file_task(no_answer)
    assert file_task(no_answer, answer_field=None, eval_fraction=0).next_problems(1)[0].answer == ""
    no_prompt = write_jsonl(tmp_path / "np.jsonl", [{"question": "a", "answer": 1}])
    with pytest.raises(ConfigError, match=r"no field 'prompt' \(fields: question, answer\)"):
        file_task(no_prompt)
    assert file_task(no_prompt, prompt_field="question", eval_fraction=0).next_problems(1)[0].prompt[-1] == {
        "role": "user",
        "content": "a",
    }
    bad_chat = write_jsonl(tmp_path / "bc.jsonl", [{"prompt": [{"role": "user"}], "answer": 1}])
    with pytest.raises(ConfigError, match="list of"):
        file_task(bad_chat)
    one = write_jsonl(tmp_path / "one.jsonl", rows(1))
    with pytest.raises(ConfigError, match="too few"):
        file_task(one, eval_fraction=0.5)


def test_file_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]],
            "answer": ["2", "4"],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    task = file_task(tmp_path / "d.parquet", eval_fraction=0)
    got = {p.answer: p.prompt for p in task.next_problems(2)}
    assert got == {"2": [{"role": "user", "content": "1+1?"}], "4": [{"role": "user", "content": "2+2?"}]}


def test_file_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(BackendUnavailable, match=r"pip install 'forgerl\[parquet\]'"):
        file_task(tmp_path / "d.parquet")
