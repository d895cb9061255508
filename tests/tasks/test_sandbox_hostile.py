"""Hostile answers that first switch off the sandbox's audit hook, then aim at the outside.

The audit hook is a tripwire, not a boundary: a one-line answer can reach the hook's function
through `gc.get_objects()` and overwrite its closure cells (writing `cell_contents` raises no audit
event), or patch the builtins the hook calls, reached through `__builtins__`, `sys.modules` or by
walking frames (`sys._getframe`, `f_back`) up to the bootstrap's `f_globals`. What must hold
then are the kernel layers (bubblewrap's mount and PID namespaces, the unprivileged uid, seccomp).
Every payload aims at a planted file to write or delete, a planted secret to read and leak, and an
outside process to signal; each must score 0 and leave all of them untouched. The controls run
the same payloads with the kernel layers off, to show that they do defeat the audit hook alone
(so the main tests are not vacuous). Where no kernel layer confines the filesystem, the sandbox
refuses to run anything, and that refusal is what is tested instead.
"""
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from types import SimpleNamespace

import pytest

import trace.tasks.sandbox as sandbox
from trace.tasks import get_task
from trace.tasks.base import Example
from trace.tasks.coding import MAX_EXPR_CHARS, clean_expression, harness
from trace.tasks.sandbox import SandboxUnavailable, capabilities, run_many

CAPS = capabilities()
INPUTS = [1, 2, 3]

# Neutralizers, each a one-line expression that switches the audit hook off for what follows.
# gc: the hook's `deny` closes over (_exit, _write, mark, violation_exit) in that (sorted) order;
# replacing the two functions with `slice` makes every denial a no-op that returns.
GC = ("[setattr(c,'cell_contents',slice)for g in __import__('gc').get_objects()"
      "if'deny'==getattr(g,'__name__',0)for c in g.__closure__[:2]]")
GC_LONG = ("[setattr(c,'cell_contents',slice)for g in __import__('gc').get_objects()"
           "if getattr(g,'__name__',0)=='deny'for c in g.__closure__ if callable(c.cell_contents)]")
# the hook's path checks start with `isinstance(path, int)` (a file descriptor: allowed); a builtin
# looked up at call time, so patching it in the builtins module (reached two ways) waves every path through
BUILTINS = "setattr(__builtins__,'isinstance',lambda*a:1)"
SYS_MODULES = "setattr(__import__('sys').modules['builtins'],'isinstance',lambda*a:1)"
# frame walking: the outermost frame is the sandbox's bootstrap, whose f_globals hold the builtins
# module the hook looks its builtins up in (inside f: f, the harness, then the bootstrap)
FRAMES = "setattr(__import__('sys')._getframe(2).f_globals['__builtins__'],'isinstance',lambda*a:1)"
FRAMES_PRELUDE = """import sys
f = sys._getframe()
while f.f_back is not None:
    f = f.f_back
b = f.f_globals['__builtins__']
getattr(b, '__dict__', b)['isinstance'] = lambda *a: True
"""
PRELUDES = {"gc": GC + "\n", "gc_long": GC_LONG + "\n", "builtins": BUILTINS + "\n",
            "sys_modules": SYS_MODULES + "\n", "frames": FRAMES_PRELUDE}


@pytest.fixture
def outside():
    """A directory outside any sandbox (short path: the answers are at most 200 characters) with a
    file to delete and a secret, a path to create, and a process to signal."""
    d = tempfile.mkdtemp(prefix="o", dir="/tmp")
    secret = "S3CRET" + uuid.uuid4().hex[:12]
    with open(os.path.join(d, "s"), "w") as f:
        f.write(secret)
    with open(os.path.join(d, "d"), "w") as f:
        f.write("keep")
    sleeper = subprocess.Popen(["sleep", "120"])
    ns = SimpleNamespace(dir=d, write=os.path.join(d, "w"), delete=os.path.join(d, "d"),
                         secret_path=os.path.join(d, "s"), secret=secret, pid=sleeper.pid, proc=sleeper)
    try:
        yield ns
    finally:
        sleeper.kill()
        sleeper.wait()
        shutil.rmtree(d, ignore_errors=True)


def actions(o) -> dict[str, str]:
    """Expressions that each do one harmful thing outside (and return a true value on success)."""
    return {
        "write": f"open('{o.write}','w').write('1')",
        "delete": f"not __import__('os').remove('{o.delete}')",
        "read": f"open('{o.secret_path}').read()",
        "kill": f"not __import__('os').kill({o.pid},9)",
    }


