"""Who to preempt when the pool runs dry. One function per policy; `pick_victim` dispatches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stopline.config import VictimPolicy
from stopline.request import Request


def _freeable(req: Request, refcount: Sequence[int]) -> int:
    """Blocks that would return to the pool if req let go (shared ones would not)."""
    return sum(1 for b in req.block_ids if refcount[b] == 1)


def _cost(cands: list[Request], deficit: int, refcount: Sequence[int]) -> Request:
    # Among victims that alone cover the deficit, the one with the least work to redo;
    # otherwise the one that frees the most blocks per token of work thrown away.
    enough = [r for r in cands if _freeable(r, refcount) >= deficit]
    if enough:
        return min(enough, key=lambda r: (r.num_computed, -r.arrival))
    return max(cands, key=lambda r: (_freeable(r, refcount) / max(1, r.num_computed), r.arrival))


_KEYS: dict[VictimPolicy, Callable[[Request], tuple]] = {
    VictimPolicy.NEWEST: lambda r: (r.arrival, r.internal_id),
    VictimPolicy.FEWEST_OUTPUT: lambda r: (-len(r.output_token_ids), r.prompt_len, r.arrival),
    VictimPolicy.LONGEST_OUTPUT: lambda r: (len(r.output_token_ids), r.arrival),
    VictimPolicy.LEAST_COMPUTED: lambda r: (-r.num_computed, r.arrival),
    VictimPolicy.PRIORITY: lambda r: (r.params.priority, r.arrival),
}


def pick_victim(policy: VictimPolicy, cands: list[Request], deficit: int,
                refcount: Sequence[int]) -> Request | None:
    """The request to preempt among `cands` (all running, none scheduled this step yet)."""
    if not cands:
        return None
    if policy is VictimPolicy.COST:
        return _cost(cands, deficit, refcount)
    return max(cands, key=_KEYS[policy])
