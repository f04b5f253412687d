"""The `moeserve` command line: `serve`, `bench`, `doctor`, `report`, `tune`, `generate`
(offline, in-process), `presets`.

Engine flags come from the config dataclasses (engine/args.py), so every knob the engine has is a
flag with the field's own docstring as its help.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from moeserve.engine.args import add_engine_args, engine_kwargs_from_args

_DEFAULT_PROMPTS = [
    "The quickest way to serve a mixture-of-experts model is",
    "Write a haiku about GPUs running at full power.",
    "List three reasons why batching raises throughput:",
    "Once upon a time, in a datacenter far away,",
]


def _cmd_presets(args: argparse.Namespace) -> int:
    from moeserve.model_config import ModelConfig
    from moeserve.presets import list_presets, load_preset

    rows = []
    for name in list_presets():
        hf = load_preset(name)
        mc = ModelConfig.from_hf(hf)
        rows.append((name, mc.architecture, mc.num_params(), hf.get("moeserve_description", "")))
    name_w = max(len("preset"), *(len(r[0]) for r in rows))
    arch_w = max(len("arch"), *(len(r[1]) for r in rows))
    params_w = max(len("params"), *(len(f"{r[2] / 1e9:.3f}B") for r in rows))
    gib_w = max(len("bf16 GiB"), *(len(f"{r[2] * 2 / 2**30:.2f}") for r in rows))
    print(f"{'preset':<{name_w}}  {'arch':<{arch_w}}  {'params':>{params_w}}  "
          f"{'bf16 GiB':>{gib_w}}  description")
    for name, arch, n, description in rows:
        print(f"{name:<{name_w}}  {arch:<{arch_w}}  {f'{n / 1e9:.3f}B':>{params_w}}  "
              f"{n * 2 / 2**30:>{gib_w}.2f}  {description}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from moeserve.engine.llm import LLM
    from moeserve.types import SamplingParams

    llm = LLM(**engine_kwargs_from_args(args))
    print(llm.report.format(), flush=True)
    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.random_input_len:
        rng = random.Random(args.seed or 0)
        vocab = llm.engine.model_config.vocab_size
        prompts += [[rng.randrange(vocab) for _ in range(args.random_input_len)]
                    for _ in range(args.num_prompts)]
    if not prompts:
        prompts = [_DEFAULT_PROMPTS[i % len(_DEFAULT_PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_out = sum(len(r.token_ids) for r in results)
    num_in = sum(len(r.prompt_token_ids) for r in results)
    for r in results[: args.show]:
        print(f"--- {r.request_id} ({len(r.token_ids)} tokens, {r.finish_reason.value}): "
              f"{r.text!r}")
    stats = llm.engine.scheduler.stats
    summary = {"requests": len(results), "input_tokens": num_in, "output_tokens": num_out,
               "seconds": round(seconds, 3), "output_tok_per_s": round(num_out / seconds, 1),
               "total_tok_per_s": round((num_in + num_out) / seconds, 1),
               "preemptions": stats.num_preemptions,
               "prefix_hit_tokens": stats.num_prefix_hit_tokens}
    print(json.dumps(summary))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "capacity": llm.report.to_dict()}, f, indent=2)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from moeserve.server.process.launch import run_serve

    return run_serve(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from moeserve.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeserve", description="moeserve: serve, benchmark and diagnose MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list the built-in model presets").set_defaults(
        func=_cmd_presets)
    serve = sub.add_parser("serve", help="the OpenAI-compatible server (API + engine processes)")
    serve.set_defaults(func=_cmd_serve)
    from moeserve.server.process.launch import add_serve_args

    add_serve_args(serve)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server (or start one)")
    bench.set_defaults(func=_cmd_bench)
    from moeserve.bench.cli import add_bench_args

    add_bench_args(bench)
    from moeserve.diagnose.cli import (
        add_doctor_args,
        add_report_args,
        run_doctor,
        run_report,
    )

    doctor = sub.add_parser("doctor", help="verdicts on benchmark runs: what bound them, "
                            "which knob to turn")
    doctor.set_defaults(func=run_doctor)
    add_doctor_args(doctor)
    report = sub.add_parser("report", help="markdown + plots of runs; several runs side by "
                            "side with the diff of their configs")
    report.set_defaults(func=run_report)
    add_report_args(report)
    from moeserve.tune.cli import add_tune_args, run_tune

    tune = sub.add_parser("tune", help="search the engine's knobs with the real server and "
                          "benchmark (Optuna, a ledger of every trial), steered by the doctor")
    tune.set_defaults(func=run_tune)
    add_tune_args(tune)
    gen = sub.add_parser("generate", help="generate offline with the in-process engine")
    gen.set_defaults(func=_cmd_generate)
    gen.add_argument("--preset", dest="model", help="a built-in preset (same as --model NAME)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--num-prompts", type=int, default=8,
                     help="number of prompts when none are given (default: 8)")
    gen.add_argument("--random-input-len", type=int, default=0,
                     help="add --num-prompts random token-id prompts of this length")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--show", type=int, default=4, help="outputs to print (default: 4)")
    gen.add_argument("--json-out", help="write the summary and capacity report here")
    add_engine_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # ConfigError included: a clear message, no traceback
        print(f"moeserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
