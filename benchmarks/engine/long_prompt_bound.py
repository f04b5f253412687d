"""The roofline of issue 14's long-prompt run with the KV cache it has: moeserve/diagnose/
kv_bound.py's idealised replay (every request at once, admitted while the cache holds it whole,
each step at its parts' roofline times) of 128 requests of 8,192 prompt + 256 output tokens at
concurrency 128 on qwen3-30b-a3b, with the KV capacity given and with room for every request
(what the cache costs), so a measured run can be set beside the bound its configuration allows.
The doctor's kv_capacity verdict gives the same figures for any fixed-length run.

    python -m benchmarks.engine.long_prompt_bound --kv-tokens 667360 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from moeserve.config import load_model_config
from moeserve.diagnose.bounds.kv_bound import Workload, replay
from moeserve.diagnose.bounds.roofline import CEILINGS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--kv-tokens", type=int, required=True,
                        help="the KV cache's tokens (the capacity report's figure)")
    parser.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    parser.add_argument("--input-len", type=int, default=Workload.input_len)
    parser.add_argument("--output-len", type=int, default=Workload.output_len)
    parser.add_argument("--max-concurrency", type=int, default=Workload.max_concurrency)
    parser.add_argument("--token-budget", type=int, default=Workload.token_budget)
    parser.add_argument("--out", default=None, help="directory for long_prompt_bound.json")
    args = parser.parse_args()
    model, _ = load_model_config(args.preset)
    work = Workload(args.num_prompts, args.input_len, args.output_len, args.max_concurrency,
                    args.token_budget)
    ceilings = CEILINGS[0]
    room_for_all = work.max_concurrency * (work.input_len + work.output_len)
    result = {"preset": args.preset, "workload": dataclasses.asdict(work),
              "ceilings": {"device": ceilings.name, "tflop_per_s": ceilings.flops_per_s / 1e12,
                           "tb_per_s": ceilings.bytes_per_s / 1e12},
              "with_kv_given": replay(model, work, args.kv_tokens, ceilings),
              "with_room_for_all": replay(model, work, max(args.kv_tokens, room_for_all),
                                          ceilings),
              "commit": os.environ.get("MOESERVE_GIT_COMMIT")}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "long_prompt_bound.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
