"""LoRA adapters in the engine: the loaded set, and each request's reference as a holder.

A request holds its adapter from admission (`hold`) until the one release drops it
(lifecycle.py): finish, cancel, deadline, error, a failed grammar, all alike, exactly once
(the reference is a set membership, so a second release finds nothing). Preemption keeps it:
a preempted or swapped request resumes under the same adapter. The audit checks, after every
step in debug mode and on demand, that each adapter's count equals its live requests.

Load and unload run on the core's thread between steps (core_loop.py utility calls), never
inside a step, so no step sees an adapter come or go. Unload is a stop with a policy:

- `wait`: new requests for it are refused as unknown; it goes once its last request ends;
- `abort`: its requests end `abort` with source `unload`, then it goes at once;
- `refuse`: refused (409) while any request holds it.

Residency: at most `max_loras` loaded adapters sit in the model's stacked slots (model/lora.py
`Slots`), the only place a step reads adapter weights from. The scheduler admits a waiting
request only once its adapter is resident (`resident`): a free slot takes it, or the least
recently used resident adapter that no live request holds is evicted for it; otherwise the
request waits in the queue while base rows and resident adapters' requests go on. A held
adapter is never evicted, so a running, preempted or swapped request always finds its slot.
Loaded adapters stay in host memory (up to `max_cpu_loras`) whether resident or not.

Answers are dicts (`status`, `message`) so they cross the process transport as they are.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from stopline.config import Choice
from stopline.kv.block_pool import LedgerError
from stopline.model.config import ModelConfig
from stopline.model.lora import Adapter, LoraError, Slots
from stopline.model.lora import load as load_adapter
from stopline.request import Request, RequestStatus

_loads = itertools.count(1)


class UnloadPolicy(Choice):
    WAIT = "wait"
    ABORT = "abort"
    REFUSE = "refuse"


def answer(status: int, message: str, **extra: Any) -> dict[str, Any]:
    return {"status": status, "message": message, **extra}


class Adapters:
    name = "adapters"

    def __init__(self, config: ModelConfig, loaded: dict[str, Adapter], *, max_loras: int,
                 max_rank: int, max_cpu_loras: int | None = None) -> None:
        """loaded: the model's table of adapters (LlamaModel.adapters); max_loras: resident
        slots (the model's lora_slots is `self.slots`); max_cpu_loras: most loaded."""
        self.config = config
        self.loaded = loaded
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.max_rank = max_rank
        self.slots = Slots(config, max_loras)
        self.used_at: dict[str, int] = {}  # resident adapter -> the last step tick that used it
        self._tick = 0
        self.refs: dict[str, set[Request]] = {}
        self.held: dict[Request, tuple[str, int]] = {}  # request -> (adapter, its load)
        self.load_id: dict[str, int] = {}
        # Unloading, by policy: no new requests. With `abort`, a request accepted before the
        # unload but admitted after it ends as the unload's others do.
        self.draining: dict[str, UnloadPolicy] = {}
        # Metrics: requests admitted, tokens generated, loads and unloads per adapter.
        self.requests: Counter = Counter()
        self.tokens: Counter = Counter()
        self.loads: Counter = Counter()
        self.unloads: Counter = Counter()
        self.evictions: Counter = Counter()
        self.slot_waits = 0  # admissions put off: every slot's adapter was held

    # ---- which adapters serve ------------------------------------------------------------
    def serves(self, name: str) -> bool:
        return name in self.loaded and name not in self.draining

    def load(self, name: str, path: str, load_id: int | None = None) -> dict[str, Any]:
        """Load (and check) an adapter; 400 naming the problem, and nothing changes, if bad.
        load_id: the load's id, given when several cores must agree on it (a split's roles
        key a shipped prefix by it); None: the next of this process."""
        if not name or not isinstance(name, str):
            return answer(400, "lora_name must be a non-empty string")
        if name in self.loaded:
            return answer(400, f"adapter {name!r} is already loaded"
                          + (" (unloading: wait until it is gone)" if name in self.draining else ""))
        if len(self.loaded) >= self.max_cpu_loras:
            return answer(400, f"{len(self.loaded)} adapters are loaded, the limit (--max-cpu-loras, "
                          f"by default --max-loras) is {self.max_cpu_loras}: unload one first")
        try:
            adapter = load_adapter(name, path, self.config, self.max_rank)
        except LoraError as exc:
            return answer(400, str(exc))
        except (OSError, ValueError) as exc:
            return answer(400, f"adapter {name!r}: cannot load {path}: {exc}")
        self.loaded[name] = adapter
        self.load_id[name] = next(_loads) if load_id is None else int(load_id)
        self.refs[name] = set()
        self.loads[name] += 1
        return answer(200, f"adapter {name!r} loaded", rank=adapter.rank, modules=list(adapter.modules),
                      load_id=self.load_id[name])

    def unload(self, name: str, policy: UnloadPolicy | str) -> tuple[dict[str, Any], list[Request]]:
        """The answer, and the requests the core must abort (source `unload`) for it."""
        try:
            policy = UnloadPolicy(policy)
        except ValueError:
            return answer(400, f"policy must be one of wait, abort, refuse, got {policy!r}"), []
        if name not in self.loaded:
            return answer(404, f"adapter {name!r} is not loaded"), []
        users = list(self.refs.get(name, ()))
        if users and policy is UnloadPolicy.REFUSE:
            return answer(409, f"adapter {name!r} is in use by {len(users)} requests"), []
        if self.draining.get(name) is not UnloadPolicy.ABORT:  # abort, once asked, stays
            self.draining[name] = policy
        if policy is UnloadPolicy.ABORT:
            return answer(200, f"adapter {name!r} unloaded; {len(users)} requests aborted",
                          aborted=len(users)), users
        self.reap()
        gone = name not in self.loaded
        return answer(200, f"adapter {name!r} unloaded" if gone else
                      f"adapter {name!r} unloads when its {len(users)} requests end", pending=not gone), []

    def reap(self) -> list[str]:
        """Drop draining adapters no request holds any more (after each step and each unload)."""
        gone = [n for n in self.draining if not self.refs.get(n)]
        for n in gone:
            self._vacate(n)
            del self.draining[n]
            del self.loaded[n]
            self.refs.pop(n, None)
            self.load_id.pop(n, None)
            self.unloads[n] += 1
        return gone

    # ---- residency ----------------------------------------------------------------------------
    def resident(self, req: Request) -> bool:
        """Whether req's adapter (if any) is in a slot, placing it there if a slot is free or
        an unused one can be evicted (least recently used first). False: it waits."""
        name = req.params.lora
        if name is None:
            return True
        self._tick += 1
        if self.slots.index(name) >= 0:
            self.used_at[name] = self._tick
            return True
        names = self.slots.names
        slot = names.index(None) if None in names else -1
        if slot < 0:
            idle = [n for n in names if n is not None and not self.refs.get(n)]
            if not idle:
                self.slot_waits += 1
                return False  # every slot's adapter is held by a live request
            victim = min(idle, key=lambda n: self.used_at.get(n, 0))
            slot = self._vacate(victim)
            self.evictions[victim] += 1
        self.slots.place(slot, self.loaded[name])
        self.used_at[name] = self._tick
        return True

    def ran(self, names: Sequence[str | None]) -> None:
        """The adapters of a step's rows were used now (the LRU order)."""
        self._tick += 1
        for n in names:
            if n is not None:
                self.used_at[n] = self._tick

    def _vacate(self, name: str) -> int:
        """Take an adapter out of its slot (evicted, or unloaded); its slot, or -1."""
        slot = self.slots.index(name)
        if slot >= 0:
            self.slots.clear(slot)
        self.used_at.pop(name, None)
        return slot

    def is_resident(self, name: str) -> bool:
        return self.slots.index(name) >= 0

    # ---- the holder --------------------------------------------------------------------------
    def hold(self, req: Request) -> bool:
        """Take req's reference at admission. False: its adapter went after add_request took
        it (an unload between the two); the core ends it as the unload's other requests.
        Draining with `wait` still admits: the request came before the unload; with `abort`
        it ends as the unload's other requests do."""
        name = req.params.lora
        if name is None:
            return True
        if name not in self.loaded or self.draining.get(name) is UnloadPolicy.ABORT:
            return False
        self.refs[name].add(req)
        self.held[req] = (name, self.load_id[name])
        self.requests[name] += 1
        return True

    def salt(self, req: Request) -> Hashable:
        """What the prefix cache keys req's blocks by besides its tokens: its adapter's load."""
        return self.held.get(req)

    def release(self, req: Request) -> None:
        held = self.held.pop(req, None)
        if held is not None:
            self.refs[held[0]].discard(req)
            self.tokens[held[0]] += len(req.output_token_ids)

    def preempt(self, req: Request) -> None:
        """A preempted request resumes under the same adapter: it keeps its reference."""

    def holds(self, req: Request) -> bool:
        return req in self.held

    def counts(self) -> dict[str, int]:
        return {n: len(self.refs.get(n, ())) for n in self.loaded}

    def audit(self, live: Sequence[Request]) -> None:
        """Each adapter's count is the number of its live requests (zero when idle)."""
        want = Counter(r.params.lora for r in live if r.params.lora is not None and r in self.held)
        if any(r.params.lora is not None and r not in self.held for r in live):
            raise LedgerError("a live request with an adapter holds no reference to it")
        have = {n: c for n, c in self.counts().items() if c}
        if have != dict(want):
            raise LedgerError(f"adapter references {have} != live requests per adapter {dict(want)}")
        if set(self.refs) != set(self.loaded) or any(n not in self.loaded for n in self.draining):
            raise LedgerError("adapter tables disagree: references for an adapter not loaded")
        resident = [n for n in self.slots.names if n is not None]
        if len(resident) != len(set(resident)) or not set(resident) <= set(self.loaded):
            raise LedgerError(f"adapter slots {self.slots.names} hold an adapter twice or one not loaded")
        scheduled = (RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        away = {r.params.lora for r in live if r.params.lora is not None and r.status in scheduled
                and not self.is_resident(r.params.lora)}
        if away:
            raise LedgerError(f"adapters {sorted(away)} of scheduled requests are not resident")
