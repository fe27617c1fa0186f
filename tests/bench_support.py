"""Checks shared by the benchmarks' tests."""

from __future__ import annotations

import re
from typing import Any

from stopline.bench import machine


def assert_stamped(result: dict[str, Any]) -> None:
    """A results dict names its host (CPU, cores, the ISA flags the kernels choose by) and the
    commit it ran on (the tests run in a checkout, so there is one)."""
    m = result["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["summary"]
    assert isinstance(m["isa"], list) and set(m["isa"]) <= set(machine.KERNEL_FLAGS)
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", result["git"]), result["git"]
