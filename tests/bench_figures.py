"""Relations a benchmark's figures must keep, whatever the machine's speed.

Figures are reported to 4 significant digits (benchmarks.significant), so a rate,
its count and its time, or a ratio and its two rates, agree within a few parts in
ten thousand each: REL covers three such roundings.
"""

from __future__ import annotations

import pytest

REL = 2e-3


def assert_quotient(q: float, a: float, b: float, what: str) -> None:
    """q is a / b, as reported."""
    assert q > 0 and a > 0 and b > 0, (what, q, a, b)
    assert q == pytest.approx(a / b, rel=REL), f"{what}: {q} is not {a} / {b}"


def assert_met(met: bool, ratio: float, target: float, what: str) -> None:
    """`met` says whether the ratio reached its target (unless the two are within rounding)."""
    assert isinstance(met, bool), what
    if abs(ratio - target) > REL * target:
        assert met == (ratio >= target), f"{what}: met={met}, ratio {ratio}, target {target}"
