"""A step's prefill budget beside playing streams: as much as keeps every listener fed.

A started media stream's listener runs dry at its deadline (playback.py); its lead is
`deadline - now`. No stream gets its next frame before the step that makes it ends, so a step
that takes T seconds costs every started stream T of lead. T is estimated from the step's cost
units (step_cost.py: decode rows + prefill tokens, attention included) by an affine model fitted
to the steps the engine measured (StepTimeFit): T(u) = fixed_s + unit_s * u.

Invariant (in that model of time): a step of decode units D holds prefill units P with

    T(D + P) <= min(lead) - margin        over every started stream,

P the largest such amount, at most the ceiling (max_step_tokens less D). The margin (twice the
recent step time, at least 50 ms: playback.StepClock) covers the model's error and the path to
the client. So a burst of new requests is admitted at the rate the playing streams' leads allow,
whatever its size: each step takes what they can spare and no more.

Floor: a prompt advances by a block at least (`floor_units`: the cost of the first prompt's next
block) when T(D + floor_units) fits. When it does not:
  - if a step of decodes alone gains every started stream lead (T(D) < its frame's seconds),
    the step holds no prefill: prompts wait while the leads grow;
  - else nothing keeps every listener fed (decodes alone take a frame or more: overload), and
    the floor runs anyway, so a new request still advances by a block every step.

Bound (every new request makes progress): let g = min(frame_s) - T(D) > 0, D the decode units
of a step holding every started stream (they all fit the step's rows). A step of decodes alone
adds at least g to every started stream's lead, and a stream that starts does so with one frame
of lead; so between two steps that advance the first prompt in order, at most

    ceil((margin + T(D + floor_units)) / g)

steps hold no prefill (W); under overload (g <= 0) none do. The first prompt in order is the
oldest (new requests rank by arrival), and its prompt done is its first frame, so the i-th
(from 0) of a burst of prompts of at most L tokens has its first frame within
(i + 1) * ceil(L / block) * (W + 1) steps; with lead to spare a step takes far more than a
block. Without a measured step (StepTimeFit.model() None) or without a started stream the
budget is the ceiling: the order before any listener exists is the plain batch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# The weight of the oldest step in the fit decays by this much per recorded step (a half-life
# of ~14 steps): the model follows a changing load (context lengths grow) without noise.
FIT_DECAY = 0.95
# Steps whose cost units spread less than this (relative standard deviation) cannot separate
# fixed time from time per unit: the fit is then proportional (fixed 0), which over-estimates
# what a unit of prefill adds whenever the true fixed time is positive (errs to safety).
MIN_SPREAD = 0.05


@dataclass(frozen=True)
class StepTime:
    """T(u) = fixed_s + unit_s * u: the seconds a step of u cost units takes."""

    fixed_s: float
    unit_s: float

    def seconds(self, units: float) -> float:
        return self.fixed_s + self.unit_s * units


class StepTimeFit:
    """An exponentially weighted least-squares fit of measured (units, seconds) steps."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return  # an empty step, or a clock too coarse to see it: nothing to learn
        d = FIT_DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + units
        self._y = d * self._y + seconds
        self._xx = d * self._xx + units * units
        self._xy = d * self._xy + units * seconds

    def model(self) -> StepTime | None:
        """The fitted T, or None before any step was recorded."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = max(0.0, self._xx / self._w - mx * mx)
        if var > (MIN_SPREAD * mx) ** 2:
            slope = (self._xy / self._w - mx * my) / var
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                return StepTime(fixed, slope)
        return StepTime(0.0, my / mx)  # proportional: see MIN_SPREAD


def prefill_budget(
    *,
    leads: Iterable[tuple[float, float]],
    margin_s: float,
    decode_units: float,
    floor_units: float,
    ceiling_units: float,
    time: StepTime | None,
) -> float:
    """The prefill cost units the next step may hold (the module docstring's invariant).

    `leads`: (lead seconds, seconds of media one frame adds) of every started stream. 0 means
    no prefill this step; a positive budget below `floor_units` never comes back (the caller
    advances the first prompt by its floor whenever the budget is positive)."""
    started = list(leads)
    if not started or time is None:
        return ceiling_units
    slack = min(lead for lead, _ in started) - margin_s
    if time.unit_s > 0:
        units = (slack - time.seconds(decode_units)) / time.unit_s
    else:
        units = math.inf if time.seconds(decode_units) <= slack else -math.inf
    if units >= floor_units:
        return max(floor_units, min(units, ceiling_units))
    frame_s = min(frame for _, frame in started)
    if time.seconds(decode_units) < frame_s:
        return 0.0  # decodes alone gain lead: the prompts wait a bounded number of steps
    return floor_units  # overload: the listeners fall behind whatever runs; admit anyway
