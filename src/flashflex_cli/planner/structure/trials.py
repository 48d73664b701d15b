"""Trial structures of one pipeline's node blocks, evaluated only when they might win.

A trial (a group-size choice per block and a block order, `pieces.TrialSpace`) is bounded from its pieces and the
transfers where they join (`bounds.runs_lower_bound`'s figures); the sweeps sum what their trials share once
(`sweeps`): a unit sweep (one block's sizes vary) the other pieces' totals, an order sweep the order-free totals, so
a trial costs O(1), resp. O(blocks) joins. A trial with more stages than layers drops its slowest stages (as
`stage_search.assemble` does) and is bounded over the kept stages piece by piece (`kept.Kept`); in a unit sweep, the
options that keep none of the block's stages (the other pieces hold the L fastest) are one pipeline, evaluated once
(`Trials.ranked`'s `one_pipeline`). Only a trial whose bound is below the best so far is evaluated. One whose layers
do not fit in its stages' memory costs inf, known from its pieces' memory rooms without a layer split
(`pieces.TrialSpace.fits`; in a unit sweep from the other pieces' rooms summed once, `sweeps.UnitBounds.may_fit`).
Otherwise its layers are split exactly; the split is given up as soon as it shows that its slowest stage is slower
than the pace the trial would need to win (`Trials._needed_pace`, `layer_split.split_layers_within`: often at its
first lower bound). When the exact fill and split show that its period is above the pace at which it would cost the
limit (`cost.schedule.period_exceeds`: one pass over its stages, no window search), it is not evaluated further and
nothing is memoised (`Trials.cost_below`, `pipeline_score.evaluate_unless`); else it is evaluated in full
(`pipeline_score.evaluate_pipeline`). Every shortcut gives the exact figure or a valid lower bound, so the trials
ranked, and the structure found, are the ones the plain evaluation of every trial gives. All figures in seconds per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from ...cost.schedule import closed_form_s, fill_s, period_exceeds
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline, evaluate_unless
from ..space.layer_split import split_layers_within, stage_times
from .bounds import INFEASIBLE, SAFETY, cannot_beat, runs_lower_bound
from .kept import Kept
from .pieces import Piece, Sizes, TrialSpace
from .sweeps import Totals, UnitBounds

Trial = tuple[Sizes, tuple[int, ...]]  # group sizes by block position, block order
UNFIT = PipeEval((), (), INFEASIBLE, INFEASIBLE, INFEASIBLE, False)  # the evaluation of a trial that does not fit
# relative margin over the needed pace before a split is given up: the split's slowest stage is within about 1e-9 of
# its walk's limit (`layer_split._room`'s rounding allowance), so a split given up is surely slower than the pace
PACE_MARGIN = 1e-8


class Trials(TrialSpace):
    """Bounded evaluation of trial structures over `blocks` for a pipeline of `micro` micro-batches and at
    most `max_stages` stages (see module docstring)."""

    def cost(self, sizes: Sizes, order: tuple[int, ...], key: tuple | None = None
             ) -> tuple[float, PipeEval]:
        """The trial's exact amortised seconds per micro-batch (`amortised`) and its evaluation (memoised;
        `key`: the trial's `key` where the caller has it)."""
        if key is None:
            key = self.key(sizes, order)
        hit = self._seen.get(key)
        if hit is None:
            pieces = self._pieces_of(sizes, order)
            stages, keep = self._assemble(pieces)
            if keep is None and not self.fits(pieces):
                hit = self._seen[key] = (INFEASIBLE, UNFIT)
                return hit
            pipe = evaluate_pipeline(self.cache, stages, lambda: self._links(pieces, stages, keep))
            hit = self._seen[key] = (amortised(pipe, self.micro, self.max_stages), pipe)
        return hit

    def cost_below(self, sizes: Sizes, order: tuple[int, ...], key: tuple, limit: float
                   ) -> float:
        """`cost`, or inf when the trial's figures once its layers are split show that it cannot be below
        `limit` (`pipeline_score.evaluate_unless`; a lower bound then goes to the bounds memo)."""
        hit = self._seen.get(key)
        if hit is not None:
            return hit[0]
        pieces = self._pieces_of(sizes, order)
        micro, most, layers = self.micro, self.max_stages, self.cache.model.num_layers
        terms, links, shape = None, None, None
        split: list[int] | None | Literal[False] = False  # (False: not split yet)
        count = sum([piece.summary.count for piece in pieces])
        if count <= layers:  # every stage kept (`_assemble`): the stages are listed only for a split
            *terms, room = self._terms_and_room(pieces, count)
            if room < layers:  # the exact figure, inf, without a layer split
                self._seen[key] = (INFEASIBLE, UNFIT)
                return INFEASIBLE
            if count <= most:  # the layer split, given up once it shows the pace it would need is out of reach
                links = self._links(pieces, (), None)
                needed = self._needed_pace(terms, links, limit)
                if needed is not None:
                    pace, low_s = needed
                    split = split_layers_within(*terms, layers, pace * (1.0 + PACE_MARGIN))
                    if split is False:
                        self._bounds[key] = low_s
                        return INFEASIBLE
            shape = lambda: self.shape(pieces)  # noqa: E731
        low: list[float] = []

        def skip(times: list[float], hops: list[float], fill: float) -> bool:
            count = len(times)
            if count > most:
                return False  # inf: evaluated, as `amortised` has it
            m = max(micro, count)
            if m < 2:  # one micro-batch through one stage: the fill is the cost
                low.append(fill)
                return cannot_beat(fill, limit)
            # the pace at which the trial would cost limit / (1 - SAFETY): with a longer period it cannot beat the limit
            pace = (m * (limit / (1.0 - SAFETY)) - fill) / (m - 1)
            if not period_exceeds(times, hops, pace * (1.0 + PACE_MARGIN)):
                return False
            low.append(closed_form_s(pace, fill, m) / m)
            return True

        if split and terms is not None and links is not None:  # split here: its figures decide before its stages
            times = stage_times(terms[0], terms[1], split)  # are listed (and `evaluate_unless` need not test them)
            if skip(times, links, fill_s(times, links)):
                self._bounds[key] = low[0]
                return INFEASIBLE
            test = _never
        else:
            test = skip
        stages, keep = self._assemble(pieces)
        pipe = evaluate_unless(self.cache, stages, (lambda: links) if links is not None else
                               (lambda: self._links(pieces, stages, keep)), test,
                               terms, shape, None if split is False else (split,))  # type: ignore[arg-type]
        if pipe is None:
            self._bounds[key] = low[0]
            return float("inf")
        hit = self._seen[key] = (amortised(pipe, micro, most), pipe)
        return hit[0]

    def _needed_pace(self, terms: list, links: list[float], limit: float) -> tuple[float, float] | None:
        """The pace (seconds per micro-batch) the trial with stage terms `terms` and transfer seconds `links` would
        need to beat `limit` with the least fill any split has (a layer a stage, the others at the fastest stage's
        speed, and the transfers), and the lower bound on its amortised seconds when its split is slower than that
        pace; None when no such bound could prune it (one micro-batch, or a bound not clearly at the limit). A split
        whose slowest stage is slower than the pace is slower than the limit, whatever its fill and windows."""
        per_layer, extra, _caps = terms
        count = len(per_layer)
        m, layers = max(self.micro, count), self.cache.model.num_layers
        if m < 2:
            return None
        fill = sum(per_layer) + sum(extra) + (layers - count) * min(per_layer) + 2.0 * sum(links)
        pace = (m * (limit / (1.0 - SAFETY)) - fill) / (m - 1)
        low = closed_form_s(pace, fill, m) / m
        return (pace, low) if cannot_beat(low, limit) else None

    def bound(self, sizes: Sizes, order: tuple[int, ...], key: tuple | None = None) -> float:
        """A lower bound on `cost` (the exact figure when already known; `key`: the trial's `key` where the
        caller has it)."""
        if key is None:
            key = self.key(sizes, order)
        hit = self._seen.get(key)
        if hit is not None:
            return hit[0]
        known = self._bounds.get(key)
        if known is None:
            known = self._bounds[key] = self._bound(key, sizes, order)
        return known

    def _bound(self, key: tuple, sizes: Sizes, order: tuple[int, ...]) -> float:
        pieces = self._pieces_of(sizes, order)
        layers = self.cache.model.num_layers
        if sum(piece.summary.count for piece in pieces) <= layers:
            join = self.join
            joins = [join(pieces[i], pieces[i + 1]) for i in range(len(pieces) - 1)]
            return runs_lower_bound([piece.summary for piece in pieces], joins, pieces[0].embed_s, pieces[-1].head_s,
                                    layers, self.micro, self.max_stages)
        return self._dropped_bound(pieces)

    def _dropped_bound(self, pieces: list[Piece]) -> float:
        """`bounds.stages_lower_bound` of the stages kept when the slowest are dropped (as `_assemble` keeps
        them: the L fastest, ties to the earlier), summed piece by piece (`Kept`; an order sweep's trials share
        each piece's, `sweeps.Totals.dropped_bound`)."""
        layers = self.cache.model.num_layers
        if layers > self.max_stages:
            return INFEASIBLE
        cut, room = self.cut_room(pieces)
        return Kept(self.cache, pieces, cut, room).bound(self)

    def _bounds_of(self, trials: list[Trial], keys: list[tuple]
                   ) -> list[float]:
        """`bound` of each trial; trials that share their group sizes (the same dict) and differ in block order
        share the order-free totals (`Totals`)."""
        totals: dict[int, Totals] = {}
        layers = self.cache.model.num_layers

        def compute(trial: Trial, key: tuple) -> float:
            sizes, order = trial
            found = totals.get(id(sizes))
            if found is None:
                found = totals[id(sizes)] = Totals(self, sizes)
            if found.count <= layers:
                return found.bound(order)
            return found.dropped_bound(order)

        return self.memo_bounds(trials, keys, compute)

    def unit_ranked(self, sizes: Sizes, order: tuple[int, ...], block: int,
                    options: list[tuple[int, ...]], bar: float) -> list[tuple[float, Sizes]]:
        """`ranked` (keep 1) of the trials that give block `block` each of `options` in the trial (`sizes`,
        `order`), as (cost, sizes); their bounds come from the other blocks' totals, summed once."""
        items = tuple(sizes.items())
        at = list(sizes).index(block)
        head, tail = items[:at], items[at + 1:]
        keys = [(head + ((block, option),) + tail, order) for option in options]  # `key`, without a dict each
        unit = UnitBounds(self, sizes, order, block)
        bounds = unit.bounds(options, keys)
        trials = _OptionTrials(sizes, order, block, options)
        layers = self.cache.model.num_layers

        def keeps_none(j: int) -> bool:  # (the options whose trials keep none of the block's stages: one pipeline)
            piece = self.piece(block, options[j])
            return unit.count + piece.summary.count > layers and unit.keeps_none(piece, layers)

        return [(value, trials[j][0]) for value, j in self.ranked(trials, 1, bar, bounds, keys,
                                                                  lambda j: unit.may_fit(options[j]), keeps_none)]

    def ranked(self, trials: Sequence[Trial], keep: int, bar: float,
               bounds: list[float] | None = None, keys: list[tuple] | None = None,
               may_fit: Callable[[int], bool] | None = None, one_pipeline: Callable[[int], bool] | None = None
               ) -> list[tuple[float, int]]:
        """The `keep` best trials strictly below `bar` as (cost, position), by (cost, position).

        Trials are evaluated best-first by lower bound (`bounds`, else `bound`); once a bound shows that a trial
        costs more than the keep-th best found so far (or `bar`), it and every trial after it in that order
        are skipped; a trial whose figures once its layers are split show the same is not evaluated further
        (`cost_below`). `keys`: the trials' `key`s where the caller has them. `may_fit(position)`: False for a
        trial whose layers do not fit in memory (its exact figure, inf, is recorded without evaluating it).
        `one_pipeline(position)`: True for trials that are all the same pipeline (the same figure): the first of them
        evaluated gives its figure to the others."""
        if keys is None:
            keys = [self.key(sizes, order) for sizes, order in trials]
        if bounds is None:
            bounds = self._bounds_of(trials, keys)
        found: list[tuple[float, int]] = []
        inf = float("inf")
        shared: list[float] = []  # the figure of the first of the `one_pipeline` trials evaluated
        for j in sorted(range(len(trials)), key=bounds.__getitem__):  # stable: ties in position order
            limit = found[keep - 1][0] if len(found) >= keep else bar
            if limit < inf:  # (with nothing below inf yet, every trial is evaluated: `finalise.nothing_fits` reads them)
                if cannot_beat(bounds[j], limit):
                    break
            same = one_pipeline is not None and one_pipeline(j)
            if same and shared:
                value = shared[0]
            else:
                if may_fit is not None and keys[j] not in self._seen and not may_fit(j):
                    self._seen[keys[j]] = (INFEASIBLE, UNFIT)
                    continue
                value = self.cost(*trials[j], keys[j])[0] if limit == inf else \
                    self.cost_below(*trials[j], keys[j], limit)
                if same:
                    shared.append(value)
            if value < bar:
                found.append((value, j))
                found.sort()
        return found[:keep]


class _OptionTrials(Sequence[Trial]):
    """The trials of a unit sweep, (sizes, order) with block `block` at each of `options`, each dict built only
    when asked for (most are bounded away without one)."""

    def __init__(self, sizes: Sizes, order: tuple[int, ...], block: int,
                 options: list[tuple[int, ...]]) -> None:
        self.sizes, self.order, self.block, self.options = sizes, order, block, options

    def __len__(self) -> int:
        return len(self.options)

    def __getitem__(self, j: int) -> Trial:  # type: ignore[override]
        return {**self.sizes, self.block: self.options[j]}, self.order


def _never(_times: list[float], _links: list[float], _fill: float) -> bool:
    """A skip test that evaluates every pipeline (`pipeline_score.evaluate_unless`)."""
    return False


def amortised(pipe: PipeEval, micro: int, max_stages: int) -> float:
    """Seconds per micro-batch when the pipeline runs `micro` micro-batches (inf when it does not fit, or
    has more stages than the `max_stages` micro-batches the whole batch has: 1F1B needs one per stage)."""
    if not pipe.ok or pipe.num_stages > max_stages:
        return float("inf")
    m = max(micro, pipe.num_stages)
    return closed_form_s(pipe.pace_s, pipe.fill_s, m) / m