def assert_untouched(o):
    assert not os.path.exists(o.write), "a file was written outside the work directory"
    with open(o.delete) as f:
        assert f.read() == "keep", "a file outside the work directory was changed"
    assert o.proc.poll() is None, "an outside process was killed"


def answer(neutralizer: str, action: str) -> str:
    # correct answers for f(x) = 2x+1, but only if the harmful action succeeded (else it raises)
    return f"({neutralizer},{action},2*x+1)[2]"


def coding_example(inputs=(4,)) -> Example:
    # one hidden input by default, so that f runs once and a deletion is not tried twice
    label = json.dumps({"inputs": list(inputs), "outputs": [2 * x + 1 for x in inputs], "gold": "2*x+1"})
    return Example(prompt="f(0)=1\ndef f(x): return", label=label, datasource="coding")


def _score_zero_or_refused(task, ex, responses):
    """Every response scores 0.0 where a kernel boundary exists (or running without one is opted into); without
    one, the reward path refuses to score at all."""
    if not CAPS["boundary"] and os.environ.get(sandbox.ALLOW_ENV) != "1":
        with pytest.raises(SandboxUnavailable):
            task.score_batch([ex] * len(responses), responses)
    else:
        assert task.score_batch([ex] * len(responses), responses) == [0.0] * len(responses)


def test_gc_closure_escape_scores_zero_through_the_reward_path(outside):
    task = get_task("coding", timeout_s=10.0)
    ex = coding_example()
    responses = []
    for name, act in actions(outside).items():
        expr = answer(GC, act)
        assert len(expr) <= MAX_EXPR_CHARS and clean_expression(" " + expr + "\n") == expr, (name, len(expr))
        responses.append(" " + expr + "\n")
    assert task.score_batch([ex], [" 2*x+1\n"]) == [1.0]
    _score_zero_or_refused(task, ex, responses)
    assert_untouched(outside)


def test_builtins_and_frame_escapes_score_zero_through_the_reward_path(outside):
    task = get_task("coding", timeout_s=10.0)
    ex = coding_example()
    responses = [" " + answer(n, a) + "\n" for n in (BUILTINS, SYS_MODULES, FRAMES)
                 for a in actions(outside).values()]
    assert all(len(r.strip()) <= MAX_EXPR_CHARS for r in responses)
    _score_zero_or_refused(task, ex, responses)
    assert_untouched(outside)


@pytest.mark.skipif(not CAPS["boundary"], reason="no kernel filesystem boundary here: the sandbox refuses")
def test_every_escape_variant_is_contained_by_the_kernel_layers(outside):
    acts = dict(actions(outside), leak=f"print(open('{outside.secret_path}').read())or 1")
    cases, srcs = [], []
    for fam, prelude in PRELUDES.items():
        for act_name, act in acts.items():
            cases.append((fam, act_name))
            srcs.append(prelude + harness(f"({act},2*x+1)[1]", INPUTS))
    # and the same actions with no audit hook at all: the kernel layers on their own
    for act_name, act in acts.items():
        cases.append(("no_hook", act_name))
        srcs.append(harness(f"({act},2*x+1)[1]", INPUTS))
    results = (run_many(srcs[:-len(acts)], timeout_s=10.0)
               + run_many(srcs[-len(acts):], _audit_hook=False, timeout_s=10.0))
    for case, r in zip(cases, results, strict=True):
        # each call of f failed (E: the kernel refused), or the tripwire ended the program; no time-outs
        assert not r.timed_out and r.killed_reason in (None, "violation"), (case, r)
        assert r.stdout in ("E\n" * len(INPUTS), ""), (case, r.stdout, r.stderr[-300:])
        assert outside.secret not in r.stdout + r.stderr, case
    assert_untouched(outside)


def test_control_the_answers_score_one_with_the_audit_hook_alone(outside, monkeypatch):
    # The same answers as above, scored with the kernel layers off: every one does its harm and
    # earns reward 1.0 (the escape as found), so the zeros above come from the kernel layers.
    import trace.tasks.coding as coding
    monkeypatch.setattr(coding, "run_many", lambda srcs, **kw: run_many(srcs, _kernel_layers=False, **kw))
    task = get_task("coding", timeout_s=10.0)
    acts = actions(outside)
    responses = [" " + answer(n, a) + "\n" for n in (GC, BUILTINS, SYS_MODULES, FRAMES)
                 for k, a in acts.items() if k not in ("kill", "delete")]
    responses += [" " + answer(GC, acts["delete"]) + "\n", " " + answer(GC, acts["kill"]) + "\n"]
    assert task.score_batch([coding_example()] * len(responses), responses) == [1.0] * len(responses)
    assert os.path.exists(outside.write) and not os.path.exists(outside.delete)
    assert outside.proc.wait(timeout=5) is not None


