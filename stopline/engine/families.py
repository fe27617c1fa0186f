"""The family table: every admitted request by its incarnation, as a family of its n samples.

A holder of the one release (lifecycle.py): a sample that ends leaves its family's links (a
leader's list of samples waiting to fork, a sample's leader), and the family leaves the table
with its last live sample, so that its caller's id may be reused from then on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from stopline.request import Family, InvalidRequest, Request, SamplingParams


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int, max_num_seqs: int) -> list[int]:
    """The prompt as a list of ints, or InvalidRequest if the request can't be served by a
    model of this vocabulary and context: bad parameters, empty or over-long prompt."""
    params.validate()
    if params.n > max_num_seqs:
        raise InvalidRequest(f"n: {params.n} samples; the engine runs at most "
                             f"{max_num_seqs} sequences at once (max_num_seqs)")
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise InvalidRequest("prompt: must contain at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequest(f"logit_bias: token id {max(params.logit_bias)} is outside the "
                             f"vocabulary (0..{vocab_size - 1})")
    if len(prompt) >= max_model_len:
        raise InvalidRequest(f"prompt: {len(prompt)} tokens; the model's context is "
                             f"{max_model_len} tokens (prompt plus at least one new token)")
    return prompt


def new_family(request_id: str, prompt: list[int], params: SamplingParams, arrival: float,
               incarnation: str, base_seed: int) -> Family:
    """A request's n samples as one family: sample i draws with seed base_seed + i, and the
    samples after the first wait to fork from it at its first token."""
    members = [Request(request_id, prompt, params, arrival=arrival, index=i, incarnation=incarnation)
               for i in range(params.n)]
    family = Family(request_id, members, incarnation)
    leader = members[0]
    for i, m in enumerate(members):
        m.family = family
        m.seed = base_seed + i
        if i:
            m.fork_leader = leader
    leader.forks_pending = members[1:]
    return family


def hold(req: Request) -> None:
    """req keeps its blocks but takes no step until unpaused (a split's prefill side, while
    its KV is shipped)."""
    req.paused = True


def detach_fork(sample: Request) -> None:
    """sample has forked from its leader (its first token): it is a request of its own now."""
    leader = sample.fork_leader
    assert leader is not None  # only samples that wait for a leader fork
    sample.fork_leader = None
    leader.forks_pending.remove(sample)


class FamilyTable:
    name = "families"

    def __init__(self) -> None:
        self.by_incarnation: dict[str, Family] = {}

    def add(self, fam: Family) -> None:
        self.by_incarnation[fam.incarnation] = fam

    def get(self, incarnation: str) -> Family | None:
        return self.by_incarnation.get(incarnation)

    def find(self, request_id: str) -> Family | None:
        """The newest live family with this caller's id (for inspection: callers' ids may
        repeat, incarnations never do)."""
        found = None
        for fam in self.by_incarnation.values():
            if fam.request_id == request_id:
                found = fam
        return found

    def __contains__(self, incarnation: str) -> bool:
        return incarnation in self.by_incarnation

    def __len__(self) -> int:
        return len(self.by_incarnation)

    def __iter__(self) -> Iterator[Family]:
        return iter(self.by_incarnation.values())

    def pause(self, incarnation: str, paused: bool) -> None:
        """A paused family keeps its place but takes no step (its client's stream is full)."""
        fam = self.by_incarnation.get(incarnation)
        for m in fam.members if fam is not None else ():
            m.paused = paused

    def live_requests(self) -> list[Request]:
        return [r for fam in self.by_incarnation.values() for r in fam.live()]

    # ---- holder -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        leader = req.fork_leader
        if leader is not None and req in leader.forks_pending:
            leader.forks_pending.remove(req)
        req.fork_leader = None
        fam = req.family
        if fam is not None and not fam.live() and self.by_incarnation.get(fam.incarnation) is fam:
            del self.by_incarnation[fam.incarnation]

    def preempt(self, req: Request) -> None:
        """Nothing: a preempted sample stays in its family."""

    def holds(self, req: Request) -> bool:
        fam = req.family
        in_table = fam is not None and self.by_incarnation.get(fam.incarnation) is fam
        return (req.fork_leader is not None or bool(req.forks_pending)
                or (in_table and not fam.live()))
