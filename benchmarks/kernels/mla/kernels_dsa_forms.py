"""kernels_dsa's decode-step A/B sweeps: each times one switch of the DSA kernels (the bisect
top-k's settings, the sparse MLA's partitions and warp-specialized forms, programmatic
dependent launch, the split combine's forms, the fused indexer RoPE, the top-k's gathered
last digits) at its settings, each first checked against the default's output, and restores
it. kernels_dsa.run_decode_case calls them on CUDA; their results are keys of its rows."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from benchmarks.kernels.kernel_runs import Timer, graph_timed
from moeserve.kernels import triton_common
from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa import sparse_triton as dsa_sparse_triton
from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_gluon, reduce_triton

# the sparse MLA's partitions of a token's selection timed (the default picks them to fill
# about a wave of programs)
SPARSE_SPLITS = (1, 2, 3, 4, 8)
# the split partials' forms timed: (splits the combine reads at once, reduce_triton's
# split_block, 0: one at a time; accumulators in bf16, its half_partials)
REDUCE_FORMS = ((0, False), (8, False), (0, True), (8, True))
# the bisect top-k's warps timed (topk_bisect_triton.WARPS forced), in graphs
BISECT_WARPS = (8, 16, 32)


def time_bisect_settings(name: str, scores: torch.Tensor, meta: AttentionMetadata, topk: int,
                         selected: torch.Tensor, timer: Timer, setting: str,
                         values: tuple[int, ...]) -> dict:
    """The bisect top-k at each of `values` of topk_bisect_triton's `setting` ("WARPS": 4,096
    / 32 / warps keys a thread a register chunk; None, the default: warps' rule; "ALIGN_ROWS":
    16-aligned rows by vector loads or plain), each
    checked against `selected`, in graphs over the scores as given and as wide as the served
    graph's context bound (16,384: four chunks, the ones past a token's context skipped):
    {"topk_bisect_<setting>_graph_ms": {value: ms}, "topk_bisect_<setting>_wide_graph_ms":
    {value: ms}} (setting in lower case)."""
    from moeserve.kernels.attention.dsa import topk_bisect_triton

    wide = torch.zeros(scores.shape[0], topk_bisect_triton.MAX_KEYS, dtype=scores.dtype,
                       device=scores.device)
    wide[:, :scores.shape[1]] = scores  # past each token's context: never read
    keys = (f"topk_bisect_{setting.lower()}_graph_ms",
            f"topk_bisect_{setting.lower()}_wide_graph_ms")
    out: dict = {key: {} for key in keys}
    saved = getattr(topk_bisect_triton, setting)
    try:
        for value in values:
            setattr(topk_bisect_triton, setting, value)
            for key, s in zip(keys, (scores, wide), strict=True):
                fn = functools.partial(topk_triton.radix_topk, s, meta, 0, topk,
                                       torch.empty_like(selected), form="bisect")
                fn()
                assert torch.equal(fn.args[4], selected), f"{name}: bisect {setting} {value}"
                out[key][str(value)] = round(graph_timed(timer, fn, True), 4)
    finally:
        setattr(topk_bisect_triton, setting, saved)
    return out


def time_sparse_splits(name: str, sparse_args: tuple, base: torch.Tensor, index_args: tuple,
                       timer: Timer) -> dict:
    """The default sparse MLA (the Gluon kernels on sm90) at SPARSE_SPLITS partitions of each
    token's selection (combined by the split reduce), each within 2^-6 of `base` (another sum
    order): sparse_mla_splits_ms {splits: ms}, and the whole step (indexer + sparse MLA) in a
    graph with each: dsa_graph_splits_ms {splits: ms}."""
    q_i, w, index_cache, meta, scale, topk = index_args
    out: dict = {"sparse_mla_splits_ms": {}, "dsa_graph_splits_ms": {}}
    for splits in SPARSE_SPLITS:
        def sparse(splits: int = splits) -> torch.Tensor:
            return dsa_sparse_triton.dsa_attention_triton(*sparse_args, num_splits=splits)
        err = float((sparse().float() - base).abs().max() / base.abs().max())
        if err > 2 ** -6:
            out["sparse_mla_splits_ms"][str(splits)] = f"mismatch {err:.3g}"
            continue
        out["sparse_mla_splits_ms"][str(splits)] = round(timer(sparse), 4)

        def step(splits: int = splits) -> torch.Tensor:
            pos, _ = dsa_triton.indexer_topk_triton(q_i, w, index_cache, meta, scale, topk)
            q, cache, _, _, mla_scale, latent = sparse_args
            return dsa_sparse_triton.dsa_attention_triton(q, cache, meta, pos, mla_scale, latent,
                                                          packed=True, num_splits=splits)
        step()
        out["dsa_graph_splits_ms"][str(splits)] = round(graph_timed(timer, step, True), 4)
    return out


def time_sparse_ws(name: str, step: Callable[[], torch.Tensor], args: tuple,
                   base: torch.Tensor, timer: Timer, cuda: bool) -> dict:
    """The sparse MLA by decode_gluon's kernel (decode_gluon.ws_sparse off) and by
    decode_gluon_ws (on) in its two forms (one P V warpgroup; two, `two_pv`), each also with
    the cache rows left in shared memory by the P V warpgroup (`slots_by_pv`: _slots), each
    first checked against the default kernel's output `base`:
    sparse_mla_{gluon,ws,ws2,ws_slots,ws2_slots}_ms, and the DSA step's graph with each,
    dsa_graph_{gluon,ws,ws2,ws_slots,ws2_slots}_ms."""
    from moeserve.kernels.attention.mla import decode_gluon_ws

    row: dict = {}
    was = decode_gluon.ws_sparse, decode_gluon_ws.two_pv, decode_gluon_ws.slots_by_pv
    try:
        for key, ws, two, by_pv in (("gluon", False, False, False), ("ws", True, False, False),
                                    ("ws2", True, True, False), ("ws_slots", True, False, True),
                                    ("ws2_slots", True, True, True)):
            decode_gluon.ws_sparse, decode_gluon_ws.two_pv = ws, two
            decode_gluon_ws.slots_by_pv = by_pv
            run = functools.partial(dsa_sparse_triton.dsa_attention_triton, *args)
            err = float((run().float() - base).abs().max() / base.abs().max())
            assert err <= 2 ** -6, f"{name}: sparse MLA ({key}): {err:.3g} from the default"
            row[f"sparse_mla_{key}_ms"] = timer(run)
            step()  # compiled (its packed form) before the capture
            row[f"dsa_graph_{key}_ms"] = graph_timed(timer, step, cuda)
    finally:
        decode_gluon.ws_sparse, decode_gluon_ws.two_pv, decode_gluon_ws.slots_by_pv = was
    return row


def time_pdl(name: str, step: Callable[[], torch.Tensor], timer: Timer) -> dict:
    """The step's graph with its kernels launched plain and at each programmatic dependent
    launch level (triton_common.pdl: 1 the wait, 2 also the successor's early launch, 3 the
    metadata read before both), each first checked equal to the plain launches' output:
    {"dsa_graph_pdl_ms": {"off": ms, "wait": ms, "early": ms, "meta": ms}}."""
    out: dict = {}
    was = triton_common.pdl
    try:
        triton_common.pdl = 0
        want = step().clone()
        for label, level in (("off", 0), ("wait", 1), ("early", 2), ("meta", 3)):
            triton_common.pdl = level
            assert torch.equal(step(), want), f"{name}: the step with PDL {label} differs"
            out[label] = round(graph_timed(timer, step, True), 4)
    finally:
        triton_common.pdl = was
    return {"dsa_graph_pdl_ms": out}


def time_reduce_forms(name: str, step: Callable[[], torch.Tensor], args: tuple,
                      base: torch.Tensor, timer: Timer) -> dict:
    """The split partials and their combine (reduce_triton) at each of REDUCE_FORMS: splits
    read at once (`split_block`; 0: one at a time) and accumulators in bf16 or fp32
    (`half_partials`), the sparse MLA first checked against `base` (a form off by more than
    2^-6 is recorded as its mismatch, untimed): the sparse MLA alone (sparse_mla_reduce_ms)
    and the step's graph (dsa_graph_reduce_ms), {"<block>[,half]": ms}."""
    out: dict = {"sparse_mla_reduce_ms": {}, "dsa_graph_reduce_ms": {}}
    was = reduce_triton.split_block, reduce_triton.half_partials
    try:
        for block, half in REDUCE_FORMS:
            reduce_triton.split_block, reduce_triton.half_partials = block, half
            key = f"{block},half" if half else str(block)
            run = functools.partial(dsa_sparse_triton.dsa_attention_triton, *args)
            err = float((run().float() - base).abs().max() / base.abs().max())
            if not err <= 2 ** -6:  # recorded, not raised: the other forms still run
                out["sparse_mla_reduce_ms"][key] = f"mismatch {err:.3g}"
                continue
            out["sparse_mla_reduce_ms"][key] = round(timer(run), 4)
            step()
            out["dsa_graph_reduce_ms"][key] = round(graph_timed(timer, step, True), 4)
    finally:
        reduce_triton.split_block, reduce_triton.half_partials = was
    return out


