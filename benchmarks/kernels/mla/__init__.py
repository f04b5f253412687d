"""Latent attention's kernel benchmarks: MLA decode (`kernels_mla`) and prefill
(`kernels_mla_prefill`), DeepSeek Sparse Attention's decode step (`kernels_dsa`) and prefill
chunks (`kernels_dsa_prefill`), the compile-once check (`mla_once`) and the cases table
(`mla_cases_table`)."""
