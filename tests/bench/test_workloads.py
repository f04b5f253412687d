"""Workloads: exact and ranged lengths, distinct prompts, shared prefixes, ShareGPT files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moeserve.bench.workloads import (
    random_workload,
    sample_lengths,
    shared_prefix_workload,
    sharegpt_workload,
)


class WordTokenizer:
    """One token per whitespace-separated word; ids index a growing vocabulary."""

    def __init__(self) -> None:
        self.vocab: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab.append(w)
            ids.append(self.vocab.index(w))
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)


def test_random_exact_lengths_with_range_ratio_1() -> None:
    items = random_workload(50, 128, 64, 1.0, random.Random(0), vocab_size=512)
    assert len(items) == 50
    for it in items:
        assert isinstance(it.prompt, list) and len(it.prompt) == 128 == it.prompt_len
        assert it.output_len == 64
        assert all(0 <= t < 512 for t in it.prompt)
    assert len({tuple(it.prompt) for it in items}) == 50  # distinct


def test_random_lengths_within_bounds_with_range_ratio_half() -> None:
    items = random_workload(400, 128, 100, 0.5, random.Random(1), vocab_size=1000)
    in_lens = [it.prompt_len for it in items]
    out_lens = [it.output_len for it in items]
    assert min(in_lens) >= 64 and max(in_lens) <= 128
    assert min(out_lens) >= 50 and max(out_lens) <= 100
    assert len(set(in_lens)) > 30 and len(set(out_lens)) > 30  # spread, not one value
    assert all(len(it.prompt) == it.prompt_len for it in items)


def test_sample_lengths_rules() -> None:
    assert sample_lengths(10, 0.0, 200, random.Random(0)).count(0) == 0  # never below 1
    with pytest.raises(ValueError, match="--range-ratio must be in"):
        sample_lengths(10, 1.5, 1, random.Random(0))
    with pytest.raises(ValueError, match="length must be >= 1"):
        sample_lengths(0, 1.0, 1, random.Random(0))


def test_random_distinct_even_for_tiny_prompts() -> None:
    items = random_workload(20, 1, 4, 1.0, random.Random(2), vocab_size=32)
    assert len({tuple(it.prompt) for it in items}) == 20
    with pytest.raises(ValueError, match="distinct prompts"):
        random_workload(5, 1, 4, 1.0, random.Random(2), vocab_size=2)


def test_random_ids_need_a_vocab() -> None:
    with pytest.raises(ValueError, match="--vocab-size N or --text-prompts"):
        random_workload(3, 8, 8, 1.0, random.Random(0), vocab_size=None)


def test_random_text_prompts() -> None:
    items = random_workload(10, 13, 8, 1.0, random.Random(3), text=True)
    assert all(isinstance(it.prompt, str) for it in items)
    assert all(len(it.prompt.split()) == 10 for it in items)  # 13 tokens ~ 13 / 1.3 words
    assert all(it.prompt_len == 13 for it in items)  # the estimate
    assert len({it.prompt for it in items}) == 10
    tok = WordTokenizer()
    measured = random_workload(10, 13, 8, 1.0, random.Random(3), text=True, tokenizer=tok)
    assert all(len(tok.encode(it.prompt)) == it.prompt_len == 13 for it in measured)


def test_same_seed_same_workload() -> None:
    a = random_workload(5, 16, 8, 0.5, random.Random(7), vocab_size=100)
    b = random_workload(5, 16, 8, 0.5, random.Random(7), vocab_size=100)
    assert a == b


def test_shared_prefix_structure() -> None:
    items = shared_prefix_workload(24, num_groups=3, prefix_len=16, suffix_len=8, output_len=5,
                                   rng=random.Random(4), vocab_size=1000)
    assert len(items) == 24
    assert all(len(it.prompt) == 24 == it.prompt_len and it.output_len == 5 for it in items)
    prefixes: dict[tuple[int, ...], int] = {}
    for it in items:
        key = tuple(it.prompt[:16])
        prefixes[key] = prefixes.get(key, 0) + 1
    assert sorted(prefixes.values()) == [8, 8, 8]  # 3 groups of 8
    assert len({tuple(it.prompt[16:]) for it in items}) == 24  # own suffixes
    groups_in_order = [list(prefixes).index(tuple(it.prompt[:16])) for it in items]
    assert groups_in_order != sorted(groups_in_order)  # shuffled


def test_shared_prefix_bad_flags() -> None:
    with pytest.raises(ValueError, match="--shared-prefix-groups >= 1"):
        shared_prefix_workload(4, 0, 16, 8, 5, random.Random(0), vocab_size=100)


def _write_sharegpt(path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "what is a mixture of experts"},
                                      {"from": "gpt", "value": "a layer with many " * 10}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello there"},
                                      {"from": "human", "value": "hi you"},
                                      {"from": "gpt", "value": "one two three four five"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "short reply please"},
                                      {"from": "gpt", "value": "ok"}]},  # output < 2: skipped
        {"id": "d", "conversations": [{"from": "human", "value": "no answer here"}]},
        {"id": "e", "conversation": [{"from": "user", "value": "tell me about gpus now"},
                                     {"from": "assistant", "value": "they are fast chips"}]},
    ]
    path.write_text(json.dumps(data))


def test_sharegpt_parsing(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    items = sharegpt_workload(path, 3, random.Random(0))
    by_prompt = {it.prompt: it for it in items}
    assert set(by_prompt) == {"what is a mixture of experts", "hi you", "tell me about gpus now"}
    assert by_prompt["what is a mixture of experts"].output_len == round(40 * 1.3)
    assert by_prompt["hi you"].prompt_len == round(2 * 1.3)
    assert by_prompt["hi you"].output_len == round(5 * 1.3)
    fixed = sharegpt_workload(path, 3, random.Random(0), output_len=17)
    assert all(it.output_len == 17 for it in fixed)
    tok = WordTokenizer()
    measured = sharegpt_workload(path, 3, random.Random(0), tokenizer=tok)
    assert {it.prompt: it.output_len for it in measured}["tell me about gpus now"] == 4


def test_sharegpt_errors(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    with pytest.raises(ValueError, match="has 3 usable conversations.*fewer than --num-prompts 4"):
        sharegpt_workload(path, 4, random.Random(0))
    with pytest.raises(ValueError, match="no such file"):
        sharegpt_workload(tmp_path / "missing.json", 1, random.Random(0))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt_workload(bad, 1, random.Random(0))
    bad.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        sharegpt_workload(bad, 1, random.Random(0))
    with pytest.raises(ValueError, match="has 2 usable"):  # max_model_len prunes long ones
        sharegpt_workload(path, 3, random.Random(0), max_model_len=12)
