"""Workloads: the list of requests a benchmark run sends.

Each builder returns `WorkItem`s (prompt as token ids or text, prompt length, output length)
from a seeded `random.Random`, so a run is reproducible:

- `random_workload`: distinct prompts of random token ids in [0, vocab) (or random words when
  text is asked for); lengths uniform in [len * range_ratio, len], so range_ratio 1.0 (the
  default, unlike bench_serving's 0) gives exact lengths.
- `sharegpt_workload`: a local ShareGPT-format JSON file; the prompt is a conversation's first
  human turn and the output length the reply's length (in tokens with a tokenizer, else an
  estimate of words x 1.3).
- `shared_prefix_workload`: groups that share a random prefix, each request with its own
  random suffix, shuffled.

Text lengths without a tokenizer are estimates; the server's usage.prompt_tokens replaces them
in the metrics when the server sends usage.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

TOKENS_PER_WORD = 1.3  # the estimate used without a tokenizer

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love "
    "support technology step baby computer type attention film tree source organization hair "
    "window evidence population truth song energy river garden engine cloud"
).split()


class TextTokenizer(Protocol):
    """What the workloads need from a tokenizer: encode and decode."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request to send."""

    prompt: list[int] | str  # token ids (completions API) or text
    prompt_len: int  # tokens (an estimate for text without a tokenizer)
    output_len: int  # max_tokens to ask for


def sample_lengths(target: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths uniform in [max(1, int(target * range_ratio)), target] (bench_serving's rule)."""
    if target < 1:
        raise ValueError(f"length must be >= 1, got {target}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(target * range_ratio))
    return [rng.randint(low, target) for _ in range(n)]


def random_ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def random_text(num_tokens: int, rng: random.Random,
                tokenizer: TextTokenizer | None = None) -> tuple[str, int]:
    """Random words of about `num_tokens` tokens: (text, its length in tokens).

    With a tokenizer the words are encoded, cut to `num_tokens` ids and decoded, and the length
    is measured; without one, round(num_tokens / 1.3) words and the length is the estimate.
    """
    if tokenizer is None:
        num_words = max(1, round(num_tokens / TOKENS_PER_WORD))
        return " ".join(rng.choice(_WORDS) for _ in range(num_words)), num_tokens
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(num_tokens)))
    text = tokenizer.decode(ids[:num_tokens])
    return text, len(tokenizer.encode(text))


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    rng: random.Random, vocab_size: int | None = None, text: bool = False,
                    tokenizer: TextTokenizer | None = None) -> list[WorkItem]:
    """Distinct random prompts; token ids unless `text` (then random words)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not text and (vocab_size is None or vocab_size < 2):
        raise ValueError("token-id prompts need the vocabulary size: the server gave none "
                         "(no /v1/engine); pass --vocab-size N or --text-prompts")
    in_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    items: list[WorkItem] = []
    seen: set[tuple[int, ...] | str] = set()
    for n_in, n_out in zip(in_lens, out_lens):
        for _ in range(100):  # redraw duplicates (only likely for tiny lengths)
            if text:
                prompt, plen = random_text(n_in, rng, tokenizer)
                key: tuple[int, ...] | str = prompt
            else:
                prompt, plen = random_ids(n_in, vocab_size or 0, rng), n_in
                key = tuple(prompt)
            if key not in seen:
                break
        else:
            raise ValueError(f"cannot draw {num_prompts} distinct prompts of {n_in} tokens")
        seen.add(key)
        items.append(WorkItem(prompt, plen, n_out))
    return items


def shared_prefix_workload(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int,
                           output_len: int, rng: random.Random, vocab_size: int | None = None,
                           text: bool = False,
                           tokenizer: TextTokenizer | None = None) -> list[WorkItem]:
    """`num_groups` random prefixes of `prefix_len`; request i gets prefix i % num_groups plus a
    random suffix of `suffix_len`; the list is shuffled."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError(f"shared-prefix needs --shared-prefix-groups >= 1 and "
                         f"--shared-prefix-len >= 1, got {num_groups} and {prefix_len}")
    prefixes = random_workload(num_groups, prefix_len, 1, 1.0, rng, vocab_size, text, tokenizer)
    suffixes = random_workload(num_prompts, suffix_len, output_len, 1.0, rng, vocab_size, text,
                               tokenizer)
    items = []
    for i, suffix in enumerate(suffixes):
        prefix = prefixes[i % num_groups]
        if text:
            prompt: list[int] | str = f"{prefix.prompt}\n\n{suffix.prompt}"
        else:
            prompt = list(prefix.prompt) + list(suffix.prompt)
        items.append(WorkItem(prompt, prefix.prompt_len + suffix.prompt_len, output_len))
    rng.shuffle(items)
    return items


def _text_len(text: str, tokenizer: TextTokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def _first_exchange(conv: Sequence[dict]) -> tuple[str, str] | None:
    """The first human turn and the reply that follows it."""
    for turn, reply in zip(conv, conv[1:]):
        if (turn.get("from") in ("human", "user")
                and reply.get("from") in ("gpt", "assistant", "chatgpt", "bard")):
            return str(turn.get("value", "")), str(reply.get("value", ""))
    return None


def sharegpt_workload(path: str | Path, num_prompts: int, rng: random.Random,
                      tokenizer: TextTokenizer | None = None, output_len: int | None = None,
                      max_model_len: int | None = None) -> list[WorkItem]:
    """Conversations of a ShareGPT JSON file, shuffled; too short (< 2 tokens either side) or
    too long (prompt + output > max_model_len) ones are skipped, as bench_serving does."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {str(path)!r}: no such file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {str(path)!r}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        conv = entry.get("conversations", entry.get("conversation")) if isinstance(
            entry, dict) else None
        pair = _first_exchange(conv) if isinstance(conv, list) else None
        if pair is not None:
            pairs.append(pair)
    rng.shuffle(pairs)
    items: list[WorkItem] = []
    for prompt, reply in pairs:
        plen = _text_len(prompt, tokenizer)
        olen = output_len if output_len is not None else _text_len(reply, tokenizer)
        if plen < 2 or olen < 2 or (max_model_len and plen + olen > max_model_len):
            continue
        items.append(WorkItem(prompt, plen, olen))
        if len(items) == num_prompts:
            return items
    raise ValueError(f"--dataset-path {str(path)!r} has {len(items)} usable conversations "
                     f"(a human turn followed by a reply, both >= 2 tokens), fewer than "
                     f"--num-prompts {num_prompts}")