def time_indexer_rope(name: str, index_cache: torch.Tensor, meta: AttentionMetadata,
                      heads: int, timer: Timer) -> dict:
    """The indexer's key LayerNorm + RoPE + cache write and its query's RoPE (`heads` heads of
    the cache's width, GLM-5's 32 x 128, 64 rotary dims, interleaved) for the step's tokens,
    as the torch ops and as the
    two fused launches (dsa/indexer_rope_triton.py), each checked against the torch ops and
    replayed in a CUDA graph: {"indexer_rope_graph_ms": {"torch": ms, "fused": ms}}."""
    from moeserve.kernels.attention.dsa import indexer_rope_triton as rope

    index_cache = index_cache.clone()  # the step's own keys left as they are
    gen = torch.Generator(device="cuda").manual_seed(9)
    t, dt, DIM = meta.num_tokens, index_cache.dtype, index_cache.shape[-1]  # noqa: N806
    k = torch.randn(t, DIM, generator=gen, device="cuda").to(dt)
    q = torch.randn(t, heads, DIM, generator=gen, device="cuda").to(dt)
    angles = torch.rand(t, 32, generator=gen, device="cuda") * 6
    cos, sin = angles.cos(), angles.sin()
    w = (torch.randn(DIM, generator=gen, device="cuda") * 0.5 + 1).to(dt)
    b = (torch.randn(DIM, generator=gen, device="cuda") * 0.1).to(dt)
    slots = meta.slot_mapping
    runs = {
        "torch": lambda: (rope.indexer_keys_ref(k, cos, sin, w, b, 1e-6, index_cache, slots,
                                                True),
                          rope.indexer_q_rope_ref(q, cos, sin, True)),
        "fused": lambda: (rope.indexer_keys_triton(k, cos, sin, w, b, 1e-6, index_cache,
                                                   slots, True),
                          rope.indexer_q_rope_triton(q, cos, sin, True)),
    }
    q_want = runs["torch"]()[1]
    keys_want = index_cache.view(-1, DIM)[slots].clone()
    q_got = runs["fused"]()[1]
    assert torch.equal(q_got, q_want), f"{name}: the fused query RoPE"
    err = float((index_cache.view(-1, DIM)[slots].float() - keys_want.float()).abs().max())
    assert err <= 2 ** -5 * float(keys_want.float().abs().max()), f"{name}: fused keys {err}"
    return {"indexer_rope_graph_ms": {key: round(graph_timed(timer, fn, True), 4)
                                      for key, fn in runs.items()}}


