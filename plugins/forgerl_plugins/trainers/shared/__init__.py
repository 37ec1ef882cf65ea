"""What the trainers share (``fsdp``, ``torchtitan``): how a batch is cut over ranks and
micro-batches, the GRPO step with its global token normalisation, metrics, logprobs,
process-group set-up and DCP checkpoints. A trainer adds only its model: how it is built,
sharded, run and exported under Hugging Face names (:class:`.base.ShardedTrainer`).

Not a plugin: nothing registers from here, and importing it imports nothing heavy.
"""
