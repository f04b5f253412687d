"""moeserve: a serving engine for Mixture-of-Experts language models."""

from __future__ import annotations

from moeserve.structured.spec import StructuredOutput
from moeserve.types import SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str):  # LLM pulls in torch; keep `import moeserve` light
    if name == "LLM":
        from moeserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
