"""Speculative decoding without a second model: n-gram drafts over a request's own tokens
(ngram.py), the per-request draft state as a holder of the one release (drafts.py), and the
auto mode's measured costs (policy.py). docs/speculative.md states the contract."""
