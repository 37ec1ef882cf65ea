"""Operating-system plumbing of the local scheduler: starting, finding and stopping process trees.

Every process the scheduler starts leads its own session (``start_new_session=True``), so
its pid is also the id of its process group and of its session. Whatever it starts
(grandchildren) stays in that group or at least that session unless it calls ``setsid``
itself, even after its parent died and it was re-parented. Stopping a "tree" therefore
means signalling every live process whose process group or session is the leader's pid,
found by scanning ``/proc``. Zombies are skipped: they are already dead, and on machines
whose init never reaps orphans (containers) they would otherwise look alive forever.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str  # "R", "S", "Z", ...
    ppid: int
    pgid: int
    sid: int
    starttime: int  # clock ticks after boot: with the pid, identifies a process across pid reuse

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed, or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    stat = proc_stat(pid)
    return None if stat is None else stat.starttime


def is_alive(pid: int, starttime: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``starttime``, is the same process."""
    stat = proc_stat(pid)
    if stat is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc (not Linux): a signal 0 probe is the best we have
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if stat.zombie:
        return False
    return starttime is None or stat.starttime == starttime


def pid_reused(pid: int, starttime: int | None) -> bool:
    """Whether a live process now holds ``pid`` but is not the one started at ``starttime``."""
    stat = proc_stat(pid)
    return stat is not None and not stat.zombie and starttime is not None and stat.starttime != starttime


def _all_stats() -> list[ProcStat]:
    out: list[ProcStat] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None and not stat.zombie:
                out.append(stat)
    return out


def _members(leaders: Iterable[int]) -> dict[int, list[ProcStat]]:
    wanted = set(leaders)
    members: dict[int, list[ProcStat]] = {leader: [] for leader in wanted}
    for stat in _all_stats():
        for owner in {stat.pgid, stat.sid} & wanted:
            members[owner].append(stat)
    return members


def tree_members(leaders: Iterable[int]) -> dict[int, list[int]]:
    """Live pids in the process group or session of each leader (leaders themselves included)."""
    if not os.path.isdir("/proc"):  # not Linux: probe the process group only
        out: dict[int, list[int]] = {}
        for leader in set(leaders):
            try:
                os.killpg(leader, 0)
                out[leader] = [leader]
            except OSError:
                out[leader] = []
        return out
    return {leader: [s.pid for s in stats] for leader, stats in _members(leaders).items()}


def signal_trees(leaders: Iterable[int], sig: int) -> None:
    """Send ``sig`` to the process group of each leader and to its session members outside it.

    Each process gets the signal once: some programs treat a second SIGTERM as "exit now".
    """
    leaders = list(leaders)
    for leader in leaders:
        try:
            os.killpg(leader, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for stats in _members(leaders).values():
        for stat in stats:
            if stat.pgid not in leaders:
                try:
                    os.kill(stat.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


def stop_trees(
    leaders: Sequence[int],
    timeout: float,
    reap: Callable[[], None] = lambda: None,
    hurry: Callable[[], bool] = lambda: False,
    kill_wait: float = 5.0,
) -> list[int]:
    """SIGTERM every tree, SIGKILL what is left after ``timeout`` (or as soon as ``hurry()``).

    ``reap`` collects exited children of this process (leaders are zombies until then).
    Returns the leaders whose trees needed SIGKILL.
    """
    leaders = [pid for pid in leaders if pid]
    if not leaders:
        return []
    signal_trees(leaders, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while True:
        reap()
        alive = [leader for leader, pids in tree_members(leaders).items() if pids]
        if not alive:
            return []
        if time.monotonic() >= deadline or hurry():
            break
        time.sleep(0.05)
    signal_trees(alive, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait
    while time.monotonic() < deadline:
        reap()
        if not any(tree_members(alive).values()):
            break
        time.sleep(0.02)
    return alive


# ------------------------------------------------------------------ death signal


def _load_prctl():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):  # not Linux
        return None


_prctl = _load_prctl()


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child receive SIGKILL when the thread that forked it ends.

    Linux ties PR_SET_PDEATHSIG to the forking *thread*, not the process: submit and
    supervise from a thread that lives as long as the job (the main thread). Returns None
    where prctl does not exist.
    """
    if _prctl is None:
        return None
    parent = os.getpid()
    prctl = _prctl  # looked up before the fork: the child only calls into libc

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


# ------------------------------------------------------------------ ports

# Ports handed out by this process recently: bind(0) alone may return a port again once the
# socket that probed it is closed, and two replicas (or two jobs) must not share one.
_recent_ports: deque[int] = deque(maxlen=4096)


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now, none handed out recently by this process.

    The usual rendezvous race remains (someone may bind the port before rank 0 does);
    torchrun accepts the same.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        family, addr = socket.AF_INET, ("", 0)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(n * 50):
            if len(ports) == n:
                break
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)  # kept open so the next bind(0) cannot return the same port
            s.bind((*addr[:1], 0, *tuple(addr[2:])))
            port = s.getsockname()[1]
            if port not in _recent_ports:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < n:
        raise OSError(f"could not find {n} free TCP ports on {host}")
    _recent_ports.extend(ports)
    return ports


def exit_code(returncode: int) -> int:
    """A Popen returncode as a shell exit status: killed by signal N → 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(code: int) -> str:
    if code > 128:
        try:
            return f"code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"code {code}"
