"""TiktokenTokenizer (Kimi K2 / Moonlight's tiktoken.model + tokenizer_config.json) on a small
tiktoken.model written here: the 256 bytes plus a few merges, special tokens with a reserved gap,
the incremental detokenizer on characters split over tokens, and the loader's errors."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from moeserve.config import ConfigError
from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.model_config import ModelConfig
from moeserve.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from moeserve.tokenizer_tiktoken import (
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    NUM_RESERVED_SPECIAL_TOKENS,
    TiktokenTokenizer,
    split_for_encoding,
)
from tests.test_tokenizer import _write_bpe

# merges after the 256 bytes (rank = 256 + index). "日" (e6 97 a5) and "本" (e6 9c ac) split
# over two tokens each; "34" and "\xa5a" cross pre-tokenizer boundaries ("123|456", "日|a"), so
# they must never apply
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world",
          b"\xe6\x97", b"\x9c\xac", b"34", b"\xa5a"]
N = 256 + len(MERGES)  # base vocabulary; special ids from N
BOS, EOS, IM_END, IM_USER, IM_ASSISTANT, THINK, UNK = N, N + 1, N + 2, N + 3, N + 4, N + 10, N + 255
CHAT = ("{{ bos_token }}{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}")


def write_tiktoken(folder: Path, config: dict | None = None, lines: list[str] | None = None,
                   generation: dict | None = None) -> Path:
    """tiktoken.model (bytes in a shuffled rank order, then MERGES) and tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    if lines is None:
        order = [(b * 37) % 256 for b in range(256)]  # ranks need not follow byte values
        tokens = [bytes((b,)) for b in order] + MERGES
        lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    if config is None:
        added = {BOS: "[BOS]", EOS: "[EOS]", IM_END: "<|im_end|>", IM_USER: "<|im_user|>",
                 IM_ASSISTANT: "<|im_assistant|>", UNK: "[UNK]"}
        config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
                  "pad_token": None, "chat_template": CHAT, "tokenizer_class": "TikTokenTokenizer",
                  "added_tokens_decoder": {
                      **{str(i): {"content": t, "special": True} for i, t in added.items()},
                      str(THINK): {"content": "<think>", "special": False}}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def _model_config() -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=N + 256, hidden_size=64,
                       num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16,
                       intermediate_size=128)


def load(folder: Path) -> TiktokenTokenizer:
    tok = load_tokenizer(str(folder), None, _model_config())
    assert isinstance(tok, TiktokenTokenizer) and isinstance(tok, Tokenizer)
    return tok


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The incremental detokenizer fed one id at a time; its deltas, flush last."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
    return [detok.add([i]) for i in ids] + [detok.flush()]


def test_ascii_round_trip_uses_the_merges(tmp_path: Path) -> None:
    tok = load(write_tiktoken(tmp_path))
    assert tok.vocab_size == N + NUM_RESERVED_SPECIAL_TOKENS
    assert tok.encode("hello world") == [256 + MERGES.index(b"hello"),
                                         256 + MERGES.index(b" world")]
    text = "hello world, Hello again: the (quick) fox's 42 tails!\n\n\tend  "
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids  # no BOS/EOS either way
    assert tok.encode("") == []


def test_pre_tokenizer_boundaries(tmp_path: Path) -> None:
    """Kimi's pattern: digits in groups of at most 3, Han runs apart from other letters, so
    merges across those boundaries never apply."""
    tok = load(write_tiktoken(tmp_path))
    assert tok.encode("123456") == [tok._ranks[bytes((b,))] for b in b"123456"]
    japanese = "日a".encode()
    assert tok.encode("日a") == [256 + MERGES.index(b"\xe6\x97"), tok._ranks[japanese[2:3]],
                                tok._ranks[b"a"]]
    assert tok.encode("34") == [256 + MERGES.index(b"34")]  # the merge itself exists


def test_multibyte_characters_split_over_tokens_stream_whole(tmp_path: Path) -> None:
    tok = load(write_tiktoken(tmp_path))
    text = "日本 é🎉 hello world ñ"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    pieces = tok.token_bytes(ids)
    assert pieces[:4] == [b"\xe6\x97", b"\xa5", b"\xe6", b"\x9c\xac"]  # 日 2+1, 本 1+2 bytes
    deltas = stream(tok, [*ids, EOS])
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert deltas[:4] == ["", "日", "", "本"]  # each character once, whole
    bad = stream(tok, [ids[0]])  # a character cut off at the end: U+FFFD, as decode gives
    assert "".join(bad) == tok.decode([ids[0]]) == "\ufffd"


def test_special_tokens_and_reserved_gap(tmp_path: Path) -> None:
    tok = load(write_tiktoken(tmp_path, generation={"eos_token_id": [IM_END, EOS]}))
    assert tok.bos_token_id == BOS and tok.eos_token_ids == (EOS, IM_END)
    assert tok.pad_token_id is None
    text = "<|im_user|>hello<|im_end|><|im_assistant|>"
    ids = tok.encode(text)
    assert ids == [IM_USER, 256 + MERGES.index(b"hello"), IM_END, IM_ASSISTANT]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == text
    # the gap between named ids: Kimi's placeholder names, special (skipped)
    gap = N + 7
    assert tok.decode([gap], skip_special_tokens=False) == f"<|reserved_token_{gap}|>"
    assert tok.encode(f"<|reserved_token_{gap}|>") == [gap] and tok.decode([gap]) == ""
    assert tok.encode("[UNK]") == [UNK]
    # an added token marked special: false stays in skipped-special text
    assert tok.encode("<think>hello") == [THINK, 256 + MERGES.index(b"hello")]
    assert tok.decode([THINK, EOS]) == "<think>"
    assert "".join(stream(tok, [BOS, THINK, IM_END], skip_special_tokens=False)) == (
        "[BOS]<think><|im_end|>")


