"""Sandboxed execution of untrusted generated Python (coding-task verification).

``run_python(src, timeout_s=2.0)`` runs `src` in a fresh interpreter and returns a `SandboxResult`;
``run_many(srcs)`` runs a batch concurrently from one thread (an event loop over the children's
pipes), which is how the coding verifier scores a whole RL batch. Compared against: the execution
sandboxes of code-RL stacks (e.g. sandbox-fusion, firejail/nsjail setups); this one takes its kernel
boundary from bubblewrap and adds no Python dependency; it is meant for the short expression programs
of the synthetic coding task (DESIGN.md section 7).

Layers, outermost first (each is tested on its own with a hostile program):
  * separate process in its own session; a wall-clock deadline SIGKILLs the whole process group;
  * ``python -I -S -B`` (the real interpreter, not a venv's link): no site-packages, no environment
    (env is empty), no bytecode writes;
  * rlimits: CPU seconds, address space (memory_mb), file size, open files, no core dumps, and
    RLIMIT_NPROC=0 (stops fork for non-root users; root ignores it, hence the next layers);
  * the kernel boundary, from bubblewrap (`bwrap`, Debian's package, installed by scripts/install.sh):
    a mount namespace whose only contents are the interpreter, the standard library and the system's
    shared-library directories (read-only, on a read-only empty root, with a minimal /dev) and the
    work dir (read-write); a PID namespace (no other process can be seen, so none can be signalled);
    IPC, UTS and network namespaces (a loopback with nothing behind it); and, when the parent is root,
    an unprivileged uid (65534): the bootstrap, started with only CAP_SETUID/CAP_SETGID, switches to
    it for good before any of the program runs. Not root: bubblewrap uses a user
    namespace, and the program keeps the caller's (unprivileged) uid;
  * on x86_64, for any user, a seccomp filter that makes fork/vfork/clone/clone3, socket/socketpair,
    ptrace, signals to any process (kill, tkill, tgkill, rt_*sigqueueinfo, pidfd_send_signal and
    pidfd_open/getfd), another process's memory, unshare/setns/mount and the other mount calls,
    io_uring, bpf, perf events, keyrings and module/kexec/reboot calls fail with EPERM in the kernel,
    whatever the program does (bubblewrap loads it just before exec; without bubblewrap, the forked
    child does, and as root it also gets a private network namespace with no interface up);
  * inside the child a `sys.addaudithook` policy that ends the process (exit code 86, a
    "SANDBOX_VIOLATION <event>" line on stderr) on: sockets, subprocess/exec/spawn/fork/system,
    kill, ctypes (import and every ctypes event), opening a file for writing outside the work dir,
    reading files outside the work dir and the standard library (so /etc/passwd is BLOCKED),
    symlinks/hardlinks/chmod/chown, and importing socket/subprocess/multiprocessing/ctypes modules.
    Ending the process, rather than raising, means a program cannot catch a violation and go on.
  * cwd is a fresh temp dir (the only writable place), deleted afterwards; stdout and stderr are
    each capped at max_output_bytes and the child is killed when it goes past the cap.

Which kernel layers work is probed once per process (`capabilities()`, by starting trivial children)
and printed as one line on stderr ("[trace.tasks.sandbox] kernel layers: ..."). If no kernel layer
confines the filesystem (no working bubblewrap: not installed, or, for a non-root caller, user
namespaces not allowed; an unprivileged uid alone still reaches that user's own files), `run_many`
refuses to run anything and raises `SandboxUnavailable`: the coding reward is then not scored at
all, rather than scored behind the audit hook alone. ``TRACE_SANDBOX_ALLOW_NO_BOUNDARY=1`` opts in to running with the
remaining layers anyway; ``TRACE_SANDBOX_BWRAP=<path>`` names the bwrap binary (empty or 0: none).

Known limits, stated plainly: Python audit hooks are a tripwire, not a security boundary (CPython's
docs say so): a one-line program can reach the hook through `gc.get_objects()` and overwrite its
closure cells, or patch the builtins it calls (tests/tasks/test_sandbox_hostile.py does both, and
shows each defeats the hook alone). What holds then is the kernel: outside files are not in the
program's view, other processes are not in its PID namespace, its uid owns nothing outside the work
dir, and seccomp refuses process creation, sockets and signals. Without bubblewrap, as root, file
access is stopped by the audit hook alone, hence the refusal above. bubblewrap costs a few ms per
program (benchmarks/bench_coding_reward.py). `preexec_fn` is used, so call from a single-threaded
process or accept CPython's caveat.

Where each layer is: this module starts the children, enforces the deadline and the output caps, reads
the results and probes the kernel layers (`capabilities`); trace/tasks/sandbox_kernel.py builds the kernel
boundary (rlimits and seccomp in the forked child, the bubblewrap command line); trace/tasks/sandbox_child.py
holds the program that runs first in the child (the uid switch and the audit-hook tripwire).
"""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from trace.tasks.sandbox_child import BOOTSTRAP, VIOLATION_EXIT, VIOLATION_MARK
from trace.tasks.sandbox_kernel import (
    NO_LAYERS,
    SANDBOX_UID,
    SECCOMP_BYTES,
    Layers,
    bwrap_argv,
    interpreter,
    lib_roots,
    make_preexec,
)


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


