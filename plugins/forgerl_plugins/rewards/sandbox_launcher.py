"""Runs one untrusted program in a sandbox and reports how it ended (stdlib only).

Started by :mod:`forgerl_plugins.rewards.sandbox` as ``python -I -S sandbox_launcher.py SPEC``
in its own session, with the program's stdin/stdout/stderr already open and a report pipe
(``report_fd`` of the spec). This process is the supervisor: it never runs untrusted code itself.

- ``namespace``: new network, PID, mount, IPC and UTS namespaces (plus a user namespace
  when not root). The program's root is a fresh read-only tmpfs holding only what the
  spec's ``root`` lists (the interpreter, its standard library, the system's libraries: see
  :mod:`forgerl_plugins.rewards.sandbox_root`), a ``/proc`` of its own and ``/tmp`` with
  its directory, the one writable place; it is chrooted there before it starts. It is PID
  1 of its namespace, so when it ends or is killed the kernel kills every process left in
  the namespace, including ones that called setsid or double-forked.
- ``process``: no namespaces. This process becomes a child subreaper, so descendants
  that escape the process group are re-parented here and killed by scanning /proc.
- ``bwrap``: like ``process``, with the program wrapped in bubblewrap's namespaces.

In every level the program gets resource limits, a fresh session, HOME and TMPDIR in its
directory, no new privileges, and (as root) a uid of its own, so that RLIMIT_NPROC holds
(the kernel exempts root from it) and it can signal nothing of ours.
"""

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SYS_MOUNT_SETATTR = 442  # the same number on every architecture that has it
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = -100, 0x8000, 1, 2

