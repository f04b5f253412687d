"""Every environment variable moeserve reads, in one typed place (all prefixed MOESERVE_).

    MOESERVE_API_PIDS_FILE   set by the `--api-servers` launcher for its API processes: a file
                             listing their pids (the summed API CPU metric reads it)
    MOESERVE_MOE_CONFIG_DIR  extra folder of tuned fused-MoE tile configs, searched first; a
                             tune at start-up writes there when it is set
    MOESERVE_CACHE_DIR       moeserve's on-disk cache (default $XDG_CACHE_HOME/moeserve, else
                             ~/.cache/moeserve); MoE tunes made at start-up go to moe_configs/
    MOESERVE_GIT_COMMIT      the commit to stamp on results where no git checkout is at hand
    MOESERVE_FAULT_INJECT    tests only, off when unset: faults to raise for chosen request ids,
                             "KIND:ID[,KIND:ID...]" with KIND one of FAULT_KINDS (below)
    MOESERVE_GROUPED_ROUTER_TRITON  "0" turns off the sigmoid, group-limited router's one
                             Triton launch on CUDA (layers/moe.py), for A/Bs; on otherwise
    MOESERVE_MLA_PREFILL_GLUON  "0" keeps the Triton MLA backend's absorbed prefill rows off
                             mla/prefill_gluon.py (wgmma, sm90), for A/Bs; on
                             otherwise where it takes the inputs
    MOESERVE_MLA_DECODE_SWAPPED  "0" keeps the Gluon MLA decode's launches of at most 32
                             heads off mla/decode_gluon_swapped.py's kernel (keys as wgmma's
                             M), for A/Bs; on otherwise
    MOESERVE_MLA_DECODE_WS  "0" keeps the Gluon MLA decode's launches of many heads (64+ on
                             the H200, 128+ on the H100; at L 512, R 64) whose rows reach
                             past 1,024 keys off mla/decode_gluon_ws.py's warp-specialized
                             kernel (one warpgroup the scores, the other half of P V), and
                             DSA's sparse MLA of 33+ heads off it too (decode_gluon.ws_sparse),
                             for A/Bs; on otherwise
    MOESERVE_MLA_SWAPPED_ONE_STAGE  "0" goes back to two key stages (one program an SM) in
                             decode_gluon_swapped.py's kernel; one stage (115 KB of shared
                             memory: two programs an SM, each copying its next tile after its
                             products) otherwise, the default since the H200 measured it
                             faster (session 34, benchmarks/results/gpu_ff7b345/)
    MOESERVE_MLA_FRESH_VARLEN  "0" keeps MLA layers' fresh prompts (no cached prefix) of
                             layers/mla.py's FRESH_VARLEN_MIN_TOKENS or more off the one
                             variable-length flash launch (mla/up_projected.attend_fresh_rows),
                             for A/Bs; on otherwise
    MOESERVE_MLA_PIECE_KERNEL  the attention kernel of the up-projected MLA prefill's pieces
                             on CUDA (mla/up_projected.PIECE_KERNEL): "auto" (the default:
                             cuDNN's for large pieces of many heads, else flash), "flash",
                             "cudnn" or "efficient"; anything else is refused at the first
                             piece
    MOESERVE_DECODE_LONGEST_FIRST  "1" launches the decode attention's rows longest
                             context first (the Gluon MLA decode's, decode_gluon.longest_first,
                             and the Triton GQA decode's, paged_triton.longest_first), "0" in
                             step order; unset, the MLA decode's longest first (its default),
                             the GQA decode's in step order
    MOESERVE_MLA_VECTOR_STORES  "0" has the Gluon MLA decode kernels store their outputs
                             from the accumulator's layout, not in 16-byte vectors
                             (decode_gluon.vector_stores), for A/Bs; on otherwise
    MOESERVE_MOE_GLUON_WS    the bf16 fused MoE's launches handed to kernels/moe/gluon_ws.py's
                             warp-specialized Gluon kernel (its `mode`): "off" (the default),
                             "auto" (from 128 rows an expert on average) or "on", for A/Bs;
                             anything else is refused at the first launch
    MOESERVE_DSA_TOPK_FORM   DSA's top-k form (dsa/topk_triton.FORM): "auto" (the default),
                             "row", "chunks", "coop" or "bisect", for A/Bs; anything else is
                             refused at the first top-k
    MOESERVE_DSA_SLOT_ROWS   "1" turns DSA's selections into cache rows before the sparse
                             attention (dsa/sparse_triton.slot_rows), an experiment; off
                             otherwise
    MOESERVE_DSA_FUSED_INDEXER  "0" runs the DSA indexer's key write and query RoPE as the
                             torch ops on CUDA, for A/Bs; one Triton launch each otherwise
                             (layers/dsa.FUSED_ON_CUDA)
    MOESERVE_PDL             "0" launches the kernels that take programmatic dependent
                             launch (DSA's decode step: indexer scores, bisect top-k, sparse
                             MLA, split combine) plainly, "1" with their waits only, for
                             A/Bs; "2" (unset) also releases each one's successor early; "3"
                             as 2, the step's metadata read before the wait, for A/Bs
                             (triton_common.pdl; any other value is an error)
    MOESERVE_GRAMMAR_MASKS_THREAD  "0" builds a deferred grammar step's masks on the
                             engine's thread, at once (engine/structured_steps.py), for
                             A/Bs; on their own thread beside the loop's other host work
                             otherwise
    MOESERVE_COLLECTIVES_AT_ONE_RANK  tests only: "1" runs a world of one's collectives
                             (the identity, skipped otherwise), so one GPU captures NCCL in
                             CUDA graphs
"""

