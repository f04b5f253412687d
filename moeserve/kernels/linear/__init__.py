"""Linear-layer kernels for quantized weights (issue 18): each beside its torch reference in
moeserve/quant/."""
