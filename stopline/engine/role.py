"""A core's role: the plug-in the one EngineCore calls at fixed points.

One engine serves a request from its prompt to its last token: `Role`, whose every hook does
nothing. A split's sides (stopline/disagg) are roles too: the prefill side ships each prompt's
KV instead of sampling, the decode side holds a request back until its prompt's KV arrives.
The core is never subclassed; it calls its role:

- at construction, `bind(core)`: the role's holders, which the core declares after its own
  and before the KV manager, so the lifecycle's order check covers them;
- at each step start, `step_start()` before the inbox and `after_inbox()` after it (an idle
  wake-up: the role reads what its link brought and ends what passed its deadline);
- before admission, `admit(fam)`: True if the role keeps the family back itself;
- after a prefill completes, `prefilled(req)`: True if the request is taken elsewhere;
- when the loop asks whether to sleep: `messages()`, `holding()`, `idle(req)`, `wake_at()`.

At release the role's holders are walked with every other holder, in the declared order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stopline.lifecycle import Holder
from stopline.request import Family, Request

if TYPE_CHECKING:
    from stopline.engine.core import EngineCore


class Role:
    name = "single"

    def bind(self, core: EngineCore) -> list[Holder]:
        """Called once while the core is built: its pool, KV cache, KV manager and tables
        exist, its lifecycle does not yet. Returns the role's holders, in release order."""
        return []

    def step_start(self) -> None:
        """Each step, before the inbox is applied."""

    def after_inbox(self) -> None:
        """Each step, right after the inbox is applied (new families are known)."""

    def admit(self, fam: Family) -> bool:
        """Before a new family is admitted; True: the role keeps it back (it calls
        `core.admit(fam)` when the family may go on)."""
        return False

    def prefilled(self, req: Request) -> bool:
        """req's prompt is computed and its first token is about to be sampled; True: the
        request is taken elsewhere and samples nothing here."""
        return False

    def messages(self) -> bool:
        """Something waits to be read that is not a request (a link's messages)."""
        return False

    def holding(self) -> bool:
        """The role holds requests that are not in the core's families' steps yet."""
        return False

    def idle(self, req: Request) -> bool:
        """req takes no step until the role hears from elsewhere."""
        return False

    def wake_at(self) -> float:
        """time.monotonic() by which an all-paused core must step with no message (the
        role's deadlines); inf: none."""
        return math.inf

    def transfers(self) -> list[tuple[int, float]] | None:
        """(bytes, seconds) of the KV transfers received; None: the role receives none."""
        return None

    def audit(self, live: Sequence[Request]) -> None:
        """Raise LedgerError if the role holds anything of a request not in `live`."""

    def close(self) -> None:
        """Stop the role's threads and sockets."""
