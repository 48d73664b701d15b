"""How far the cost model's step-time predictions are off where they were checked against real runs, and the
band outside which a run's measured/predicted ratio means that an input is wrong rather than that the model is
its usual few percent off. Read by the plan summary (is a plan's gain over the symmetric layout real?), the end
of a run and `show --run` (is this measurement believable?).

The figures are docs/cost-model.md section 8's: 18 plans on emulated CPU devices, median step-time error 7.0-8.3%
and worst 15.6-19.5% over three validation runs; the recorded H100 runs within 3-8%.
"""

from __future__ import annotations

MEDIAN_STEP_ERROR = 0.08  # relative, |measured / predicted - 1|: the median of the validation runs above
WORST_STEP_ERROR = 0.20  # relative: the worst of the same runs, rounded up
# A measured/predicted step-time ratio outside this band is more than twice the worst validated error away from
# 1: a device's peak, a layer profile or the host's load is wrong (fewer cores than emulated devices, say).
SUSPECT_RATIO_LOW, SUSPECT_RATIO_HIGH = 2.0 / 3.0, 1.5


def ratio_is_suspect(measured_over_predicted: float) -> bool:
    """True when a run's measured/predicted step time lies outside [SUSPECT_RATIO_LOW, SUSPECT_RATIO_HIGH]."""
    return not SUSPECT_RATIO_LOW <= measured_over_predicted <= SUSPECT_RATIO_HIGH


def suspect_ratio_advice(measured_over_predicted: float, on_cpu: bool) -> str:
    """One line: what a measured/predicted ratio outside the band likely means and what to run."""
    band = f"{SUSPECT_RATIO_LOW:.2f}-{SUSPECT_RATIO_HIGH:.2f}"
    if measured_over_predicted < SUSPECT_RATIO_LOW:
        cause = ("the devices ran faster than their peak in the cluster file says"
                 + (" (an emulated CPU device's catalog peak is a guess)" if on_cpu else ""))
        fix = ("measure this host with `flashflex profile --out node.json` and plan on it, or fit the model to this "
               "run with `flashflex calibrate RUN --out x.layers.json` and re-plan with --layers x.layers.json")
    else:
        cause = ("the devices ran slower than the cluster file says"
                 + (" (emulated devices sharing too few cores, or a loaded host)" if on_cpu else
                    " (a slower device or link than described, or another job on it)"))
        fix = ("re-profile the hardware (`flashflex profile`), emulate fewer devices per core" if on_cpu else
               "re-profile the hardware (`flashflex profile`)") + \
            ", or fit the model to this run with `flashflex calibrate RUN --out x.layers.json`"
    return (f"measured/predicted {measured_over_predicted:.2f} is outside {band} (the model's validated error is "
            f"within {100 * WORST_STEP_ERROR:.0f}%): {cause}; {fix}")


def mfu_advice(mfu: float, on_cpu: bool) -> str:
    """One line for an MFU above 100%: the peak FLOP/s it divides by is below what the devices did."""
    guess = " (an emulated CPU device's catalog peak is a guess)" if on_cpu else ""
    return (f"MFU {100 * mfu:.1f}% is above 100%: the devices' peak FLOP/s in the cluster file is below what they "
            f"computed{guess}; measure it with `flashflex profile --out node.json` and plan on that file")
