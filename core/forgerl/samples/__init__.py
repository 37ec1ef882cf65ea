"""What the model wrote: one record per sample, in ``<run_dir>/samples/`` (training steps and
held-out evaluations of a run; ``forge eval`` writes the same records).

:mod:`.records` is the schema (:class:`SampleRecord`, one JSON object per line),
:mod:`.writer` the bounded, rotated writer, :mod:`.reader` reads and filters them back,
:mod:`.redact` keeps secrets out and :mod:`.capture` turns a step's episodes into records.
"""

from forgerl.samples.reader import read_samples, select
from forgerl.samples.records import KINDS, SampleRecord
from forgerl.samples.redact import Redactor
from forgerl.samples.writer import SAMPLES_DIR, SampleWriter

__all__ = ["KINDS", "SAMPLES_DIR", "Redactor", "SampleRecord", "SampleWriter", "read_samples", "select"]
