"""POST /tokenize and /detokenize's bodies (vLLM's routes, for clients that count or keep the
exact token ids of a prompt: RL trainers, context managers), parsed as strictly as the OpenAI
routes' (an unknown field is a 400 naming it).

    /tokenize    {"prompt": text} or {"messages": [...], "tools"?, "chat_template_kwargs"?,
                 "add_generation_prompt"?}: the prompt's ids, a chat rendered exactly as
                 /v1/chat/completions renders it; add_special_tokens (default true for a prompt,
                 false for a chat, whose template writes them); return_token_strs
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [...]} -> {"prompt": the text}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeserve.server.agent.protocol import MAX_TOOLS, ChatMessage, Tool

MAX_TOKENS = 1 << 20  # ids a /detokenize body may hold


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class TokenizeRequest(_Request):
    """POST /tokenize: exactly one of prompt and messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    """Shown to the template, as in chat (messages only)."""
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None
    add_generation_prompt: bool | None = None
    """Messages only: the template's generation prompt after them (default true)."""
    add_special_tokens: bool | None = None
    """The tokenizer's own special tokens (BOS); default true for a prompt, false for
    messages (the chat template writes them)."""
    return_token_strs: bool = False
    """Each token's text too (its bytes decoded; a piece of a character decodes to U+FFFD)."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None:
            chat_only = [name for name in ("tools", "chat_template_kwargs",
                                           "add_generation_prompt")
                         if getattr(self, name) is not None]
            if chat_only:
                raise ValueError(f"{chat_only[0]} goes with messages, not with prompt")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_TOKENS)]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Response):
    prompt: str
