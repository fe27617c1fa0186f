"""What the server keeps per request stays bounded without anyone reading it (issue 47 item 4:
the soak's server grew 0.94 KiB a request; tracemalloc put most of it in TokenRate)."""

from __future__ import annotations

from stopline.server.metrics import TokenRate


def test_token_rate_keeps_only_its_window_when_nobody_reads_it():
    rate = TokenRate(window=2.0)
    for k in range(100_000):  # 100 outputs a second for 1,000 s; the console never asks
        rate.add(3, now=k / 100)
    assert len(rate._marks) <= 2.0 * 100 + 1
    assert rate.rate(now=99_999 / 100) == 3 * len(rate._marks) / 2.0


def test_token_rate_counts_the_last_window():
    rate = TokenRate(window=2.0)
    rate.add(10, now=0.0)
    rate.add(4, now=1.5)
    assert rate.rate(now=1.9) == 7.0
    assert rate.rate(now=2.9) == 2.0  # the first mark left the window
    assert rate.rate(now=10.0) == 0.0
