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

Over 700 lines on purpose: every isolation layer above sits in this one file, so that whoever judges
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
import sysconfig
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

def _drop(uid):
    # Under bubblewrap as root: leave uid 0 (and the CAP_SETUID/CAP_SETGID kept for this) for good.
    if uid >= 0:
        try:
            posix.setgroups([])
            posix.setresgid(uid, uid, uid)
            posix.setresuid(uid, uid, uid)
        except OSError:
            posix._exit(125)
        if posix.getresuid() != (uid, uid, uid) or posix.getresgid() != (uid, uid, uid):
            posix._exit(125)
    # bubblewrap always sets PWD; the program gets an empty environment
    posix.environ.pop(b"PWD", None)
    if "PWD" in getattr(sys.modules.get("os"), "environ", ()):
        del sys.modules["os"].environ["PWD"]
    import resource
    # no new processes (root ignores it, hence seccomp and the uid drop); set here, after exec, as
    # an unprivileged uid over the limit could not exec at all
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

_drop(int(sys.argv[7]))

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
del _install, _drop, _f
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
# Kernel layers: set up in the forked child before exec, or by bubblewrap.

_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
# x86_64 syscall numbers refused by the filter: new processes, sockets, other processes (signals,
# ptrace, their memory and file descriptors), namespaces and mounts, and kernel administration.
_DENY_X86_64 = {
    "clone": 56, "fork": 57, "vfork": 58, "clone3": 435,
    "socket": 41, "socketpair": 53, "ptrace": 101, "unshare": 272, "setns": 308,
    "mount": 165, "io_uring_setup": 425, "process_vm_writev": 311,
    "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
    "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "process_vm_readv": 310,
    "kcmp": 312, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
    "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168,
}
_EPERM = 1
_ENOSYS = 38

# Opt-in to score without a kernel filesystem boundary (see the module docstring).
ALLOW_ENV = "TRACE_SANDBOX_ALLOW_NO_BOUNDARY"
# Path of the bwrap binary to use; empty or "0" turns bubblewrap off.
BWRAP_ENV = "TRACE_SANDBOX_BWRAP"
SANDBOX_UID = 65534  # "nobody": what the program runs as when the parent is root


class SandboxUnavailable(RuntimeError):
    """No kernel layer confines the program's filesystem access, and the user has not opted in."""


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
_STATIC_MOUNTS: list[str] | None = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


@dataclass(frozen=True)
class _Layers:
    """The kernel layers one child gets."""
    bwrap: str | None = None  # bubblewrap binary: mount, PID, IPC, UTS and network namespaces
    drop_uid: int = -1  # uid the bootstrap switches to (root under bubblewrap), -1: none
    netns: bool = False  # without bubblewrap: unshare the network namespace before exec (root)
    seccomp: bool = False


_NO_LAYERS = _Layers()


def _interpreter() -> str:
    """The real interpreter binary (not a venv's link to it), so the sandbox needs no venv."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _lib_roots() -> list[str]:
    """The standard library's directory (of the real interpreter: a venv's site-packages stay out)."""
    return [os.path.realpath(os.path.join(sys.base_prefix, "lib"))]


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
        if seccomp:
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                os._exit(125)
            if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
                os._exit(125)

    preexec._keepalive = (prog_buf, fprog)  # the filter buffer must outlive the fork
    return preexec


def _static_mounts() -> list[str]:
    """bwrap arguments for the read-only part of the view: the interpreter binary, the standard
    library and the system's shared-library directories (every path at its own place)."""
    global _STATIC_MOUNTS
    if _STATIC_MOUNTS is not None:
        return _STATIC_MOUNTS
    exe = _interpreter()
    libdir = sysconfig.get_config_var("LIBDIR")  # where libpython lives when it is shared
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for d in ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.islink(d):
            links.append((os.readlink(d), d))
        elif os.path.isdir(d):
            binds.append(d)
    for p in [*_lib_roots(), os.path.realpath(libdir) if libdir else None, exe, "/etc/ld.so.cache"]:
        if p and os.path.exists(p) and p not in binds:
            binds.append(p)
    binds.sort()
    kept: list[str] = []
    for b in binds:  # a path inside one already bound is visible through it
        if not any(b.startswith(k + "/") for k in kept):
            kept.append(b)
    args = _mkdirs([k for k in kept] + [d for _, d in links])
    for b in kept:
        args += ["--ro-bind", b, b]
    for target, d in links:
        args += ["--symlink", target, d]
    _STATIC_MOUNTS = args
    return args


