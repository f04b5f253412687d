"""The sampler: greedy, temperature, top-k / top-p / min-p, seeded counter-based noise, logprobs."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from moeserve.layers import sampler as sampler_module
from moeserve.layers.sampler import (
    SamplingTensors,
    _apply_top_k_top_p,
    exponential_noise,
    random_uniform,
    sample,
)
from moeserve.runner.step_sampling import add_logit_bias_, sample_step
from moeserve.types import SamplingParams
from tests.cuda_graph import capture

CHI2_7DOF_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def _tensors(params: list[SamplingParams], seeds: list[int] | None = None,
             positions: list[int] | None = None) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(params, seeds or [0] * n, positions or list(range(n)), "cpu")


def _draw(probs: list[float], n: int, seed: int = 1, **kw: float) -> torch.Tensor:
    """n draws from one distribution: one row per position, same seed."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()  # [n, V]
    params = [SamplingParams(**kw)] * n
    token_ids, _, _ = sample(logits, _tensors(params, [seed] * n, list(range(n))))
    return token_ids


def _chi2(token_ids: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(token_ids, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * len(token_ids)
    return float(((counts - expected) ** 2 / expected).sum())


def test_build_converts_params_and_sets_flags() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=-1, top_p=0.9, logprobs=3),
              SamplingParams(top_k=5, min_p=0.1, logprobs=0)]
    t = SamplingTensors.build(params, [7, -1, 2**64 + 5], [10, 11, 12], "cpu")
    assert t.top_k.tolist() == [0, 0, 5] and t.top_k.dtype == torch.int64
    assert t.temperature.dtype == torch.float32 and t.temperature.tolist()[0] == 0.0
    assert t.seeds.tolist() == [7, -1, 5] and t.positions.tolist() == [10, 11, 12]
    assert (t.all_greedy, t.any_top_k, t.any_top_p, t.any_min_p) == (False, True, True, True)
    assert t.max_num_logprobs == 3
    plain = _tensors([SamplingParams(temperature=0.0)] * 2)
    assert plain.all_greedy and not (plain.any_top_k or plain.any_top_p or plain.any_min_p)
    assert plain.max_num_logprobs is None
    with pytest.raises(ValueError, match="differ in length"):
        SamplingTensors.build(params, [1], [1, 2, 3], "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_lowest_index_on_ties(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50).to(dtype)
    logits[2, 7] = logits[2, 30] = 100.0  # a tie: index 7 wins
    token_ids, logprobs, _ = sample(logits, _tensors([SamplingParams(temperature=0.0)] * 6))
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert token_ids[2] == 7 and logprobs is None


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    token_ids, _, _ = sample(logits, _tensors(params))
    assert token_ids[0] == logits[0].argmax() and token_ids[2] == logits[2].argmax()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_the_distribution(temperature: float) -> None:
    probs = [0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]
    token_ids = _draw(probs, 4000, temperature=temperature)
    tempered = [p ** (1 / temperature) for p in probs]
    expected = [p / sum(tempered) for p in tempered]
    assert _chi2(token_ids, expected) < CHI2_7DOF_P001


def test_seeded_row_is_independent_of_its_neighbours() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    alone, _, _ = sample(row, _tensors([SamplingParams(temperature=1.0)], [1234], [57]))
    neighbours = torch.randn(8, 1000)
    neighbours[3] = row[0]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.5), (1.0, 0, 1.0), (2.0, 50, 0.9),
               (0.0, 3, 1.0), (1.0, 0, 0.2), (0.9, 10, 0.8)]]
    seeds = [1, 2, 3, 1234, 5, 6, 7, 8]
    batch, _, _ = sample(neighbours, _tensors(params, seeds, [0, 9, 99, 57, 3, 2, 1, 0]))
    assert batch[3] == alone[0]


