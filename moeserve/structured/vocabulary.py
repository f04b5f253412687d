"""The model's vocabulary as llguidance sees it, built once from moeserve's Tokenizer.

Every id of the model's logits gets its bytes (`token_bytes`, special tokens kept); the ids that
never stand for text (`non_text_token_ids`) and the ids past the tokenizer's own vocabulary
(models pad their embedding) are special, which a grammar never allows; the engine's EOS ids are
llguidance's EOS, which a grammar allows where its output may end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moeserve.tokenizer import Tokenizer


class _Vocabulary:
    """llguidance's TokenizerWrapper protocol: the attributes and the call LLTokenizer reads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        own = min(tokenizer.vocab_size, vocab_size)
        non_text = {i for i in tokenizer.non_text_token_ids() if i < vocab_size}
        non_text |= set(eos_ids) | set(range(own, vocab_size))
        pieces = tokenizer.token_bytes(range(own), skip_special_tokens=False)
        pieces += [b""] * (vocab_size - own)
        for i in non_text:  # a marker llguidance shows in its messages; never matched as text
            pieces[i] = f"<|special:{i}|>".encode()
        self.tokens: list[bytes] = pieces
        self.special_token_ids: list[int] = sorted(non_text)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's LLTokenizer over the model's `vocab_size` ids (the logits' width), with
    `eos_ids` (the engine's stop set) as its EOS tokens. A model without one gets an EOS id of
    llguidance's own past its ids, which it cannot sample: its requests end when their grammar
    is complete (grammars.py), or at max_tokens."""
    from llguidance import LLTokenizer

    vocabulary = _Vocabulary(tokenizer, vocab_size, eos_ids)
    return LLTokenizer(vocabulary, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