@pytest.mark.parametrize("fam", sorted(PRELUDES))
def test_control_the_escapes_do_defeat_the_audit_hook_alone(outside, fam):
    # Without the kernel layers, each neutralizer lets the program read the secret: the audit hook
    # alone is no boundary, which is why the tests above need the kernel layers to pass.
    src = PRELUDES[fam] + harness(f"(print(open('{outside.secret_path}').read()),2*x+1)[1]", [1])
    r = run_many([src], _kernel_layers=False, timeout_s=10.0)[0]
    assert r.ok and outside.secret in r.stdout, (r.killed_reason, r.stderr[-300:])


@pytest.mark.skipif(not CAPS["bwrap"], reason="bubblewrap is not available here")
def test_the_kernel_view_is_minimal_and_unprivileged():
    src = ("import os\nprint(sorted(os.listdir('/')))\nprint(os.getuid(), os.getpid())\n"
           "print([p for p in ('/etc/passwd', '/proc/1', '/home', '/work', '/sys', %r) if os.path.exists(p)])"
           % os.path.realpath(sandbox.__file__))
    r = run_many([src], _audit_hook=False, timeout_s=10.0)[0]
    assert r.ok, r.stderr
    top, ids, seen = r.stdout.splitlines()
    allowed = {"usr", "lib", "lib64", "lib32", "libx32", "dev", "tmp", "root", "etc", "opt"}
    assert set(eval(top)) <= allowed, top
    uid, pid = map(int, ids.split())
    assert pid < 10  # its own PID namespace
    # as root, the program runs as an unprivileged uid; otherwise as the caller's
    assert uid == (sandbox.SANDBOX_UID if CAPS["root"] else os.geteuid())
    assert seen == "[]"
    r = run_many(["import os\nfor f in (lambda: os.setresuid(0, 0, 0), lambda: os.kill(os.getpid(), 0)):\n"
                  "    try:\n        f()\n        print('ok')\n    except OSError as e:\n        print(e.errno)"],
                 _audit_hook=False, timeout_s=10.0)[0]
    # EPERM: the uid cannot be taken back; seccomp refuses even a signal 0 to itself
    assert r.stdout == "1\n" + ("1\n" if CAPS["seccomp"] else "ok\n"), r
    # the standard library is read-only, the work directory writable
    r = run_many(["import json, os\nopen('a', 'w').write('1')\nprint(os.listdir('.'))\n"
                  "try:\n    open(json.__file__, 'a')\nexcept OSError as e:\n    print(e.errno)"],
                 _audit_hook=False, timeout_s=10.0)[0]
    assert r.ok and r.stdout.splitlines()[0] == "['a']" and r.stdout.splitlines()[1] in ("13", "30"), r


def test_refuses_to_run_without_a_kernel_boundary(monkeypatch, capfd):
    weak = dict(CAPS, bwrap=None, mount_ns=False, pid_ns=False, uid=0, drop_uid=-1, unprivileged_uid=False,
                boundary=False)
    monkeypatch.setattr(sandbox, "_CAPS", weak)
    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match=sandbox.ALLOW_ENV):
        run_many(["print(1)"])
    task = get_task("coding", timeout_s=10.0)
    with pytest.raises(SandboxUnavailable):
        task.score_batch([coding_example()], [" sum([2*x,1])\n"])  # a call: goes to the sandbox
    assert task.score_batch([coding_example()], [" 2*x+1\n"]) == [1.0]  # plain arithmetic needs none
    monkeypatch.setenv(sandbox.ALLOW_ENV, "1")
    assert task.score_batch([coding_example()], [" sum([2*x,1])\n"]) == [1.0]


def test_start_up_line_names_the_active_layers(monkeypatch, capfd):
    monkeypatch.setattr(sandbox, "_CAPS", None)
    caps = sandbox.capabilities()
    err = capfd.readouterr().err
    line = [ln for ln in err.splitlines() if "kernel layers:" in ln]
    assert len(line) == 1, err
    for name in ("mount_ns", "pid_ns", "seccomp"):
        assert (name in line[0]) == caps[name], line
    assert ("NO kernel filesystem boundary" in line[0]) == (not caps["boundary"])