@pytest.mark.parametrize("elements", [100, 300, 1000])  # 1, 3 and 10 rows a chunk
def test_random_path_in_chunks_of_rows_gives_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    logits = torch.randn(10, 100) * 3
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_p=0.5 + 0.05 * i, top_k=i * 7,
                             min_p=0.01 * (i % 3)) for i in range(9)]
    params.insert(4, SamplingParams(temperature=0.0))  # a greedy row amid the chunks
    t = _tensors(params, list(range(10)))
    whole, _, _ = sample(logits, t)
    monkeypatch.setattr(sampler_module, "_ROW_CHUNK_ELEMENTS", elements)
    assert torch.equal(sample(logits, t)[0], whole)
    assert whole[4] == logits[4].argmax()


def test_noise_depends_on_seed_and_position_only() -> None:
    seeds, positions = torch.tensor([5, 5, 6, 5]), torch.tensor([10, 11, 10, 10])
    u = random_uniform(seeds, positions, 4096)
    assert torch.equal(u[0], u[3])  # same (seed, position): same stream
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, random_uniform(seeds, positions, 4096))  # deterministic
    # Different positions give different draws: a seeded request's tokens vary along its output.
    token_ids = _draw([0.25] * 4, 200, seed=99)
    assert len(set(token_ids.tolist())) == 4 and len(set(token_ids[:10].tolist())) > 1


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63), 12345])
def test_uniform_is_open_interval_and_uniform(seed: int) -> None:
    t = _tensors([SamplingParams()] * 64, [seed] * 64, list(range(64)))
    u = random_uniform(t.seeds, t.positions, 2000)  # [64, 2000]
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    counts = torch.histc(u.double(), bins=50, min=0.0, max=1.0)
    expected = u.numel() / 50
    assert float(((counts - expected) ** 2 / expected).sum()) < 86.7  # 49 dof, p = 0.001
    centred = u.double() - 0.5  # neighbours along the vocab and along positions: uncorrelated
    assert abs(float((centred[:, 1:] * centred[:, :-1]).mean() * 12)) < 0.02
    assert abs(float((centred[1:] * centred[:-1]).mean() * 12)) < 0.02
    e = exponential_noise(t.seeds, t.positions, 2000)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert abs(float(e.double().mean()) - 1.0) < 0.02


def test_extreme_uniform_values_stay_inside_the_interval() -> None:
    # The extremes the hash can give: m = 0 and m = 2**23 - 1 (see random_uniform).
    lo, hi = torch.tensor([0.5, 2**23 - 0.5]) * (1.0 / (1 << 23))
    assert 0.0 < float(lo) and float(hi) < 1.0
    assert 0.0 < float(-torch.log(hi)) and math.isfinite(float(-torch.log(lo)))


def _support(probs: list[float], **kw: float) -> set[int]:
    return set(_draw(probs, 2000, seed=3, **kw).tolist())


PROBS = [0.05, 0.5, 0.15, 0.3, 1e-4, 1e-4]  # ranks: 1, 3, 2, 0, 4, 5


@pytest.mark.parametrize(("kw", "allowed"), [
    ({"top_k": 1}, {1}),
    ({"top_k": 3}, {1, 3, 2}),
    ({"top_p": 0.4}, {1}),
    ({"top_p": 0.75}, {1, 3}),
    ({"top_p": 0.9}, {1, 3, 2}),
    ({"min_p": 0.5}, {1, 3}),  # keep p >= 0.25
    ({"min_p": 0.2}, {1, 3, 2}),  # keep p >= 0.1
    ({"top_k": 3, "top_p": 0.75}, {1, 3}),
    ({"top_k": 2, "top_p": 0.95}, {1, 3}),
    ({"top_k": 3, "min_p": 0.5}, {1, 3}),
    ({"top_k": 2, "temperature": 3.0}, {1, 3}),
])
def test_filters_never_return_excluded_tokens(kw: dict, allowed: set[int]) -> None:
    assert _support(PROBS, **kw) == allowed


def test_filtered_distribution_is_renormalised() -> None:
    probs = [0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0]
    token_ids = _draw([p + 1e-9 for p in probs], 4000, seed=8, top_k=2)
    counts = torch.bincount(token_ids, minlength=8)
    assert counts[2:].sum() == 0
    assert abs(float(counts[0]) / 4000 - 4 / 7) < 0.03  # 0.4 / (0.4 + 0.3)


