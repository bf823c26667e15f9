"""`NodeCache`: LangGraph's node cache, minus the decisions that must be decided again.

LangGraph stores every finished node's writes in the graph's cache and replays them on a
hit; a node cannot veto that. A decision an engine fault touched (its fallback, or the
escalation that stood in for the canvas), one the escalation budget turned away, or one whose
escalation failed (the canvas answer standing in for the target's: cause `target_fault`) would
be replayed after the engine or the target is back or the budget refills, for the whole TTL.
`NodeCache` wraps any LangGraph cache (`InMemoryCache`, `SqliteCache`, `RedisCache`...)
and does not store the writes of such a decision, so the next run decides again: in this
process and in every worker sharing the cache.

A hit replays the records as they were written, but as a replay (`replayed_record`): the node
did not run and sent no event, so what the records say was spent in this run is nothing
(`timing.totals` all zero, `timing.replayed == "node_cache"`, a new decision id), and what the
decision spent when it was read is their `timing.original`.

```python
builder.add_node("triage", node, cache_policy=node.cache_policy(ttl=300))
graph = builder.compile(cache=NodeCache(InMemoryCache()))
```
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from langgraph.cache.base import BaseCache, FullKey, Namespace

from ._records import is_record, replayed_record

__all__ = ["NodeCache", "replayable_writes", "replayed_writes", "stable_json"]


class NodeCache(BaseCache[Any]):
    """A LangGraph cache that keeps no decision a fault or a budget refusal produced.

    Args:
        cache: The LangGraph cache that stores everything else.
    """

    def __init__(self, cache: BaseCache[Any]) -> None:
        if not isinstance(cache, BaseCache):
            raise TypeError(f"NodeCache wraps a LangGraph BaseCache (e.g. InMemoryCache()), not {type(cache).__name__}")
        super().__init__(serde=cache.serde)
        self.cache = cache
        self.refused = 0
        """Writes not stored (a decision a fault or a budget refusal touched)."""

    def __repr__(self) -> str:
        return f"NodeCache({self.cache!r})"

    def get(self, keys: Sequence[FullKey]) -> dict[FullKey, Any]:
        return {key: replayed_writes(writes) for key, writes in self.cache.get(keys).items()}

    async def aget(self, keys: Sequence[FullKey]) -> dict[FullKey, Any]:
        return {key: replayed_writes(writes) for key, writes in (await self.cache.aget(keys)).items()}

    def set(self, pairs: Mapping[FullKey, tuple[Any, int | None]]) -> None:
        if kept := self._kept(pairs):
            self.cache.set(kept)

    async def aset(self, pairs: Mapping[FullKey, tuple[Any, int | None]]) -> None:
        if kept := self._kept(pairs):
            await self.cache.aset(kept)

    def clear(self, namespaces: Sequence[Namespace] | None = None) -> None:
        self.cache.clear(namespaces)

    async def aclear(self, namespaces: Sequence[Namespace] | None = None) -> None:
        await self.cache.aclear(namespaces)

    def _kept(self, pairs: Mapping[FullKey, tuple[Any, int | None]]) -> dict[FullKey, tuple[Any, int | None]]:
        kept = {key: entry for key, entry in pairs.items() if replayable_writes(entry[0])}
        self.refused += len(pairs) - len(kept)
        return kept


def replayed_writes(writes: Any) -> Any:
    """A node's cached writes `[(channel, value), ...]` as a hit replays them: every decision
    record among the values (flat, or by fan-out branch) a node-cache replay that spent nothing,
    each decision set under a new id; anything else as it was."""
    ids: dict[Any, str] = {}

    def replay(value: Any) -> Any:
        if is_record(value):
            old = (value.get("timing") or {}).get("decision")
            return replayed_record(value, "node_cache", ids.setdefault(old, uuid.uuid4().hex))
        if isinstance(value, Mapping) and value and all(isinstance(v, Mapping) for v in value.values()):
            return {k: replay(v) for k, v in value.items()}
        return value

    return [(w[0], replay(w[1])) if isinstance(w, Sequence) and len(w) == 2 else w for w in writes or ()]


_DECIDED_AGAIN = ("over_budget", "target_fault")
"""Causes a replay must not repeat: the budget or the target may answer next time."""


def replayable_writes(writes: Any) -> bool:
    """Whether a node's writes `[(channel, value), ...]` may be replayed: no decision record
    among the values, flat or grouped by fan-out branch (`{question_id: {branch: record}}`),
    carries an engine fault (`read.error`), a budget refusal (`read.cause == "over_budget"`) or a
    failed escalation's degraded answer (`read.cause == "target_fault"`: not the target's answer)."""
    for write in writes or ():
        value = write[1] if isinstance(write, Sequence) and len(write) == 2 else None
        if isinstance(value, Mapping) and not all(_replayable(v) for v in value.values()):
            return False
    return True


def _replayable(value: Any) -> bool:
    """A record, or a branch group of records, that no fault or budget refusal touched."""
    if is_record(value):
        read = value.get("read")
        return not (isinstance(read, Mapping) and (read.get("error") or read.get("cause") in _DECIDED_AGAIN))
    if isinstance(value, Mapping):  # a fan-out question's records by branch key
        return all(_replayable(v) for v in value.values() if isinstance(v, Mapping))
    return True


def stable_json(value: Any) -> Any:
    """JSON for what `json` cannot write in a node's cache key, the same in every process:
    sets in sorted order (hash randomisation would reorder them), anything else as text."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=lambda v: (type(v).__name__, repr(v)))
    return str(value)
