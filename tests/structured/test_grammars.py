"""The engine's grammars over the byte tokenizer: each step's bitmask against the tokens a
grammar can take next (worked out independently by trying each byte), tokens accepted, a
complete grammar reported, a refused token named, a deferred start, compiled grammars shared."""

from __future__ import annotations

import re

import numpy as np
import pytest

from moeserve.structured.grammars import GRAMMAR_FAILED, Grammars
from moeserve.structured.spec import StructuredOutput
from moeserve.tokenizer import ByteTokenizer
from moeserve.types import RequestOutput, SamplingParams, SchedulerOutput

VOCAB = 300  # ids 0-255 bytes; 256 BOS, 257 EOS; 258-299 not text (padding of the embedding)
EOS = 257


def _grammars() -> Grammars:
    return Grammars(lambda: ByteTokenizer(290, 256, EOS), VOCAB, (EOS,))


def _plan(req_ids: list[str], sample: list[bool] | None = None) -> SchedulerOutput:
    n = len(req_ids)
    return SchedulerOutput(req_ids=req_ids, num_scheduled_tokens=[1] * n,
                           num_computed_tokens=[0] * n, token_ids=[0] * n,
                           block_tables=[[]] * n, sample=sample or [True] * n,
                           sampling_params=[SamplingParams()] * n, sample_seeds=[0] * n,
                           num_output_tokens=[0] * n)


def _mask(g: Grammars, plan: SchedulerOutput, rows: list[int]) -> np.ndarray:
    mask, failed = g.bitmask(plan, rows)
    assert failed == {}
    return mask


def _allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def _output(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[1], new_token_ids=tokens,
                         finished=finished)


def test_the_bitmask_allows_exactly_the_tokens_the_pattern_can_take() -> None:
    pattern = r"(ab|cd)[0-9]{2}"
    g = _grammars()
    g.add("r", StructuredOutput("regex", pattern))
    text = ""
    for chosen in "cd17":
        mask = _mask(g, _plan(["r"]), [0])
        # independently: a byte is allowed when text + byte is still a prefix of a match
        assert _allowed(mask[0]) == _prefix_bytes(pattern, text)
        assert g.accept([_output("r", [ord(chosen)])]).ended == ([] if chosen != "7" else ["r"])
        text += chosen


def _prefix_bytes(pattern: str, text: str) -> set[int]:
    """Bytes b such that text + b can still be completed to a full match (brute force over the
    pattern's short alphabet: the matches of (ab|cd)[0-9]{2} are enumerable)."""
    matches = [a + d1 + d2 for a in ("ab", "cd") for d1 in "0123456789" for d2 in "0123456789"]
    assert all(re.fullmatch(pattern, m) for m in matches)
    return {b for b in range(256) if any(m.startswith(text + chr(b)) for m in matches)}


def test_a_complete_grammar_allows_eos_and_reports_the_end() -> None:
    g = _grammars()
    g.add("r", StructuredOutput("regex", "a+"))
    assert g.accept([_output("r", [ord("a")])]).ended == []  # "a" can go on: not ended
    assert _allowed(_mask(g, _plan(["r"]), [0])[0]) == {ord("a"), EOS}
    assert g.accept([_output("r", [EOS])]).ended == ["r"]


def test_a_token_the_grammar_refuses_is_named() -> None:
    g = _grammars()
    g.add("r", StructuredOutput.json_schema({"type": "integer"}))
    found = g.accept([_output("r", [ord("x")])])
    assert list(found.refused) == ["r"]
    assert "sampled token 120 is not allowed" in found.refused["r"]


def test_non_text_ids_are_never_allowed() -> None:
    g = _grammars()
    g.add("r", StructuredOutput("grammar", 'start: /(.|\\n)*/'))
    allowed = _allowed(_mask(g, _plan(["r"]), [0])[0])
    assert 256 not in allowed and all(i not in allowed for i in range(258, VOCAB))
    assert set(range(128)) <= allowed and EOS in allowed


def test_a_deferred_grammar_waits_for_its_start_token() -> None:
    g = _grammars()
    g.add("r", StructuredOutput("choice", '["yes", "no"]', start_after=10))
    plan = _plan(["r"])
    assert g.rows(plan) == []  # thinking: unconstrained
    g.accept([_output("r", [ord("z"), ord("q")])])
    assert g.rows(plan) == []
    g.accept([_output("r", [10])])  # the end of the reasoning
    assert g.rows(plan) == [0]
    assert _allowed(_mask(g, plan, [0])[0]) == {ord("y"), ord("n")}


def test_rows_are_those_that_sample_under_a_grammar() -> None:
    g = _grammars()
    g.add("b", StructuredOutput("regex", "x"))
    g.add("d", StructuredOutput("regex", "y"))
    assert g.rows(_plan(["a", "b", "c", "d"], [True, True, True, False])) == [1]


def test_a_compiled_grammar_is_shared_and_each_request_has_its_own_state() -> None:
    g = _grammars()
    spec = StructuredOutput.choice(["ab", "cd"])
    g.add("1", spec)
    g.add("2", spec)
    assert len(g._compiled) == 1
    g.accept([_output("1", [ord("a")])])
    masks = _mask(g, _plan(["1", "2"]), [0, 1])
    assert _allowed(masks[0]) == {ord("b")} and _allowed(masks[1]) == {ord("a"), ord("c")}


