"""The knob space `moeserve tune` searches: declared once, from the engine's config fields.

    KNOBS                      every knob: the config field it sets, its values, the device it
                               matters on, whether changing it needs a server restart
    knob_space(device, fixed)  the knobs that apply to a device, less those the user fixed
    Space.suggest(trial)       one config from an Optuna trial (define-by-run; conditional
                               knobs are suggested only where they apply)
    Space.snap(name, value)    a value the doctor proposes, moved onto the knob's values
    Space.complete(params)     a partial config filled with the start's values, then repaired
                               (combinations the engine refuses are made valid)
    Space.flags(params)        the `moeserve serve` flags of a config: its knobs away from the
                               engine's defaults
    server_flags(params)       the flags of every value given, in knob order

A knob's condition (`unless`) names a knob listed before it, so that define-by-run suggests
the condition first. Values are the engine's own (config.py field values; "auto" where the
field takes it), so a ledger row reads as a command line. Ordered numeric choices (powers of
two) are categorical to Optuna, whose TPE sampler handles a few dozen noisy trials over them
well; a range of small integers is an integer distribution. On a machine of several GPUs the
parallel layout joins the space (tensor_parallel_size, enable_expert_parallel,
expert_parallel_size: `_parallel_knobs`); with dummy weights the quantized format
(`QUANTIZATION`: a checkpoint's format is its own) and the KV cache's element type
(`KV_CACHE_DTYPE`: fp8 rounds a real checkpoint's cache, a choice of quality the user makes);
for a model with shared experts whether they fold into the routed launch (`FOLD_SHARED`); for
quantized weights whether the projections outside the routed experts are dequantized at load
(`DEQUANTIZE_LINEARS`) and the 4-bit experts' layout (`MOE_WEIGHT_LAYOUT`); a knob the engine
gains later is one more row in _knobs.

Restart: every knob today is an engine flag, read at start-up, so a trial is a fresh server;
`restart` is declared per knob so that a knob the server can change live can skip it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeserve.config import ConfigError
from moeserve.engine.args import engine_config_from_kwargs, field_docs


@dataclass(frozen=True, slots=True)
class Knob:
    """One searchable engine field.

    `choices` (categorical, ordered where numeric) or `low`/`high` (an integer or float range)
    gives its values; `default` is the engine's default, always among them; `devices` the
    device kinds where it moves anything; `unless` a (knob, value) under which it does not
    apply (it is then not suggested and takes its default): decode steps > 1 with overlap
    scheduling on, a graph size with graphs off."""

    name: str  # the EngineConfig / CacheConfig / SchedulerConfig field
    default: Any
    choices: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    kind: str = "categorical"  # categorical | int | float
    devices: tuple[str, ...] = ("cuda", "cpu")
    restart: bool = True
    unless: tuple[str, Any] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return any(_same(value, c) for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return self.low <= value <= self.high and (self.kind == "float" or value == int(value))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _cpu_thread_choices() -> tuple[Any, ...]:
    n = os.cpu_count() or 1
    return ("auto", *sorted({1, 2, 4, 8, 16, 32, 64, n} & set(range(1, n + 1))))


def _cap_choices(concurrency: int) -> tuple[Any, ...]:
    """"auto" and the powers of two from concurrency / 16 to 4 x concurrency: a cap far
    below the concurrency is a bad start worth representing, one far above it admits nothing
    more."""
    top = 1 << max(0, math.ceil(math.log2(max(1, concurrency))))
    return ("auto", *(1 << i for i in range(max(0, top.bit_length() - 5),
                                           (4 * top).bit_length())))


def _parallel_knobs(num_devices: int) -> tuple[Knob, ...]:
    """Tensor and expert parallelism over the machine's devices (none on one device): the
    world sizes that are powers of two up to the devices, EP on or off, or a MoE TP x EP mix."""
    if num_devices < 2:
        return ()
    sizes = tuple(1 << i for i in range(num_devices.bit_length()) if 1 << i <= num_devices)
    return (
        Knob("tensor_parallel_size", 1, sizes, devices=("cuda",)),
        Knob("enable_expert_parallel", False, (False, True), devices=("cuda",),
             unless=("tensor_parallel_size", 1)),
        Knob("expert_parallel_size", None, (None, *sizes[1:-1]), devices=("cuda",),
             unless=("enable_expert_parallel", False)),
    )


def _knobs(concurrency: int = 1024, num_devices: int = 1) -> tuple[Knob, ...]:
    return (*_parallel_knobs(num_devices),
        Knob("max_running_requests", "auto", _cap_choices(concurrency)),
        Knob("async_scheduling", None, (None, True, False), devices=("cuda",)),
        Knob("num_continuous_decode_steps", 1, low=1, high=8, kind="int",
             unless=("async_scheduling", True)),
        Knob("max_num_batched_tokens", 8192, (2048, 4096, 8192, 16384, 32768)),
        Knob("prefill_batch_delay_steps", 0, low=0, high=8, kind="int"),
        Knob("enforce_eager", False, (False, True), devices=("cuda",)),
        Knob("cuda_graph_max_batch_size", "auto", ("auto", 64, 256, 1024), devices=("cuda",),
             unless=("enforce_eager", True)),
        Knob("mixed_cuda_graphs", False, (False, True), devices=("cuda",),
             unless=("enforce_eager", True)),
        Knob("moe_backend", "auto", ("auto", "measured", "triton", "grouped_mm"),
             devices=("cuda",)),
        Knob("moe_backend", "auto", ("auto", "grouped_mm", "torch"), devices=("cpu",)),
        Knob("moe_tiles", "tuned", ("tuned", "default"), devices=("cuda",)),
        Knob("mem_fraction", 0.90, low=0.80, high=0.95, kind="float", devices=("cuda",)),
        Knob("block_size", 16, (16, 32, 64)),
        Knob("torch_threads", "auto", _cpu_thread_choices(), devices=("cpu",)),
    )


KNOBS = _knobs()  # at concurrency 1,024 (W1's headline); knob_space builds its own


class Space:
    """The knobs searched on one device, with the start's values for the rest."""

    def __init__(self, knobs: Sequence[Knob], start: Mapping[str, Any], device: str) -> None:
        self.knobs = {k.name: k for k in knobs}
        self.device = device
        self.start = {n: start.get(n, k.default) for n, k in self.knobs.items()}
        for name, value in self.start.items():
            if not self.knobs[name].contains(value):
                raise ValueError(f"start value {name}={value!r} is outside the knob's values "
                                 f"({self.describe(name)})")

    def describe(self, name: str) -> str:
        k = self.knobs[name]
        vals = (", ".join(map(_show, k.choices)) if k.kind == "categorical"
                else f"{_show(k.low)}..{_show(k.high)}")
        return f"{k.flag}: {vals}"

    def applies(self, knob: Knob, params: Mapping[str, Any]) -> bool:
        if knob.unless is None or knob.unless[0] not in self.knobs:
            return True
        other, value = knob.unless
        return not _same(params.get(other, self.start[other]), value)

    def suggest(self, trial: Any) -> dict[str, Any]:
        """One config from an Optuna trial; knobs that do not apply get the start's value."""
        params: dict[str, Any] = {}
        for k in self.knobs.values():
            if not self.applies(k, params):
                params[k.name] = k.default
                continue
            if k.kind == "categorical":
                params[k.name] = trial.suggest_categorical(k.name, list(k.choices))
            elif k.kind == "int":
                params[k.name] = trial.suggest_int(k.name, int(k.low), int(k.high))
            else:
                params[k.name] = round(trial.suggest_float(k.name, k.low, k.high), 3)
        return params

    def snap(self, name: str, value: Any) -> Any:
        """`value` moved onto knob `name`'s values: the nearest choice (log distance for
        numbers), a range's nearest bound; ValueError for a value it cannot take."""
        k = self.knobs[name]
        if k.contains(value):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}={value!r} is not a value of {self.describe(name)}")
        if k.kind != "categorical":
            clipped = min(max(value, k.low), k.high)
            return int(round(clipped)) if k.kind == "int" else round(float(clipped), 3)
        numbers = [c for c in k.choices if isinstance(c, int) and not isinstance(c, bool)]
        if not numbers or value <= 0:
            raise ValueError(f"{name}={value!r} is not a value of {self.describe(name)}")
        return min(numbers, key=lambda c: (abs(math.log(c / value)), -c))

    def complete(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Every knob's value (the start's where `params` has none), with knobs that do not
        apply reset to their defaults, so that the engine accepts the combination."""
        out = {n: params.get(n, self.start[n]) for n in self.knobs}
        for k in self.knobs.values():
            if not self.applies(k, out):
                out[k.name] = k.default
        return out

    def flags(self, params: Mapping[str, Any]) -> list[str]:
        """The `moeserve serve` flags of a config: the knobs away from the engine's default
        (so the engine's defaults are no flags at all)."""
        return server_flags({n: v for n, v in params.items()
                             if n in self.knobs and not _same(v, self.knobs[n].default)})

    def check(self, params: Mapping[str, Any], fixed: Mapping[str, Any]) -> str | None:
        """None when the engine's config accepts `params` with the fixed arguments, else why
        not (the ConfigError's text): such a trial is infeasible without starting a server."""
        kwargs = {n: v for n, v in {**fixed, **params}.items() if v is not None}
        try:
            engine_config_from_kwargs(**kwargs)
        except (ConfigError, TypeError) as e:
            return str(e)
        return None

    def help_lines(self) -> list[str]:
        """One line per knob: its flag, values and what it does (the config field's docstring)."""
        from moeserve.config import EngineConfig
        from moeserve.engine.args import _SECTIONS, _flat_fields

        fields = _flat_fields()
        out = []
        for name in self.knobs:
            section = fields[name][0]
            cls = EngineConfig if section is None else _SECTIONS[section]
            doc = field_docs(cls).get(name, "")
            out.append(f"{self.describe(name)} (start {_show(self.start[name])}): {doc}")
        return out


def _show(v: Any) -> str:
    return "auto" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


# the weights' format, where the weights are dummy (a checkpoint's format is its own): on CUDA,
# where the quantized kernels run (on CPU their torch references dequantize every step)
QUANTIZATION = Knob("quantization", None, (None, "fp8", "nvfp4", "int4"), devices=("cuda",))
# the KV cache's element type: with dummy weights too (it rounds what a real checkpoint's
# cache holds, so a study over real weights leaves it to the user)
KV_CACHE_DTYPE = Knob("kv_cache_dtype", "auto", ("auto", "fp8"), devices=("cuda",))
# the projections outside the routed experts dequantized at load (--dequantize-linears): a
# quantized checkpoint, or dummy weights whose format is quantized (not with QUANTIZATION None)
DEQUANTIZE_LINEARS = Knob("dequantize_linears", False, (False, True), devices=("cuda",),
                          unless=("quantization", None))
# the 4-bit routed experts micro-tiled ("auto" on CUDA) or in rows (--moe-weight-layout): where
# DEQUANTIZE_LINEARS is (fp8 experts are rows either way: the knob then changes nothing)
MOE_WEIGHT_LAYOUT = Knob("moe_weight_layout", "auto", ("auto", "rows"), devices=("cuda",),
                         unless=("quantization", None))
# the shared experts in the routed launch or beside it: a model with shared experts only
FOLD_SHARED = Knob("fold_shared_experts", False, (False, True))


def knob_space(device: str, start: Mapping[str, Any], fixed: Sequence[str] = (),
               only: Sequence[str] | None = None, concurrency: int = 1024,
               num_devices: int = 1, dummy_weights: bool = False,
               shared_experts: bool = False, quantized: bool = False) -> Space:
    """The knobs that matter on `device` ("cuda" or "cpu") at the largest concurrency the
    study optimises, less `fixed` (fields the user set in the server's fixed arguments),
    restricted to `only` when given; with num_devices > 1 (GPUs), the parallel layouts too;
    with dummy_weights (a preset, or --load-format dummy), the weights' quantized format and
    the KV cache's element type; with
    shared_experts (the model has them), whether they fold into the routed launch; with dummy
    weights or a quantized checkpoint (`quantized`), whether the projections outside the routed
    experts are dequantized at load and the 4-bit experts' layout."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    extra = [QUANTIZATION, KV_CACHE_DTYPE] if dummy_weights else []
    extra += [DEQUANTIZE_LINEARS, MOE_WEIGHT_LAYOUT] if dummy_weights or quantized else []
    extra += [FOLD_SHARED] if shared_experts else []
    knobs = [k for k in [*_knobs(concurrency, num_devices), *extra]
             if device in k.devices and k.name not in fixed]
    if only is not None:
        unknown = sorted(set(only) - {k.name for k in knobs})
        if unknown:
            raise ValueError(f"--knobs: {', '.join(unknown)} not searchable on {device} "
                             f"(searchable: {', '.join(k.name for k in knobs)})")
        knobs = [k for k in knobs if k.name in only]
    unknown = sorted(set(start) - {k.name for k in knobs})
    if unknown:
        raise ValueError(f"the start sets {', '.join(unknown)}, which this study does not "
                         "search (on this device, or fixed): put it in --server-args")
    return Space(knobs, start, device)


def server_flags(params: Mapping[str, Any]) -> list[str]:
    """The `moeserve serve` flags of a config: booleans as --x / --no-x; None (auto) and the
    string "auto" left out where the flag has no "auto" spelling (the default then applies)."""
    out: list[str] = []
    for name, value in params.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out
