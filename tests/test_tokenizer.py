"""Tokenizers (byte and HF tokenizer.json), chat templates, incremental detokenizer, stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from moeserve.config import ConfigError
from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.model_config import ModelConfig
from moeserve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

VOCAB = 300
BOS, EOS, PAD = 256, 257, 258
TEXT = "Hi 👋🏽 日本語 ñ!"
SENTENCES = ["hello world, the quick brown fox jumps over the lazy dog",
             "hello there: tokenizers split words into pieces", "the end of the text"] * 5
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _model_config(**kw: object) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=64,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, **kw)


def _byte() -> ByteTokenizer:
    return ByteTokenizer(VOCAB, BOS, EOS, PAD)


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None,
            stop: tuple[str, ...] = (), min_tokens: int = 0
            ) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` in chunks of the given sizes (1 by default); the deltas, flush last."""
    detok = IncrementalDetokenizer(tok, [BOS], stop=stop, min_tokens=min_tokens)
    deltas, pos = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
    if pos < len(ids):
        deltas.append(detok.add(ids[pos:]))
    deltas.append(detok.flush())
    return deltas, detok


# --- ByteTokenizer ------------------------------------------------------------------------------

def test_byte_round_trip() -> None:
    tok = _byte()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == (EOS,) and tok.bos_token_id == BOS and tok.vocab_size == VOCAB


def test_byte_placeholders_and_special_tokens() -> None:
    tok = _byte()
    ids = [BOS, *b"ab", 299, EOS, 280, PAD]
    assert tok.decode(ids) == "ab<|299|><|280|>"
    assert tok.decode(ids, skip_special_tokens=False) == "<|256|>ab<|299|><|257|><|280|><|258|>"


@pytest.mark.parametrize("bad", [VOCAB, 10**6, -1])
def test_byte_out_of_vocab_raises(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        _byte().decode([104, bad])
    with pytest.raises(ValueError, match=str(bad)):
        IncrementalDetokenizer(_byte(), []).add([bad])


def test_byte_tokenizer_rejects_bad_construction() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100, None, None)
    with pytest.raises(ValueError, match="eos_token_id 400"):
        ByteTokenizer(300, None, 400)


def test_chat_template_default_format() -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _byte().apply_chat_template(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")
    assert _byte().apply_chat_template(messages, add_generation_prompt=False).endswith("Hi\n")


# --- incremental detokenizer --------------------------------------------------------------------

def test_multibyte_characters_split_over_tokens_are_emitted_whole() -> None:
    tok = _byte()
    deltas, detok = _stream(tok, tok.encode(TEXT))
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "👋" in deltas  # the 4 bytes of the emoji come out as one delta, at the 4th byte


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
       chunks=st.lists(st.integers(1, 5), max_size=30))
def test_incremental_decode_equals_full_decode(ids: list[int], chunks: list[int]) -> None:
    tok = _byte()
    deltas, detok = _stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids) == detok.text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab日🎉 ", max_size=30),
       stops=st.lists(st.text(alphabet="ab日🎉", min_size=1, max_size=3), min_size=1, max_size=3),
       chunks=st.lists(st.integers(1, 4), max_size=40))
def test_stop_string_streaming_property(text: str, stops: list[str], chunks: list[int]) -> None:
    tok = _byte()
    deltas, detok = _stream(tok, tok.encode(text), chunks, stop=tuple(stops))
    found = sorted((text.find(s) + len(s), text.find(s), i) for i, s in enumerate(stops)
                   if s in text)  # the stop that completes first
    expected = text[:found[0][1]] if found else text
    assert "".join(deltas) == expected == detok.text
    assert detok.stop_hit == (stops[found[0][2]] if found else None)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab ", max_size=30),
       stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=3), min_size=1, max_size=3),
       chunks=st.lists(st.integers(1, 4), max_size=40), min_tokens=st.integers(0, 12))
def test_min_tokens_holds_stop_strings(text: str, stops: list[str], chunks: list[int],
                                       min_tokens: int) -> None:
    """A stop string counts only if it ends in the text of a token past the first min_tokens
    (one byte, one character, one token here), whatever the chunking; it may begin earlier."""
    tok = _byte()
    deltas, detok = _stream(tok, tok.encode(text), chunks, tuple(stops), min_tokens)
    found = sorted((p + len(s), p, i) for i, s in enumerate(stops) for p in range(len(text))
                   if text.startswith(s, p) and p + len(s) > min_tokens)
    expected = text[:found[0][1]] if found else text
    assert "".join(deltas) == expected == detok.text
    assert detok.stop_hit == (stops[found[0][2]] if found else None)