def _mkdirs(dests: list[str]) -> list[str]:
    """Create the parents of mount points as 0755 directories (bwrap would copy the host's mode,
    and /root's 0700 would lock the unprivileged uid out of a standard library below it)."""
    parents = set()
    for d in dests:
        p = os.path.dirname(d)
        while p not in ("/", ""):
            parents.add(p)
            p = os.path.dirname(p)
    args = []
    for p in sorted(parents, key=lambda q: (q.count("/"), q)):
        if not any(p == d or p.startswith(d + "/") for d in dests):
            args += ["--perms", "0755", "--dir", p]
    return args


def _bwrap_argv(layers: _Layers, root: str, work: str, seccomp_fd: int | None) -> list[str]:
    argv = [layers.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--as-pid-1"]
    if os.geteuid() == 0:
        if layers.drop_uid >= 0:
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    prog = os.path.join(root, "prog.py")
    argv += _static_mounts() + _mkdirs([prog, work])
    argv += ["--dev", "/dev", "--ro-bind", prog, prog, "--bind", work, work, "--chdir", work,
             "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--"]


def _probe_bwrap(path: str, drop_uid: int, seccomp: bool) -> dict | None:
    """Start one child through bubblewrap and report what it saw, or None if it did not start."""
    hostfile = os.path.realpath(__file__)  # exists here, must not exist in the child's view
    src = ("import posix\ntry:\n    posix.stat(%r)\n    seen = 1\nexcept OSError:\n    seen = 0\n"
           "print(posix.getuid(), posix.getpid(), seen)" % hostfile)
    layers = _Layers(bwrap=path, drop_uid=drop_uid, seccomp=seccomp)
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
        if (layer == "netns_preexec" and not root) or (layer == "seccomp" and _SECCOMP_BYTES is None):
            continue
        try:
            pre = _make_preexec(5, 256, 1 << 20, netns=layer == "netns_preexec", seccomp=layer == "seccomp")
            rc = subprocess.run([_interpreter(), "-I", "-S", "-c", "pass"], preexec_fn=pre, env={},
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


def _layers_for(kernel_layers) -> _Layers:
    """True: every layer that works here; False: none; a collection of names ("bwrap", "netns",
    "seccomp"): those of them that work (the benchmark's comparisons)."""
    if kernel_layers is False:
        return _NO_LAYERS
    caps = capabilities()
    want = {"bwrap", "netns", "seccomp"} if kernel_layers is True else set(kernel_layers)
    use_bwrap = "bwrap" in want and caps["bwrap"] is not None
    return _Layers(bwrap=caps["bwrap"] if use_bwrap else None, drop_uid=caps["drop_uid"] if use_bwrap else -1,
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


def _start(idx, source, stdin, timeout_s, memory_mb, max_file_bytes, layers: _Layers, audit):
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
    argv = [_interpreter(), "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP,
            root, work, "\x1f".join(_lib_roots()), str(VIOLATION_EXIT), VIOLATION_MARK,
            "1" if audit else "0", str(layers.drop_uid)]
    pass_fds: tuple[int, ...] = ()
    if layers.bwrap:
        # bwrap reads the filter from a pipe and loads it just before exec (after its own setup)
        rfd = None
        if layers.seccomp:
            rfd, wfd = os.pipe()
            os.write(wfd, _SECCOMP_BYTES)
            os.close(wfd)
            pass_fds = (rfd,)
        argv = _bwrap_argv(layers, root, work, rfd) + argv
        preexec = _make_preexec(timeout_s, memory_mb, max_file_bytes, netns=False, seccomp=False)
    else:
        preexec = _make_preexec(timeout_s, memory_mb, max_file_bytes, layers.netns, layers.seccomp)
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
              layers: _Layers, audit: bool) -> list[SandboxResult]:
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
