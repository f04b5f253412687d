"""Multi-head latent attention (MLA) over the paged latent cache: the torch references
(`reference`), the absorbed Triton decode and prefill (`absorbed_triton`), the split-K combine
(`reduce_triton`) and the layer's fused latent norm / RoPE / cache write (`rope_cache_triton`)."""