def test_disabled_filters_leave_the_distribution_untouched() -> None:
    logits = torch.randn(64, 300) * 3
    params = [SamplingParams(temperature=0.8)] * 64
    t = _tensors(params, list(range(64)), list(range(100, 164)))
    plain, _, _ = sample(logits, t)
    forced = dataclasses.replace(t, any_top_k=True, any_top_p=True, any_min_p=True)
    filtered, _, _ = sample(logits, forced)
    assert torch.equal(plain, filtered)  # same noise, every mask a no-op


def test_top_p_one_masks_nothing_despite_rounding() -> None:
    logits = torch.zeros(2, 3000)
    logits[:, :1000] = 30.0  # the tail's mass (~1e-10) is lost to the rounding of the cumsum
    logits[:, 1000:] = torch.linspace(0.0, -1.0, 2000)
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=1.0, top_k=2500)]
    t = dataclasses.replace(_tensors(params), any_top_p=True)
    masked = _apply_top_k_top_p(logits.clone(), t)
    assert bool(torch.isfinite(masked[0]).all())
    assert int(torch.isfinite(masked[1]).sum()) == 2500


def test_logprobs_are_raw_log_softmax() -> None:
    logits = (torch.randn(5, 64) * 2).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.5),
              SamplingParams(top_k=3, logprobs=4), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.5, logprobs=0)]
    token_ids, lp, _ = sample(logits, _tensors(params))
    assert lp is not None and lp.top_ids.shape == (5, 4) and lp.top_logprobs.shape == (5, 4)
    ref = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(lp.token_logprob, ref.gather(-1, token_ids[:, None])[:, 0])
    ref_top, ref_ids = ref.topk(4, dim=-1)
    assert torch.equal(lp.top_ids, ref_ids)
    torch.testing.assert_close(lp.top_logprobs, ref_top)
    assert lp.token_logprob.dtype == torch.float32


def test_logits_are_not_modified() -> None:
    logits = torch.randn(3, 40)
    before = logits.clone()
    params = [SamplingParams(top_k=2, top_p=0.5, min_p=0.3, logprobs=2)] * 3
    sample(logits, _tensors(params))
    assert torch.equal(logits, before)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_runs_inside_a_cuda_graph() -> None:
    params = [SamplingParams(temperature=0.9, top_k=k, top_p=p, min_p=m, logprobs=2)
              for k, p, m in [(0, 1.0, 0.0), (20, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.05)]] * 16
    seeds, positions = list(range(64)), list(range(1000, 1064))
    logits = torch.randn(64, 32000) * 4
    cpu_ids, _, _ = sample(logits, _tensors(params, seeds, positions))
    t = SamplingTensors.build(params, seeds, positions, "cuda")
    noise = exponential_noise(t.seeds, t.positions, 32000)
    torch.testing.assert_close(noise.cpu(), exponential_noise(t.seeds.cpu(), t.positions.cpu(),
                                                              32000))
    static_logits = logits.cuda()
    eager_ids, eager_lp, _ = sample(static_logits, t)
    assert (eager_ids.cpu() == cpu_ids).float().mean() > 0.95  # fp rounding may flip a near-tie
    graph, (graph_ids, graph_lp, _) = capture(lambda: sample(static_logits, t))
    graph.replay()
    assert torch.equal(graph_ids, eager_ids) and torch.equal(graph_lp.top_ids, eager_lp.top_ids)
    t.positions.add_(1)  # the next decode step, in place: new draws, same graph
    graph.replay()
    next_ids, _, _ = sample(static_logits, t)
    assert torch.equal(graph_ids, next_ids) and not torch.equal(next_ids, eager_ids)


