"""Which of the model's weights are held quantized, and in what format: the plan the layers are
built from (layers/linear.py's WeightFactory reads it).

A weight is quantizable when its layer declares it through the factory: the linear projections
(attention's qkv / in_proj / q_b_proj / o_proj, the DSA indexer's wq_b, the dense MLPs and
shared experts, the routed experts' w13 and w2). The embedding, the LM head, the routers, the
norms and MLA's kv_b_proj (its views W_UK and W_UV are the absorbed decode's operands) stay in
the engine's dtype.

    from a checkpoint: a weight is held quantized when every checkpoint tensor it is made of is
        quantized there (the fused ones: q, k and v; gate and up; all the experts); one with a
        part left unquantized (`exclude_modules`, `ignore`, `modules_to_not_convert`) is held
        in the engine's dtype, its quantized parts dequantized as they load (exact)
    dummy weights (`--quantization F --load-format dummy`): every quantizable weight
    either way, with `experts_only` (--dequantize-linears) the routed experts' stacks alone: the
        other projections in the engine's dtype (a checkpoint's dequantized as they load)
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.quant.spec import QuantSpec

DUMMY_INT4_GROUP = 32  # dummy INT4 weights: Kimi K2-Thinking's group


@dataclass(frozen=True)
class QuantPlan:
    format: str  # "fp8" | "nvfp4" | "int4"
    int4_group: int | None = None  # int4: K per scale
    held: frozenset[str] | None = None  # the weights' paths held quantized; None: every one
    # the routed experts' stacks only ([E, N, K]: WeightFactory.linear's weights with leading
    # dims); every other projection in the engine's dtype (--dequantize-linears)
    experts_only: bool = False

    @classmethod
    def from_spec(cls, spec: QuantSpec, held: frozenset[str] | None = None) -> QuantPlan:
        return cls(spec.format, spec.group_size if spec.format == "int4" else None, held)

    def holds(self, path: str, stacked: bool = True) -> bool:
        """Whether the weight at `path` is held quantized (`stacked`: a routed experts' stack,
        [E, N, K])."""
        if self.experts_only and not stacked:
            return False
        return self.held is None or path in self.held

    def describe(self) -> str:
        text = {"fp8": "fp8 block-scaled W8A8 (e4m3, 128-wide scales)",
                "nvfp4": "nvfp4 W4A16 (e2m1, e4m3 scales per 16, a global scale)",
                "int4": f"int4 W4A16 (pack-quantized, groups of {self.int4_group})"
                }[self.format]
        return text + (" for the routed experts only (--dequantize-linears)"
                       if self.experts_only else "")