def test_min_tokens_lets_a_stop_begin_in_the_held_text() -> None:
    tok = _byte()
    deltas, detok = _stream(tok, tok.encode("xSTOPySTOPz"), [4, 7], ("STOP",), min_tokens=3)
    assert "".join(deltas) == "x" and detok.stop_hit == "STOP"  # ends at the 5th token
    deltas, detok = _stream(tok, tok.encode("xSTOPySTOPz"), [11], ("STOP",), min_tokens=5)
    assert "".join(deltas) == "xSTOPy" and detok.stop_hit == "STOP"  # the first ends at 5


def test_stop_string_across_token_boundaries_truncates() -> None:
    tok = _byte()
    ids = tok.encode("Hello STOP world")
    deltas, detok = _stream(tok, ids, [7, 2, 3, 4], stop=("STOP",))
    assert deltas == ["Hello ", "", "", "", ""]  # "S", then "STO", held back; then the stop
    assert detok.text == "Hello " and detok.stop_hit == "STOP"
    assert detok.add(tok.encode("more")) == "" and detok.flush() == ""


def test_first_completed_stop_string_wins_whatever_the_chunking() -> None:
    tok = _byte()
    ids = tok.encode("one two three")
    for chunks in ([1] * len(ids), [len(ids)], [5, 3, 5]):
        deltas, detok = _stream(tok, ids, chunks, stop=("three", "one two", "two", "e t"))
        assert "".join(deltas) == "on" and detok.stop_hit == "e t"
        deltas, detok = _stream(tok, ids, chunks, stop=("three", "one two", "two"))
        assert "".join(deltas) == "" and detok.stop_hit == "one two"


def test_held_back_text_is_released_by_flush() -> None:
    tok = _byte()
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    assert detok.add(tok.encode("abcST")) == "abc"  # "ST" could start "STOP"
    assert detok.text == "abcST"
    assert detok.add(tok.encode("O")) == ""
    assert detok.add(tok.encode("x")) == "STOx"  # no longer a start of "STOP"
    assert detok.add(tok.encode("yS")) == "y"
    assert detok.flush() == "S" and detok.stop_hit is None and detok.text == "abcSTOxyS"
    assert detok.add(tok.encode("TOP")) == ""


