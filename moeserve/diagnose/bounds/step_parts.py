"""One step's device time by part, each part against its own roofline bound.

A step's kernels fall into parts by name (`part_of`):

    moe          the fused MoE and its routing (top-k, align/sort)       bound: expert weights
                                                                          touched, expert FLOPs
    attention    paged / MLA / sparse attention kernels and their reduce, bound: KV read +
                 DSA's indexer (scores, radix top-k, slot rows)           q read + out
                                                                          written, attention
                                                                          FLOPs
    dense        GEMMs (cuBLAS nvjet / cutlass / xmma, aten::mm)          bound: dense weights
                                                                          (+ lm_head), FLOPs
    norm_rope    RMSNorm, RoPE and the fused q/k norm + RoPE + KV write   no bound (activations)
    other        copies, fills, sampling, everything else                 no bound

Each bounded part's bound is max(bytes / bandwidth, FLOPs / peak) of its own bytes and FLOPs
(diagnose/bounds/roofline.py's StepCost parts), so "MoE at 62% of its bound, attention at 20%" says
where the rest of the step is, which the whole step's one percentage cannot. The parts' bounds
add up to at least the step's bound (their work does not overlap within a step). The attention
part also counts its kernels' queries and outputs (StepCost.attention_io_bytes), which the
step's roofline leaves out: at a mixed step's prefill tokens (MLA absorbed: 20 heads x 1,088
values a token a layer) they outweigh the latents read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moeserve.diagnose.bounds.roofline import Ceilings, StepCost

PARTS = ("moe", "attention", "dense", "norm_rope", "other")

# moeserve's own kernels whose function names no pattern below places, by exact name (the
# profiler names a Triton or Gluon kernel by its function): DSA's indexer keys (LayerNorm, RoPE
# and the cache write) with the norms; the MoE's align (count, offsets, scatter; one launch at
# few pairs) and the zeroed rows of other ranks' pairs with the MoE; the warp-specialized MLA
# decode (DSA's sparse MLA too), DSA's bisect top-k and the flat MLA decode's combine with
# attention; the FP8 block GEMM, the W4A16 GEMM and its dequantized path's column scaling with
# the dense GEMMs. Left in "other": the FP8 activation quantize, SiLU-and-mul and the 4-bit
# dequantize (the linears' and the large MoE steps' experts': one kernel, whose name cannot say
# which). tests/diagnose/test_step_parts.py holds every kernel moeserve defines to its part,
# so a new or renamed kernel is placed on purpose.
_EXACT = {
    "_keys_kernel": "norm_rope",
    "_count_kernel": "moe", "_offsets_kernel": "moe", "_scatter_kernel": "moe",
    "_one_kernel": "moe", "_zero_rows_kernel": "moe",
    "_ws_kernel": "attention", "_bisect_kernel": "attention", "_combine_kernel": "attention",
    "_matmul_kernel": "dense", "_w4a16_kernel": "dense", "_scale_columns_kernel": "dense",
}
# substrings of kernel names, checked in order (the first match wins)
_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("norm_rope", ("_rms_norm", "rmsnorm", "_rope", "qk_rope_kv", "rotary")),
    ("moe", ("moe", "_route", "topk", "bitonicsort", "expert")),
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel", "mla_", "_mla",
                   "_sparse", "attention", "flash", "index_copy", "_index_score", "_radix_",
                   "_slots_kernel")),
    ("dense", ("nvjet", "gemm", "cutlass", "xmma", "aten::mm", "aten::addmm", "cublas",
               "sm90_")),
)


def part_of(kernel_name: str) -> str:
    """The part a kernel belongs to, by its name (see the module docstring)."""
    if kernel_name in _EXACT:
        return _EXACT[kernel_name]
    name = kernel_name.lower()
    for part, needles in _PATTERNS:
        if any(n in name for n in needles):
            return part
    return "other"


def part_times_ms(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """(kernel name, device ms) pairs -> ms per part (every part present, 0 when none ran)."""
    out = dict.fromkeys(PARTS, 0.0)
    for name, ms in kernels:
        out[part_of(name)] += ms
    return out


@dataclass(frozen=True, slots=True)
class PartShare:
    part: str
    measured_ms: float
    bound_ms: float | None  # None: a part without a bound (norm_rope, other)
    bound_kind: str | None  # "memory" or "compute"

    @property
    def share(self) -> float | None:
        """The bound's share of the measured time (1.0 = at its bound)."""
        if self.bound_ms is None or self.measured_ms <= 0:
            return None
        return self.bound_ms / self.measured_ms

    def to_dict(self) -> dict:
        share = self.share
        return {"part": self.part, "measured_ms": round(self.measured_ms, 4),
                "bound_ms": None if self.bound_ms is None else round(self.bound_ms, 4),
                "bound": self.bound_kind,
                "percent_of_bound": None if share is None else round(100 * share, 1)}


def part_shares(cost: StepCost, ceilings: Ceilings,
                measured_ms: dict[str, float]) -> list[PartShare]:
    """Each part's measured ms against its own bound, in PARTS order."""
    bounded = cost.parts()
    out = []
    for part in PARTS:
        ms = measured_ms.get(part, 0.0)
        if part not in bounded:
            out.append(PartShare(part, ms, None, None))
            continue
        nbytes, flops = bounded[part]
        if part == "attention":
            nbytes += cost.attention_io_bytes
        mem_s, flop_s = nbytes / ceilings.bytes_per_s, flops / ceilings.flops_per_s
        out.append(PartShare(part, ms, 1e3 * max(mem_s, flop_s),
                             "memory" if mem_s >= flop_s else "compute"))
    return out


def describe(shares: list[PartShare]) -> str:
    """One line: each part's ms and, where it has a bound, its share of it."""
    parts = []
    for s in shares:
        if s.measured_ms <= 0 and s.bound_ms is None:
            continue
        text = f"{s.part} {s.measured_ms:.2f} ms"
        if s.share is not None:
            text += f" ({s.share:.0%} of its {s.bound_kind} bound {s.bound_ms:.2f} ms)"
        parts.append(text)
    return "; ".join(parts)