def test_named_ids_past_the_reserved_block_extend_it(tmp_path: Path) -> None:
    """A later named id (the Kimi-Linear class reserves 256 + 2) extends the special block."""
    late = N + NUM_RESERVED_SPECIAL_TOKENS + 1
    tok = load(write_tiktoken(tmp_path, {"added_tokens_decoder": {
        str(late): {"content": "<|late|>", "special": True}}}))
    assert tok.vocab_size == late + 1
    assert tok.encode("<|late|>") == [late]
    late_gap = late - 1
    assert tok.decode([late_gap], skip_special_tokens=False) == f"<|reserved_token_{late_gap}|>"
    assert tok.bos_token_id is None and tok.eos_token_ids == ()


def test_ids_past_the_vocabulary_and_negative(tmp_path: Path) -> None:
    tok = load(write_tiktoken(tmp_path))
    past = tok.vocab_size + 3
    assert tok.decode([past]) == f"<|{past}|>"
    with pytest.raises(ValueError, match="-2"):
        tok.decode([-2])


def test_chat_template_and_max_token_chars(tmp_path: Path) -> None:
    tok = load(write_tiktoken(tmp_path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "[BOS]<|im_user|>hello<|im_end|><|im_assistant|>"
    assert tok.encode(prompt)[:2] == [BOS, IM_USER]
    assert tok.max_token_chars() == len("<|reserved_token_xxx|>")  # the longest name, in bytes
    no_template = load(write_tiktoken(tmp_path / "plain", {}))
    assert no_template.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|user|>\nhi\n<|assistant|>\n")


def test_long_runs_are_cut_as_kimi_does(tmp_path: Path) -> None:
    """Runs of whitespace / non-whitespace over MAX_RUN_CHARS are cut every MAX_RUN_CHARS from
    the run's start; texts over MAX_ENCODE_CHARS go in chunks. Encoding stays lossless."""
    text = "a" * (2 * MAX_RUN_CHARS + 10_000) + " " * (MAX_RUN_CHARS + 5_000) + "b"
    pieces = list(split_for_encoding(text))
    assert [len(p) for p in pieces] == [MAX_RUN_CHARS, MAX_RUN_CHARS, 10_000 + MAX_RUN_CHARS,
                                        5_001]
    assert "".join(pieces) == text
    long = "hello world " * (MAX_ENCODE_CHARS // 12 + 100)
    chunks = list(split_for_encoding(long))
    assert len(chunks[0]) == MAX_ENCODE_CHARS and "".join(chunks) == long
    assert list(split_for_encoding("")) == [] and list(split_for_encoding("a b")) == ["a b"]
    tok = load(write_tiktoken(tmp_path))
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_json_wins_over_tiktoken_model(tmp_path: Path) -> None:
    _write_bpe(tmp_path)
    write_tiktoken(tmp_path, {})
    assert isinstance(load_tokenizer(str(tmp_path), None, _model_config()), HFTokenizer)


def test_missing_tokenizer_files_say_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path), None, _model_config())
    message = str(err.value)
    assert "tokenizer.json" in message and "tiktoken.model" in message
    assert str(tmp_path) in message
    with pytest.raises(ConfigError, match="no tokenizer folder"):
        load_tokenizer(None, None, _model_config())


def test_without_tiktoken_the_error_says_to_install_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiktoken(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(RuntimeError, match="pip install tiktoken"):
        load_tokenizer(str(tmp_path), None, _model_config())


def test_bad_tiktoken_model_files(tmp_path: Path) -> None:
    def lines(tokens: list[bytes], ranks: list[int]) -> list[str]:
        return [f"{base64.b64encode(t).decode()} {r}" for t, r in zip(tokens, ranks)]

    all_bytes = [bytes((b,)) for b in range(256)]
    cases = {
        "gap": (lines(all_bytes, [*range(255), 256]), "ranks are not 0 .. 255"),
        "duplicate": (lines([*all_bytes, b"a"], [*range(256), 256]), "each token and each rank"),
        "bytes": (lines(all_bytes[1:] + [b"ab"], list(range(256))), "single bytes"),
        "line": (["YQ== 0 extra"], "tiktoken.model:1"),
        "base64": (["!!!! 0"], "tiktoken.model:1"),
    }
    for name, (text, match) in cases.items():
        folder = write_tiktoken(tmp_path / name, {}, lines=text)
        with pytest.raises(ValueError, match=match):
            TiktokenTokenizer(str(folder))
    folder = write_tiktoken(tmp_path / "twice", {"added_tokens_decoder": {
        str(N): {"content": "<x>"}, str(N + 1): {"content": "<x>"}}})
    with pytest.raises(ValueError, match="both '<x>'"):
        TiktokenTokenizer(str(folder))
