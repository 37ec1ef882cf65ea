"""``--model tiny``: a tiny random Qwen2/Llama with a small byte-level BPE tokenizer.

Built offline, deterministically, in a few seconds: the tokenizer is trained on a fixed
built-in corpus (arithmetic prompts and common English), the weights come from a fixed
seed. Embeddings are tied, as in the small Qwen2 and SmolLM2 models, so tests exercise
the tied-embedding path of weight updates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from forgerl.options import OptionsModel
from forgerl_plugins.models.folder import ModelFolder

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig, PreTrainedModel

# Bump when the output of the builder changes, so cached folders are rebuilt.
BUILDER_VERSION = 3

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the template of Qwen2 and SmolLM2 instruct models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the answer is what think briefly then give final inside a an of to and in is it you that "
    "for on with as be at this have from or by not but what all were when we there can number "
    "sum plus minus times equals result problem solve step first second so therefore compute "
    "system user assistant please question correct wrong because add subtract multiply"
).split()


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            op = "+-*"[(a + b) % 3]
            lines.append(
                f"What is {a} {op} {b}? Think briefly, then give the final answer inside "
                f"<answer></answer>. The answer is <answer>{a + b}</answer>."
            )
    lines.append(" ".join(_WORDS))
    lines.append(" ".join(w.capitalize() for w in _WORDS))
    lines.append("0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 . , ? ! : ; ( ) < > / = + - *")
    return lines


def _options_key(options: Any) -> str:
    payload = json.dumps({"v": BUILDER_VERSION, **options.model_dump()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


class TinyModel(ModelFolder):
    """The folder of the tiny model for the options, built on first use (torch and
    transformers are imported only then)."""

    name = "tiny"
    description = "tiny random model with a small BPE tokenizer, built offline"
    requires = ("torch", "transformers", "tokenizers")
    # max_position_embeddings of the folder it builds (checked against max_tokens).
    info: ClassVar[dict[str, Any]] = {"context_length": 1024}

    class Options(OptionsModel):
        architecture: str = Field("qwen2", pattern="^(qwen2|llama)$")
        hidden_size: int = Field(64, ge=8, le=4096)
        layers: int = Field(2, ge=1, le=64)
        vocab_size: int = Field(512, ge=300, le=262_144)
        seed: int = Field(0, ge=0, le=2**32 - 1)

    def __init__(self, options: Options, *, cache_dir: Path) -> None:
        super().__init__(build_tiny_model(options, cache_dir=cache_dir))


def build_tiny_model(options: Any, *, cache_dir: Path) -> Path:
    """Return the folder of the tiny model for ``options``, building it on first use."""
    target = Path(cache_dir) / f"tiny-{options.architecture}-{_options_key(options)}"
    return build_once(target, lambda folder: write_tiny_model(options, folder))


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, a model folder ``write(folder)`` fills, built on first use. Built beside
    the target and renamed: a crash or a concurrent builder never leaves a half-written
    folder under the final name (a concurrent one's finished folder wins)."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def byte_level_bpe(vocab_size: int, special_tokens: list[str], corpus: list[str]) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (deterministic: the
    same inputs give the same vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_tiny_model(options: Any, folder: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_bpe(options.vocab_size, SPECIAL_TOKENS, _corpus())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    pad_id = tok.token_to_id("<|endoftext|>")
    common = dict(
        vocab_size=vocab,
        hidden_size=options.hidden_size,
        intermediate_size=options.hidden_size * 2,
        num_hidden_layers=options.layers,
        # 32-wide heads: vLLM's CPU attention kernels need a head size of at least 32.
        num_attention_heads=max(1, options.hidden_size // 32),
        num_key_value_heads=max(1, options.hidden_size // 64),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    Config: type[PretrainedConfig]
    Model: type[PreTrainedModel]
    if options.architecture == "qwen2":
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    else:
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    config = Config(**common)
    torch.manual_seed(options.seed)
    model = Model(config)
    # Embeddings a little larger than the default init, so the tiny model's next-token
    # distribution is neither uniform nor degenerate (about 4 nats of entropy): with tied
    # embeddings a std of 0.5 made it repeat its input token with probability ~1, and
    # every seed sampled the same tokens.
    with torch.no_grad():
        model.get_input_embeddings().get_parameter("weight").normal_(0.0, 0.1)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(folder, safe_serialization=True)
