"""The quantized kernels' module switches that benchmarks/quant/kernels_quant.py times each setting
of: a benchmark's rows run with one switch set, each row of the switch's formats tagged with
the value it ran with.

    decode         kernels/linear/nvfp4_tile.py `decode`            nvfp4   bits | asm
    int4_decode    kernels/linear/int4_tile.py `decode`             int4 MoE  reshape | planes |
                                                                    planes-asm
    prefetch       kernels/moe/quant/fused_triton.py `prefetch_scales`  fp8  off | on
    fp8_act_quant  kernels/moe/quant/act_quant.py `enabled`         fp8 MoE  fused | apart
    fp8_moe        kernels/moe/quant/fp8_gluon.py `backend`          fp8 MoE  triton | gluon |
                                                                    gluon-128 | gluon-down
    fp8_gluon_dot  kernels/moe/quant/fp8_gluon.py `one_dot`          fp8 MoE  two | one
    fp8_gluon_down_n  kernels/moe/quant/fp8_gluon.py `down_block_n`  fp8 MoE  128 | 64
    fp8_gluon_gated_n kernels/moe/quant/fp8_gluon.py `gated_block_n` fp8 MoE  64 | 32
    fp8_gluon_stages  kernels/moe/quant/fp8_gluon.py `stages`        fp8 MoE  3 .. 6
    fp8_gluon_scales  kernels/moe/quant/fp8_gluon.py `smem_scales`   fp8 MoE  global | smem
    w4a16_backend  kernels/linear/w4a16_dequant.py `backend`        nvfp4, int4 linears
    moe_dequant    kernels/moe/quant/dequant.py `mode`              nvfp4, int4 MoE
    maxnreg        kernels/moe/quant/fused_triton.py `max_registers`  every format's MoE
                                                                    off | a register cap
    scale_layout   benchmarks/quant/quant_weights.py `scale_layout`  nvfp4, int4 MoE
                                                                    rows | k-major
    weight_layout  benchmarks/quant/quant_weights.py `packed_layout`  nvfp4, int4 MoE
                                                                    rows | micro
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    module: str
    attr: str
    formats: tuple[str, ...]
    convert: Callable[[str], object] = str  # the command line's value -> the module's


SWITCHES = {
    "decode": Switch("moeserve.kernels.linear.nvfp4_tile", "decode", ("nvfp4",)),
    "int4_decode": Switch("moeserve.kernels.linear.int4_tile", "decode", ("int4",)),
    "prefetch": Switch("moeserve.kernels.moe.quant.fused_triton", "prefetch_scales", ("fp8",),
                       lambda v: v == "on"),
    "fp8_act_quant": Switch("moeserve.kernels.moe.quant.act_quant", "enabled",
                            ("fp8",), lambda v: v == "fused"),
    "fp8_moe": Switch("moeserve.kernels.moe.quant.fp8_gluon", "backend", ("fp8",)),
    "fp8_gluon_dot": Switch("moeserve.kernels.moe.quant.fp8_gluon", "one_dot", ("fp8",),
                            lambda v: v == "one"),
    "fp8_gluon_down_n": Switch("moeserve.kernels.moe.quant.fp8_gluon", "down_block_n",
                               ("fp8",), int),
    "fp8_gluon_gated_n": Switch("moeserve.kernels.moe.quant.fp8_gluon", "gated_block_n",
                                ("fp8",), int),
    "fp8_gluon_stages": Switch("moeserve.kernels.moe.quant.fp8_gluon", "stages", ("fp8",),
                               int),
    "fp8_gluon_scales": Switch("moeserve.kernels.moe.quant.fp8_gluon", "smem_scales",
                               ("fp8",), lambda v: v == "smem"),
    "w4a16_backend": Switch("moeserve.kernels.linear.w4a16_dequant", "backend",
                            ("nvfp4", "int4")),
    "moe_dequant": Switch("moeserve.kernels.moe.quant.dequant", "mode", ("nvfp4", "int4")),
    "maxnreg": Switch("moeserve.kernels.moe.quant.fused_triton", "max_registers",
                      ("fp8", "nvfp4", "int4"), lambda v: None if v == "off" else int(v)),
    "scale_layout": Switch("benchmarks.quant.quant_weights", "scale_layout", ("nvfp4", "int4")),
    "weight_layout": Switch("benchmarks.quant.quant_weights", "packed_layout",
                            ("nvfp4", "int4")),
}


def with_switch(tag: str, value: str | None, bench: Callable[[], list[dict]]) -> list[dict]:
    """bench()'s rows with switch `tag` set to value (None: as set), the rows of its formats
    tagged with the value the module held."""
    switch = SWITCHES[tag]
    module = importlib.import_module(switch.module)
    before = getattr(module, switch.attr)
    setattr(module, switch.attr, before if value is None else switch.convert(value))
    try:
        rows = bench()
    finally:
        chosen = getattr(module, switch.attr)
        setattr(module, switch.attr, before)
    for row in rows:
        if row["format"] in switch.formats:
            row[tag] = chosen
    return rows


def set_switch(setting: str) -> str:
    """Set a switch for the rest of the process from "TAG=VALUE" (a profiler's single run,
    moe_quant_once --switch); returns the setting. Unknown tags and values without "=" are
    refused by name."""
    tag, sep, value = setting.partition("=")
    if not sep or tag not in SWITCHES:
        raise argparse.ArgumentTypeError(
            f"a switch is TAG=VALUE with TAG one of {', '.join(SWITCHES)}; got {setting!r}")
    switch = SWITCHES[tag]
    setattr(importlib.import_module(switch.module), switch.attr, switch.convert(value))
    return setting


def switched(settings: list[tuple[str, str | None]],
             bench: Callable[[], list[dict]]) -> list[dict]:
    """bench() under every (tag, value) of settings at once."""
    for tag, value in settings:
        bench = _bind(tag, value, bench)
    return bench()


def _bind(tag: str, value: str | None, bench: Callable[[], list[dict]]
          ) -> Callable[[], list[dict]]:
    return lambda: with_switch(tag, value, bench)


def register_cap(value: str) -> str:
    """--maxnreg's value: "off", or a register count ptxas can cap a thread at (24..255)."""
    if value != "off" and not (value.isdigit() and 24 <= int(value) <= 255):
        raise argparse.ArgumentTypeError(f"a register cap is 'off' or 24..255, got {value!r}")
    return value
