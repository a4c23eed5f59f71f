"""The few statistics a comparison over seeds needs, in plain Python (no SciPy: it is not a dependency).

* :func:`mean` and :func:`sample_std` (n - 1 in the denominator) of one metric over seeds;
* :func:`student_t_975`, the 95 % critical value of Student's t, from a table;
* :func:`paired_difference`: patched − baseline seed by seed (the same seed gives both runs the same data order and
  initial weights), its mean and a confidence interval with N − 1 degrees of freedom;
* :func:`verdict`: whether that difference is larger than the seed noise, in words;
* :func:`paired_t_p_value` and :func:`holm_adjusted`: the two-sided p-value of a paired difference and Holm's
  step-down correction of a family of them (several comparisons read together).

``recipes.compare --seeds N`` and ``recipes.sweep`` use them, so both say the same thing in the same words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ONE_SEED = "one seed: no error bar"
WITHIN_NOISE = "within seed noise"
LARGER_THAN_NOISE = "difference larger than seed noise"
NO_DIFFERENCE = "no difference"


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; an empty sequence is an error (there is nothing to report)."""
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float | None:
    """The sample standard deviation (n - 1 in the denominator); None for fewer than two values (no spread to
    estimate from one run)."""
    if len(values) < 2:
        return None
    centre = mean(values)
    return math.sqrt(math.fsum((value - centre) ** 2 for value in values) / (len(values) - 1))


# Student's t quantile t_{0.975}(dof), the half-width factor of a two-sided 95 % interval, as printed in every t
# table (three decimals). Degrees of freedom between two rows take the row below: a slightly larger factor, so a
# slightly wider interval, never a narrower one.
# fmt: off
T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
    40: 2.021, 60: 2.000, 120: 1.980,
}
# fmt: on


def student_t_975(dof: int) -> float:
    """t_{0.975} with ``dof`` degrees of freedom (the 95 % two-sided critical value), from :data:`T_975`."""
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {dof!r}")
    return T_975[max(row for row in T_975 if row <= dof)]


@dataclass(frozen=True)
class PairedDifference:
    """patched − baseline over the seeds both were run with.

    ``ci_low``/``ci_high`` bound the mean difference with 95 % confidence (Student t, n - 1 degrees of freedom);
    they and ``std`` are None for a single seed.
    """

    n: int
    mean: float
    std: float | None
    ci_low: float | None
    ci_high: float | None
    baseline_mean: float

    @property
    def relative(self) -> float | None:
        """The mean difference in percent of the baseline's mean (None for a zero baseline)."""
        return None if self.baseline_mean == 0 else 100.0 * self.mean / abs(self.baseline_mean)

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low is not None and (self.ci_low > 0 or self.ci_high < 0)

    @property
    def p_value(self) -> float | None:
        """The two-sided p-value of a paired t-test of ``mean == 0``; None for a single seed."""
        if self.std is None:
            return None
        if self.std == 0:
            return 1.0 if self.mean == 0 else 0.0
        return paired_t_p_value(self.mean / (self.std / math.sqrt(self.n)), self.n - 1)


def paired_difference(patched: Sequence[float], baseline: Sequence[float]) -> PairedDifference:
    """The mean of patched[i] − baseline[i] (seed i of each) and its 95 % confidence interval."""
    if len(patched) != len(baseline):
        raise ValueError(f"paired values need the same seeds: {len(patched)} patched vs {len(baseline)} baseline")
    if not patched:
        raise ValueError("no seeds to compare")
    differences = [p - b for p, b in zip(patched, baseline)]
    centre, spread = mean(differences), sample_std(differences)
    low = high = None
    if spread is not None:
        half = student_t_975(len(differences) - 1) * spread / math.sqrt(len(differences))
        low, high = centre - half, centre + half
    return PairedDifference(len(differences), centre, spread, low, high, mean(baseline))


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), by the continued fraction of the incomplete beta function (modified Lentz), on the side of
    ``x`` where it converges fast (the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) for the other)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(1.0 - x, b, a)
    log_front = (
        a * math.log(x) + b * math.log1p(-x) - math.log(a) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    )
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction


def paired_t_p_value(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's T with ``dof`` degrees of freedom: I_{dof/(dof+t²)}(dof/2, 1/2)."""
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {dof!r}")
    return min(1.0, regularized_incomplete_beta(dof / (dof + t * t), dof / 2.0, 0.5))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the i-th smallest (from 0) is
    multiplied by ``m - i``, and each kept at least as large as the one before it (capped at 1). Rejecting where
    the adjusted value is below alpha keeps the chance of any false call in the family at most alpha."""
    order = sorted(range(len(p_values)), key=lambda index: p_values[index])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def verdict(
    difference: PairedDifference,
    greater_is_better: bool,
    no_difference_below: float | None = None,
    p_adjusted: float | None = None,
    alpha: float = 0.05,
) -> str:
    """In words: larger than seed noise (better or worse), or within it. One seed gives no error bar: without
    ``no_difference_below`` that is what it says; with it (a percentage of the baseline), a relative change below
    it reads "no difference" and one above it "better" or "worse" (``recipes.compare``'s threshold). With
    ``p_adjusted`` (a family's corrected p-value, e.g. :func:`holm_adjusted`'s) the call is ``p_adjusted < alpha``
    instead of the 95 % interval excluding 0."""
    if difference.n < 2:
        if no_difference_below is None or difference.relative is None:
            return ONE_SEED
        if abs(difference.relative) < no_difference_below:
            return NO_DIFFERENCE
        return "better" if (difference.mean > 0) == greater_is_better else "worse"
    larger = difference.excludes_zero if p_adjusted is None else p_adjusted < alpha
    if not larger:
        return WITHIN_NOISE
    better = (difference.mean > 0) == greater_is_better
    return f"{LARGER_THAN_NOISE} ({'better' if better else 'worse'})"


def format_mean_std(values: Sequence[float], digits: int = 4) -> str:
    """``"12.3456 ± 0.1234"``; the mean alone for one value."""
    spread = sample_std(values)
    centre = f"{mean(values):.{digits}f}"
    return centre if spread is None else f"{centre} ± {spread:.{digits}f}"


def format_difference(difference: PairedDifference, digits: int = 4) -> str:
    """``"-0.1234 [-0.2000, -0.0468] (-0.88 %)"``: mean difference, confidence interval, relative change. A mean too
    small for ``digits`` decimals (or the relative change for 2) gets as many more as show two significant digits of
    it, interval included: ``"-0.000048 [-0.000099, +0.000004] (-0.0026 %)"``, not ``"-0.0000 [-0.0001, +0.0000]"``."""
    digits = decimals_for(difference.mean, digits)
    text = f"{difference.mean:+.{digits}f}"
    if difference.ci_low is not None:
        text += f" [{difference.ci_low:+.{digits}f}, {difference.ci_high:+.{digits}f}]"
    if difference.relative is not None:
        text += f" ({difference.relative:+.{decimals_for(difference.relative, 2)}f} %)"
    return text


def decimals_for(value: float, digits: int, significant: int = 2, most: int = 8) -> int:
    """``digits``, or more (at most ``most``) where ``value`` would show fewer than ``significant`` significant
    digits with ``digits`` decimals; 0 keeps ``digits``."""
    if value == 0 or not math.isfinite(value):
        return digits
    return min(max(digits, significant - 1 - math.floor(math.log10(abs(value)))), most)
