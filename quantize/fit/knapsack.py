"""Multiple-choice knapsack (MCKP): one precision per unit, total bytes within the budget,
least total predicted cost.

The per-layer mixed-precision assignment as an integer program over "one choice per layer,
sum of bit-costs under a budget" is the formulation of HAWQ-V3 (Yao et al., arXiv:2011.10680,
ILP over per-layer Hessian-weighted perturbations) and of the mixed-precision searches that
followed; with additive costs it is the classical multiple-choice knapsack problem, solved
exactly here by the textbook dynamic program over capacity (Kellerer, Pferschy, Pisinger,
*Knapsack Problems*, Springer 2004, ch. 11): dp[c] = min over the unit's choices j of
dp_prev[c - w_j] + cost_j. Each class's smallest item is taken as given (its bytes are
subtracted from the budget), and only the increments above it are counted in bins of
`bin_bytes`, rounded *up*, so any solution the DP returns fits the real budget and the
all-smallest solution fits whenever its real size does; the bin size is fixed by the items
(at most BINS_PER_CLASS x classes bins: rounding costs under 1% of the largest increment
total), not by the budget, so a larger budget never yields a larger optimum (monotone).
dp[c] is "the least cost within c bins", so the final row is the whole size/cost Pareto
frontier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

BINS = 4096  # resolution: the largest increment total is cut into at least this many bins
BINS_PER_CLASS = 100


@dataclass(frozen=True)
class Item:
    bytes: int
    cost: float


@dataclass(frozen=True)
class Solution:
    picks: list[int]  # the chosen item's index, per class
    bytes: int  # real bytes of the picks
    cost: float
    feasible: bool


@dataclass
class Table:
    """The solved DP: the frontier (least cost within each capacity) and how to rebuild."""

    classes: list[list[Item]]
    bin_bytes: int
    frontier: np.ndarray  # [bins + 1] least cost within c bins (inf: nothing fits)
    choice: np.ndarray  # [classes, bins + 1] argmin item per class and capacity

    @property
    def base(self) -> int:
        """Bytes of every class at its smallest item (taken before the DP)."""
        return sum(min(i.bytes for i in c) for c in self.classes)

    def capacity(self, budget: int) -> int:
        room = budget - self.base
        return -1 if room < 0 else min(len(self.frontier) - 1, room // self.bin_bytes)

    def increment(self, k: int, j: int) -> int:
        items = self.classes[k]
        return _bins(items[j].bytes - min(i.bytes for i in items), self.bin_bytes)

    def solve(self, budget: int) -> Solution:
        cap = self.capacity(budget)
        if cap < 0 or not math.isfinite(float(self.frontier[cap])):
            return Solution([], 0, math.inf, False)
        picks: list[int] = [0] * len(self.classes)
        c = cap
        for k in range(len(self.classes) - 1, -1, -1):
            j = int(self.choice[k, c])
            picks[k] = j
            c -= self.increment(k, j)
        size = sum(cl[j].bytes for cl, j in zip(self.classes, picks, strict=True))
        cost = sum(cl[j].cost for cl, j in zip(self.classes, picks, strict=True))
        return Solution(picks, size, cost, True)

    def smallest_within(self, max_cost: float, budget: int) -> Solution:
        """The smallest solution whose cost is at most max_cost, within the budget."""
        cap = self.capacity(budget)
        ok: Any = np.nonzero(self.frontier[: cap + 1] <= max_cost)[0] if cap >= 0 else []
        if len(ok) == 0:
            return Solution([], 0, math.inf, False)
        return self.solve(self.base + int(ok[0]) * self.bin_bytes)


def _bins(n: int, bin_bytes: int) -> int:
    return -(-n // bin_bytes)


def build(classes: list[list[Item]], bins: int | None = None) -> Table:
    """Solve the DP for every capacity up to the largest total (all classes at their
    largest item). `bins`: the resolution (default max(BINS, BINS_PER_CLASS x classes))."""
    if not classes or any(not c for c in classes):
        raise ValueError("every class needs at least one item")
    top = sum(max(i.bytes for i in c) - min(i.bytes for i in c) for c in classes)
    bins = bins or max(BINS, BINS_PER_CLASS * len(classes))
    bin_bytes = max(1, _bins(top, bins))
    n = _bins(top, bin_bytes) + len(classes)  # room for per-item rounding up
    dp = np.zeros(n + 1)  # no class yet: cost 0 within any capacity
    choice = np.zeros((len(classes), n + 1), dtype=np.int16)
    for k, items in enumerate(classes):
        new = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, dtype=np.int16)
        low = min(i.bytes for i in items)
        for j, it in enumerate(items):
            w = _bins(it.bytes - low, bin_bytes)
            if w > n:
                continue
            cand = np.full(n + 1, np.inf)
            cand[w:] = dp[: n + 1 - w] + it.cost
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        dp, choice[k] = new, arg
    return Table(classes, bin_bytes, dp, choice)
