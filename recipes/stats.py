"""The few statistics a comparison over seeds needs, in plain Python (no SciPy: it is not a dependency).

* :func:`mean` and :func:`sample_std` (n - 1 in the denominator) of one metric over seeds;
* :func:`student_t_quantile`, Student's t quantile, from the t distribution's CDF (the regularized incomplete
  beta function, evaluated by its continued fraction) inverted by bisection; exact to ~1e-10;
* :func:`paired_difference`: patched − baseline seed by seed (the same seed gives both runs the same data order and
  initial weights), its mean and a confidence interval with N − 1 degrees of freedom;
* :func:`verdict`: whether that difference is larger than the seed noise, in words.

``recipes.compare --seeds N`` and ``recipes.sweep`` use them, so both say the same thing in the same words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
ONE_SEED = "one seed: no error bar"
WITHIN_NOISE = "within seed noise"
LARGER_THAN_NOISE = "difference larger than seed noise"


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


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' betacf)."""
    tiny, epsilon = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < epsilon:
            return result
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the CDF of the Beta(a, b) distribution at x in [0, 1]."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry I_x(a,b) =
    # 1 - I_{1-x}(b,a) on the other side.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, dof: float) -> float:
    """P(T <= t) for Student's t with ``dof`` degrees of freedom."""
    if dof <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {dof}")
    tail = 0.5 * regularized_incomplete_beta(dof / (dof + t * t), dof / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(p: float, dof: float) -> float:
    """The t with P(T <= t) = p (e.g. p = 0.975 for a two-sided 95 % interval): bisection on the CDF."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be strictly between 0 and 1, got {p}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, dof)
    if p == 0.5:
        return 0.0
    low, high = 0.0, 1.0
    while student_t_cdf(high, dof) < p:  # bracket the quantile
        low, high = high, high * 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, dof) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class PairedDifference:
    """patched − baseline over the seeds both were run with.

    ``ci_low``/``ci_high`` bound the mean difference with probability ``confidence`` (Student t, n - 1 degrees of
    freedom); they and ``std`` are None for a single seed.
    """

    n: int
    mean: float
    std: float | None
    ci_low: float | None
    ci_high: float | None
    baseline_mean: float
    confidence: float = CONFIDENCE

    @property
    def relative(self) -> float | None:
        """The mean difference in percent of the baseline's mean (None for a zero baseline)."""
        return None if self.baseline_mean == 0 else 100.0 * self.mean / abs(self.baseline_mean)

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low is not None and (self.ci_low > 0 or self.ci_high < 0)


def paired_difference(
    patched: Sequence[float], baseline: Sequence[float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """The mean of patched[i] − baseline[i] (seed i of each) and its confidence interval."""
    if len(patched) != len(baseline):
        raise ValueError(f"paired values need the same seeds: {len(patched)} patched vs {len(baseline)} baseline")
    if not patched:
        raise ValueError("no seeds to compare")
    differences = [p - b for p, b in zip(patched, baseline)]
    centre, spread = mean(differences), sample_std(differences)
    low = high = None
    if spread is not None:
        half = student_t_quantile(0.5 + confidence / 2.0, len(differences) - 1) * spread / math.sqrt(len(differences))
        low, high = centre - half, centre + half
    return PairedDifference(len(differences), centre, spread, low, high, mean(baseline), confidence)


def verdict(difference: PairedDifference, greater_is_better: bool) -> str:
    """In words: one seed (no error bar), within seed noise, or larger than seed noise (better or worse)."""
    if difference.n < 2:
        return ONE_SEED
    if not difference.excludes_zero:
        return WITHIN_NOISE
    better = (difference.mean > 0) == greater_is_better
    return f"{LARGER_THAN_NOISE} ({'better' if better else 'worse'})"


def format_mean_std(values: Sequence[float], digits: int = 4) -> str:
    """``"12.3456 ± 0.1234"``; the mean alone for one value."""
    spread = sample_std(values)
    centre = f"{mean(values):.{digits}f}"
    return centre if spread is None else f"{centre} ± {spread:.{digits}f}"


def format_difference(difference: PairedDifference, digits: int = 4) -> str:
    """``"-0.1234 [-0.2000, -0.0468] (-0.88 %)"``: mean difference, confidence interval, relative change."""
    text = f"{difference.mean:+.{digits}f}"
    if difference.ci_low is not None:
        text += f" [{difference.ci_low:+.{digits}f}, {difference.ci_high:+.{digits}f}]"
    if difference.relative is not None:
        text += f" ({difference.relative:+.2f} %)"
    return text
