"""Run untrusted Python in a separate process that cannot hurt the host.

Layers, each tested (tests/test_answers.py: infinite loop, fork bomb, memory hog, writes outside the working
directory, sockets), the host surviving every one:
  - a fresh temporary working directory, removed afterwards;
  - resource limits set in the child before exec: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS),
    processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), no core dumps;
  - a wall-clock timeout, after which the child's whole process group is killed (it leads its own group: setsid);
    the group is killed at the end in any case;
  - where the platform allows it (root, util-linux `unshare`/`setpriv`): new network and PID namespaces
    (no interface but a down loopback; every process of the run dies with its first one) and an unprivileged
    user (nobody), so the process limit counts and the host's files are out of reach;
  - always, an audit hook installed before the code runs (sys.addaudithook cannot be removed): it refuses
    sockets, subprocesses/exec, ctypes, and any write, rename or delete outside the working directory.
The audit hook stops Python-level attempts on any platform; the namespaces and the uid stop the rest.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache

NOBODY = 65534

_BOOT = r'''
import os, sys
sys.dont_write_bytecode = True
_ROOT = os.path.realpath(os.getcwd())
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.replace": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1,
                "os.chown": 1, "os.link": 2, "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "shutil.move": 2, "shutil.copyfile": 2}
_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn",
           "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill", "sys.addaudithook", "sys.setprofile")

def _inside(path):
    if isinstance(path, int):
        return True
    path = os.path.realpath(os.path.join(_ROOT, os.fsdecode(path)))
    return path == _ROOT or path.startswith(_ROOT + os.sep) or path == os.devnull

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: no writing outside the working directory ({path})")
    elif event in _PATH_EVENTS:
        for path in args[: _PATH_EVENTS[event]]:
            if path is not None and not _inside(path):
                raise PermissionError(f"sandbox: {event} outside the working directory ({path})")
    elif event.startswith(_DENIED):
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(_hook)
del _hook
import runpy
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolation: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def summary(self) -> str:
        if self.timed_out:
            return f"timed out after {self.wall_s:.1f}s"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        last = next((line for line in reversed(self.stderr.strip().splitlines()) if line.strip()), "")
        return f"exit code {self.returncode}" + (f": {last[:200]}" if last else "")


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Can we wrap the child in new net + pid namespaces and drop to `nobody`? (root with util-linux)"""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    try:
        probe = subprocess.run(_wrapper() + ["true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _wrapper() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--",
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _limits(cpu_s: int, memory_mb: int, max_procs: int, file_mb: int):
    def apply() -> None:
        os.setsid()  # a process group of its own, killed as a whole
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, timeout_s: float = 10.0, cpu_s: int | None = None, memory_mb: int = 512,
               max_procs: int = 16, file_mb: int = 16, python: str | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox; return its exit code, output (tails) and what happened."""
    python = python or sys.executable
    cpu_s = cpu_s or max(1, int(timeout_s + 0.999))
    workdir = tempfile.mkdtemp(prefix="specdraft-sandbox-")
    logs = tempfile.mkdtemp(prefix="specdraft-sandbox-logs-")
    isolation = ["tempdir", "rlimits", "process-group", "audit-hook"]
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(workdir, "_boot.py"), "w") as f:
            f.write(_BOOT)
        command = [python, "-I", "-S", "-B", "_boot.py", "main.py"]
        if namespaces_available():
            os.chown(workdir, NOBODY, NOBODY)
            command = _wrapper() + command
            isolation += ["netns", "pidns", "uid-nobody"]
        else:
            max_procs += _user_processes()  # RLIMIT_NPROC counts every process of this uid
        started = time.perf_counter()
        with open(os.path.join(logs, "out"), "w+b") as out, open(os.path.join(logs, "err"), "w+b") as err:
            proc = subprocess.Popen(command, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    preexec_fn=_limits(cpu_s, memory_mb, max_procs, file_mb),
                                    env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "HOME": workdir})
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
            wall = time.perf_counter() - started
            out.seek(0), err.seek(0)
            stdout, stderr = out.read()[-8192:], err.read()[-8192:]
        return SandboxResult(proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"),
                             timed_out, wall, isolation)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