def test_sample_step_fails_only_the_faulted_row_and_keeps_the_others_logprobs() -> None:
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(temperature=0.8, seed=5, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=7, logprobs=1)]
    seeds, positions, ids = [1, 2, 3, 4], [10, 11, 12, 13], ["a", "b", "c", "d"]
    clean = sample_step(logits, params, seeds, positions, ids, {})
    assert not clean.row_errors and bool(clean.finite.all())
    faulted = sample_step(logits, params, seeds, positions, ids,
                          {"sample": frozenset({"c"}), "nan": frozenset({"a"})})
    assert list(faulted.row_errors) == [2] and "InjectedFault" in faulted.row_errors[2]
    assert faulted.finite.tolist() == [False, True, True, True]  # row a: NaN logits
    for j in (1, 3):
        assert faulted.token_ids[j] == clean.token_ids[j]
        n = params[j].logprobs
        assert torch.equal(faulted.logprobs.top_ids[j, :n], clean.logprobs.top_ids[j, :n])
        torch.testing.assert_close(faulted.logprobs.token_logprob[j],
                                   clean.logprobs.token_logprob[j])


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    logits = torch.randn(6, 50) * 2
    params = [SamplingParams(temperature=1.0, top_p=p, seed=i)
              for i, p in enumerate([0.0, 1e-46, 5e-324, 1e-46, 0.0, 1e-30])]
    token_ids, _, finite = sample(logits, _tensors(params))
    assert torch.equal(token_ids, logits.argmax(dim=-1)) and bool(finite.all())



def test_the_profiles_sampling_pass_samples_its_rows(monkeypatch) -> None:
    """step_sampling.sample_random_logits (the memory plan's sampling pass) runs the sampler
    once over random logits of the rows and vocabulary asked for."""
    from moeserve.runner import step_sampling

    shapes = []
    real = step_sampling.sample

    def spy(logits, tensors, *args, **kwargs):
        shapes.append(tuple(logits.shape))
        return real(logits, tensors, *args, **kwargs)

    monkeypatch.setattr(step_sampling, "sample", spy)
    step_sampling.sample_random_logits(3, 40, torch.device("cpu"))
    assert shapes == [(3, 40)]


def test_logit_bias_moves_greedy_and_random_rows_and_the_logprobs() -> None:
    """logit_bias is added to the row's logits before sampling: +100 forces a token on a greedy
    row and on a random one, -100 bans the argmax, a row without one is untouched, and the
    logprobs report the biased distribution."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top = int(logits[2].argmax())
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=1),
              SamplingParams(temperature=1.0, seed=3, logit_bias=((11, 100.0),)),
              SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
              SamplingParams(temperature=0.0)]
    got = sample_step(logits.clone(), params, [0, 1, 2, 3], [5, 6, 7, 8], list("abcd"), {})
    assert got.token_ids[0] == 7 and got.token_ids[1] == 11
    second = int(logits[2].topk(2).indices[1])
    assert got.token_ids[2] == second != top
    assert got.token_ids[3] == int(logits[3].argmax())
    biased = logits[0].clone()
    biased[7] += 100.0
    torch.testing.assert_close(got.logprobs.token_logprob[0],
                               biased.log_softmax(-1)[7])


def test_logit_bias_rounds_once_in_the_logits_dtype() -> None:
    """bf16 logits: the sum is taken in fp32 and rounded once (not the bias rounded first)."""
    logits = torch.full((1, 8), 3.0, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 0.01})]
    add_logit_bias_(logits, params)
    assert logits[0, 2] == torch.tensor(3.0 + 0.01).to(torch.bfloat16)
    assert torch.equal(logits[0, :2], torch.full((2,), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize(("bias", "message"), [
    ({-1: 1.0}, "integers >= 0"), ({"5": 1.0}, "integers >= 0"), ({5: 100.5}, "[-100, 100]"),
    ({5: float("nan")}, "[-100, 100]"), (((5, 1.0), (5, 2.0)), "twice"),
    ({i: 1.0 for i in range(1025)}, "at most 1024"), (((5,),), "pairs"),
])
def test_logit_bias_is_validated(bias, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_crosses_to_the_engine_process() -> None:
    import msgspec

    from moeserve.engine.process.protocol import WireSamplingParams

    params = SamplingParams(temperature=0.0, logit_bias={9: -3.5, 2: 100},
                            presence_penalty=0.5, frequency_penalty=-1, min_tokens=3)
    assert params.logit_bias == ((2, 100.0), (9, -3.5))
    assert params.frequency_penalty == -1.0
    for p in (params, SamplingParams()):
        wire = msgspec.msgpack.encode(WireSamplingParams.from_params(p))
        assert msgspec.msgpack.decode(wire, type=WireSamplingParams).to_params() == p