def test_finished_and_dropped_requests_are_forgotten() -> None:
    g = _grammars()
    g.add("1", StructuredOutput("regex", "a+"))
    g.add("2", StructuredOutput("regex", "a+"))
    g.accept([_output("1", [ord("a")], finished=True)])
    g.drop(["2", "unknown"])
    assert len(g) == 0


def test_a_grammar_that_does_not_compile_is_refused() -> None:
    with pytest.raises(ValueError, match="not valid"):
        _grammars().add("r", StructuredOutput("regex", "(unclosed"))


def test_json_object_takes_any_object_and_nothing_else() -> None:
    g = _grammars()
    g.add("r", StructuredOutput("json_object"))
    assert _allowed(_mask(g, _plan(["r"]), [0])[0]) == {ord("{")}
    text = '{"a":[1,{"b":null}],"c":"\\"é"}'
    found = g.accept([_output("r", list(text.encode()))])
    assert not found.refused and found.ended == ["r"]


def test_a_grammar_past_a_parser_limit_fails_its_request_with_the_reason() -> None:
    """llguidance's Earley rows hold at most 2,000 items: a rule of 2,001 alternatives breaks
    at its first token, which the mask allowed. The request's grammar is at fault, named so
    (GRAMMAR_FAILED: the API answers 400); a token the mask refused is named otherwise."""
    g = _grammars()
    g.add("r", StructuredOutput("grammar", "start: " + " | ".join(['"0"'] * 2001)))
    g.add("ok", StructuredOutput("regex", "0+"))
    mask = _mask(g, _plan(["r", "ok"]), [0, 1])
    assert _allowed(mask[0]) == {ord("0")}
    found = g.accept([_output("r", [ord("0")]), _output("ok", [ord("0")])])
    assert list(found.refused) == ["r"] and found.refused["r"].startswith(GRAMMAR_FAILED)
    assert "max is 2000" in found.refused["r"]
    g.add("strict", StructuredOutput("regex", "1"))
    _mask(g, _plan(["strict"]), [0])
    assert "not allowed" in g.accept([_output("strict", [ord("2")])]).refused["strict"]


def test_thousands_of_choices_are_one_lexeme() -> None:
    g = _grammars()
    g.add("r", StructuredOutput.choice([f"x{i}" for i in range(4000)] + ["x7"] * 96))
    _mask(g, _plan(["r"]), [0])
    assert not g.accept([_output("r", list(b"x399"))]).refused
    assert _allowed(_mask(g, _plan(["r"]), [0])[0]) == {ord(str(d)) for d in range(10)} | {EOS}


def test_a_model_without_eos_ends_by_its_grammar() -> None:
    """llguidance then adds an EOS id past the model's 256: a row a word longer, which the
    sampler reads only the model's ids of; the request ends when the grammar is complete."""
    g = Grammars(lambda: ByteTokenizer(256, None, None), 256, ())
    g.add("r", StructuredOutput("regex", "ab?"))
    mask = _mask(g, _plan(["r"]), [0])
    assert mask.shape == (1, 9) and _allowed(mask[0]) == {ord("a")}
    assert g.accept([_output("r", [ord("a")])]).ended == []
    assert _allowed(_mask(g, _plan(["r"]), [0])[0]) == {ord("b"), 256}  # 256: no model id
    assert g.accept([_output("r", [ord("b")])]).ended == ["r"]


def test_masks_built_on_another_thread_equal_the_bitmask() -> None:
    """`masks` -> `compute` on another thread -> `finish` gives `bitmask`'s array: a row whose
    grammar is complete allows every token; a request dropped meanwhile (an abort) keeps its
    row and is not brought back; the array it is given is filled, one of another shape is
    refused by name."""
    import threading

    plans = []
    for g in (_grammars(), _grammars()):
        g.add("a", StructuredOutput("regex", "ab"))
        g.add("b", StructuredOutput("regex", "x"))
        g.add("c", StructuredOutput("json_object"))
        g.accept([_output("a", [ord("a")]), _output("b", [ord("x")])])
        plans.append((g, _plan(["a", "b", "c"])))
    (g1, plan1), (g2, plan2) = plans
    expected = _mask(g1, plan1, [0, 1, 2])
    into = np.zeros((3, g2.words), dtype=np.int32)
    masks = g2.masks(plan2, [0, 1, 2], into)
    g2.drop(["c"])
    worker = threading.Thread(target=masks.compute)
    worker.start()
    worker.join()
    mask, failed = masks.finish()
    assert mask is into and failed == {} and np.array_equal(mask, expected)
    assert _allowed(mask[0]) == {ord("b")} and (mask[1] == -1).all()
    assert "c" not in g2 and len(g2) == 2
    with pytest.raises(ValueError, match=r"C-contiguous int32 \(3, 10\)"):
        g2.masks(plan2, [0, 1, 2], np.zeros((3, 9), dtype=np.int32))