#: Where a program in namespaces sees its directory.
VIEW_BOX = "/tmp/sandbox"
#: Where the program's root is built, in the launcher's mount namespace: a tmpfs over the
#: host's /tmp (which the program must not see either).
NEW_ROOT = "/tmp"

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option, value):
    check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def mount(source, target, fstype, flags, data=None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def read_only(top):
    """Every mount at and below ``top`` (of this private mount namespace) read-only."""

    class MountAttr(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    done = libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, top.encode(), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    if done == 0:
        return
    # Kernels before 5.12: remount each mount point read-only, outermost first.
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        if point == top or point.startswith(top.rstrip("/") + "/"):
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def inside(path, folders):
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def build_root(root, box):
    """The program's root at NEW_ROOT (a fresh tmpfs; the caller holds ``box``, an O_PATH
    descriptor of the program's directory): ``root``'s binds read-only at their own paths,
    its links, its hidden folders covered, the devices, an empty /proc, and the directory at
    VIEW_BOX. Nothing is ever created inside a bound folder: every mount point is made in
    the tmpfs (the spec's binds are never inside one another)."""
    binds = root["binds"] + root["devices"]
    # Held before the tmpfs covers /tmp: a source may live under it (an interpreter there).
    held = [(path, os.open(path, os.O_PATH | os.O_NOFOLLOW)) for path in binds]
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, fd in held:
        target = NEW_ROOT + path
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        os.close(fd)
    for path in root["hidden"]:  # inside a bind: they exist there
        mount("tmpfs", NEW_ROOT + path, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=555")
    for path, target in root["links"]:
        if inside(path, binds) or os.path.lexists(NEW_ROOT + path):
            continue  # the bound folder shows it as the host has it
        os.makedirs(NEW_ROOT + os.path.dirname(path), 0o755, exist_ok=True)
        os.symlink(target, NEW_ROOT + path)
    os.makedirs(NEW_ROOT + VIEW_BOX, 0o755)
    mount(f"/proc/self/fd/{box}", NEW_ROOT + VIEW_BOX, None, MS_BIND)
    os.mkdir(NEW_ROOT + "/proc", 0o555)
    read_only(NEW_ROOT)
    mount(None, NEW_ROOT + VIEW_BOX, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def enter_namespaces(spec):
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if not root:
        flags |= CLONE_NEWUSER
    check(libc.unshare(flags), "unshare")
    if not root:
        # Map our own ids to themselves: the exec'd program is then no namespace root and
        # loses the capabilities unshare gave us (which could undo the read-only mounts).
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    # Held before /tmp is covered (the program's directory may live under it).
    box = os.open(spec["box"], os.O_PATH | os.O_DIRECTORY)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    build_root(spec["root"], box)
    os.close(box)


def set_limits(limits):
    names = {
        "cpu": resource.RLIMIT_CPU,
        "address_space": resource.RLIMIT_AS,
        "processes": resource.RLIMIT_NPROC,
        "file_size": resource.RLIMIT_FSIZE,
        "open_files": resource.RLIMIT_NOFILE,
        "core": resource.RLIMIT_CORE,
    }
    for key, value in limits.items():
        # The hard CPU limit one second later: SIGXCPU first, then SIGKILL.
        hard = value + 1 if key == "cpu" else value
        resource.setrlimit(names[key], (value, hard))


def run_program(spec, supervisor, in_pid_namespace):
    """In the forked child: become the program (never returns)."""
    try:
        os.close(spec["report_fd"])  # the report and stop pipes are ours
        if spec.get("stop_fd") is not None:
            os.close(spec["stop_fd"])
        os.setsid()
        if in_pid_namespace:
            try:
                mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass  # a container that masks parts of /proc forbids a fresh one: none, then
            # Before the uid changes (it takes the capability): from here on nothing of the
            # host's tree can be named, and a chrooted process may not make a user namespace
            # to regain the capability.
            os.chroot(NEW_ROOT)
        os.chdir(VIEW_BOX if in_pid_namespace else spec["box"])
        if spec.get("uid") is not None:
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if os.getppid() != supervisor and not in_pid_namespace:
            os._exit(126)
        set_limits(spec["limits"])
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - report and die; never run on as the launcher
        try:
            os.write(2, f"sandbox: could not start the program: {exc}\n".encode())
        finally:
            os._exit(127)


def children_of(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # The command name may hold spaces and parentheses: fields follow the last ')'.
            fields = stat[stat.rfind(b")") + 2 :].split()
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def kill_everything_left(spec, in_pid_namespace):
    """Kill and reap every descendant (re-parented to us, the subreaper), until none is left.
    In a PID namespace the kernel has done it: the namespace died with its init."""
    me = os.getpid()
    deadline = time.monotonic() + 30
    while True:
        if spec.get("uid") is not None and not in_pid_namespace and os.fork() == 0:
            # kill(-1) as the sandbox's uid hits all its processes in one pass that a
            # fork bomb cannot outrun (the kernel holds the task list while it signals).
            try:
                os.setuid(spec["uid"])
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        for pid in children_of(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)  # the killed need a moment to become zombies


def wait_with_deadline(pid, seconds, stop_fd=None):
    """(wait status, CPU seconds it used), "timeout", or "stopped" when ``stop_fd`` (the
    reward's end of a pipe) became readable: the reward has what it needs from the program."""
    fd = os.pidfd_open(pid)
    try:
        watched = [fd] if stop_fd is None else [fd, stop_fd]
        ready, _, _ = select.select(watched, [], [], max(0.0, seconds))
    finally:
        os.close(fd)
    if not ready:
        return "timeout"
    if fd not in ready:
        return "stopped"
    _, status, usage = os.wait4(pid, 0)
    return status, usage.ru_utime + usage.ru_stime


def out_of_cpu_time(status, cpu_used, cpu_limit):
    """The program was stopped by its CPU-time limit: SIGXCPU at the soft limit, or the
    SIGKILL of the hard one after it ignored that. Like the wall clock, this is its time
    running out, so it counts as a timeout; which of the two limits fires first is a race
    (CPU and wall time advance together on an idle core) and must not decide the score."""
    if os.WIFEXITED(status):
        # bwrap reports its program's death by signal N as its own exit status 128 + N.
        return os.WEXITSTATUS(status) == 128 + signal.SIGXCPU
    sig = os.WTERMSIG(status)
    return sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_limit)


def main():
    spec = json.loads(sys.argv[1])
    report = os.fdopen(spec["report_fd"], "w")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent"]:
        return 1  # the reward process died while we started
    level = spec["level"]
    try:
        if level == "namespace":
            enter_namespaces(spec)
        else:
            prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError as exc:
        report.write(json.dumps({"setup_error": str(exc)}))
        return 1
    started = time.monotonic()
    me = os.getpid()
    child = os.fork()
    if child == 0:
        run_program(spec, me, level == "namespace")
    waited = wait_with_deadline(child, spec["timeout"], spec.get("stop_fd"))
    stopped = waited == "stopped"
    if waited in ("timeout", "stopped"):
        timed_out = not stopped
        os.kill(child, signal.SIGKILL)  # in a PID namespace: its init, so everything in it
        status = os.waitpid(child, 0)[1]
    else:
        status, cpu_used = waited
        timed_out = out_of_cpu_time(status, cpu_used, spec["limits"]["cpu"])
    elapsed = time.monotonic() - started
    kill_everything_left(spec, level == "namespace")
    report.write(
        json.dumps(
            {
                "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "timed_out": timed_out,
                "stopped": stopped,
                "seconds": elapsed,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
