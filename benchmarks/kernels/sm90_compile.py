"""The compile behind kernel_sass.py: a Triton (or Gluon) kernel compiled for sm90 with no GPU,
its SASS read for the instruction mix, the longest loop's ops, its copy waits and ptxas's
registers and spills (the report kernel_sass.py prints)."""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile


def compile_sm90(jit_fn, pointers: dict[str, str], const: dict, nospec: set[str],
                 warps: int, stages: int) -> dict:
    """Compile `jit_fn` for sm90: the report (module doc) of its SASS and TTGIR."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(jit_fn.fn).parameters)
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
           if n not in const and n not in nospec}
    if getattr(jit_fn, "is_gluon", lambda: False)():  # a Gluon kernel: its own IR source
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(jit_fn, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=div)
    options = {"num_warps": warps, "num_stages": stages}
    if os.environ.get("SASS_MAXNREG"):  # a register cap (Triton's maxnreg launch option)
        options["maxnreg"] = int(os.environ["SASS_MAXNREG"])
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(out.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                          check=True).stdout
    os.unlink(f.name)
    if os.environ.get("SASS_DUMP"):  # the whole listing, to read
        with open(os.environ["SASS_DUMP"], "w") as dump:
            dump.write(sass)
        with open(os.environ["SASS_DUMP"] + ".ptx", "w") as dump:  # and its PTX beside it
            dump.write(out.asm["ptx"])
    ops = collections.Counter(
        m.group(1) for line in sass.splitlines()
        if (m := OPCODE.search(line)))
    ttgir = out.asm["ttgir"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(out.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    usage = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    return {"triton": triton.__version__, **ptxas_usage(usage),
            "sass_instructions": sum(ops.values()),
            "loop_instructions": _top(_loop_ops(sass)),
            "loop_copy_wait": _loop_copy_wait(sass),
            "loop_wgmma_waits": _loop_wgmma_waits(sass),
            "top_ops": dict(ops.most_common(int(os.environ.get("SASS_TOP", "12")))),
            "shared_bytes": out.metadata.shared,
            "cp_async": out.asm["ptx"].count("cp.async."),
            "convert_layout": ttgir.count("ttg.convert_layout"),
            "wgmma": ttgir.count("warp_group_dot "),
            # griddepcontrol.wait and .launch_dependents (programmatic dependent launch's
            # wait and early release, triton_common.pdl)
            "gdc_waits": ops["ACQBULK"], "gdc_launches": ops["PREEXIT"]}


def ptxas_usage(text: str) -> dict[str, int]:
    """Registers a thread and spilled bytes from `ptxas -v`'s report (a spill in a kernel's
    main loop is what makes it slow before anything else is)."""
    def grab(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {"registers": grab(r"Used (\d+) registers"),
            "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
            "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
            # ptxas serializing every wgmma of the kernel (C7510-C7520: an accumulator
            # register touched by another instruction while a wgmma runs, and the like)
            "wgmma_serialized": int("wgmma.mma_async instructions are serialized" in text)}


# the loads, stores and barriers: always reported, however rare (a synchronous LDG in the K
# loop, or a cp.async missing from it, is what one reads the loop for)
MEMORY_OPS = ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LDS", "LDSM", "STS", "STSM", "BAR")


def _top(ops: collections.Counter) -> dict[str, int]:
    """The SASS_TOP (default 12) most common opcodes and "total", plus every MEMORY_OPS
    opcode (0 when absent)."""
    top = dict(ops.most_common(int(os.environ.get("SASS_TOP", "12"))))
    return top | {op: ops.get(op, 0) for op in MEMORY_OPS}


OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)")


def _longest_loop(sass: str) -> list[str]:
    """The instruction lines of the longest loop: between a label and a later branch back to
    it (the K loop)."""
    labels, body, best = {}, [], []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(body)
        elif m := OPCODE.search(line):
            body.append(line)
            target = re.search(r"BRA\s+(?:\S+\s+)?`?\(?(\.L_x_\d+)", line)
            if m.group(1) == "BRA" and target and target.group(1) in labels:
                loop = body[labels[target.group(1)]:]
                if len(loop) > len(best):
                    best = loop
    return best


def _loop_ops(sass: str) -> collections.Counter:
    """The opcodes of the longest loop, "total" their count."""
    ops = collections.Counter(OPCODE.search(line).group(1) for line in _longest_loop(sass))
    ops["total"] = sum(ops.values())
    return ops


def _loop_wgmma_waits(sass: str) -> list[int]:
    """N of each wgmma wait in the longest loop (WARPGROUP.DEPBAR.LE gsb0, N), in order: the
    wgmma groups it leaves running. All 0: each step's MMAs finish before anything after
    them (Triton's block-scaled FP8 loop, or ptxas's serialization)."""
    return [int(m.group(1), 0) for line in _longest_loop(sass)
            if (m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+|\d+)", line))]


def _loop_copy_wait(sass: str) -> int | None:
    """N of the longest loop's first wait on its async copies (DEPBAR.LE SB0, N): the copy
    groups it leaves in flight while it computes. 0 means it waits for every copy issued, so
    no load overlaps the loop's math (what a block-table lookup in front of the loads gives);
    None, no wait in the loop."""
    for line in _longest_loop(sass):
        if m := re.search(r"DEPBAR\.LE\s+SB0,\s*(0x[0-9a-f]+|\d+)", line):
            return int(m.group(1), 0)
    return None


def pdl_level() -> int:
    """SASS_PDL=1, 2 or 3: the kernels that take a PDL constexpr (triton_common.pdl's level)
    compiled with their wait for the previous kernel (2, 3: and the next one's early launch)."""
    return int(os.environ.get("SASS_PDL") or "0")


def nospec_of(args: argparse.Namespace, kernel) -> set[str]:
    """The integer arguments compiled unspecialized: --nospec's, else the kernel's own
    do_not_specialize list."""
    if args.nospec is not None:
        return set(args.nospec)
    names = list(inspect.signature(kernel.fn).parameters)  # the list holds names or indices
    return {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
