"""Engine correctness: prefix caching changes no output; hits are exact; namespaces isolate."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from instrumented_engine.core.request import SamplingParams
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.workloads import ChatConfig, DocQAConfig, chat, docqa
from instrumented_engine.workloads.base import Arrival
from tests.instrumented_engine.helpers import tapped_model, tiny_config, tokens

# Logits of a prefill that reuses cached blocks vs a full prefill, both float64: they differ
# only in summation order (a few ulps of values of order 1).
LOGITS_TOL = 1e-10


def _run(arrivals: Sequence[Arrival], *, caching: bool, **cfg: int) -> tuple[LLMEngine, dict]:
    eng = LLMEngine(tiny_config(prefix_caching=caching, **cfg))
    for a in arrivals:
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    return eng, {o.request_id: o for o in eng.run_until_done()}


@pytest.mark.parametrize("workload", ["docqa", "chat"])
def test_greedy_outputs_equal_with_caching_on_and_off(workload: str) -> None:
    if workload == "docqa":
        arrivals = docqa(16, seed=5, rate=0, vocab_size=512,
                         cfg=DocQAConfig(system_tokens=20, num_docs=3, doc_tokens=(40, 90),
                                         question_tokens=(5, 12), output_tokens=(4, 10)))
    else:
        arrivals = chat(16, seed=6, rate=0, vocab_size=512,
                        cfg=ChatConfig(system_tokens=20, turns=(2, 4), user_tokens=(5, 20),
                                       reply_tokens=(4, 10), think_time_s=0))
    # Few running slots: later requests hit blocks of finished ones, not only batch-mates.
    on_eng, on = _run(arrivals, caching=True, max_num_seqs=4, max_batched_tokens=96)
    _off_eng, off = _run(arrivals, caching=False, max_num_seqs=4, max_batched_tokens=96)
    assert sum(o.accounting.device_hit_tokens for o in on.values()) > 0
    assert sum(o.accounting.device_hit_tokens for o in off.values()) == 0
    assert on_eng.stats.partial_prefills > 0  # chunked prefills took part
    for rid, o in on.items():
        assert o.output_token_ids == off[rid].output_token_ids, rid
        assert len(o.output_token_ids) == next(a.max_tokens for a in arrivals
                                               if a.request_id == rid)


def test_prefill_reusing_cached_blocks_matches_full_prefill_logits() -> None:
    prefix, suffix = tokens(1, 200), tokens(2, 37)
    cfg = tiny_config()
    model, seen_cached = tapped_model(cfg)
    cached = LLMEngine(cfg, model=model)
    cached.generate([prefix + tokens(3, 5)], max_tokens=1)
    out = cached.generate([prefix + suffix], max_tokens=1)[0]
    assert out.accounting.device_hit_tokens == 192  # 12 full blocks of 16
    assert out.accounting.recomputed_tokens == 45
    cold_cfg = tiny_config(prefix_caching=False)
    model, seen_cold = tapped_model(cold_cfg)
    LLMEngine(cold_cfg, model=model).generate([prefix + suffix], max_tokens=1)
    # One sampling step per request (max_tokens=1): the second request's, against the cold one.
    assert len(seen_cached) == 2 and len(seen_cold) == 1
    a, b = seen_cached[1][0], seen_cold[0][0]
    assert torch.allclose(a, b, atol=LOGITS_TOL, rtol=0), (a - b).abs().max()


def test_shared_100_token_prefix_shares_exactly_six_blocks() -> None:
    eng = LLMEngine(tiny_config(block_size=16))
    prefix = tokens(9, 100)
    first = eng.make_request(prefix + tokens(10, 30), 4)
    eng.submit(first, eng.lookup(first))
    eng.run_until_done()
    second = eng.make_request(prefix + tokens(11, 30), 4)
    promised = eng.lookup(second)
    assert promised == {"device": 96}
    assert second.block_hashes[:6] == first.block_hashes[:6]
    assert second.block_hashes[6] != first.block_hashes[6]
    eng.submit(second, promised)
    eng.step()  # admits `second`
    assert [b.block_id for b in second.blocks[:6]] == list(range(6))
    # From the free queue's head: first's partial last block 8 (no hash, nothing to keep),
    # not one of its cached blocks.
    assert second.blocks[6].block_id == 8
    out = eng.run_until_done()[0]
    assert out.accounting.device_hit_tokens == 96
    assert out.accounting.recomputed_tokens == 34
    assert out.accounting.lookup_tokens == 128


def test_tenants_never_share_a_hit_but_share_within_a_tenant() -> None:
    eng = LLMEngine(tiny_config())
    prompt = tokens(4, 80)
    outs = [eng.generate([prompt], max_tokens=2, tenant=t)[0] for t in ("a", "b", "a")]
    assert [o.accounting.device_hit_tokens for o in outs] == [0, 0, 64]
    assert outs[0].output_token_ids == outs[1].output_token_ids == outs[2].output_token_ids


def test_explicit_cache_salt_overrides_the_tenant() -> None:
    eng = LLMEngine(tiny_config())
    prompt = tokens(4, 40)
    eng.add_request(prompt, 1, tenant="a", cache_salt="shared")
    eng.run_until_done()
    eng.add_request(prompt, 1, tenant="b", cache_salt="shared")
    assert eng.run_until_done()[0].accounting.device_hit_tokens == 32


def test_engines_of_different_revisions_share_no_keys() -> None:
    prompt = tokens(4, 40)
    a = LLMEngine(tiny_config(seed=0))
    b = LLMEngine(tiny_config(seed=1))
    ra, rb = a.make_request(prompt, 1), b.make_request(prompt, 1)
    a.lookup(ra)
    b.lookup(rb)
    assert not set(ra.block_hashes) & set(rb.block_hashes)


def test_seeded_sampling_does_not_depend_on_batch_mates() -> None:
    prompt = tokens(12, 50)
    params = SamplingParams(temperature=0.8, seed=42)
    alone = LLMEngine(tiny_config()).generate([prompt], 12, params)[0].output_token_ids
    eng = LLMEngine(tiny_config())
    eng.add_request(tokens(13, 70), 12, SamplingParams(temperature=1.0, seed=7))
    rid = eng.add_request(prompt, 12, params)
    eng.add_request(tokens(14, 20), 12)
    crowd = {o.request_id: o for o in eng.run_until_done()}[rid].output_token_ids
    greedy = LLMEngine(tiny_config()).generate([prompt], 12)[0].output_token_ids
    assert alone == crowd
    assert alone != greedy


def test_tier_lookup_continues_the_chain_after_device_hits() -> None:
    eng = LLMEngine(tiny_config(), tier_config=TierConfig(host_blocks=8))
    prompt = tokens(15, 100)
    req = eng.make_request(prompt, 1)
    eng.lookup(req)
    host = eng.flow.host if eng.flow is not None else None
    assert host is not None
    zeros = torch.zeros(host.layout.payload_shape, dtype=host.layout.dtype)
    for h in req.block_hashes[:5]:  # the host tier holds the first 5 blocks of the chain
        host.put(h, zeros)
    eng.generate([prompt[:40]], 1)  # the device holds the first 2 blocks now
    req2 = eng.make_request(prompt, 1)
    assert eng.lookup(req2) == {"device": 32, "host": 48}
    assert req2.acct.host_hit_tokens == 48 and req2.acct.lookup_tokens == 96


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_token_ids": []}, "empty prompt"),
    ({"prompt_token_ids": [512]}, r"ids must be in \[0, 512\)"),
    ({"prompt_token_ids": [1], "max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"prompt_token_ids": [1] * 2040, "max_tokens": 9}, "exceeds max_model_len"),
])
def test_bad_requests_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_config()).make_request(**kwargs)


def test_request_larger_than_the_pool_is_rejected() -> None:
    eng = LLMEngine(tiny_config(num_blocks=4))
    with pytest.raises(ValueError, match="needs 5 blocks; the pool has 4"):
        eng.make_request([1] * 70, 2)
