"""Per-sample cost of an image prompt against a text prompt of the same token count.

``python -m benchmarks.vision_cost [--repeats 5] [--images 1]``: the tiny VLM (``tiny-vl``),
the ``hf`` generator (n=4, 16 new tokens, fp32) and the ``fsdp`` trainer (one logprob pass
and one train step over those samples). The text prompt is the image prompt's ids with each
image token replaced by a plain token, so both have exactly the same length: the difference
is the vision encoder, the per-row forwards of image rows, and moving the pixels.
Prints a JSON line per setting with medians in seconds per sample.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor

    from forgerl.images import ImageLimits
    from forgerl.images.render import render_chat
    from forgerl.runloop.batching import collate
    from forgerl.types import Episode, GenerationRequest, Problem, SamplingParams
    from forgerl_plugins.models.tiny_vl import TinyVLModel, build_tiny_vl_model
    from tests.helpers import images as im
    from tests.helpers import trainer_worker as worker

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="vision-cost-"))
    model_dir = build_tiny_vl_model(TinyVLModel.Options(), cache_dir=tmp / "models")
    processor = AutoProcessor.from_pretrained(model_dir)
    parts = [im.image_part(im.data_url(im.png(40 + i, 24, (255, 0, 0)))) for i in range(args.images)]
    ids, images = render_chat(processor, im.chat(*parts), ImageLimits())
    assert images is not None
    placeholder = processor.tokenizer.convert_tokens_to_ids("<image>")
    plain = processor.tokenizer("a", add_special_tokens=False)["input_ids"][0]
    text_ids = [plain if t == placeholder else t for t in ids]

    from forgerl.testing.trainer_support import run_config, run_context
    from forgerl_plugins.generators.hf.generator import HFGenerator

    context = run_context(model_dir, tmp / "gen", run_config({}, worker.TEMPERATURE))
    generator = HFGenerator(HFGenerator.Options(dtype="float32"), context=context, transport=None)  # type: ignore[arg-type]
    trainer = worker.make_trainer(model_dir, tmp / "train", micro_batch_size=args.n)
    sampling = SamplingParams(max_tokens=16, temperature=worker.TEMPERATURE)
    results = {}
    try:
        for name, prompt, inputs in (("text", text_ids, None), ("image", ids, images)):
            gen, train = [], []
            for r in range(args.repeats + 1):  # the first is a warm-up
                request = GenerationRequest("r", prompt, args.n, dataclasses.replace(sampling, seed=r), images=inputs)
                t0 = time.perf_counter()
                [completions] = asyncio.run(generator.generate([request]))
                t1 = time.perf_counter()
                episodes = [Episode(Problem("p", ""), 0, list(prompt), c, reward=0.0, images=inputs) for c in completions]
                batch = collate(episodes, pad_id=0)
                batch.advantages = torch.tensor([1.0, -1.0] * (args.n // 2) + [0.0] * (args.n % 2))
                t2 = time.perf_counter()
                trainer.logprobs(batch)
                trainer.train_step(batch)
                t3 = time.perf_counter()
                if r:
                    gen.append((t1 - t0) / args.n)
                    train.append((t3 - t2) / args.n)
            results[name] = {"prompt_tokens": len(prompt), "generate_s_per_sample": statistics.median(gen),
                             "train_s_per_sample": statistics.median(train)}  # fmt: skip
    finally:
        generator.close()
        trainer.close()
    ratio = {k: results["image"][k] / results["text"][k] for k in ("generate_s_per_sample", "train_s_per_sample")}
    json.dump({"images": args.images, "n": args.n, **results, "image_over_text": ratio}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
