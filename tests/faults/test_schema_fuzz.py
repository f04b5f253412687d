"""Schemathesis against a real server: the served /openapi.json must be true.

It generates requests for every operation of the document (the coverage phase: each field at its
boundaries and just past them, undeclared methods; the fuzzing phase: random valid and invalid
bodies; the examples phase: the schema's examples), sends them to 127.0.0.1, and checks each
response: no 5xx, a documented status, a documented content type, a body (or each SSE event's
data) valid against its schema, documented headers, invalid input refused with a 4xx, an
undeclared method answered 405 with Allow. A failure is a bug in the server or in the schema.

It runs through schemathesis's engine (what `schemathesis run` drives), in-process, so that it
counts cases and check results itself: FIGURES["schemathesis"] (tests/faults/figures.py).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import schemathesis
from schemathesis.engine import events, from_schema

from tests.faults.figures import FIGURES
from tests.faults.serve import ServeProcess

# Not positive_data_acceptance: a body valid by the schema may still be a 400 for a limit no
# schema can show (an empty prompt under the byte tokenizer, prompts x n over 256, ...).
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance",
          "negative_data_rejection", "unsupported_method")
SEED = 1  # generation is seeded; schemathesis also learns from the 4xx messages it gets back
MAX_EXAMPLES = 200  # per operation in the fuzzing phase (the coverage phase adds its own)
MIN_CASES = 1000


class _Tally:
    """Cases, check results and failures of an engine run."""

    def __init__(self) -> None:
        self.cases: Counter[str] = Counter()  # by phase
        self.modes: Counter[str] = Counter()  # positive (valid by the schema) or negative
        self.operations: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.checks: dict[str, Counter[str]] = defaultdict(Counter)
        self.failures: list[str] = []
        self.errors: list[str] = []
        self.stop_reason = "not finished"

    def add(self, event: events.EngineEvent) -> None:
        if isinstance(event, events.ScenarioFinished):
            self._add_scenario(event)
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            self.errors.append(repr(getattr(event, "value", getattr(event, "exception", event))))
        elif isinstance(event, events.EngineFinished):
            self.stop_reason = event.stop_reason.value

    def _add_scenario(self, event: events.ScenarioFinished) -> None:
        recorder = event.recorder
        for case_id, node in recorder.cases.items():
            self.cases[event.phase.value] += 1
            self.operations[node.value.operation.label] += 1
            meta = node.value.meta
            self.modes[meta.generation.mode.value if meta is not None else "unknown"] += 1
            interaction = recorder.interactions.get(case_id)
            if interaction is not None and interaction.response is not None:
                self.statuses[interaction.response.status_code] += 1
            for check in recorder.checks.get(case_id, []):
                self.checks[check.name][check.status.value] += 1
                if check.failure_info is not None:
                    failure = check.failure_info.failure
                    self.failures.append(f"{check.name}: {failure.title}\n{failure.message}\n"
                                         f"{check.failure_info.code_sample}")

    def figures(self, seconds: float) -> dict[str, Any]:
        return {"cases": sum(self.cases.values()), "failures": len(self.failures),
                "errors": len(self.errors), "stop": self.stop_reason,
                "seconds": round(seconds, 1),
                "checks": {name: dict(c) for name, c in sorted(self.checks.items())},
                "cases_by_phase": dict(self.cases), "cases_by_mode": dict(self.modes),
                "cases_by_operation": dict(self.operations),
                "statuses": {str(s): n for s, n in sorted(self.statuses.items())},
                "seed": SEED, "max_examples": MAX_EXAMPLES,
                "version": schemathesis.__version__}


def test_served_schema_holds_under_fuzzing(served: ServeProcess) -> None:
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        # NOTE: one worker. With 4 (operations in parallel, in threads), hypothesis's lambda
        # descriptions (ast.parse) deep in schemathesis's coverage recursion over the
        # structured-output fields tripped CPython 3.11.7's "AST constructor recursion depth
        # mismatch" in a worker thread: a client-side error in one run of two to seven
        "workers": 1,
        "request-timeout": 120,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
        "phases": {"stateful": {"enabled": False}},  # no links between operations
        "suppress-health-check": ["too_slow"],  # data generation on a busy 2-core machine
    })
    start = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", config=config)
    tally = _Tally()
    for event in from_schema(schema).execute():
        tally.add(event)
    FIGURES["schemathesis"] = figures = tally.figures(time.monotonic() - start)

    assert tally.stop_reason == "completed", figures
    assert not tally.errors, f"{tally.errors[:5]}\n{served.log_tail()}"
    assert not tally.failures, "\n\n".join(tally.failures[:10]) + "\n" + served.log_tail()
    assert figures["cases"] >= MIN_CASES, figures
    assert set(tally.checks) == set(CHECKS), figures  # every check ran
    assert all(c["success"] > 0 for c in tally.checks.values()), figures
    doc = httpx.get(f"{served.url}/openapi.json").json()
    assert set(tally.operations) == {f"{method.upper()} {path}" for path, methods
                                     in doc["paths"].items() for method in methods}, figures
    assert {"200", "400", "405"} <= set(figures["statuses"]), figures
    assert {"positive", "negative"} <= set(figures["cases_by_mode"]), figures