def time_gather(name: str, scores: torch.Tensor, meta: AttentionMetadata, topk: int,
                selected: torch.Tensor, step: Callable[[], object], timer: Timer,
                cuda: bool) -> dict:
    """topk_triton.GATHER on (the threshold's last two digits from its 16-bit bin's scores):
    the row, chunks and coop forms (coop where not refused) checked against `selected`, then
    in graphs as topk_gather_graph_ms {form: ms}; the step's graph with it as
    dsa_graph_gather_ms ("auto"'s form), and with the coop form as dsa_graph_coop_gather_ms."""
    row: dict = {"topk_gather_graph_ms": {}}
    was = topk_triton.GATHER, topk_triton.FORM
    topk_triton.GATHER = True
    try:
        for form in ("chunks", "row", "coop"):
            fn = functools.partial(topk_triton.radix_topk, scores, meta, 0, topk,
                                   torch.empty_like(selected), form=form)
            try:
                fn()
            except ValueError:  # coop: more tokens than its programs' places
                continue
            assert torch.equal(fn.args[4], selected), f"{name}: {form} with GATHER"
            row["topk_gather_graph_ms"][form] = round(graph_timed(timer, fn, cuda), 4)
        step()
        row["dsa_graph_gather_ms"] = graph_timed(timer, step, cuda)
        if "coop" in row["topk_gather_graph_ms"]:
            topk_triton.FORM = "coop"
            step()
            row["dsa_graph_coop_gather_ms"] = graph_timed(timer, step, cuda)
    finally:
        topk_triton.GATHER, topk_triton.FORM = was
    return row
