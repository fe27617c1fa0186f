"""Who to preempt when the pool runs dry. One function per policy; `pick_victim` dispatches."""

from __future__ import annotations

from collections.abc import Callable

from stopline.config import VictimPolicy
from stopline.kv.manager import KVManager
from stopline.request import Request


def _cost(cands: list[Request], deficit: int, kv: KVManager, group: int = 0) -> Request:
    # Among victims that alone cover the deficit (in the pool that lacks), the one with the
    # least work to redo; otherwise the one that frees the most blocks per token of work
    # thrown away.
    enough = [r for r in cands if kv.freeable(r, group) >= deficit]
    if enough:
        return min(enough, key=lambda r: (kv.computed(r), -r.arrival))
    return max(cands, key=lambda r: (kv.freeable(r, group) / max(1, kv.computed(r)), r.arrival))


_KEYS: dict[VictimPolicy, Callable[[Request, KVManager], tuple]] = {
    VictimPolicy.NEWEST: lambda r, kv: (r.arrival, r.internal_id),
    VictimPolicy.FEWEST_OUTPUT: lambda r, kv: (-len(r.output_token_ids), r.prompt_len, r.arrival),
    VictimPolicy.LONGEST_OUTPUT: lambda r, kv: (len(r.output_token_ids), r.arrival),
    VictimPolicy.LEAST_COMPUTED: lambda r, kv: (-kv.computed(r), r.arrival),
    VictimPolicy.PRIORITY: lambda r, kv: (r.params.priority, r.arrival),
}


def pick_victim(policy: VictimPolicy, cands: list[Request], deficit: int,
                kv: KVManager, group: int = 0) -> Request | None:
    """The request to preempt among `cands` (all running, none scheduled this step yet);
    their tables and counts are read through the KV manager. deficit: blocks lacking in
    layer group `group`'s pool (KVManager.deficit)."""
    if not cands:
        return None
    if policy is VictimPolicy.COST:
        return _cost(cands, deficit, kv, group)
    key = _KEYS[policy]
    return max(cands, key=lambda r: key(r, kv))
