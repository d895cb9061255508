"""Sandbox: ordinary programs work; hostile programs are contained (DESIGN.md section 7).

Every defence is tested on its own where it can be switched off (`_audit_hook=False` leaves only
the process/rlimit/kernel layers), so a test fails if the layer it names stops working.
"""
import os
import time
import uuid

import pytest

from trace.tasks.sandbox import VIOLATION_EXIT, capabilities, run_many, run_python

CAPS = capabilities()
pytestmark = pytest.mark.usefixtures("allow_weak_sandbox")
needs_netns = pytest.mark.skipif(not CAPS["netns"], reason="network namespaces need root + unshare")
needs_kernel_fork_block = pytest.mark.skipif(
    not (CAPS["seccomp"] or CAPS["nproc_enforced"]), reason="no kernel-level fork block available here")


def assert_violation(r, event_prefix):
    assert not r.ok
    assert r.killed_reason == "violation", (r.returncode, r.stderr[-300:])
    assert r.returncode == VIOLATION_EXIT
    assert r.violation.startswith(event_prefix), r.violation


def test_plain_program_stdout_stdin_and_stdlib():
    r = run_python("import json, math, re, random, collections\nx = input()\nprint(json.dumps([x, math.gcd(12, 18)]))",
                   stdin="hello\n")
    assert r.ok and r.returncode == 0 and r.killed_reason is None
    assert r.stdout == '["hello", 6]\n'


def test_environment_is_empty_and_tempdir_is_removed():
    r = run_python("import os\nprint(dict(os.environ))\nprint(os.getcwd())")
    assert r.ok, r.stderr
    env_line, cwd = r.stdout.splitlines()
    # the only variable is the one CPython's own C-locale coercion (PEP 538) sets for itself
    assert eval(env_line, {"__builtins__": {}}) in ({}, {"LC_CTYPE": "C.UTF-8"})
    assert "trace_sbx_" in cwd and not os.path.exists(cwd)


def test_writes_inside_workdir_allowed():
    r = run_python("open('a.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
                   "print(open('d/b.txt').read())")
    assert r.ok, r.stderr
    assert r.stdout == "hi\n"


def test_exception_is_reported_not_killed():
    r = run_python("raise ValueError('boom')")
    assert not r.ok and r.returncode == 1 and r.killed_reason is None
    assert "ValueError: boom" in r.stderr


def test_infinite_loop_times_out_quickly():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert r.timed_out and r.killed_reason == "timeout" and not r.ok