# Opt-in to score without a kernel filesystem boundary (see the module docstring).
ALLOW_ENV = "TRACE_SANDBOX_ALLOW_NO_BOUNDARY"
# Path of the bwrap binary to use; empty or "0" turns bubblewrap off.
BWRAP_ENV = "TRACE_SANDBOX_BWRAP"


class SandboxUnavailable(RuntimeError):
    """No kernel layer confines the program's filesystem access, and the user has not opted in."""


_CAPS: dict | None = None  # what `capabilities` found, once per process


def _probe_bwrap(path: str, drop_uid: int, seccomp: bool) -> dict | None:
    """Start one child through bubblewrap and report what it saw, or None if it did not start."""
    hostfile = os.path.realpath(__file__)  # exists here, must not exist in the child's view
    src = ("import posix\ntry:\n    posix.stat(%r)\n    seen = 1\nexcept OSError:\n    seen = 0\n"
           "print(posix.getuid(), posix.getpid(), seen)" % hostfile)
    layers = Layers(bwrap=path, drop_uid=drop_uid, seccomp=seccomp)
    try:
        r = _run_jobs([src], [""], 10.0, 256, 4096, 1 << 20, 1, layers, audit=False)[0]
        uid, pid, seen = (int(v) for v in r.stdout.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if not r.ok:
        return None
    return {"uid": uid, "pid_ns": pid != os.getpid() and pid < 10, "mount_ns": seen == 0}


def capabilities() -> dict:
    """Which kernel layers work here (probed once by starting trivial children); prints one line."""
    global _CAPS
    if _CAPS is not None:
        return _CAPS
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    # netns_preexec: the network namespace the forked child unshares itself (no bubblewrap)
    caps = {"root": root, "nproc_enforced": not root, "netns_preexec": False, "seccomp": False,
            "bwrap": None, "mount_ns": False, "pid_ns": False, "uid": os.geteuid(), "drop_uid": -1}
    for layer in ("netns_preexec", "seccomp"):
        # seccomp with no_new_privs needs no privilege; a network namespace needs root
        if (layer == "netns_preexec" and not root) or (layer == "seccomp" and SECCOMP_BYTES is None):
            continue
        try:
            pre = make_preexec(5, 256, 1 << 20, netns=layer == "netns_preexec", seccomp=layer == "seccomp")
            rc = subprocess.run([interpreter(), "-I", "-S", "-c", "pass"], preexec_fn=pre, env={},
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode
            caps[layer] = rc == 0
        except (OSError, subprocess.SubprocessError):
            caps[layer] = False
    env = os.environ.get(BWRAP_ENV)
    bwrap = shutil.which("bwrap", path=os.environ.get("PATH", "") + ":/usr/bin:/bin") if env is None else env
    if bwrap and bwrap != "0":
        # as root, the child switches to an unprivileged uid; if that fails, it stays root inside
        for drop in ((SANDBOX_UID, -1) if root else (-1,)):
            seen = _probe_bwrap(bwrap, drop, caps["seccomp"])
            if seen is not None:
                caps.update(bwrap=bwrap, mount_ns=seen["mount_ns"], pid_ns=seen["pid_ns"], uid=seen["uid"],
                            drop_uid=drop, nproc_enforced=seen["uid"] != 0)
                break
    caps["netns"] = caps["bwrap"] is not None or caps["netns_preexec"]
    caps["unprivileged_uid"] = caps["uid"] != 0
    caps["boundary"] = caps["mount_ns"]
    _CAPS = caps
    active = [name for name in ("mount_ns", "pid_ns", "netns", "seccomp") if caps[name]]
    active.append(f"uid={caps['uid']}" + ("" if caps["unprivileged_uid"] else " (root)"))
    how = f"bubblewrap at {caps['bwrap']}" if caps["bwrap"] else "no bubblewrap"
    verdict = ("" if caps["boundary"] else
               f"; NO kernel filesystem boundary: refusing to run programs unless {ALLOW_ENV}=1")
    print(f"[trace.tasks.sandbox] kernel layers: {' '.join(active)} ({how}); "
          f"audit hook as tripwire{verdict}", file=sys.stderr, flush=True)
    return caps


def _layers_for(kernel_layers) -> Layers:
    """True: every layer that works here; False: none; a collection of names ("bwrap", "netns",
    "seccomp"): those of them that work (the benchmark's comparisons)."""
    if kernel_layers is False:
        return NO_LAYERS
    caps = capabilities()
    want = {"bwrap", "netns", "seccomp"} if kernel_layers is True else set(kernel_layers)
    use_bwrap = "bwrap" in want and caps["bwrap"] is not None
    return Layers(bwrap=caps["bwrap"] if use_bwrap else None, drop_uid=caps["drop_uid"] if use_bwrap else -1,
                   netns=(not use_bwrap) and "netns" in want and caps["netns_preexec"],
                   seccomp="seccomp" in want and caps["seccomp"])


def describe_layers(kernel_layers=True) -> str:
    """One line naming the layers a child gets with `run_many(..., _kernel_layers=kernel_layers)`."""
    lay = _layers_for(kernel_layers)
    caps = capabilities()
    if lay.bwrap:
        parts = [f"bwrap({'mount_ns ' if caps['mount_ns'] else ''}{'pid_ns ' if caps['pid_ns'] else ''}netns "
                 f"uid={caps['uid']})"]
    else:
        parts = ["netns"] if lay.netns else []
        parts.append(f"uid={os.geteuid()}")
    parts += ["seccomp"] if lay.seccomp else []
    return " ".join(parts) + " + rlimits + audit hook"


# ---------------------------------------------------------------------------------------------


class _Job:
    __slots__ = ("idx", "proc", "root", "deadline", "out", "err", "open_fds", "truncated",
                 "killed", "start", "bwrap")


def _start(idx, source, stdin, timeout_s, memory_mb, max_file_bytes, layers: Layers, audit):
    root = tempfile.mkdtemp(prefix="trace_sbx_")
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    if layers.drop_uid >= 0:
        os.chown(work, layers.drop_uid, layers.drop_uid)
    with open(os.path.join(root, "prog.py"), "w", encoding="utf-8") as f:
        f.write(source)
    stdin_path = os.path.join(root, "stdin")
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(stdin)
    work = os.path.realpath(work)
    argv = [interpreter(), "-I", "-S", "-B", "-X", "utf8", "-c", BOOTSTRAP,
            root, work, "\x1f".join(lib_roots()), str(VIOLATION_EXIT), VIOLATION_MARK,
            "1" if audit else "0", str(layers.drop_uid)]
    pass_fds: tuple[int, ...] = ()
    if layers.bwrap:
        # bwrap reads the filter from a pipe and loads it just before exec (after its own setup)
        rfd = None
        if layers.seccomp:
            rfd, wfd = os.pipe()
            os.write(wfd, SECCOMP_BYTES)
            os.close(wfd)
            pass_fds = (rfd,)
        argv = bwrap_argv(layers, root, work, rfd) + argv
        preexec = make_preexec(timeout_s, memory_mb, max_file_bytes, netns=False, seccomp=False)
    else:
        preexec = make_preexec(timeout_s, memory_mb, max_file_bytes, layers.netns, layers.seccomp)
    try:
        with open(stdin_path, "rb") as stdin_f:
            proc = subprocess.Popen(
                argv, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env={},
                start_new_session=True, close_fds=True, pass_fds=pass_fds, preexec_fn=preexec,
            )
    finally:
        for fd in pass_fds:
            os.close(fd)
    job = _Job()
    job.idx, job.proc, job.root = idx, proc, root
    job.bwrap = bool(layers.bwrap)
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
    if job.bwrap and rc > 128:
        rc = 128 - rc  # bwrap exits with 128 + N when the program died of signal N
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
        elif (rc == 125 and not stderr) or (job.bwrap and rc == 1 and stderr.startswith("bwrap: ")):
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
    _kernel_layers=True,
) -> list[SandboxResult]:
    """Run each source in its own sandboxed process, up to `max_workers` at once.

    Single-threaded: one selector loop reads every child's pipes and enforces every deadline, so
    a slow or hostile program costs at most its own timeout. Raises `SandboxUnavailable` when no
    kernel layer confines the filesystem here, unless TRACE_SANDBOX_ALLOW_NO_BOUNDARY=1.
    `_audit_hook` / `_kernel_layers` exist only so tests can check each defence layer on its own
    and the benchmark can time them (`_layers_for` says what `_kernel_layers` accepts).
    """
    if stdins is not None and len(stdins) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(stdins)} stdins")
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
    if _kernel_layers is True and not capabilities()["boundary"] and os.environ.get(ALLOW_ENV) != "1":
        raise SandboxUnavailable(
            "refusing to run generated code: no kernel layer confines its filesystem access here "
            "(no working bubblewrap: install it with `apt-get install bubblewrap`; as a non-root user it "
            "also needs unprivileged user namespaces). "
            f"Set {ALLOW_ENV}=1 to run with the remaining layers (rlimits, seccomp, network namespace, "
            "audit hook) anyway.")
    layers = _layers_for(_kernel_layers)
    workers = max_workers or max(1, (os.cpu_count() or 1))
    return _run_jobs(sources, stdins or [""] * len(sources), timeout_s, memory_mb, max_output_bytes,
                     max_file_bytes, workers, layers, _audit_hook)


def _run_jobs(sources, stdins, timeout_s, memory_mb, max_output_bytes, max_file_bytes, workers,
              layers: Layers, audit: bool) -> list[SandboxResult]:
    results: list[SandboxResult | None] = [None] * len(sources)
    pending = list(range(len(sources)))[::-1]
    running: dict[int, _Job] = {}
    sel = selectors.DefaultSelector()
    try:
        while pending or running:
            while pending and len(running) < workers:
                i = pending.pop()
                job = _start(i, sources[i], stdins[i], timeout_s, memory_mb, max_file_bytes, layers, audit)
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
