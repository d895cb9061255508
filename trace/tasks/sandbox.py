"""Sandboxed execution of untrusted generated Python (coding-task verification).

``run_python(src, timeout_s=2.0)`` runs `src` in a fresh interpreter and returns a `SandboxResult`;
``run_many(srcs)`` runs a batch concurrently from one thread (an event loop over the children's
pipes), which is how the coding verifier scores a whole RL batch. Compared against: the execution
sandboxes of code-RL stacks (e.g. sandbox-fusion, firejail/nsjail setups); this is a dependency-free
version meant for the short expression programs of the synthetic coding task (DESIGN.md section 7).

Layers, outermost first (each is tested on its own with a hostile program):
  * separate process in its own session; a wall-clock deadline SIGKILLs the whole process group;
  * ``python -I -S -B``: no site-packages, no environment (env is empty), no bytecode writes;
  * rlimits: CPU seconds, address space (memory_mb), file size, open files, no core dumps, and
    RLIMIT_NPROC=0 (stops fork for non-root users; root ignores it, hence the next layers);
  * as root, a private network namespace (no interfaces up, so no loopback either); on x86_64, for
    any user, a seccomp filter that makes fork/vfork/clone/clone3, socket/socketpair, ptrace,
    unshare/setns/mount and io_uring fail with EPERM in the kernel, whatever the program does;
  * inside the child a `sys.addaudithook` policy that ends the process (exit code 86, a
    "SANDBOX_VIOLATION <event>" line on stderr) on: sockets, subprocess/exec/spawn/fork/system,
    kill, ctypes (import and every ctypes event), opening a file for writing outside the work dir,
    reading files outside the work dir and the standard library (so /etc/passwd is BLOCKED),
    symlinks/hardlinks/chmod/chown, and importing socket/subprocess/multiprocessing/ctypes modules.
    Ending the process, rather than raising, means a program cannot catch a violation and go on.
  * cwd is a fresh temp dir (the only writable place), deleted afterwards; stdout and stderr are
    each capped at max_output_bytes and the child is killed when it goes past the cap.

Known limits, stated plainly: Python audit hooks are a tripwire, not a security boundary (CPython's
docs say so); an interpreter bug could sidestep them. As root the kernel layers above still hold
for fork and network, but file writes outside the work dir are stopped by the audit hook alone
(no mount namespace; the interpreter lives under /root, mode 0700, so the child cannot drop to
an unprivileged uid). Good enough for model-written one-line expressions; not for adversarial
humans. `preexec_fn` is used, so call from a single-threaded process or accept CPython's caveat.

Over 450 lines on purpose: every isolation layer above sits in this one file, so that whoever judges
the sandbox reads all of it in one place.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

VIOLATION_EXIT = 86
VIOLATION_MARK = "SANDBOX_VIOLATION"

# Runs first in the child. It reads the program before the hook exists (the program file sits
# outside the readable work dir), installs the policy and then runs the program in a fresh
# namespace. Everything the hook calls is bound at install time, because the program can rebind
# module attributes (os.path.realpath, posixpath.islink, ...) but not builtin function objects.
_BOOTSTRAP = r'''
import sys, posix
_root, _work = sys.argv[1], sys.argv[2]
with open(_root + "/prog.py", encoding="utf-8") as _f:
    _src = _f.read()

def _install(work, lib_roots, violation_exit, mark, allow_audit):
    _lstat, _stat, _readlink, _getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    _write, _exit, _fspath = posix.write, posix._exit, posix.fspath
    IFMT, IFLNK, IFDIR = 0o170000, 0o120000, 0o040000
    WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    READ_FILES = ("/dev/null", "/dev/urandom", "/dev/zero")
    BLOCKED_MODULES = ("ctypes", "_ctypes", "socket", "_socket", "_ssl", "ssl", "subprocess",
                       "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty",
                       "_xxsubinterpreters", "_interpreters", "asyncio")
    BLOCKED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                        "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "pty.",
                        "ctypes.", "os.symlink", "os.link", "os.chmod", "os.chown", "os.chflags",
                        "os.lchmod", "os.lchown", "os.setxattr", "os.removexattr", "os.chroot",
                        "os.chdir", "os.putenv", "os.unsetenv", "resource.setrlimit",
                        "resource.prlimit", "shutil.chown", "syslog.", "webbrowser.",
                        "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                        "nntplib.", "telnetlib.", "os.startfile", "sys.remote_exec",
                        "os.mknod", "os.mkfifo", "sys.addaudithook")
    # event -> (indices of path arguments, indices of dir_fd arguments)
    PATH_WRITE_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
                         "os.mkdir": ((0,), (2,)), "os.rename": ((0, 1), (2, 3)),
                         "os.truncate": ((0,), ()), "os.utime": ((0,), (3,))}

    def deny(event, detail=""):
        try:
            _write(2, (mark + " " + event + " " + str(detail)[:200] + "\n").encode())
        finally:
            _exit(violation_exit)

    def resolve(path):
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = _getcwd() + "/" + path
        todo = [p for p in path.split("/") if p and p != "."][::-1]
        parts = []
        hops = 0
        while todo:
            name = todo.pop()
            if name == "..":
                if parts:
                    parts.pop()
                continue
            cand = "/" + "/".join(parts + [name])
            try:
                st = _lstat(cand)
            except OSError:
                parts.append(name)
                continue
            if st.st_mode & IFMT == IFLNK:
                hops += 1
                if hops > 40:
                    return None
                target = _readlink(cand)
                if target.startswith("/"):
                    parts = []
                todo.extend([p for p in target.split("/") if p and p != "."][::-1])
            else:
                parts.append(name)
        return "/" + "/".join(parts)

    def under(p, root):
        return p == root or p.startswith(root + "/")

    def is_dir(p):
        try:
            return _stat(p).st_mode & IFMT == IFDIR
        except OSError:
            return False

    def check_write(event, path):
        if isinstance(path, int):
            return
        raw = _fspath(path)
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "surrogateescape")
        # The open event does not carry dir_fd, so a relative '..' could escape from a dir fd
        # that differs from the cwd; such paths are simply refused.
        if not raw.startswith("/") and ".." in raw.split("/"):
            deny(event, raw)
        p = resolve(raw)
        if p is None or not (under(p, work) or p == "/dev/null"):
            deny(event, raw)

    def check_read(event, path, allow_dirs):
        if isinstance(path, int):
            return
        raw = _fspath(path)
        p = resolve(raw)
        if p is None:
            deny(event, raw)
        if under(p, work) or p in READ_FILES:
            return
        for r in lib_roots:
            if under(p, r) and (allow_dirs or not is_dir(p)):
                return
        deny(event, raw)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (flags or 0) & WRITE_FLAGS or (
                isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if writing:
                check_write(event, path)
            else:
                check_read(event, path, False)
            return
        if event == "import":
            if args[0].split(".")[0] in BLOCKED_MODULES:
                deny(event, args[0])
            return
        if event in ("os.listdir", "os.scandir"):
            if args[0] is not None:
                check_read(event, args[0], True)
            return
        spec = PATH_WRITE_EVENTS.get(event)
        if spec is not None:
            for i in spec[1]:
                # a dir_fd makes a relative path resolve against an unknown directory
                if i < len(args) and args[i] is not None and args[i] != -1:
                    deny(event, "dir_fd")
            for i in spec[0]:
                if i < len(args) and not isinstance(args[i], int):
                    check_write(event, args[i])
            return
        if event == "sqlite3.connect" and args and args[0] not in (":memory:", b":memory:"):
            check_write(event, args[0])
            return
        for pre in BLOCKED_PREFIXES:
            if event.startswith(pre):
                deny(event)

    if allow_audit:
        sys.addaudithook(hook)

_install(sys.argv[2], tuple(sys.argv[3].split("\x1f")), int(sys.argv[4]), sys.argv[5],
         sys.argv[6] == "1")
del _install, _f
exec(compile(_src, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exit code 0 and not killed
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool  # wall deadline or CPU limit
    killed_reason: str | None  # timeout|cpu|memory|output_limit|file_size|violation|signal:N|None
    violation: str | None = None  # audit event that ended the program, e.g. "os.system"
    truncated: bool = False
    wall_s: float = 0.0


# ---------------------------------------------------------------------------------------------
# Kernel layers set up in the forked child before exec (root only).

_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
# x86_64 syscall numbers refused by the filter.
_DENY_X86_64 = {
    "clone": 56, "fork": 57, "vfork": 58, "clone3": 435,
    "socket": 41, "socketpair": 53, "ptrace": 101, "unshare": 272, "setns": 308,
    "mount": 165, "io_uring_setup": 425, "process_vm_writev": 311,
}
_EPERM = 1
_ENOSYS = 38


def _seccomp_program() -> bytes | None:
    if platform.machine() != "x86_64" or sys.byteorder != "little":
        return None
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, kill_errno = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    ins: list[tuple[int, int, int, int]] = []
    deny = list(_DENY_X86_64.items())
    ins.append((ld_w_abs, 0, 0, 4))  # seccomp_data.arch
    ins.append((jeq_k, 1, 0, _AUDIT_ARCH_X86_64))
    ins.append((ret_k, 0, 0, kill_errno | _EPERM))  # other ABIs (i386 via int 0x80): refuse all
    ins.append((ld_w_abs, 0, 0, 0))  # seccomp_data.nr
    ins.append((jge_k, 0, 1, 0x40000000))  # x32 ABI numbers
    ins.append((ret_k, 0, 0, kill_errno | _EPERM))
    n = len(deny)
    for _name, nr in deny:
        # compare i jumps to return i: skip the n-1-i compares after it, the ALLOW and i returns
        ins.append((jeq_k, n, 0, nr))
    ins.append((ret_k, 0, 0, allow))
    for name, _ in deny:
        # ENOSYS for clone3 makes glibc fall back to clone, which is then refused too
        ins.append((ret_k, 0, 0, kill_errno | (_ENOSYS if name == "clone3" else _EPERM)))
    return b"".join(struct.pack("<HBBI", *i) for i in ins)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_LIBC = None
_SECCOMP_BYTES = _seccomp_program()
_CAPS: dict | None = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _make_preexec(timeout_s: float, memory_mb: int, max_file_bytes: int, netns: bool, seccomp: bool):
    cpu = max(1, math.ceil(timeout_s))
    mem = int(memory_mb) * 2**20
    libc = _libc() if (netns or seccomp) else None
    prog_buf = ctypes.create_string_buffer(_SECCOMP_BYTES) if seccomp else None
    fprog = _SockFprog(len(_SECCOMP_BYTES) // 8, ctypes.addressof(prog_buf)) if seccomp else None

    def preexec():
        # Runs between fork and exec: no allocation-heavy work, no imports.
        if netns and libc.unshare(_CLONE_NEWNET) != 0:
            os._exit(125)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        if seccomp:
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                os._exit(125)
            if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
                os._exit(125)

    preexec._keepalive = (prog_buf, fprog)  # the filter buffer must outlive the fork
    return preexec


def capabilities() -> dict:
    """Which optional kernel layers work here (probed once by starting a trivial child)."""
    global _CAPS
    if _CAPS is not None:
        return _CAPS
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    caps = {"root": root, "nproc_enforced": not root, "netns": False, "seccomp": False}
    for layer in ("netns", "seccomp"):
        # seccomp with no_new_privs needs no privilege; a network namespace needs root
        if (layer == "netns" and not root) or (layer == "seccomp" and _SECCOMP_BYTES is None):
            continue
        try:
            pre = _make_preexec(5, 256, 1 << 20, netns=layer == "netns", seccomp=layer == "seccomp")
            rc = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=pre, env={},
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode
            caps[layer] = rc == 0
        except (OSError, subprocess.SubprocessError):
            caps[layer] = False
    _CAPS = caps
    return caps


# ---------------------------------------------------------------------------------------------


class _Job:
    __slots__ = ("idx", "proc", "root", "deadline", "out", "err", "open_fds", "truncated",
                 "killed", "start")


def _start(idx, source, stdin, timeout_s, memory_mb, max_file_bytes, netns, seccomp, audit):
    root = tempfile.mkdtemp(prefix="trace_sbx_")
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(root, "prog.py"), "w", encoding="utf-8") as f:
        f.write(source)
    stdin_path = os.path.join(root, "stdin")
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(stdin)
    lib_roots = sorted({os.path.realpath(os.path.join(p, "lib")) for p in (sys.base_prefix, sys.prefix)})
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP,
            root, os.path.realpath(work), "\x1f".join(lib_roots), str(VIOLATION_EXIT), VIOLATION_MARK,
            "1" if audit else "0"]
    with open(stdin_path, "rb") as stdin_f:
        proc = subprocess.Popen(
            argv, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env={},
            start_new_session=True, close_fds=True,
            preexec_fn=_make_preexec(timeout_s, memory_mb, max_file_bytes, netns, seccomp),
        )
    job = _Job()
    job.idx, job.proc, job.root = idx, proc, root
    job.start = time.monotonic()
    job.deadline = job.start + timeout_s
    job.out, job.err = bytearray(), bytearray()
    job.open_fds = 2
    job.truncated = False
    job.killed = None
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
    return job


def _kill(job: _Job, reason: str) -> None:
    if job.killed is None:
        job.killed = reason
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _finish(job: _Job, max_output_bytes: int) -> SandboxResult:
    rc = job.proc.wait()
    wall = time.monotonic() - job.start
    shutil.rmtree(job.root, ignore_errors=True)
    stdout = bytes(job.out[:max_output_bytes]).decode("utf-8", "replace")
    stderr = bytes(job.err[:max_output_bytes]).decode("utf-8", "replace")
    reason = job.killed
    violation = None
    if reason is None:
        if rc == VIOLATION_EXIT and VIOLATION_MARK in stderr:
            reason = "violation"
            line = stderr[stderr.rindex(VIOLATION_MARK):].split("\n", 1)[0]
            violation = (line.split(" ") + ["", ""])[1]
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL):
            reason = "cpu"
        elif rc == -signal.SIGXFSZ or (rc != 0 and "[Errno 27] File too large" in stderr):
            # CPython ignores SIGXFSZ, so the write fails with EFBIG instead of killing
            reason = "file_size"
        elif rc != 0 and "MemoryError" in stderr:
            reason = "memory"
        elif rc == 125 and not stderr:
            reason = "setup_failed"
        elif rc < 0:
            reason = f"signal:{-rc}"
    return SandboxResult(
        ok=rc == 0 and reason is None,
        stdout=stdout,
        stderr=stderr,
        returncode=rc,
        timed_out=reason in ("timeout", "cpu"),
        killed_reason=reason,
        violation=violation,
        truncated=job.truncated,
        wall_s=wall,
    )


def run_many(
    sources: list[str],
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    max_file_bytes: int = 1 << 20,
    stdins: list[str] | None = None,
    max_workers: int | None = None,
    _audit_hook: bool = True,
    _kernel_layers: bool = True,
) -> list[SandboxResult]:
    """Run each source in its own sandboxed process, up to `max_workers` at once.

    Single-threaded: one selector loop reads every child's pipes and enforces every deadline, so
    a slow or hostile program costs at most its own timeout. `_audit_hook` / `_kernel_layers`
    exist only so tests can check each defence layer on its own.
    """
    if stdins is not None and len(stdins) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(stdins)} stdins")
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
    caps = capabilities() if _kernel_layers else {"netns": False, "seccomp": False}
    workers = max_workers or max(1, (os.cpu_count() or 1))
    results: list[SandboxResult | None] = [None] * len(sources)
    pending = list(range(len(sources)))[::-1]
    running: dict[int, _Job] = {}
    sel = selectors.DefaultSelector()
    try:
        while pending or running:
            while pending and len(running) < workers:
                i = pending.pop()
                job = _start(i, sources[i], stdins[i] if stdins else "", timeout_s, memory_mb,
                             max_file_bytes, caps["netns"], caps["seccomp"], _audit_hook)
                running[i] = job
                sel.register(job.proc.stdout, selectors.EVENT_READ, (job, job.out))
                sel.register(job.proc.stderr, selectors.EVENT_READ, (job, job.err))
            now = time.monotonic()
            # Children that closed both pipes may still be running (os.close(1) then spin), so
            # they are polled instead of waited on.
            wait = min(j.deadline for j in running.values()) - now
            if any(j.open_fds == 0 for j in running.values()):
                wait = min(wait, 0.005)
            for key, _ in sel.select(max(0.0, wait)):
                job, buf = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    job.open_fds -= 1
                    continue
                buf += chunk
                if len(buf) > max_output_bytes:
                    job.truncated = True
                    _kill(job, "output_limit")
            now = time.monotonic()
            for i, job in list(running.items()):
                if job.killed is None and now >= job.deadline:
                    _kill(job, "timeout")
                if job.killed is not None and job.open_fds:
                    # after SIGKILL nothing more is worth reading; stop watching the pipes
                    for f in (job.proc.stdout, job.proc.stderr):
                        if not f.closed:
                            sel.unregister(f)
                            f.close()
                    job.open_fds = 0
                if job.open_fds == 0 and (job.killed is not None or job.proc.poll() is not None):
                    results[i] = _finish(job, max_output_bytes)
                    del running[i]
    finally:
        for job in running.values():
            _kill(job, "aborted")
            job.proc.wait()
            shutil.rmtree(job.root, ignore_errors=True)
        sel.close()
    return results  # type: ignore[return-value]


def run_python(
    source: str,
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    stdin: str = "",
    max_file_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run one program in the sandbox (see the module docstring for what is enforced)."""
    return run_many([source], timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                    stdins=[stdin], max_file_bytes=max_file_bytes, max_workers=1)[0]
