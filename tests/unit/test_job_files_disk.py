"""Schedulers' job files on a disk that refuses writes: never a traceback,
never half a file. The refusal is the kernel's own: each case runs in a child process whose
RLIMIT_FSIZE lets a write reach only the first bytes of a file (then EFBIG), as a full disk
takes only what fits."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def in_child(code: str, limit: int, **env: str) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        def limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **env})


def test_slurm_submit_on_a_full_disk_is_one_line_and_queues_no_half_script(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "sbatch-called"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\n: > '{called}'\necho 4242\n")  # where no Slurm exists: a stand-in
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    run = tmp_path / "run"
    out = in_child(f"""
        from forgerl.types import JobSpec, RoleSpec
        from forgerl_plugins.schedulers.slurm.scheduler import SlurmScheduler
        job = JobSpec(name="r", run_dir={str(run)!r},
                      roles=(RoleSpec(name="trainer", command=("python", "-V"), primary=True),))
        limit()
        try:
            SlurmScheduler().submit(job)
        except Exception as exc:
            print(type(exc).__name__, exc)
    """, limit=16, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"RunWriteError cannot write {run / 'slurm' / 'job.sbatch'}: file too large"), lines
    assert sorted(p.name for p in (run / "slurm").iterdir()) == [], "no script, whole or half, may be left"
    assert not called.exists(), "sbatch must not be given a script that was not written whole"


def test_local_job_files_on_a_full_disk_keep_the_old_record_and_whole_lines(tmp_path: Path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    out = in_child(f"""
        from pathlib import Path
        from forgerl_plugins.schedulers.local import jobfile
        run = Path({str(run)!r})
        jobfile.write_job(run, {{"state": "running", "pad": "x" * 10}})
        jobfile.log_event(run, "first")
        limit()
        print(jobfile.write_job(run, {{"state": "failed", "pad": "y" * 400}}))
        jobfile.log_event(run, "second " + "z" * 400)
    """, limit=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]
    assert json.loads((run / "job.json").read_text())["state"] == "running"
    assert sorted(p.name for p in run.iterdir()) == ["job.json", "logs"], "no temporary job file may be left"
    log = (run / "logs" / "scheduler.log").read_text()
    assert log.endswith(" first\n") and log.count("\n") == 1, log
