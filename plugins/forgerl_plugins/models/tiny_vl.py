"""``--model tiny-vl``: a tiny random Idefics3 (SmolVLM's architecture) with its processor.

Built offline, deterministically, in seconds, like ``tiny``: a byte-level BPE tokenizer
trained on a fixed corpus, a SigLIP-style vision tower, Idefics3's pixel-shuffle
connector and a Llama text model, weights from a fixed seed. No pretrained VLM can be
installed from a package index, so this is what CI runs; it has no skill to learn from.

Why Idefics3 and not Qwen2-VL (both registered in vLLM's CPU build): transformers builds
``Qwen2VLProcessor`` only with torchvision (its video processor), and torchvision from
PyPI does not import beside the CPU torch vLLM pins; ``Idefics3Processor`` has no video
part and its Pillow image processor needs nothing more. vLLM 0.32 (CPU) serves this folder
and its logprobs on an image prompt equal transformers' (docs/vision.md).

Each image is resized to ``image_size`` square (no tiling) and becomes
``(image_size / patch_size)² / 4`` image tokens between ``<fake_token_around_image>``
and ``<global-img>`` markers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from forgerl.options import OptionsModel
from forgerl_plugins.models.folder import ModelFolder
from forgerl_plugins.models.tiny import _corpus, build_once, byte_level_bpe

BUILDER_VERSION = 1

IMAGE_MARKERS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
# Idefics3's processor looks these up even without tiling; as special tokens they stay one id.
TILE_MARKERS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_MARKERS, *TILE_MARKERS]

# ChatML (as ``tiny``), with content parts: an image part becomes ``<image>``, which the
# processor expands into the image's tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_VISION_WORDS = (
    "what colour color is the square circle image picture shown red green blue black white "
    "left right top bottom how many shapes are there describe"
)


class TinyVLModel(ModelFolder):
    """The folder of the tiny VLM for the options, built on first use."""

    name = "tiny-vl"
    description = "tiny random Idefics3 vision-language model with its processor, built offline"
    requires = ("torch", "transformers", "tokenizers", "PIL")
    info: ClassVar[dict[str, Any]] = {"context_length": 1024}

    class Options(OptionsModel):
        hidden_size: int = Field(64, ge=32, le=4096)
        layers: int = Field(2, ge=1, le=64)
        vision_hidden_size: int = Field(32, ge=32, le=4096)
        vision_layers: int = Field(1, ge=1, le=64)
        image_size: int = Field(64, ge=16, le=1024, description="Images are resized to this square.")
        patch_size: int = Field(8, ge=2, le=64)
        vocab_size: int = Field(512, ge=300, le=262_144)
        seed: int = Field(0, ge=0, le=2**32 - 1)

        @model_validator(mode="after")
        def _patches_tile(self) -> TinyVLModel.Options:
            side = self.image_size // self.patch_size
            if self.image_size % self.patch_size or side % 2:
                raise ValueError(
                    f"image_size {self.image_size} must be an even number of patches of {self.patch_size} "
                    "(the connector merges 2 x 2 patches)"
                )
            return self

    def __init__(self, options: Options, *, cache_dir: Path) -> None:
        super().__init__(build_tiny_vl_model(options, cache_dir=cache_dir))


def build_tiny_vl_model(options: Any, *, cache_dir: Path) -> Path:
    """The folder of the tiny VLM for ``options``, built on first use (as ``tiny``'s: beside
    the target, then renamed, so no half-written folder ever has the final name)."""
    payload = json.dumps({"v": BUILDER_VERSION, **options.model_dump()}, sort_keys=True)
    target = Path(cache_dir) / f"tiny-vl-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"
    return build_once(target, lambda folder: write_tiny_vl_model(options, folder))


def write_tiny_vl_model(options: Any, folder: Path) -> None:
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = byte_level_bpe(options.vocab_size, SPECIAL_TOKENS, [*_corpus(), _VISION_WORDS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[*IMAGE_MARKERS, *TILE_MARKERS],
    )
    fast.chat_template = CHAT_TEMPLATE
    side = options.image_size // options.patch_size
    image_seq_len = side * side // 4
    # No tiling: one image, one square of image_seq_len tokens (the cost per image is fixed).
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": options.image_size},
        max_image_size={"longest_edge": options.image_size},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=fast, image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(folder)

    ids: dict[str, int] = {}
    for t in [*SPECIAL_TOKENS[:4], "<image>"]:
        token_id = tok.token_to_id(t)
        assert token_id is not None, f"the tokenizer lost the special token {t!r}"
        ids[t] = token_id
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=tok.get_vocab_size(),
            hidden_size=options.hidden_size,
            intermediate_size=options.hidden_size * 2,
            num_hidden_layers=options.layers,
            # 32-wide heads: vLLM's CPU attention kernels need a head size of at least 32.
            num_attention_heads=max(1, options.hidden_size // 32),
            num_key_value_heads=max(1, options.hidden_size // 64),
            max_position_embeddings=1024,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            bos_token_id=None,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            image_size=options.image_size,
            patch_size=options.patch_size,
            hidden_size=options.vision_hidden_size,
            intermediate_size=options.vision_hidden_size * 2,
            num_hidden_layers=options.vision_layers,
            num_attention_heads=max(1, options.vision_hidden_size // 32),
        ),
        scale_factor=2,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    config.dtype = "float32"
    torch.manual_seed(options.seed)
    model = Idefics3ForConditionalGeneration(config)
    # As ``tiny``: embeddings a little larger than the default init, so sampling is
    # neither uniform nor stuck on one token.
    with torch.no_grad():
        model.get_input_embeddings().get_parameter("weight").normal_(0.0, 0.1)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder, safe_serialization=True)
