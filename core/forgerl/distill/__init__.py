"""On-policy distillation: a teacher scores the student's own samples, and each sampled
token's advantage is minus its reverse KL term (docs/distillation.md).

* :mod:`.teacher`: the Teacher interface (kind ``teacher``, hook ``forge_teachers``);
* :mod:`.advantages`: the per-token advantages and the metrics' maths (torch);
* :mod:`.scoring`: a step's samples scored with timeouts, each failure its sample's alone;
* :mod:`.batch`: the step's TrainBatch with per-token advantages (``objective: distill``);
* :mod:`.tokenizers`: the check, before launch, that teacher and student share a tokenizer.

Only the interface is imported here: the rest imports torch or transformers when used.
"""

from __future__ import annotations

from forgerl.teacher import Teacher, TeacherRequest, TeacherScores

__all__ = ["Teacher", "TeacherRequest", "TeacherScores"]
