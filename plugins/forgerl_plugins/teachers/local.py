"""The ``model`` teacher in the trainer's process: a transformers forward pass.

A batch of sequences is right-padded and run through the causal LM in one forward pass;
row ``i``'s logits at positions ``start - 1 .. n - 2`` predict its tokens ``start .. n - 1``:
their log-softmax at those tokens are the teacher's logprobs (temperature 1), their argmax
the teacher's top-1. Blocking: the teacher calls it on a worker thread, one batch at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from forgerl.teacher import TeacherRequest, TeacherScores


class LocalTeacher:
    def __init__(self, folder: Path, *, device: str | None, dtype: str | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)} if dtype else {}
        model: Any = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        self.model = model.to(self.device).eval()
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        # The model is not safe to run from two threads at once (a call abandoned after a
        # timeout may still be running when the next one starts).
        self._lock = threading.Lock()

    def score(self, requests: list[TeacherRequest]) -> list[TeacherScores]:
        """The teacher's logprob and top-1 of every scored token of each request."""
        torch = self.torch
        from forgerl.algorithms.logprobs import selective_logprobs

        for r in requests:
            bad = [t for t in r.token_ids if not 0 <= t < self.vocab]
            if bad:
                # The embedding lookup would fail for the whole batch: say which token.
                raise ValueError(f"token id {bad[0]} is outside the teacher's vocabulary of {self.vocab}")
        longest = max(len(r.token_ids) for r in requests)
        ids = torch.zeros((len(requests), longest), dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, r in enumerate(requests):
            ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.long)
            attention[i, : len(r.token_ids)] = 1
        with self._lock, torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
            out = []
            for i, r in enumerate(requests):
                n = len(r.token_ids)
                rows = logits[i, r.start - 1 : n - 1].float()  # predicts tokens start .. n-1
                targets = ids[i, r.start : n].to(self.device)
                logprobs = selective_logprobs(rows.unsqueeze(0), targets.unsqueeze(0))[0]
                top1 = rows.argmax(-1)
                out.append(TeacherScores(logprobs.cpu().tolist(), top1.cpu().tolist()))
        return out
