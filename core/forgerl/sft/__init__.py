"""Supervised fine-tuning: the ``sft`` objective (docs/sft.md).

- :mod:`.config`: the run config's ``sft`` section;
- :mod:`.rows` and :mod:`.files`: demonstrations read from JSONL or Parquet (or given by a
  task) and checked, every problem one line naming the file, the row and the field;
- :mod:`.render`: demonstrations as token ids and a loss mask, rendered as environments
  render trajectories (:mod:`forgerl.rollouts.chat_tokens`);
- :mod:`.from_samples`: a run's own sample records as demonstrations (``forge samples
  --export``: rejection-sampling fine-tuning);
- :mod:`.data`: the resumable stream of examples a run trains on;
- :mod:`.batch` and :mod:`.loss`: the batch a trainer gets, and the cross-entropy it
  minimises;
- :mod:`.loop`, :mod:`.run`: the supervised loop on trainer rank 0;
- :mod:`.needs`, :mod:`.preflight`: what such a run starts, and checks before it does.

Importing this package imports nothing heavy; :mod:`.loss` (torch) only when a trainer
trains the objective.
"""
