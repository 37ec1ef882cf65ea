"""A teacher whose tokenizer is not the student's is refused before launch, in one line
with exit status 2: the comparison is of vocabularies and special tokens, not of names."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from forgerl.distill.tokenizers import tokenizer_difference

RUN = ["run", "--model", "tiny", "--generator", "hf", "--reward", "format", "--steps", "1", "--quiet",
       "--set", "objective=distill", "--set", "distill.teacher.options.model=tiny"]


def forge(argv: list[str]) -> tuple[int, str]:
    from forgerl.cli import main

    err = io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    return (code if isinstance(code, int) else 1), err.getvalue()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Named models are built here (a run builds them before launch to compare tokenizers)."""
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(cache: Path, tmp_path: Path):
    out = tmp_path / "run"
    code, err = forge([*RUN, "--set", "distill.teacher.options.model_options.vocab_size=600", "--output", str(out)])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("forge: error: distill.teacher:"), lines[0]
    assert "tokenizer" in lines[0] and "vocabularies of 512 and 600 tokens" in lines[0], lines[0]
    assert not out.exists(), "nothing of the run was created"


def test_a_teacher_of_the_same_family_passes_the_check(cache: Path, tmp_path: Path):
    # Other weights (seed) and width, one tokenizer: what distillation is for.
    code, err = forge([*RUN, "--set", "distill.teacher.options.model_options.seed=1",
                       "--set", "distill.teacher.options.model_options.hidden_size=128", "--dry-run"])
    assert code == 0, err


def test_an_unknown_teacher_model_is_one_line_too(cache: Path):
    code, err = forge([*RUN[:-1], "distill.teacher.options.model=./no-such-folder", "--dry-run"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no-such-folder" in err, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    return build_tiny_model(TinyModel.Options(), cache_dir=tmp_path_factory.mktemp("models"))


def edited_copy(tiny: Path, where: Path, edit) -> Path:
    """A copy of the tiny model's folder with its tokenizer files edited (as saved by
    transformers: tokenizer.json and tokenizer_config.json)."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny, where)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    edit(tokenizer)
    tokenizer.save_pretrained(where)
    return where


def test_the_same_tokenizer_saved_again_is_the_same(tiny: Path, tmp_path: Path):
    assert tokenizer_difference(tiny, tiny) is None
    resaved = edited_copy(tiny, tmp_path / "resaved", lambda t: setattr(t, "chat_template", "{{ messages }}"))
    assert tokenizer_difference(tiny, resaved) is None, "a chat template is not the tokenizer"


def test_another_end_of_sequence_token_differs(tiny: Path, tmp_path: Path):
    other = edited_copy(tiny, tmp_path / "eos", lambda t: setattr(t, "eos_token", "<|endoftext|>"))
    assert "eos_token" in (tokenizer_difference(tiny, other) or "")


def test_an_added_token_differs(tiny: Path, tmp_path: Path):
    other = edited_copy(tiny, tmp_path / "added", lambda t: t.add_special_tokens({"additional_special_tokens": ["<tool>"]}))
    difference = tokenizer_difference(tiny, other) or ""
    assert "only in the teacher's" in difference and "<tool>" in difference, difference


def test_same_tokens_under_other_ids_differ(tiny: Path, tmp_path: Path):
    other = tmp_path / "swapped"
    shutil.copytree(tiny, other)
    data = json.loads((tiny / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    difference = tokenizer_difference(tiny, other) or ""
    assert "2 shared tokens have other ids" in difference, difference