def test_flush_replaces_an_incomplete_trailing_character() -> None:
    tok = _byte()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(list("日".encode())[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_skipped_or_kept_in_stream() -> None:
    tok = _byte()
    ids = [*b"ok", EOS]
    assert IncrementalDetokenizer(tok, []).add(ids) == "ok"
    assert IncrementalDetokenizer(tok, [], skip_special_tokens=False).add(ids) == "ok<|257|>"


# --- HF tokenizer.json --------------------------------------------------------------------------

def _write_bpe(folder: Path, chat_template: str | None = CHATML) -> RustTokenizer:
    """A tiny byte-level BPE (GPT-2 / Qwen style) trained here, saved as a checkpoint would."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    tok.add_tokens([AddedToken("日本", special=False), AddedToken("<tool>", special=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict = {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
                    "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tok


def test_hf_tokenizer_loads_and_round_trips(tmp_path: Path) -> None:
    rust = _write_bpe(tmp_path)
    tok = load_tokenizer(str(tmp_path), "byte", _model_config())
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id is None and tok.pad_token_id == 0
    assert tok.vocab_size == rust.get_vocab_size()
    text = "hello world <tool> 日本語 🎉 ñ the end"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.decode([*ids, 2]) == text
    assert tok.decode([*ids, 2], skip_special_tokens=False) == text + "<|im_end|>"


def test_hf_incremental_decode_matches_full_decode(tmp_path: Path) -> None:
    _write_bpe(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    text = " the quick 日本語🎉 fox <tool>, héllo"
    ids = tok.encode(text) + [2]
    for chunks in ([1] * len(ids), [3] * len(ids), [len(ids)]):
        deltas, detok = _stream(tok, ids, chunks)
        assert "".join(deltas) == tok.decode(ids) == detok.text
        assert all("\ufffd" not in d for d in deltas)
    deltas, detok = _stream(tok, ids, stop=("fox",))
    assert "".join(deltas) == " the quick 日本語🎉 " and detok.stop_hit == "fox"


def test_hf_ids_past_the_vocabulary_are_placeholders(tmp_path: Path) -> None:
    _write_bpe(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert b"".join(tok.token_bytes([tok.vocab_size + 5])) == f"<|{tok.vocab_size + 5}|>".encode()
    with pytest.raises(ValueError, match="-3"):
        tok.decode([-3])


def test_hf_chat_template(tmp_path: Path) -> None:
    _write_bpe(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    (tmp_path / "chat_template.jinja").write_text(
        "{{ raise_exception('no ' + messages[0]['role']) }}")
    with pytest.raises(ValueError, match="no user"):
        HFTokenizer(str(tmp_path)).apply_chat_template(messages)


def test_hf_named_and_missing_chat_templates(tmp_path: Path) -> None:
    _write_bpe(tmp_path / "named", [{"name": "tool_use", "template": "T"},
                                    {"name": "default", "template": "{{ messages | length }}"}])
    messages = [{"role": "user", "content": "hi"}]
    assert HFTokenizer(str(tmp_path / "named")).apply_chat_template(messages) == "1"
    _write_bpe(tmp_path / "none", None)
    assert HFTokenizer(str(tmp_path / "none")).apply_chat_template(messages) == (
        "<|user|>\nhi\n<|assistant|>\n")


def test_sentencepiece_style_tokenizer_streams_in_context(tmp_path: Path) -> None:
    """Mixtral/Llama-2 style: Metaspace, byte fallback, and a decoder that strips the first
    space of a sequence. The stream is the text the output adds after the prompt."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581",
              *"abcdefghijklmnopqrstuvwxyz"]
    rust = RustTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                                    unk_token="<unk>", byte_fallback=True))
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = load_tokenizer(str(tmp_path), None, _model_config())
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    prompt, output = tok.encode("a b"), tok.encode("a b cd 日本 é", add_special_tokens=False)
    assert tok.decode(output) == "a b cd 日本 é"
    deltas, _ = _stream(tok, output + [2])
    full, head = tok.decode(prompt + output), tok.decode(prompt)
    assert "".join(deltas) == full[len(head):] == " a b cd 日本 é"


def test_load_tokenizer_builtin_and_errors(tmp_path: Path) -> None:
    tok = load_tokenizer(str(tmp_path), "byte", _model_config(bos_token_id=BOS,
                                                              eos_token_ids=(EOS, 5)))
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (VOCAB, BOS, (EOS,))
    assert isinstance(load_tokenizer(None, "byte", _model_config()), ByteTokenizer)
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path), None, _model_config())
    with pytest.raises(ConfigError, match="'sentencepiece'"):
        load_tokenizer(None, "sentencepiece", _model_config())


def test_output_processor_keeps_special_tokens_but_never_the_eos_that_ends() -> None:
    from moeserve.engine.output_processor import OutputProcessor
    from moeserve.types import FinishReason, RequestOutput, SamplingParams

    tok = _byte()
    processor = OutputProcessor(tok)
    eos = f"<|{EOS}|>"
    cases = [(SamplingParams(), None, "a"),
             (SamplingParams(skip_special_tokens=False), None, f"a{eos}"),
             (SamplingParams(skip_special_tokens=False, stop_token_ids=(PAD,)), PAD, f"a{eos}")]
    for i, (params, stop, middle) in enumerate(cases):
        rid = f"r{i}"
        processor.add_request(rid, [1], params)
        end = [stop] if stop is not None else [EOS]
        outs = [RequestOutput(rid, [1], [97, EOS]),  # "a", then an EOS the request ignores
                RequestOutput(rid, [1], [ord("b"), *end], finished=True,
                              finish_reason=FinishReason.STOP, stop_reason=stop)]
        texts = [out.text for out in processor.process(outs[:1])[0]]
        texts += [out.text for out in processor.process(outs[1:])[0]]
        assert "".join(texts) == middle + "b", (params, texts)


def test_include_stop_keeps_the_stop_string_whatever_the_chunking() -> None:
    tok = _byte()
    ids = tok.encode("one two three")
    for chunks in ([1] * len(ids), [len(ids)], [5, 3, 5]):
        detok = IncrementalDetokenizer(tok, [], stop=("two", "e t"), include_stop=True)
        deltas, pos = [], 0
        for size in chunks:
            deltas.append(detok.add(ids[pos:pos + size]))
            pos += size
        deltas.append(detok.flush())
        assert "".join(deltas) == "one t" == detok.text and detok.stop_hit == "e t"