def test_sleeping_program_times_out_on_wall_clock():
    # no CPU is used, so only the wall deadline can stop it
    t0 = time.monotonic()
    r = run_python("import time\ntime.sleep(30)", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert r.killed_reason == "timeout"


def test_closed_pipes_then_spin_still_times_out():
    t0 = time.monotonic()
    r = run_python("import os\nos.close(1)\nos.close(2)\nwhile True: pass", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert r.timed_out


@pytest.mark.parametrize("src", [
    "while True:\n    print('x' * 1000)",
    "import sys\nsys.stdout.write('y' * 10**7)",
    "import sys\nsys.stderr.write('z' * 10**7)",
])
def test_huge_output_truncated_without_hang(src):
    t0 = time.monotonic()
    r = run_python(src, max_output_bytes=10_000, timeout_s=5)
    assert time.monotonic() - t0 < 3.0
    assert r.truncated and r.killed_reason == "output_limit"
    assert len(r.stdout) <= 10_000 and len(r.stderr) <= 10_000


@pytest.mark.parametrize("src", [
    "x = bytearray(10**9)",
    "l = []\nwhile True:\n    l.append(bytearray(10**6))",
])
def test_memory_blowup_killed(src):
    r = run_python(src, memory_mb=128, timeout_s=5)
    assert not r.ok and r.killed_reason == "memory", (r.returncode, r.stderr[-200:])


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'0' * (4 << 20))", max_file_bytes=1 << 20)
    assert not r.ok and r.killed_reason == "file_size"


@pytest.mark.parametrize("src,event", [
    ("import os\nos.fork()", "os.fork"),
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import os\nos.system('touch /tmp/x')", "os.system"),
    ("import subprocess\nsubprocess.run(['ls'])", "import"),
    ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/sh', ['sh'], {})", "os.posix_spawn"),
    ("import os\nos.kill(1, 9)", "os.kill"),
])
def test_process_creation_blocked_by_audit_hook(src, event):
    assert_violation(run_python(src), event)


@needs_kernel_fork_block
def test_fork_blocked_by_kernel_layer_alone():
    src = ("import os\ntry:\n    pid = os.fork()\nexcept OSError as e:\n    print('blocked', e.errno)\n"
           "else:\n    print('forked' if pid else 'child')\n    os._exit(0) if pid == 0 else None")
    r = run_many([src], _audit_hook=False)[0]
    assert r.ok, r.stderr
    assert r.stdout.startswith("blocked"), r.stdout
    if CAPS["root"]:
        # control: root ignores RLIMIT_NPROC, so without seccomp the same fork succeeds
        ctl = run_many([src], _audit_hook=False, _kernel_layers=False)[0]
        assert ctl.stdout.startswith("forked"), ctl.stdout


def test_violation_cannot_be_caught():
    src = "try:\n    import socket\nexcept BaseException:\n    pass\nprint('survived')"
    r = run_python(src)
    assert_violation(r, "import")
    assert "survived" not in r.stdout


def test_write_outside_workdir_blocked():
    target = f"/tmp/pwned_{uuid.uuid4().hex}"
    srcs = [
        f"open({target!r}, 'w').write('x')",
        f"import os\nfd = os.open({target!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')",
        f"open('../../{os.path.basename(target)}', 'w')",
        f"import pathlib\npathlib.Path({target!r}).write_text('x')",
        "import os\nfd = os.open('.', os.O_RDONLY)\nos.open('../x', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')",
        f"import os\nos.mkdir({target!r})",
        "import os\nos.remove('/etc/hostname')",
    ]
    for r in run_many(srcs):
        assert r.killed_reason == "violation", (r.returncode, r.stderr[-300:])
    assert not os.path.exists(target)
    assert os.path.exists("/etc/hostname") or not os.path.exists("/etc")


def test_reading_outside_workdir_is_blocked():
    # documented policy: only the work dir, the standard library and /dev/{null,zero,urandom} are readable
    assert_violation(run_python("print(open('/etc/passwd').read())"), "open")
    assert_violation(run_python("import os\nprint(os.listdir('/'))"), "os.listdir")
    assert_violation(run_python("import os\nprint(os.listdir('/root'))"), "os.listdir")


@pytest.mark.parametrize("src", [
    "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))",
    "import _socket",
    "__import__('importlib').import_module('socket')",
])
def test_socket_blocked_by_audit_hook(src):
    assert_violation(run_python(src), "import")


@needs_netns
def test_network_unreachable_without_audit_hook():
    # with seccomp the socket() call itself fails; with only the network namespace, connect does
    src = ("import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
           "except OSError as e:\n    print('blocked', e.errno)\nelse:\n    print('connected')")
    r = run_many([src], _audit_hook=False)[0]
    assert r.ok, r.stderr
    assert r.stdout.startswith("blocked")
    # and the control: without the kernel layers the same connect reaches the host's loopback,
    # so the check above is not vacuous (refused or connected, but not "unreachable")
    ctl = run_many([src.replace("print('blocked', e.errno)", "print('err', e.errno)")],
                   _audit_hook=False, _kernel_layers=False)[0]
    assert ctl.ok and (ctl.stdout.startswith("connected") or ctl.stdout.startswith("err 111"))


@pytest.mark.parametrize("src", [
    "import ctypes",
    "import _ctypes",
    "import importlib\nimportlib.import_module('ctypes')",
    "import multiprocessing",
    "import sys\nsys.addaudithook(lambda *a: None)",
])
def test_ctypes_and_escape_hatches_blocked(src):
    r = run_python(src)
    assert r.killed_reason == "violation", (r.returncode, r.stderr[-300:])


def test_batch_is_fast_and_ordered():
    t0 = time.monotonic()
    rs = run_many([f"print({i} * {i})" for i in range(24)])
    dt = time.monotonic() - t0
    assert [r.stdout for r in rs] == [f"{i * i}\n" for i in range(24)]
    assert dt < 6.0, dt  # ~25 ms per program on 2 cores here


def test_batch_isolates_hostile_neighbours():
    rs = run_many(["print(1)", "while True: pass", "import os\nos.system('id')", "print(2)"], timeout_s=0.5)
    assert [r.ok for r in rs] == [True, False, False, True]
    assert rs[1].timed_out and rs[2].killed_reason == "violation"
    assert rs[0].stdout == "1\n" and rs[3].stdout == "2\n"


def test_bad_arguments():
    with pytest.raises(ValueError):
        run_many(["print(1)"], stdins=[])
    with pytest.raises(ValueError):
        run_python("print(1)", timeout_s=0)