from __future__ import annotations

import os

API_PIDS_FILE = "MOESERVE_API_PIDS_FILE"
MOE_CONFIG_DIR = "MOESERVE_MOE_CONFIG_DIR"
CACHE_DIR = "MOESERVE_CACHE_DIR"
GIT_COMMIT = "MOESERVE_GIT_COMMIT"
FAULT_INJECT = "MOESERVE_FAULT_INJECT"
COLLECTIVES_AT_ONE_RANK = "MOESERVE_COLLECTIVES_AT_ONE_RANK"
GROUPED_ROUTER_TRITON = "MOESERVE_GROUPED_ROUTER_TRITON"
MLA_PREFILL_GLUON = "MOESERVE_MLA_PREFILL_GLUON"
MLA_DECODE_SWAPPED = "MOESERVE_MLA_DECODE_SWAPPED"
MLA_FRESH_VARLEN = "MOESERVE_MLA_FRESH_VARLEN"
MLA_DECODE_WS = "MOESERVE_MLA_DECODE_WS"
MLA_SWAPPED_ONE_STAGE = "MOESERVE_MLA_SWAPPED_ONE_STAGE"
MLA_VECTOR_STORES = "MOESERVE_MLA_VECTOR_STORES"
MLA_PIECE_KERNEL = "MOESERVE_MLA_PIECE_KERNEL"
DECODE_LONGEST_FIRST = "MOESERVE_DECODE_LONGEST_FIRST"
DSA_SLOT_ROWS = "MOESERVE_DSA_SLOT_ROWS"
DSA_FUSED_INDEXER = "MOESERVE_DSA_FUSED_INDEXER"
PDL = "MOESERVE_PDL"
MOE_GLUON_WS = "MOESERVE_MOE_GLUON_WS"
DSA_TOPK_FORM = "MOESERVE_DSA_TOPK_FORM"
GRAMMAR_MASKS_THREAD = "MOESERVE_GRAMMAR_MASKS_THREAD"

# Where an injected fault fires, for the request id it names:
#   sample      the step's sampler raises while that request is in the batch (the runner then
#               samples row by row, and only that request's row fails)
#   nan         that request's logits are NaN (the runner's finite check fails its row)
#   detokenize  its detokenization raises (API process or offline LLM)
#   step        the forward raises while it is in the batch: a fault of no one request, which
#               stops the engine loudly
#   hold_startup  (the id is a file path) the engine's start-up waits until that file exists:
#               a start-up as long as a test needs, like a long MoE tune
#   slow_step   (the id is milliseconds) every engine step sleeps that long first: an engine
#               slower than its clients, for overload and disconnect tests
#   hold_steps  (the id is a file path) every engine step waits until that file exists: no
#               request finishes until a test lets them
#   oom         the forward raises torch.OutOfMemoryError while that request is in the batch
#               (a step the memory plan did not foresee: engine/oom.py recovers); oom_once:
#               only the first time
FAULT_KINDS = ("sample", "nan", "detokenize", "step", "hold_startup", "slow_step",
               "hold_steps", "oom", "oom_once")


