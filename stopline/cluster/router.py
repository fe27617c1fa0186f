"""Where a new request goes: least loaded with prefix affinity, or round robin.

Affinity: the prompt's full KV blocks are hashed as a chain (block 1, blocks 1-2, ...); the
longest chain seen before names the replica that served it, whose prefix cache likely still
holds those blocks. It wins when its load is within `slack` requests of the least loaded;
otherwise load wins. Only healthy replicas are candidates.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from stopline.config import Choice


class Policy(Choice):
    AFFINITY = "affinity"
    ROUND_ROBIN = "round-robin"


class NoReplica(Exception):
    """No healthy replica to send a request to."""


class Router:
    def __init__(self, policy: Policy = Policy.AFFINITY, *, block_size: int = 16,
                 max_blocks: int = 64, slack: int = 2, remember: int = 100_000) -> None:
        self.policy = Policy(policy)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.slack = slack
        self._seen: OrderedDict[int, int] = OrderedDict()  # prefix chain hash -> replica
        self._remember = remember
        self._rr = itertools.count()

    def _chain(self, prompt: Sequence[int]) -> list[int]:
        out, h, bs = [], 0, self.block_size
        for k in range(min(len(prompt) // bs, self.max_blocks)):
            h = hash((h, tuple(prompt[k * bs:(k + 1) * bs])))
            out.append(h)
        return out

    def choose(self, prompt: Sequence[int], healthy: Sequence[int],
               load: Callable[[int], int]) -> int:
        if not healthy:
            raise NoReplica("no replica is healthy")
        if self.policy is Policy.ROUND_ROBIN:
            return healthy[next(self._rr) % len(healthy)]
        chain = self._chain(prompt)
        loads = {r: load(r) for r in healthy}
        least = min(healthy, key=lambda r: (loads[r], r))
        pick = least
        for h in reversed(chain):
            r = self._seen.get(h)
            if r is not None and r in loads:
                if loads[r] <= loads[least] + self.slack:
                    pick = r
                break
        for h in chain:
            self._seen[h] = pick
            self._seen.move_to_end(h)
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return pick
