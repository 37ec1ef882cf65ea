
import pytest

from forgerl.types import Problem, RewardInput
from forgerl_countdown.game import CountdownReward, CountdownTask, evaluate


def problem(numbers, target):
    return Problem(id="p", prompt="", answer=str(target), metadata={"numbers": tuple(numbers)})


def score(text, numbers=(3, 7, 25), target=46):
    reward = CountdownReward(CountdownReward.Options())
    return reward.score(RewardInput(problem(numbers, target), text))


def test_right_expression_scores_one():
    assert score("<answer>25 + 3*7</answer>").value == 1.0


def test_wrong_value_gets_only_format_credit():
    r = score("<answer>25 + 3 + 7</answer>")
    assert r.value == pytest.approx(0.1) and r.components["correct"] == 0.0


def test_reusing_a_number_is_wrong():
    assert score("<answer>25 + 7 + 7 + 7</answer>", target=46).components["correct"] == 0.0


def test_no_code_execution():
    assert score("<answer>__import__('os').getcwd()</answer>").value == 0.0
    with pytest.raises(ValueError):
        evaluate("(lambda: 1)()")


def test_task_is_deterministic_and_resumable():
    a = CountdownTask(CountdownTask.Options(), seed=3)
    first = a.next_problems(4)
    state = a.state_dict()
    after = a.next_problems(2)
    b = CountdownTask(CountdownTask.Options(), seed=3)
    b.load_state_dict(state)
    assert [p.prompt for p in b.next_problems(2)] == [p.prompt for p in after]
    assert [p.prompt for p in CountdownTask(CountdownTask.Options(), seed=3).next_problems(4)] == [
        p.prompt for p in first
    ]


def test_eval_split_is_fixed_and_disjoint_from_training():
    t1, t2 = CountdownTask(CountdownTask.Options(), seed=1), CountdownTask(CountdownTask.Options(), seed=2)
    assert [p.answer for p in t1.eval_problems()] == [p.answer for p in t2.eval_problems()]
    keys = {(p.metadata["numbers"], p.answer) for p in t1.eval_problems()}
    assert not any((p.metadata["numbers"], p.answer) in keys for p in t1.next_problems(200))
