"""The runtime switches of `flashflex plan`, `show` and `launch`, declared once (semantics/runtime_paths.py
says what each path does). Each option's default is None, "not given": `plan` then predicts the launch default,
while `show` and `launch` take what the plan was predicted for (`PlanInputs.runtime`), so that a plan made with
`--no-compile` is shown and launched eager without repeating the switch.

A command takes them as parameters defaulting to the option objects below, and turns what it was given into
switches with `given_switches`:

    def command(..., lean_p2p: bool | None = LEAN_P2P, ...): switches = given_switches(lean_p2p, ...)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import typer

from ..errors import InputError
from ..semantics.runtime_paths import (
    OPTIMIZER_FLAG,
    STAGE_GRAPH_MAX_LAYERS,
    SWITCH_FLAGS,
    VALUE_FLAGS,
    RuntimeOptions,
    switch_flag,
)

_DEFAULTS = " (default: what the plan was predicted for; `plan`: the launch default)"


def _flag(name: str) -> str:
    on, off = SWITCH_FLAGS[name]
    return f"{on}/{off}"


LEAN_P2P: Any = typer.Option(None, _flag("lean_p2p"), help="Off for comparison only: stage-boundary sends in fp32 "
                             "and in full from every TP rank." + _DEFAULTS)
OVERLAP_DP: Any = typer.Option(None, _flag("overlap_dp"), help="Off for comparison only: one blocking gradient "
                               "reduction after the whole backward." + _DEFAULTS)
HIERARCHICAL_DP: Any = typer.Option(None, _flag("hierarchical_dp"), help="Off for comparison only: one flat "
                                    "reduction ring over all holders of a slice." + _DEFAULTS)
COMPILE: Any = typer.Option(None, _flag("compile"), help="torch.compile each layer, the final norm and the loss, "
                            "warmed up before step 0 (launch default: on for GPU plans, off on CPU devices)."
                            + _DEFAULTS)
CHUNKED_LOSS: Any = typer.Option(None, _flag("chunked_loss"), help="Off for comparison only: the whole logits "
                                 "tensor, upcast to fp32 for the loss." + _DEFAULTS)
OPTIMIZER: Any = typer.Option(None, OPTIMIZER_FLAG, help="AdamW kernels: fused or foreach (auto, the launch "
                              "default: fused on GPUs, foreach on CPU devices)." + _DEFAULTS)
CAST_ONCE: Any = typer.Option(None, _flag("cast_once"), help="Under bf16/fp16 autocast, cast the layers' weights "
                              "once per step, shared by the micro-batches, instead of once per micro-batch (launch "
                              "default: off)." + _DEFAULTS)
# `launch` only: the cost model charges both loss kernels and both compile scopes alike, so a plan does not record
# them (their default: the runtime's, or what the run folder's config.json holds on --resume)
LOSS_KERNEL: Any = typer.Option(None, VALUE_FLAGS["loss_kernel"][0], help="The chunked loss's kernel: own (the "
                                "project's, the default) or torch (torch's linear_cross_entropy at TP 1 where the "
                                "installed torch has it).")
COMPILE_SCOPE: Any = typer.Option(None, VALUE_FLAGS["compile_scope"][0], help="With --compile: block (each layer "
                                  "its own graph), stage (a stage's whole forward one graph; at TP > 1 its all-reduces traced) or auto (the "
                                  f"default: stage up to {STAGE_GRAPH_MAX_LAYERS} layers at TP 1, else block).")


def given_switches(lean_p2p: bool | None, overlap_dp: bool | None, hierarchical_dp: bool | None,
                   compile_: bool | None, chunked_loss: bool | None, optimizer: str | None,
                   cast_once: bool | None = None, loss_kernel: str | None = None,
                   compile_scope: str | None = None) -> dict[str, Any]:
    """The switches given on the command line, by RuntimeOptions field (those not given are absent); InputError
    (one line) for an unknown value of --optimizer, --loss-kernel or --compile-scope."""
    values = {"lean_p2p": lean_p2p, "overlap_dp": overlap_dp, "hierarchical_dp": hierarchical_dp,
              "compile": compile_, "chunked_loss": chunked_loss, "optimizer": optimizer, "cast_once": cast_once,
              "loss_kernel": loss_kernel, "compile_scope": compile_scope}
    for name, (flag, choices) in VALUE_FLAGS.items():
        if values[name] is not None and values[name] not in choices:
            raise InputError(f"{flag} must be one of {', '.join(choices)}, got {values[name]!r}")
    return {name: value for name, value in values.items() if value is not None}


def switched(base: RuntimeOptions, given: dict[str, Any]) -> RuntimeOptions:
    """`base` (the launch defaults, or what a plan was predicted for) with the `given` switches applied."""
    return RuntimeOptions(**{**asdict(base), **given})


def flags_text(given: dict[str, Any]) -> str:
    """The given switches as the flags that set them: "--no-compile --optimizer foreach"."""
    return " ".join(switch_flag(name, value) for name, value in given.items())
