"""1F1B event simulation against closed forms and hand-worked schedules."""

from __future__ import annotations

import random

import pytest

from flashflex_cli.cost.schedule import (
    closed_form_s,
    drain_offsets_s,
    fill_s,
    period_exceeds,
    simulate_1f1b,
    stage_order,
    steady_period_s,
)


@pytest.mark.parametrize("stages, micro", [(1, 1), (1, 5), (2, 2), (4, 4), (4, 16), (8, 9), (4, 2), (8, 3)])
def test_uniform_stages_match_closed_form(stages: int, micro: int) -> None:
    f, b = 1.5, 3.25
    result = simulate_1f1b([f] * stages, [b] * stages, [0.0] * (stages - 1), micro)
    assert result.total_s == pytest.approx((micro + stages - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
    assert result.busy_s == tuple(pytest.approx(micro * (f + b)) for _ in range(stages))


def test_stage_order_is_warmup_steady_cooldown() -> None:
    # stage 0 of 3 with 4 micro-batches: 2 warm-up forwards, 2 (F, B) pairs, 2 cool-down backwards
    assert stage_order(0, 3, 4) == [(True, 0), (True, 1), (True, 2), (False, 0), (True, 3), (False, 1),
                                    (False, 2), (False, 3)]
    assert stage_order(2, 3, 4) == [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2), (False, 2),
                                    (True, 3), (False, 3)]


def test_hand_worked_two_stage_schedule_with_transfer() -> None:
    # S=2, m=2, f=(1, 2), b=(2, 4), p2p=0.5. Stage 0: F0 [0,1], F1 [1,2]; stage 1: F0 [1.5,3.5], B0 [3.5,7.5],
    # F1 [7.5,9.5], B1 [9.5,13.5]; stage 0: B0 [8,10], B1 [14,16].
    result = simulate_1f1b([1.0, 2.0], [2.0, 4.0], [0.5], 2)
    assert result.total_s == pytest.approx(16.0)
    assert result.last_backward_end_s == (pytest.approx(16.0), pytest.approx(13.5))
    assert result.bubble_fraction == pytest.approx(1 - (6 + 12) / (2 * 16))


def test_gradient_transfers_can_differ_from_activation_transfers() -> None:
    # S=2, m=1, f=1, b=2: F0 [0,1] -> 0.5 -> stage 1 F0 [1.5,2.5] B0 [2.5,4.5] -> back 1.5 -> B0 [6,8]
    result = simulate_1f1b([1.0, 1.0], [2.0, 2.0], [0.5], 1, p2p_back_s=[1.5])
    assert result.total_s == pytest.approx(8.0)
    assert simulate_1f1b([1.0, 1.0], [2.0, 2.0], [0.5], 1).total_s == pytest.approx(7.0)


def test_transfers_cost_at_least_one_round_trip_per_hop() -> None:
    # Fill and drain cross every hop twice; in the steady state strict 1F1B also waits on round trips
    # (stage 0's backward i depends on its forward i travelling down and back), so the cost grows with m.
    f, b, c, stages = 1.0, 2.0, 0.25, 4
    for micro in (4, 8, 16):
        free = (micro + stages - 1) * (f + b)
        with_comm = simulate_1f1b([f] * stages, [b] * stages, [c] * (stages - 1), micro).total_s
        assert free + 2 * (stages - 1) * c <= with_comm <= free + 2 * (stages - 1) * c * micro


def test_slowest_stage_bounds_the_pipeline() -> None:
    fwd, bwd, micro = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 32
    total = simulate_1f1b(fwd, bwd, [0.0, 0.0], micro).total_s
    assert total >= micro * (3.0 + 6.0)
    assert total <= micro * (3.0 + 6.0) + sum(fwd) + sum(bwd)


def test_more_micro_batches_shrink_the_bubble() -> None:
    few = simulate_1f1b([1.0] * 4, [2.0] * 4, [0.1] * 3, 4).bubble_fraction
    many = simulate_1f1b([1.0] * 4, [2.0] * 4, [0.1] * 3, 64).bubble_fraction
    assert many < few


def test_bad_lengths_raise() -> None:
    with pytest.raises(ValueError):
        simulate_1f1b([1.0, 1.0], [1.0, 1.0], [], 2)
    with pytest.raises(ValueError):
        simulate_1f1b([1.0], [1.0], [], 0)


def test_the_closed_form_equals_the_simulation_for_uniform_stages_and_free_transfers() -> None:
    """fill + (m - 1) x period is the simulated total of equal stages without transfer time, whatever S and m."""
    rng = random.Random(2)
    for _ in range(200):
        stages, f = rng.randint(1, 9), rng.uniform(0.01, 1.0)
        b, m = rng.choice([2 * f, rng.uniform(0.01, 2.0)]), rng.randint(1, 40)
        times, links = [f + b] * stages, [0.0] * (stages - 1)
        simulated = simulate_1f1b([f] * stages, [b] * stages, links, m).total_s
        assert closed_form_s(steady_period_s(times, links), fill_s(times, links), m) == pytest.approx(simulated,
                                                                                                      rel=1e-12)


def test_the_period_is_the_slowest_window_and_the_slowest_stage_without_transfers() -> None:
    # the window of stages 1..2, (1 + 1 + 2 x 0.5) / 2 = 1.5, beats the slowest stage (1.2) and the whole (4.4 / 3)
    assert steady_period_s([1.2, 1.0, 1.0], [0.1, 0.5]) == pytest.approx(1.5)
    assert steady_period_s([1.2, 1.0, 1.0], [0.0, 0.0]) == 1.2
    assert steady_period_s([0.7], []) == 0.7
    assert fill_s([1.2, 1.0, 1.0], [0.1, 0.5]) == pytest.approx(4.4)


def test_period_exceeds_answers_whether_the_period_is_above_a_pace() -> None:
    """The O(S) test the planner prunes with agrees with the window search, on both sides of the period."""
    assert period_exceeds([1.2, 1.0, 1.0], [0.1, 0.5], 1.49)  # the 1..2 window, 1.5
    assert not period_exceeds([1.2, 1.0, 1.0], [0.1, 0.5], 1.51)
    assert not period_exceeds([0.7], [], 0.7)
    rng = random.Random(7)
    above = below = 0
    for _ in range(3000):
        stages = rng.randint(1, 16)
        times = [rng.choice([1.0, rng.uniform(0.05, 2.0)]) for _ in range(stages)]
        links = [rng.choice([0.0, rng.uniform(0.0, 0.6)]) for _ in range(stages - 1)]
        period = steady_period_s(times, links)
        for pace in (period * (1 - 1e-9), period * (1 + 1e-9), rng.uniform(0.05, 3.0)):
            exceeds = period_exceeds(times, links, pace)
            assert exceeds == (period > pace)
            above += exceeds
            below += not exceeds
    assert above > 2000 and below > 2000


def test_the_closed_form_cool_down_equals_the_simulations_where_backwards_do_not_shrink() -> None:
    """Each stage's last backward ends where the simulation ends it when no stage's backward is longer than the
    next one's (equal stages among them), whatever the transfers."""
    rng = random.Random(4)
    for _ in range(200):
        stages = rng.randint(2, 8)
        bwd = sorted(rng.uniform(0.01, 1.0) for _ in range(stages))
        if rng.random() < 0.3:
            bwd = [bwd[0]] * stages
        back = [rng.choice([0.0, rng.uniform(0.0, 0.2)]) for _ in range(stages - 1)]
        result = simulate_1f1b([t / 2 for t in bwd], bwd, back, rng.randint(stages, 4 * stages))
        simulated = [end - result.last_backward_end_s[0] for end in result.last_backward_end_s]
        assert drain_offsets_s(bwd, back) == pytest.approx(simulated, abs=1e-12)


def _reference_1f1b(fwd: list[float], bwd: list[float], p2p: list[float], back: list[float], m: int
                    ) -> tuple[float, list[float]]:
    """The schedule run straight from `stage_order`: every stage in turn runs its next operation once what it
    waits for has ended; (last end, each stage's last backward end)."""
    stages = len(fwd)
    orders = [stage_order(s, stages, m) for s in range(stages)]
    ends: dict[tuple[bool, int, int], float] = {}
    clock, pos = [0.0] * stages, [0] * stages
    while any(p < 2 * m for p in pos):
        for s in range(stages):
            while pos[s] < 2 * m:
                forward, i = orders[s][pos[s]]
                if forward:
                    wait = ends.get((True, s - 1, i)) if s else 0.0
                    step = p2p[s - 1] if s else 0.0
                else:
                    wait = ends.get((False, s + 1, i)) if s < stages - 1 else ends[(True, s, i)]
                    step = back[s] if s < stages - 1 else 0.0
                if wait is None:
                    break
                clock[s] = max(clock[s], wait + step) + (fwd[s] if forward else bwd[s])
                ends[(forward, s, i)] = clock[s]
                pos[s] += 1
    return max(clock), [ends[(False, s, m - 1)] for s in range(stages)]


def test_the_simulation_runs_stage_order_exactly() -> None:
    """The simulation (which visits operations by their position in `stage_order`) ends every stage where the
    schedule run straight from `stage_order` does, to the last bit, also with fewer micro-batches than stages."""
    rng = random.Random(8)
    for _ in range(300):
        stages, m = rng.randint(1, 9), rng.randint(1, 20)
        fwd = [rng.uniform(0.0, 1.0) for _ in range(stages)]
        bwd = [rng.choice([2 * f, rng.uniform(0.0, 2.0)]) for f in fwd]
        p2p = [rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in range(stages - 1)]
        back = [rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in range(stages - 1)]
        result = simulate_1f1b(fwd, bwd, p2p, m, p2p_back_s=back)
        assert (result.total_s, list(result.last_backward_end_s)) == _reference_1f1b(fwd, bwd, p2p, back, m)
