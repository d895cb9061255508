"""The sandbox's kernel boundary: what confines a child in the kernel, set up before its interpreter runs.

`trace/tasks/sandbox.py` starts the children and decides which of these layers each one gets (`Layers`); this
module builds them:
  * `make_preexec`: the function run in the forked child between fork and exec. It sets the rlimits (CPU
    seconds, address space, file size, open files, no core dumps) and, where asked, unshares a network
    namespace (root only) and loads the seccomp filter (no_new_privs first, so any user can);
  * `SECCOMP_BYTES`: that filter as a classic-BPF program, built here without libseccomp. On x86_64 it makes
    the syscalls in `_DENY_X86_64` (new processes, sockets, signals and ptrace of other processes, their
    memory, namespaces and mounts, io_uring, bpf, perf events, keyrings, module/kexec/reboot) fail with EPERM
    (clone3 with ENOSYS, so that glibc falls back to clone, which is refused too), and refuses every syscall
    of another ABI (i386 through int 0x80, x32). Elsewhere it is None and the layer is off;
  * `bwrap_argv`: the bubblewrap command line: PID, network, IPC, UTS (and cgroup where possible) namespaces;
    a read-only empty root holding only the interpreter, the standard library and the system's shared-library
    directories, a minimal /dev, the program file (read-only) and the work dir (read-write). As root it keeps
    only CAP_SETUID/CAP_SETGID, which the child program (trace/tasks/sandbox_child.py) uses to switch to
    `SANDBOX_UID` for good; as another user it asks for a user namespace. bubblewrap loads the seccomp filter
    from a pipe just before exec, after its own setup (which needs the calls the filter refuses).

No function here starts a process; which layers work on this machine is probed by `sandbox.capabilities()`.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import struct
import sys
import sysconfig
from dataclasses import dataclass

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

SANDBOX_UID = 65534  # "nobody": what the program runs as when the parent is root


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
# the filter as the kernel takes it (struct sock_filter[]); None where it is not built (not x86_64)
SECCOMP_BYTES = _seccomp_program()
_STATIC_MOUNTS: list[str] | None = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


@dataclass(frozen=True)
class Layers:
    """The kernel layers one child gets."""
    bwrap: str | None = None  # bubblewrap binary: mount, PID, IPC, UTS and network namespaces
    drop_uid: int = -1  # uid the bootstrap switches to (root under bubblewrap), -1: none
    netns: bool = False  # without bubblewrap: unshare the network namespace before exec (root)
    seccomp: bool = False


NO_LAYERS = Layers()


def interpreter() -> str:
    """The real interpreter binary (not a venv's link to it), so the sandbox needs no venv."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def lib_roots() -> list[str]:
    """The standard library's directory (of the real interpreter: a venv's site-packages stay out)."""
    return [os.path.realpath(os.path.join(sys.base_prefix, "lib"))]


def make_preexec(timeout_s: float, memory_mb: int, max_file_bytes: int, netns: bool, seccomp: bool):
    cpu = max(1, math.ceil(timeout_s))
    mem = int(memory_mb) * 2**20
    libc = _libc() if (netns or seccomp) else None
    prog_buf = ctypes.create_string_buffer(SECCOMP_BYTES) if seccomp else None
    fprog = _SockFprog(len(SECCOMP_BYTES) // 8, ctypes.addressof(prog_buf)) if seccomp else None

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
    exe = interpreter()
    libdir = sysconfig.get_config_var("LIBDIR")  # where libpython lives when it is shared
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for d in ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.islink(d):
            links.append((os.readlink(d), d))
        elif os.path.isdir(d):
            binds.append(d)
    for p in [*lib_roots(), os.path.realpath(libdir) if libdir else None, exe, "/etc/ld.so.cache"]:
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


def bwrap_argv(layers: Layers, root: str, work: str, seccomp_fd: int | None) -> list[str]:
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
