"""Before launch: the teacher scores the student's token ids, so both must share one
tokenizer. Two tokenizers are the same here when every token maps to the same id (the
vocabulary, added tokens included) and the special tokens agree (the same tokens flagged
special, and the same beginning, end and unknown tokens: an end-of-sequence the teacher
does not know as one would be scored as an unlikely token). Names are not compared: two
folders of one model family share a tokenizer, and a folder's name says nothing.

A teacher backend says which folder holds its tokenizer with a static method
``tokenizer_folder(options) -> Path`` (the built-in ``model`` teacher: its model's
folder); one that does not cannot be checked, which ``forge run`` says as a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.registry.plugins import Registry

log = logging.getLogger("forgerl.distill")

#: Files whose equal bytes mean equal tokenizers (compared first: no tokenizer is loaded).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")  # fmt: skip
#: The special tokens that must agree (padding may differ: it is never scored).
ROLES = ("bos_token", "eos_token", "unk_token")


def check_teacher_tokenizer(config: RunConfig, registry: Registry) -> None:
    """ConfigError (one line) when the teacher of ``config`` does not share the student's
    tokenizer. Builds a named model (student or teacher) if it is not built yet."""
    from forgerl.events import announce
    from forgerl.models.resolve import resolve_model

    choice = config.distill.teacher
    backend = registry.require("teacher", choice.name)
    find = getattr(backend.load_factory(), "tokenizer_folder", None)
    if find is None:
        said = (
            f"teacher {choice.name!r} does not say which tokenizer it uses: forge cannot check before launch that it "
            "is the student's (a teacher with another tokenizer would score the wrong tokens)"
        )
        log.warning("%s", said)
        announce(said, stage="teacher", state="warning")
        return
    with _quiet():  # building a named model draws progress bars: `forge run` says one line
        teacher_dir = Path(find(backend.validate_options(choice.options)))
        student_dir = resolve_model(config.model, registry)
        difference = tokenizer_difference(student_dir, teacher_dir)
    if difference is not None:
        raise ConfigError(
            f"distill.teacher: the teacher's tokenizer ({teacher_dir}) is not the student's ({config.model.name}: "
            f"{student_dir}): {difference}; the teacher scores the student's token ids, so both must share one "
            "tokenizer: pick a teacher of the student's model family"
        )


def tokenizer_difference(student: Path, teacher: Path) -> str | None:
    """How the tokenizers of two model folders differ, in a few words; None when they are
    the same (see the module docstring)."""
    if _same_files(student, teacher):
        return None
    a, b = _load(student), _load(teacher)
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        moved = sorted(t for t in va.keys() & vb.keys() if va[t] != vb[t])
        only_a, only_b = sorted(va.keys() - vb.keys()), sorted(vb.keys() - va.keys())
        parts = [f"vocabularies of {len(va)} and {len(vb)} tokens"]
        if moved:
            parts.append(f"{len(moved)} shared tokens have other ids (e.g. {moved[0]!r}: {va[moved[0]]} vs {vb[moved[0]]})")
        if only_a:
            parts.append(f"{len(only_a)} only in the student's (e.g. {only_a[0]!r})")
        if only_b:
            parts.append(f"{len(only_b)} only in the teacher's (e.g. {only_b[0]!r})")
        return ", ".join(parts)
    for role in ROLES:
        sa, sb = getattr(a, role, None), getattr(b, role, None)
        if sa != sb:
            return f"different {role} ({sa!r} vs {sb!r})"
    special_a, special_b = set(a.all_special_tokens), set(b.all_special_tokens)
    pad = {a.pad_token, b.pad_token}
    if special_a - pad != special_b - pad:
        differing = sorted((special_a ^ special_b) - pad)
        return f"different special tokens (e.g. {differing[0]!r} is special in one only)"
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' progress bars off for the duration (as they were after)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers


def _same_files(a: Path, b: Path) -> bool:
    """Both folders hold the same tokenizer files, byte for byte (and at least one)."""
    found = False
    for name in TOKENIZER_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file():
            return False
        if fa.is_file():
            if _digest(fa) != _digest(fb):
                return False
            found = True
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - any loader failure is one line about the folder
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"distill.teacher: cannot load the tokenizer of {folder}: {reason}") from None
