"""`moeserve bench`: flags, and the sweep that ties workloads, runner, metrics and report.

    run_bench(args)
      no --url: start `moeserve serve --preset P` on a free port (server.py), stop it at the end
      GET /v1/engine (capacity report: vocab size, device; null for foreign servers)
      GET /v1/models (the model name, unless --model)
      for each C in --max-concurrency (a sweep; none = no cap):
        workload of --num-prompts (default 3 x C) fresh requests (no prompt repeats across runs)
        warm-up (one fresh short request, then 1 s)   -> runner.warmup
        timed run under the rich progress bar          -> runner.run_timed
        figures                                        -> metrics.compute_metrics
        table on the terminal; one JSON line appended  -> report
        --diagnose: telemetry during the timed run, then the doctor's verdicts after the table
                    (res["diagnostics"], res["verdicts"])  -> diagnostics.py
      a sweep table when there was more than one run

`run_bench` also takes an argv list (as does `run_bench_argv`), so tests can drive it like the
command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from moeserve.bench.client import ClientConfig
from moeserve.bench.diagnostics import RunDiagnostics, attach, print_verdicts
from moeserve.bench.engine_run import describe, engine_run, engine_snapshot
from moeserve.bench.metrics import compute_metrics
from moeserve.bench.report import append_jsonl, build_result, print_run, print_sweep, progress_bar
from moeserve.bench.runner import RunConfig, run_async, run_timed, warmup
from moeserve.bench.server import (
    ServerProcess,
    find_key,
    first_model,
    get_json,
    git_commit,
    server_cpu_seconds,
    vocab_size_of,
)
from moeserve.bench.workloads import (
    TextTokenizer,
    WorkItem,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)
from moeserve.diagnose.bounds.roofline import run_serial_bound

DEFAULT_NUM_PROMPTS_UNCAPPED = 100  # --num-prompts without --max-concurrency


def _concurrency_list(values: list[str] | None) -> list[int | None]:
    """["256", "512,1024"] -> [256, 512, 1024]; None -> [None] (no cap)."""
    if not values:
        return [None]
    out: list[int | None] = []
    for v in values:
        for part in v.split(","):
            if not part.strip():
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise ValueError(f"--max-concurrency: {part!r} is not an integer") from None
    return out


def _json_object(text: str) -> dict[str, Any]:
    """--extra-body: a JSON object (argparse turns the ValueError into a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `moeserve bench`."""
    t = parser.add_argument_group("target")
    t.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. "
                   "http://127.0.0.1:8000 (default: start `moeserve serve` here)")
    t.add_argument("--api", choices=("completions", "chat"), default="completions")
    t.add_argument("--model", help="model name sent in requests (default: first of /v1/models)")
    t.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--preset", default="tiny-moe",
                   help="preset of the server the bench starts without --url (default: tiny-moe)")
    t.add_argument("--server-args", default="",
                   help="extra `moeserve serve` flags for that server, as one string "
                   "(one flag alone as --server-args=--flag: argparse takes a lone '--flag' "
                   "value for an option)")
    t.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for that server's /ready (default: 600)")
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "sharegpt", "shared-prefix"),
                   default="random")
    w.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (random; the suffix for shared-prefix) (default: 128)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens (default: 128)")
    w.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths uniform in [len x ratio, len]; 1.0 = exact (default: 1.0)")
    w.add_argument("--text-prompts", action="store_true",
                   help="random words instead of token ids (always so for --api chat)")
    w.add_argument("--vocab-size", type=int,
                   help="vocabulary for random token ids (default: from /v1/engine)")
    w.add_argument("--tokenizer", help="tokenizer.json (or a folder with one) to measure text")
    w.add_argument("--dataset-path", help="ShareGPT-format JSON file (--workload sharegpt)")
    w.add_argument("--sharegpt-output-len", type=int,
                   help="output length for every ShareGPT request (default: the reply's)")
    w.add_argument("--shared-prefix-groups", type=int, default=4,
                   help="groups sharing a prefix (shared-prefix) (default: 4)")
    w.add_argument("--shared-prefix-len", type=int, default=512,
                   help="shared prefix tokens (shared-prefix) (default: 512)")
    w.add_argument("--num-prompts", type=int, help="requests per run (default: 3 x the "
                   f"concurrency, or {DEFAULT_NUM_PROMPTS_UNCAPPED} without one)")
    w.add_argument("--seed", type=int, default=0)
    ld = parser.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second, Poisson (default: inf = all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrival gaps; 1 = Poisson, < 1 burstier")
    ld.add_argument("--max-concurrency", nargs="+", metavar="C",
                    help="in-flight cap; several values (or 256,512) run a sweep")
    ld.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one short request and 1 s of quiet before each run (default: on)")
    ld.add_argument("--workers", type=int, default=1,
                    help="client processes sharing the load (default: 1)")
    ld.add_argument("--timeout", type=float, default=6 * 3600.0,
                    help="seconds per request (default: 21600)")
    ld.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos")
    ld.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                    help="fields added to every request, e.g. '{\"response_format\": {\"type\": "
                    "\"json_object\"}}' to bench structured outputs (not the fields the bench "
                    "sets: prompt, messages, max_tokens, temperature, stream, ignore_eos, ...)")
    o = parser.add_argument_group("output")
    o.add_argument("--output-json", help="append one JSON line per run to this file")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    o.add_argument("--diagnose", action="store_true",
                   help="sample the engine (/v1/engine, 250 ms), the GPUs (NVML, 100 ms) and the "
                   "server's processes during each run, then print the doctor's verdicts")


class _HFTokenizer:
    """A tokenizer.json through the `tokenizers` library, without special tokens."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"--tokenizer {path!r}: no tokenizer.json there")
        self._tok = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def run_bench(args: argparse.Namespace | Sequence[str]) -> int:
    """Run `moeserve bench`; 0 when every run completed requests, 1 when a run completed
    none, 2 for bad flags or an unreachable or failing server."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="moeserve bench")
        add_bench_args(parser)
        args = parser.parse_args(list(args))
    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the sweep table
        console = Console(width=120)
    try:
        if args.url:
            return _bench(args, args.url, console, started=False)
        console.print(f"starting `moeserve serve --preset {args.preset}"
                      f"{' ' + args.server_args if args.server_args else ''}`", highlight=False)
        with ServerProcess(args.preset, args.server_args, args.api_key,
                           ready_timeout_s=args.server_timeout) as server:
            return _bench(args, server.url, console, started=True,
                          server_proc=(server.proc.pid, server.port) if server.proc else None)
    except (ValueError, RuntimeError) as e:
        print(f"moeserve bench: error: {e}", file=sys.stderr)
        return 2


def run_bench_argv(argv: Sequence[str]) -> int:
    """`moeserve bench` with these arguments (for tests and scripts)."""
    return run_bench(list(argv))


def _settings(args: argparse.Namespace, engine: Any | None) -> dict[str, Any]:
    """Resolved workload inputs and the warnings they call for."""
    warnings: list[str] = []
    if engine is None:
        warnings.append("the server has no /v1/engine (not moeserve?): its config and device "
                        "are unknown")
    text = args.text_prompts or args.workload == "sharegpt" or args.api == "chat"
    if args.api == "chat" and not args.text_prompts and args.workload != "sharegpt":
        warnings.append("--api chat sends text: prompts are random words, not token ids")
    tokenizer = _HFTokenizer(args.tokenizer) if args.tokenizer else None
    if text and tokenizer is None:
        warnings.append("text lengths are estimates (words x 1.3; no --tokenizer); the server's "
                        "usage.prompt_tokens replaces them where sent")
    vocab, source = (args.vocab_size, "--vocab-size") if args.vocab_size else \
        vocab_size_of(engine)
    return {"text": text, "tokenizer": tokenizer, "vocab_size": vocab, "vocab_source": source,
            "warnings": warnings,
            "max_model_len": find_key(engine, "max_model_len")}


def build_workload(args: argparse.Namespace, num_prompts: int, rng: random.Random,
                   s: dict[str, Any]) -> list[WorkItem]:
    """The requests of one run, from the flags and the resolved settings `s`."""
    tok: TextTokenizer | None = s["tokenizer"]
    if args.workload == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--workload sharegpt needs --dataset-path FILE.json")
        return sharegpt_workload(args.dataset_path, num_prompts, rng, tok,
                                 args.sharegpt_output_len, s["max_model_len"])
    if args.workload == "shared-prefix":
        return shared_prefix_workload(num_prompts, args.shared_prefix_groups,
                                      args.shared_prefix_len, args.input_len, args.output_len,
                                      rng, s["vocab_size"], s["text"], tok)
    return random_workload(num_prompts, args.input_len, args.output_len, args.range_ratio, rng,
                           s["vocab_size"], s["text"], tok)


def _bench(args: argparse.Namespace, url: str, console: Console, started: bool,
           server_proc: tuple[int, int] | None = None) -> int:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    engine = get_json(url, "/v1/engine", api_key)
    model = args.model or first_model(url, api_key)
    client = ClientConfig(base_url=url, model=model, api=args.api, api_key=api_key,
                          ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                          extra_body=args.extra_body)
    s = _settings(args, engine)
    for w in s["warnings"]:
        console.print(f"[yellow]note:[/yellow] {w}", highlight=False)
    if not s["text"] and s["vocab_size"]:
        console.print(f"prompts: random token ids in [0, {s['vocab_size']}) (vocabulary size "
                      f"from {s['vocab_source']})", highlight=False)
    provenance = {
        "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in vars(args).items() if k not in ("func", "api_key")},
        "server": {"url": url, "model": model, "api": args.api, "started_by_bench": started,
                   "preset": args.preset if started else None, "vocab_size": s["vocab_size"],
                   "vocab_source": s["vocab_source"] or None},
        "engine": engine,
        "device": find_key(engine, "device_name") or find_key(engine, "device"),
        "git": git_commit(),
    }
    rng = random.Random(args.seed)
    results = []
    for i, conc in enumerate(_concurrency_list(args.max_concurrency)):
        res = _run_one(args, client, conc, args.seed + i, rng, s, provenance, console,
                       server_proc)
        if args.output_json:
            append_jsonl(args.output_json, res)
        results.append(res)
    if len(results) > 1:
        print_sweep(console, results)
    return 0 if all(r["completed"] > 0 for r in results) else 1


def _run_one(args: argparse.Namespace, client: ClientConfig, conc: int | None, seed: int,
             rng: random.Random, s: dict[str, Any], provenance: dict[str, Any],
             console: Console, server_proc: tuple[int, int] | None = None) -> dict[str, Any]:
    """One run of the sweep: workload, warm-up, timed run, figures, table; its JSON object."""
    num = args.num_prompts or (3 * conc if conc else DEFAULT_NUM_PROMPTS_UNCAPPED)
    run_cfg = RunConfig(max_concurrency=conc, request_rate=args.request_rate,
                        burstiness=args.burstiness, seed=seed, num_workers=args.workers)
    items = build_workload(args, num, rng, s)
    if args.warmup:  # a prompt of its own, so that no prefix of the run is cached by it
        first = items[0]
        fresh = random_workload(1, max(1, first.prompt_len), first.output_len, 1.0, rng,
                                s["vocab_size"], s["text"], s["tokenizer"])[0]
        run_async(warmup(client, fresh))
    label = f"concurrency {conc}" if conc else f"rate {args.request_rate}"
    api_cpu0 = server_cpu_seconds(client.base_url, client.api_key)
    has_engine = provenance["engine"] is not None
    engine0 = engine_snapshot(client.base_url, client.api_key) if has_engine else None
    diag = RunDiagnostics(client.base_url, client.api_key, has_engine,
                          server_proc) if args.diagnose else None
    if diag is not None:
        diag.start()
    try:
        with progress_bar(console, len(items), label, args.progress) as on_progress:
            run = run_timed(client, items, run_cfg, on_progress)
    except BaseException:
        if diag is not None:
            diag.stop(None)
        raise
    diagnostics = diag.stop(run.duration) if diag is not None else None
    api_cpu1 = server_cpu_seconds(client.base_url, client.api_key)
    engine1 = engine_snapshot(client.base_url, client.api_key) if has_engine else None
    metrics = compute_metrics(run.records, run.duration)
    warnings = list(s["warnings"])
    no_usage = sum(1 for r in run.records if r.success and r.usage_completion_tokens is None)
    if no_usage:
        warnings.append(f"{no_usage} requests had no usage in the stream: their output "
                        f"lengths are counted from the stream")
    res = build_result(metrics, run, max_concurrency=conc, request_rate=args.request_rate,
                       warnings=warnings, **provenance)
    # the server's API process CPU over the run (moeserve exports it): is the API side the limit?
    res["server_api_cpu_fraction"] = (None if api_cpu0 is None or api_cpu1 is None
                                      else (api_cpu1 - api_cpu0) / run.duration)
    # what the engine did in the timed run: steps, graph replays, where the loop's time went
    res["engine_run"] = engine_run(engine0, engine1, run.duration)
    if conc and args.workload == "random" and args.range_ratio == 1.0:  # fixed lengths
        res["serial_bound"] = run_serial_bound(res, conc, args.input_len, args.output_len)
    print_run(console, res)
    if (line := describe(res["engine_run"])) is not None:
        console.print(line, highlight=False)
    if (bound := res.get("serial_bound")) and "percent" in bound:
        console.print(f"serial roofline ({bound['device']}, ANCHORS.md's method): "
                      f"{bound['output_tok_s']:,.0f} output tok/s; this run "
                      f"{bound['percent']:.1f}% of it", highlight=False)
    if diagnostics is not None:
        print_verdicts(console, res, attach(res, diagnostics))
    return res
