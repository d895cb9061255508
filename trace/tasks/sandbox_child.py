"""The program that runs first in every sandboxed child (`BOOTSTRAP`, run as ``python -I -S -B -c``).

It reads the program before any policy exists (the program file sits outside the readable work dir), then:
  * under bubblewrap as root, switches to the unprivileged uid it is given (argv[7]) for good, with
    setgroups/setresgid/setresuid, and exits 125 if any of them fails or the ids are not all that uid;
  * drops the PWD that bubblewrap sets (the program gets an empty environment) and sets RLIMIT_NPROC to 0
    (set here, after exec, since an unprivileged uid over that limit could not exec at all);
  * installs the audit-hook tripwire (`sys.addaudithook`, unless argv[6] is "0"): sockets, process creation
    and exec, kill, ctypes, writes outside the work dir, reads outside the work dir and the standard library,
    links/chmod/chown, and imports of socket/subprocess/multiprocessing/ctypes-like modules end the process
    with exit code `VIOLATION_EXIT` and a "`VIOLATION_MARK` <event> <detail>" line on stderr. Ending the
    process, rather than raising, means a program cannot catch a violation and go on. Every function the hook
    calls is bound at install time, because the program can rebind module attributes (os.path.realpath,
    posixpath.islink, ...) but not builtin function objects;
  * runs the program in a fresh namespace as ``__main__``.

The hook is a tripwire, not a boundary: a program can reach its closure cells or patch the builtins it calls
(tests/tasks/test_sandbox_hostile.py shows both); the kernel layers (trace/tasks/sandbox_kernel.py) are what
hold then.
"""

VIOLATION_EXIT = 86
VIOLATION_MARK = "SANDBOX_VIOLATION"

# argv: [1] the root holding prog.py, [2] the work dir, [3] the readable library roots joined by \x1f,
# [4] the violation exit code, [5] the violation mark, [6] "1" to install the hook, [7] the uid to switch to
# (-1: none)
BOOTSTRAP = r'''
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