def collectives_at_one_rank() -> bool:
    return os.environ.get(COLLECTIVES_AT_ONE_RANK) == "1"


def grouped_router_triton() -> bool:
    return os.environ.get(GROUPED_ROUTER_TRITON) != "0"


def mla_prefill_gluon() -> bool:
    return os.environ.get(MLA_PREFILL_GLUON) != "0"


def grammar_masks_thread() -> bool:
    return os.environ.get(GRAMMAR_MASKS_THREAD) != "0"


def mla_decode_swapped() -> bool:
    return os.environ.get(MLA_DECODE_SWAPPED) != "0"


def mla_decode_ws() -> bool:
    return os.environ.get(MLA_DECODE_WS) != "0"


def mla_swapped_one_stage() -> bool:
    return os.environ.get(MLA_SWAPPED_ONE_STAGE) != "0"


def mla_fresh_varlen() -> bool:
    return os.environ.get(MLA_FRESH_VARLEN) != "0"


def mla_vector_stores() -> bool:
    return os.environ.get(MLA_VECTOR_STORES) != "0"


def mla_piece_kernel(default: str) -> str:
    return os.environ.get(MLA_PIECE_KERNEL) or default


def decode_longest_first(default: bool) -> bool:
    value = os.environ.get(DECODE_LONGEST_FIRST)
    return default if value is None else value == "1"


def moe_gluon_ws(default: str) -> str:
    return os.environ.get(MOE_GLUON_WS) or default


def dsa_topk_form(default: str) -> str:
    return os.environ.get(DSA_TOPK_FORM) or default


def dsa_slot_rows() -> bool:
    return os.environ.get(DSA_SLOT_ROWS) == "1"


def dsa_fused_indexer() -> bool:
    return os.environ.get(DSA_FUSED_INDEXER) != "0"


def pdl() -> int:
    """MOESERVE_PDL: 0 plain launches, 1 each DSA kernel waits for its predecessor, 2 (unset)
    also lets its successor launch right after that wait, 3 reads the step's metadata first
    (triton_common.pdl)."""
    value = os.environ.get(PDL) or "2"
    if value not in ("0", "1", "2", "3"):
        raise ValueError(f"{PDL}={value!r}: expected 0, 1, 2 or 3")
    return int(value)


def set_variables() -> dict[str, str]:
    """The MOESERVE_ variables of this module that are set here, with their values: what a
    result records beside its config (the kernel switches change what runs)."""
    names = [value for name, value in globals().items()
             if name.isupper() and isinstance(value, str) and value.startswith("MOESERVE_")]
    return {name: os.environ[name] for name in sorted(names) if name in os.environ}


def api_pids_file() -> str | None:
    return os.environ.get(API_PIDS_FILE) or None


def moe_config_dir() -> str | None:
    return os.environ.get(MOE_CONFIG_DIR) or None


def cache_dir() -> str:
    """MOESERVE_CACHE_DIR, else $XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve."""
    explicit = os.environ.get(CACHE_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moeserve")


def git_commit() -> str | None:
    return os.environ.get(GIT_COMMIT) or None


class InjectedFault(RuntimeError):
    """A fault raised on purpose by MOESERVE_FAULT_INJECT (tests only)."""


def fault_injection() -> dict[str, frozenset[str]]:
    """MOESERVE_FAULT_INJECT parsed: kind -> request ids; {} when unset (the default). A
    malformed value raises ValueError naming it, so a test never runs without its faults."""
    raw = os.environ.get(FAULT_INJECT, "").strip()
    faults: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        kind, sep, request_id = item.partition(":")
        if not sep or kind not in FAULT_KINDS or not request_id:
            raise ValueError(f"{FAULT_INJECT}: {item!r} is not KIND:REQUEST_ID with KIND one of "
                             f"{', '.join(FAULT_KINDS)}")
        faults.setdefault(kind, set()).add(request_id)
    return {kind: frozenset(ids) for kind, ids in faults.items()}
