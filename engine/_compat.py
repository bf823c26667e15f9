"""0.1 spellings, kept for one minor version: each old keyword means exactly its 0.2 spelling.

canvasroute 0.2.0 replaced keywords by values of their own (`Connection`, `Batching`,
`OutcomePolicy`, `Escalation`, `ReadOptions`). Until canvasroute 0.3.0 a call may still use the
0.1 spelling: it gets one `DeprecationWarning` naming the new spelling, attributed to the caller's
line (the first frame outside canvasroute and the libraries it is called through, so Python's
default filters show it once per call site), and it decides exactly as the 0.2 spelling does.
Both spellings of one setting in one call raise `TypeError`.

The machinery is here, with the engine's keywords:

- `moved_keywords(old, translate)`: a function or `__init__` whose callers may name the `old`
  keywords; `translate` rewrites them (inspect.signature still shows the 0.2 signature);
- `keep_removed(cls, **removed)`: a frozen dataclass that takes keywords it no longer has and keeps
  their values (`kept(instance)`), through `dataclasses.replace`, for whoever builds with it to map
  (`GatePolicy(on_unsure=...)` reaches the model's `OutcomePolicy` that way);
- `warn_moved`, `renamed`, `take`: one warning per call; a renamed keyword; old keywords out of a call.

`canvasroute.router._compat` maps the router's and the harness's keywords; CHANGELOG.md has the table.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, ParamSpec, TypeVar

from ._types import Batching
from .transport import Connection, Limits, Retries, Timeout

__all__ = ["CONNECTION", "REMOVED_IN", "SERVER_KEYWORDS", "TRANSFORMERS", "Translate", "connection_keywords",
           "keep_removed", "kept", "moved_keywords", "renamed", "renaming", "server_keywords", "take",
           "transformers_keywords", "warn_moved", "with_kept"]

REMOVED_IN = "0.3.0"
"""The release that drops the 0.1 spellings."""

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
Translate = Callable[[tuple[Any, ...], dict[str, Any]],
                     tuple[tuple[Any, ...], dict[str, Any], Callable[[Any], None] | None]]
"""`(args, kwargs) -> (args, kwargs, after)`: a call in its 0.2 spelling (`moved_keywords`)."""

_THROUGH = frozenset(("canvasroute", "pydantic", "pydantic_core", "langchain_core", "langgraph"))
"""Top-level packages a call passes through on its way here: a warning names the first frame outside them."""


def warn_moved(where: str, moved: Mapping[str, str]) -> None:
    """One `DeprecationWarning` for the 0.1 keywords of one call (`moved`: old keyword -> its 0.2
    spelling), at the caller's line."""
    if not moved:
        return
    said = "; ".join(f"{old}= is {new}" for old, new in moved.items())
    warnings.warn(f"{where}: {said} in canvasroute 0.2 (the 0.1 spelling is removed in {REMOVED_IN})",
                  DeprecationWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """`stacklevel` for `warnings.warn` in `warn_moved`: the first frame outside `_THROUGH`."""
    frame, level = sys._getframe(2), 2  # warn_moved's caller (stacklevel 1 is warn_moved)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in _THROUGH:
        frame, level = frame.f_back, level + 1
    return level


def take(kwargs: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    """The keywords of `names` a call gave, removed from `kwargs` (in the call's order)."""
    return {name: kwargs.pop(name) for name in [k for k in kwargs if k in names]}


def renamed(where: str, kwargs: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`kwargs` with each renamed keyword (`names`: old -> new) under its new name, warned once.

    Raises:
        TypeError: a call naming both spellings.
    """
    old = take(kwargs, names)
    for name, value in old.items():
        if names[name] in kwargs:
            raise TypeError(f"{where}: {name}= is the 0.1 spelling of {names[name]}=; give one of them")
        kwargs[names[name]] = value
    warn_moved(where, {name: f"{names[name]}=" for name in old})
    return kwargs


def renaming(where: str, names: Mapping[str, str]) -> Translate:
    """A `moved_keywords` translation for keywords that only changed their names (old -> new)."""

    def translate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], None]:
        return args, renamed(where, kwargs, names), None

    return translate


def moved_keywords(old: Collection[str], translate: Translate) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function (or `__init__`) whose callers may still name the 0.1 keywords `old`:
    `translate(args, kwargs)` returns the call in the 0.2 spelling (and warns), and what to run on
    the first argument once the call is done (for an `__init__`: the instance; None: nothing).
    The wrapped function's signature is the 0.2 one (`inspect.signature` follows `__wrapped__`);
    a call naming none of `old` costs one set test."""
    names = frozenset(old)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> R:
            if names.isdisjoint(kwargs):
                return fn(*args, **kwargs)
            args, kwargs, after = translate(args, dict(kwargs))
            result = fn(*args, **kwargs)
            if after is not None:
                after(args[0])
            return result

        return call

    return decorate


_KEPT: dict[type, tuple[type, Mapping[str, tuple[str, Collection[str]]]]] = {}
"""Each class `keep_removed` was given -> its subclass that keeps the removed keywords, and them."""
_SUBCLASSES: set[type] = set()


def keep_removed(cls: type[T], **removed: tuple[str, Collection[str]]) -> type[T]:
    """Let the frozen dataclass `cls` take keywords it no longer has (`removed`: name -> (its 0.2
    spelling, the values 0.1 took)).

    `cls(..., name=value)` warns and returns an instance of a subclass (the same name and fields,
    plus `removed`, the old keywords' values as sorted pairs) that `dataclasses.replace` and every
    copy keep, so the value they meant reaches whoever builds with the instance (`kept`). A call
    naming none of them builds a plain `cls`. Returns the subclass.

    Raises:
        ValueError: (at `cls(...)`) a removed keyword given a value 0.1 did not take.
    """
    sub = dataclasses.make_dataclass(
        cls.__name__, [("removed", tuple, dataclasses.field(default=()))], bases=(cls,), frozen=True,
        kw_only=True, slots=True, namespace={"__module__": cls.__module__})
    sub.__qualname__ = f"{cls.__qualname__}._Kept"
    sub.__doc__ = f"A {cls.__name__} given 0.1 keywords ({', '.join(removed)}): `removed` holds them."
    names = frozenset(removed)
    init: Callable[..., None] = vars(sub)["__init__"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the subclass's constructor
        old = take(kwargs, names)
        if old:
            _check(cls.__name__, old, removed)
            warn_moved(cls.__name__, {name: removed[name][0] for name in old})
            kwargs["removed"] = tuple(sorted({**dict(kwargs.get("removed", ())), **old}.items()))
        init(self, *args, **kwargs)

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - cls's allocator
        return object.__new__(sub if klass is cls and not names.isdisjoint(kwargs) else klass)

    sub.__init__ = __init__  # type: ignore[misc]
    signature = inspect.signature(cls)  # what help() and editors show stays the 0.2 constructor
    cls.__new__ = staticmethod(__new__)  # type: ignore[assignment,method-assign]
    cls.__signature__ = signature  # type: ignore[attr-defined]
    setattr(cls, "_Kept", sub)  # noqa: B010 - where pickle finds it (its `__qualname__`)
    _KEPT[cls] = (sub, removed)
    _SUBCLASSES.add(sub)
    return sub


def _check(where: str, old: Mapping[str, Any], removed: Mapping[str, tuple[str, Collection[str]]]) -> None:
    for name, value in old.items():
        if value not in removed[name][1]:
            raise ValueError(f"{where}: {name} must be one of {', '.join(map(str, removed[name][1]))}, "
                             f"not {value!r}")


def with_kept(cls: type[T], values: Mapping[str, Any], removed: Mapping[str, Any]) -> T:
    """`cls(**values)` keeping the removed keywords `removed` (checked as `cls(...)` checks them),
    without a warning: for a caller that has warned in words of its own (a policy file's loader)."""
    if not removed:
        return cls(**values)
    sub, spec = _KEPT[cls]
    _check(cls.__name__, removed, spec)
    return sub(**values, removed=tuple(sorted(removed.items())))  # type: ignore[no-any-return]


def kept(value: Any) -> dict[str, Any]:
    """The removed keywords a `keep_removed` instance was built with (empty for any other value)."""
    return dict(value.removed) if type(value) in _SUBCLASSES else {}


# -- the engine's keywords ---------------------------------------------------------------------

CONNECTION = {
    "api_key": "Connection(url, api_key=...)",
    "timeout": "Connection(url, timeout=Timeout(read=...))",
    "connect_timeout": "Connection(url, timeout=Timeout(connect=...))",
    "max_concurrency": "Connection(url, limits=Limits(max_concurrency=...))",
    "max_connections": "Connection(url, limits=Limits(max_concurrency=...))",
    "keepalive_expiry": "Connection(url, limits=Limits(keepalive_expiry=...))",
    "max_response_bytes": "Connection(url, limits=Limits(max_response_bytes=...))",
    "max_retries": "Connection(url, retries=Retries(max_retries=...))",
    "backoff": "Connection(url, retries=Retries(backoff=...))",
    "replica_cooldown": "Connection(url, retries=Retries(replica_cooldown=...))",
    "verify": "Connection(url, verify=...)",
    "cert": "Connection(url, cert=...)",
    "trust_env": "Connection(url, trust_env=...)",
    "transport": "Connection(url, transport=...)",
}
"""The transport keywords 0.1's clients took (`VLLMServerEngine`, `SystemOneDecisionModel`), and
where each went: one `Connection`."""


def connection_keywords(where: str, url: Any, kwargs: dict[str, Any], *, names: Collection[str],
                        spelled: Mapping[str, str] | None = None) -> Any:
    """The connection a 0.1 call meant: `url` (a URL, URLs, or a `Connection`) and the transport
    keywords of `names` taken out of `kwargs` (warned once, with `spelled`'s extra old keywords).

    Raises:
        TypeError: transport keywords beside a `Connection` (they are its own: give them to it).
    """
    old = take(kwargs, names)
    warn_moved(where, {**(spelled or {}), **{name: CONNECTION[name] for name in old}})
    if not old:
        return url
    if isinstance(url, Connection):
        raise TypeError(f"{where}: {', '.join(f'{k}=' for k in old)} beside a Connection: they are the "
                        "connection's own settings, give them to Connection(...)")
    timeout = Timeout(**{new: old[name] for name, new in (("timeout", "read"), ("connect_timeout", "connect"))
                         if name in old})
    limits = Limits(**{new: old[name] for name, new in (
        ("max_concurrency", "max_concurrency"), ("max_connections", "max_concurrency"),
        ("keepalive_expiry", "keepalive_expiry"), ("max_response_bytes", "max_response_bytes")) if name in old})
    retries = Retries(**{name: old[name] for name in ("max_retries", "backoff", "replica_cooldown") if name in old})
    rest = {name: old[name] for name in ("api_key", "verify", "cert", "trust_env", "transport") if name in old}
    return Connection(url, timeout=timeout, limits=limits, retries=retries, **rest)


SERVER_KEYWORDS = frozenset((*CONNECTION.keys() - {"max_connections"}, "base_url"))
"""`VLLMServerEngine`'s 0.1 keywords: its transport, now its `Connection`'s (and `base_url=`, now
the first argument, `connection`)."""


def server_keywords(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], None]:
    """`VLLMServerEngine(url, max_retries=..., ...)` as `VLLMServerEngine(Connection(url, ...))`."""
    spelled = {}
    if "base_url" in kwargs:
        if len(args) > 1 or "connection" in kwargs:
            raise TypeError("VLLMServerEngine: base_url= is the 0.1 name of connection (the first argument); "
                            "give one of them")
        args, spelled = (*args, kwargs.pop("base_url")), {"base_url": "the first argument, connection"}
    if len(args) < 2:
        raise TypeError("VLLMServerEngine needs a connection: a URL, URLs or a Connection")
    connection = connection_keywords("VLLMServerEngine", args[1], kwargs, names=SERVER_KEYWORDS, spelled=spelled)
    return (args[0], connection, *args[2:]), kwargs, None


TRANSFORMERS = {
    "max_batch": "batching=Batching(max_batch=...)",
    "batch_window_s": "batching=Batching(window_s=...)",
    "max_queue": "batching=Batching(max_queue=...)",
    "canvas_prefix": "gone (the engine works out its canvas prefix; until 0.3.0 it still overrides it)",
    "end_of_turn": "gone (the engine works out its end of turn; until 0.3.0 it still overrides it)",
}
"""`TransformersEngine`'s 0.1 keywords and their 0.2 spelling."""


def transformers_keywords(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
        tuple[Any, ...], dict[str, Any], Callable[[Any], None] | None]:
    """`TransformersEngine(..., max_batch=, batch_window_s=, max_queue=)` as `batching=Batching(...)`;
    `canvas_prefix=` / `end_of_turn=` (no 0.2 spelling) override what the engine reports, as in 0.1."""
    old = take(kwargs, TRANSFORMERS)
    warn_moved("TransformersEngine", {name: TRANSFORMERS[name] for name in old})
    batch = {new: old[name] for name, new in (("max_batch", "max_batch"), ("batch_window_s", "window_s"),
                                              ("max_queue", "max_queue")) if name in old}
    if batch:
        if kwargs.get("batching", Batching()) != Batching():
            raise TypeError(f"TransformersEngine: {', '.join(f'{k}=' for k in batch)} beside batching=: "
                            "give them to Batching(...)")
        kwargs["batching"] = Batching(**batch)
    overrides = {name: old[name] for name in ("canvas_prefix", "end_of_turn") if old.get(name) is not None}

    def override(engine: Any) -> None:
        engine._info = dataclasses.replace(engine._info, **overrides)

    return args, kwargs, override if overrides else None
