"""The report's page of samples: what the model wrote, per step, filterable in the page.

The records come from the run's ``samples/`` folder (:mod:`forgerl.samples`), a bounded
share of them (:data:`PER_STEP` per step and kind, texts cut to :data:`MAX_CHARS`), kept as
JSON in the page (``<script id="forge-report-samples">``) and drawn by a few lines of
script: a step, a kind, failed only, an order and a text filter.
"""

from __future__ import annotations

import json
from typing import Any

from forgerl.errors import UserError
from forgerl.report.data import RunData

SAMPLES_ID = "forge-report-samples"
#: Most records per (step, kind) in the page: the worst and the best, half each.
PER_STEP = 16
#: Longest text kept per prompt or completion in the page (head and tail).
MAX_CHARS = 2000
#: Most steps with samples in the page (the newest).
MAX_STEPS = 200


def samples_data(runs_: list[RunData]) -> list[dict[str, Any]]:
    """Per run with samples: its label and the records the page shows."""
    from forgerl.samples.reader import read_samples
    from forgerl.samples.records import message_text

    out = []
    for run in runs_:
        try:
            records = read_samples(run.run_dir)
        except UserError:  # no samples folder (an older run, or samples off)
            continue
        by_step: dict[tuple[str, int], list[Any]] = {}
        for r in records:
            by_step.setdefault((r.kind, r.step), []).append(r)
        steps = sorted({s for _, s in by_step})[-MAX_STEPS:]
        shown = []
        for (kind, step), recs in sorted(by_step.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if step not in steps:
                continue
            if len(recs) > PER_STEP:
                ranked = sorted(recs, key=lambda r: (r.reward is None, r.reward or 0.0))
                keep = {id(r) for r in ranked[: PER_STEP // 2] + ranked[-(PER_STEP - PER_STEP // 2):]}
                recs = [r for r in recs if id(r) in keep]
            for r in recs:
                shown.append({
                    "kind": kind, "step": step, "group": r.group, "index": r.index, "problem_id": r.problem_id,
                    "policy_version": r.policy_version, "reward": r.reward, "components": r.components,
                    "advantage": r.advantage, "correct": r.correct, "finish_reason": r.finish_reason,
                    "error": r.error, "prompt": _cut(r.prompt), "completion": _cut(r.completion),
                    "messages": [{"role": str(m.get("role", "?")), "content": _cut(message_text(m))}
                                 for m in (r.messages or []) if isinstance(m, dict)] or None,
                })
        if shown:
            out.append({"label": run.label, "records": shown})
    return out


def section(runs_: list[RunData]) -> str:
    """The samples section of the page ("" when no run recorded samples)."""
    data = samples_data(runs_)
    if not data:
        return ""
    payload = json.dumps(data).replace("</", "<\\/")
    note = (f"Up to {PER_STEP} samples per step and kind (the worst and the best by reward), texts cut to "
            f"{MAX_CHARS} characters; all of them: <code>forge samples RUN_DIR</code>.")
    return "\n".join([
        '<section id="samples"><h2>Samples</h2>', f'<p class="muted">{note}</p>',
        '<p class="controls"><select id="s-run"></select> <select id="s-step"></select> '
        '<select id="s-kind"><option value="">train and eval</option><option>train</option><option>eval</option>'
        '</select> <select id="s-order"><option value="">as written</option><option value="worst">worst first'
        '</option><option value="best">best first</option></select> '
        '<label><input type="checkbox" id="s-failed"> failed only</label> '
        '<input type="search" id="s-grep" placeholder="filter text"></p>',
        '<div id="s-list"></div>',
        f'<script type="application/json" id="{SAMPLES_ID}">{payload}</script>',
        f"<script>{_SCRIPT}</script></section>",
    ])


def _cut(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    half = MAX_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - MAX_CHARS} characters cut ...]\n{text[-half:]}"


# Plain DOM, no library: the page stays self-contained. Text goes in through textContent
# only (never innerHTML), so a completion holding markup stays text.
_SCRIPT = """
(function () {
  const data = JSON.parse(document.getElementById('SAMPLES_ID').textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, text, cls) => { const n = document.createElement(tag);
    if (text !== undefined) n.textContent = text; if (cls) n.className = cls; return n; };
  data.forEach((run, i) => $('s-run').appendChild(new Option(run.label, i)));
  if (data.length < 2) $('s-run').style.display = 'none';
  function steps() {
    const run = data[+$('s-run').value || 0]; const sel = $('s-step'); const was = sel.value;
    sel.innerHTML = ''; sel.appendChild(new Option('every step', ''));
    [...new Set(run.records.map(r => r.step))].sort((a, b) => a - b)
      .forEach(s => sel.appendChild(new Option('step ' + s, s)));
    sel.value = was; if (sel.value !== was) sel.value = '';
  }
  function draw() {
    const run = data[+$('s-run').value || 0]; const step = $('s-step').value, kind = $('s-kind').value;
    const grep = $('s-grep').value.toLowerCase(), failed = $('s-failed').checked, order = $('s-order').value;
    let recs = run.records.filter(r => (step === '' || r.step === +step) && (!kind || r.kind === kind) &&
      (!failed || r.error) && (!grep || [r.prompt, r.completion, r.error || '', r.problem_id || '',
      ...(r.messages || []).map(m => m.content)].join('\\n').toLowerCase().includes(grep)));
    if (order) { const sign = order === 'worst' ? 1 : -1;
      recs = recs.slice().sort((a, b) => (a.reward === null) - (b.reward === null) ||
        sign * ((a.reward || 0) - (b.reward || 0))); }
    const list = $('s-list'); list.innerHTML = '';
    list.appendChild(el('p', recs.length + ' sample(s)', 'muted'));
    recs.forEach(r => {
      const box = el('div', undefined, 'sample');
      const head = ['step ' + r.step, r.kind];
      if (r.group !== null) head.push('group ' + r.group + (r.index !== null ? ' #' + r.index : ''));
      if (r.problem_id) head.push('problem ' + r.problem_id);
      if (r.policy_version !== null) head.push('version ' + r.policy_version);
      if (r.reward !== null) head.push('reward ' + r.reward.toPrecision(3) + ' ' +
        Object.entries(r.components).map(([k, v]) => k + ' ' + (+v).toPrecision(3)).join(', '));
      if (r.advantage !== null) head.push('advantage ' + r.advantage.toFixed(3));
      if (r.correct !== null) head.push(r.correct ? 'correct' : 'wrong');
      if (r.finish_reason) head.push('finish ' + r.finish_reason);
      box.appendChild(el('div', head.join(' · '), 'head'));
      if (r.error) box.appendChild(el('div', 'FAILED: ' + r.error, 'error'));
      const prompt = el('details'); prompt.appendChild(el('summary', r.messages ? 'messages' : 'prompt'));
      if (r.messages) r.messages.forEach(m => prompt.appendChild(el('pre', '[' + m.role + '] ' + m.content)));
      else prompt.appendChild(el('pre', r.prompt));
      box.appendChild(prompt); box.appendChild(el('pre', r.completion || '(empty)'));
      list.appendChild(box);
    });
  }
  ['s-run', 's-step', 's-kind', 's-order', 's-failed', 's-grep'].forEach(id =>
    $(id).addEventListener(id === 's-grep' ? 'input' : 'change', () => { if (id === 's-run') steps(); draw(); }));
  steps(); draw();
})();
""".replace("SAMPLES_ID", SAMPLES_ID)

CSS = """
.sample { border: 1px solid #ddd; margin: 0.6em 0; padding: 0.4em 0.6em; }
.sample .head { font-size: 0.85em; color: #444; } .sample .error { color: #b00; font-size: 0.9em; }
.sample pre { white-space: pre-wrap; margin: 0.3em 0; font-size: 0.85em; background: #f7f7f7; padding: 0.3em; }
.controls select, .controls input { margin-right: 0.4em; }
"""
