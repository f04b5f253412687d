"""The host cost of structured outputs' token masks (structured/grammars.py), per step and per row,
at a realistic vocabulary size: the engine builds them on a thread of its own while the step's
forward runs and the loop goes on (engine/structured_steps.py), so what matters is this time
against a decode step's.

No checkpoint is downloaded: a byte-level BPE tokenizer is trained on this repository's text
(its files under 2 MiB; the size reached is in the result's config: "vocab_size"). Each run
puts R requests under one JSON schema and walks them through the same compact JSON reply token
by token, timing `Grammars.bitmask` over the R rows at each step (the accepts are not timed),
the masks built as the engine builds them (`Grammars.bitmask`: one call of llguidance's
executor on one thread; before bdccbac one Python call a row, which `--per-row` times beside
it as `per_row`). (More executor threads,
MOESERVE_GRAMMAR_THREADS, were slower on 2 cores and on 16, benchmarks/results/gpu_ff7b345/,
and were removed.)

    python -m benchmarks.structured.mask_cost --rows 1 64 256 1024 [--per-row] --out DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import llguidance
import numpy as np

from moeserve.bench.server import git_commit
from moeserve.structured.grammars import Grammars
from moeserve.structured.spec import StructuredOutput
from moeserve.tokenizer import HFTokenizer
from moeserve.types import RequestOutput, SamplingParams, SchedulerOutput

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
REPLY = '{"name":"Alice Smith, the third of the name","age":42,"tags":["a","bb","ccc","dddd"]}'


def train_tokenizer(vocab_size: int, folder: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(path for pattern in ("*.py", "*.md", "*.json", "*.sh")
                   for path in glob.glob(str(ROOT / "**" / pattern), recursive=True)
                   if "/.venv/" not in path and os.path.getsize(path) < 2 << 20)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return HFTokenizer(folder)


def plan(rows: int) -> SchedulerOutput:
    return SchedulerOutput(
        req_ids=[f"r{i}" for i in range(rows)], num_scheduled_tokens=[1] * rows,
        num_computed_tokens=[0] * rows, token_ids=[0] * rows, block_tables=[[]] * rows,
        sample=[True] * rows, sampling_params=[SamplingParams()] * rows,
        sample_seeds=[0] * rows, num_output_tokens=[0] * rows)


def per_row_masks(grammars: Grammars, rows: int) -> np.ndarray:
    """The masks one Python call a row, the engine's way before bdccbac (the reference)."""
    from llguidance.numpy import fill_next_token_bitmask

    mask = np.empty((rows, grammars.words), dtype=np.int32)
    for j in range(rows):
        fill_next_token_bitmask(grammars._requests[f"r{j}"].matcher, mask, j)
    return mask


def run(tokenizer: HFTokenizer, rows: int, per_row: bool) -> dict:
    """The engine's masks (Grammars.bitmask) at each step of the reply; with `per_row` the
    reference too, on grammars of its own in the same states, the two timed in turns (which
    goes first alternates: a state's first visit pays for both's shared caches)."""
    sets = [Grammars(lambda: tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
            for _ in range(2 if per_row else 1)]
    start = time.perf_counter()
    for grammars in sets:
        for i in range(rows):
            grammars.add(f"r{i}", StructuredOutput.json_schema(SCHEMA))
    setup_s = (time.perf_counter() - start) / len(sets)
    step, ids = plan(rows), tokenizer.encode(REPLY, add_special_tokens=False)
    times: list[list[float]] = [[] for _ in sets]
    for k, token in enumerate(ids):
        order = range(len(sets)) if k % 2 == 0 else reversed(range(len(sets)))
        masks = {}
        for m in order:
            start = time.perf_counter()
            if m == 0:
                masks[m], failed = sets[0].bitmask(step, list(range(rows)))
            else:
                masks[m] = per_row_masks(sets[1], rows)
            times[m].append(time.perf_counter() - start)
        if failed or (per_row and not np.array_equal(masks[0], masks[1])):
            raise RuntimeError(f"the masks differ, or the reply broke the grammar: {failed}")
        for grammars in sets:
            accepted = grammars.accept([RequestOutput(f"r{i}", [1], [token])
                                        for i in range(rows)])
            if accepted.refused:
                raise RuntimeError(f"the reply broke the grammar: {accepted.refused}")
    result = {"rows": rows, "steps": len(ids), "setup_s": round(setup_s, 4),
              **_stats(times[0], rows)}
    if per_row:
        result["per_row"] = _stats(times[1], rows)
    return result


def _stats(times: list[float], rows: int) -> dict:
    return {"step_ms_median": round(statistics.median(times) * 1e3, 3),
            "step_ms_mean": round(statistics.mean(times) * 1e3, 3),
            "step_ms_max": round(max(times) * 1e3, 3),
            "row_us_median": round(statistics.median(times) / rows * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--vocab-size", type=int, default=150_000)
    parser.add_argument("--per-row", action="store_true",
                        help="time the per-row reference too (`per_row` in each run)")
    parser.add_argument("--out", help="directory for mask_cost.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        tokenizer = train_tokenizer(args.vocab_size, folder)
        trained_s = time.perf_counter() - start
        runs = [run(tokenizer, rows, args.per_row) for rows in args.rows]
    result = {"benchmark": "structured mask cost", **git_commit(),
              "device": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
              "python": platform.python_version(),
              "llguidance": llguidance.__version__ if hasattr(llguidance, "__version__")
              else "1.9.1 (constraints.txt)",
              "config": {"vocab_size_asked": args.vocab_size, "vocab_size": tokenizer.vocab_size,
                         "schema": SCHEMA, "reply": REPLY, "tokenizer_trained_s":
                         round(trained_s, 1)},
              "runs": runs}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mask_cost.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
