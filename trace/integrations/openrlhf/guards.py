"""Start-up checks that every hook TRACE puts into OpenRLHF is in force, each failing with one line.

TRACE runs inside OpenRLHF by replacing or wrapping a few of its names (docs/openrlhf.md, "What is
patched"). An upstream rename or refactor would make such a patch silently miss: the run would then
train OpenRLHF's plain policy, or drop TRACE's records, without any error. These helpers check, at
start-up, that the OpenRLHF symbol a patch targets exists, that the code which should call it still
refers to it, and that the patched object is the one in place; a miss raises `PatchNotInForce`
whose message is one line naming the OpenRLHF symbol. `check_openrlhf_version` refuses an OpenRLHF
release the hooks were not tested with, unless `TRACE_OPENRLHF_UNTESTED_OK=1`.
`launch` prints `error: <line>` and exits 2 on either (`one_line` also unwraps the error a Ray
actor raised).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
import types
import warnings

TESTED_OPENRLHF = ("0.11.2",)
UNTESTED_OK_ENV = "TRACE_OPENRLHF_UNTESTED_OK"


class HookError(RuntimeError):
    """A TRACE hook into OpenRLHF cannot work; the message is a single line."""

    def __init__(self, msg: str):
        super().__init__(" ".join(str(msg).split()))


class PatchNotInForce(HookError):
    """A patch of an OpenRLHF symbol did not take effect (or its target is gone)."""


class UntestedOpenRLHF(HookError):
    """The installed OpenRLHF is not a release TRACE's hooks were tested with."""


def _hint() -> str:
    return f"TRACE's hooks are tested with OpenRLHF {', '.join(TESTED_OPENRLHF)}"


def openrlhf_version() -> str | None:
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_openrlhf_version(installed: str | None = None) -> str | None:
    """Raise UntestedOpenRLHF unless `installed` (default: the installed distribution's version) is a
    tested release or $TRACE_OPENRLHF_UNTESTED_OK is 1 (then a warning); returns the version."""
    v = openrlhf_version() if installed is None else installed
    if v in TESTED_OPENRLHF:
        return v
    msg = (f"OpenRLHF {v or '(not installed)'} is installed, but {_hint()}; "
           f"install openrlhf=={TESTED_OPENRLHF[-1]} or set {UNTESTED_OK_ENV}=1 to run anyway")
    if v is not None and os.environ.get(UNTESTED_OK_ENV) == "1":
        warnings.warn(msg, stacklevel=2)
        return v
    raise UntestedOpenRLHF(msg)


def deepspeed_gathers_wait_all(installed: str | None = None) -> bool:
    """Whether DeepSpeed's ZeRO-3 parameter gather waits on every one of its async all-gathers (0.19.8 and later,
    DeepSpeed PR #8539); before, it waited on the last one only, which on gloo (CPU ranks, each gather on a
    thread of its own) let a world of 2+ ranks read parameters before they arrived. installed: a version string
    (default: the installed distribution's)."""
    from packaging.version import Version

    try:
        v = installed or importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False
    return Version(v) >= Version("0.19.8")


def require_attr(obj, attr: str, symbol: str):
    """obj.attr, or PatchNotInForce naming the OpenRLHF `symbol` (renamed or removed upstream)."""
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise PatchNotInForce(f"OpenRLHF has no `{symbol}` (renamed or removed?); {_hint()}") from None


def require_patched(obj, attr: str, expected, symbol: str) -> None:
    """PatchNotInForce unless obj.attr is `expected` (identity): the patch of `symbol` is in place."""
    found = require_attr(obj, attr, symbol)
    if found is not expected:
        raise PatchNotInForce(f"TRACE's patch of `{symbol}` is not in force (found {found!r}); {_hint()}")


def _names(code: types.CodeType) -> set[str]:
    """Global/attribute names and string constants (keyword names, dict keys) of code and its nested code."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
        elif isinstance(c, str):
            out.add(c)
        elif isinstance(c, tuple):
            out |= {x for x in c if isinstance(x, str)}
    return out


def require_uses(func, name: str, symbol: str, where: str) -> None:
    """PatchNotInForce unless OpenRLHF's `where` (func) refers to `name`: patching `symbol` reaches it
    only while the code that should use it does. Decorators (Ray wraps actor methods) are unwrapped."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    if code is None or name not in _names(code):
        raise PatchNotInForce(f"OpenRLHF's `{where}` no longer uses `{symbol}`, so TRACE's patch of it "
                              f"would have no effect; {_hint()}")


def require_called(count: int, symbol: str, where: str) -> None:
    """PatchNotInForce unless a wrapper of `symbol` ran during OpenRLHF's `where`."""
    if not count:
        raise PatchNotInForce(f"TRACE's patch of `{symbol}` was never called by OpenRLHF's `{where}`; {_hint()}")


def ray_actor_class(remote_cls, symbol: str) -> type:
    """The plain class under a `@ray.remote` actor class (Ray's `__ray_metadata__.modified_class`)."""
    meta = require_attr(remote_cls, "__ray_metadata__", f"{symbol}.__ray_metadata__")
    cls = require_attr(meta, "modified_class", f"{symbol}.__ray_metadata__.modified_class")
    if not isinstance(cls, type):
        raise PatchNotInForce(f"`{symbol}.__ray_metadata__.modified_class` is not a class; {_hint()}")
    return cls


def require_field(dc, name: str, symbol: str) -> None:
    """PatchNotInForce unless dataclass `dc` has field `name` (e.g. Experience.mm_train_inputs)."""
    if not dataclasses.is_dataclass(dc) or name not in {f.name for f in dataclasses.fields(dc)}:
        raise PatchNotInForce(f"OpenRLHF has no field `{symbol}` (renamed or removed?); {_hint()}")


@dataclasses.dataclass(frozen=True)
class Hook:
    """An OpenRLHF name a TRACE hook replaces, wraps or calls: `owner.attr`, named `symbol` in errors."""
    owner: object
    attr: str
    symbol: str
    own: bool = False  # the owner class itself must define it (a method TRACE overrides: inherited is a miss)

    def check(self):
        if self.own and self.attr not in vars(self.owner):
            raise PatchNotInForce(f"OpenRLHF has no `{self.symbol}` (renamed or removed?); {_hint()}")
        return require_attr(self.owner, self.attr, self.symbol)


@dataclasses.dataclass(frozen=True)
class Use:
    """OpenRLHF code (`owner.attr`, named `where`) that must still refer to `name` for a hook on `symbol` to
    take effect."""
    owner: object
    attr: str
    name: str
    symbol: str
    where: str

    def check(self) -> None:
        require_uses(require_attr(self.owner, self.attr, self.where), self.name, self.symbol, self.where)


def check_all(hooks, uses) -> None:
    """Every Hook exists and every Use still refers to its name; the first miss raises PatchNotInForce."""
    for h in hooks:
        h.check()
    for u in uses:
        u.check()


def one_line(exc: BaseException) -> str | None:
    """The one-line message of a HookError, also when a Ray actor raised it (RayTaskError.cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(cause, HookError):
            return str(cause.args[0])
        if isinstance(exc, HookError) and type(exc) in (HookError, PatchNotInForce, UntestedOpenRLHF):
            return str(exc.args[0])
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return None


__all__ = ["TESTED_OPENRLHF", "UNTESTED_OK_ENV", "Hook", "HookError", "PatchNotInForce", "UntestedOpenRLHF", "Use",
           "check_all", "check_openrlhf_version", "one_line", "openrlhf_version", "ray_actor_class", "require_attr",
           "require_called", "require_field", "require_patched", "require_uses"]
