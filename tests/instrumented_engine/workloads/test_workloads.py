"""Workload generators and the Mooncake trace replay."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from agent.errors import InputError
from instrumented_engine.workloads import build_workload, chat, docqa
from instrumented_engine.workloads.chat import ChatConfig
from instrumented_engine.workloads.docqa import DocQAConfig
from instrumented_engine.workloads.trace import trace
from tests.conftest import shared_data


def test_docqa_prompts_are_system_doc_question() -> None:
    cfg = DocQAConfig(system_tokens=10, num_docs=3, doc_tokens=(20, 30), question_tokens=(4, 6))
    arr = docqa(40, seed=1, rate=5.0, vocab_size=100, tenants=2, cfg=cfg)
    assert arr == docqa(40, seed=1, rate=5.0, vocab_size=100, tenants=2, cfg=cfg)
    system = arr[0].prompt_token_ids[:10]
    assert all(a.prompt_token_ids[:10] == system for a in arr)
    assert all(10 + 20 + 4 <= len(a.prompt_token_ids) <= 10 + 30 + 6 for a in arr)
    assert 1 < len({tuple(a.prompt_token_ids[10:30]) for a in arr}) <= 3  # three documents
    times = [a.at_s for a in arr]
    assert times == sorted(times) and times[0] > 0
    assert {a.tenant for a in arr} == {"tenant-0", "tenant-1"}
    assert all(8 <= a.max_tokens <= 24 for a in arr)


def test_docqa_popularity_is_skewed() -> None:
    cfg = DocQAConfig(num_docs=10, doc_tokens=(30, 30), system_tokens=1, zipf_s=1.2)
    arr = docqa(300, seed=2, rate=0, vocab_size=1000, cfg=cfg)
    counts: dict[tuple[int, ...], int] = {}
    for a in arr:
        key = tuple(a.prompt_token_ids[1:31])
        counts[key] = counts.get(key, 0) + 1
    top = sorted(counts.values(), reverse=True)
    assert top[0] > 3 * top[-1]
    assert all(a.at_s == 0 for a in arr)  # rate 0: an offline batch


def test_chat_turns_extend_the_previous_prompt() -> None:
    cfg = ChatConfig(system_tokens=8, turns=(3, 3), user_tokens=(2, 5), reply_tokens=(3, 6),
                     think_time_s=1.0)
    arr = chat(30, seed=3, rate=2.0, vocab_size=50, cfg=cfg)
    by_conv: dict[str, list] = {}
    for a in arr:
        by_conv.setdefault(a.request_id[:9], []).append(a)
    full = [v for v in by_conv.values() if len(v) == 3]
    assert full
    for turns in full:
        turns.sort(key=lambda a: a.request_id)
        for prev, nxt in itertools.pairwise(turns):
            n = len(prev.prompt_token_ids)
            assert nxt.prompt_token_ids[:n] == prev.prompt_token_ids
            # The reply spliced in is as long as the previous turn's max_tokens.
            assert len(nxt.prompt_token_ids) - n - prev.max_tokens >= 2
            assert nxt.at_s >= prev.at_s
    assert [a.at_s for a in arr] == sorted(a.at_s for a in arr)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 64, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 32, "hash_ids": [1, 2, 4]},
    {"timestamp": 4000, "input_length": 300, "output_length": 1, "hash_ids": [9]},
]


def test_trace_scale_preserves_sharing_exactly(tmp_path: Path) -> None:
    p = _write_trace(tmp_path / "t.jsonl", ROWS)
    arr = trace(p, 10, seed=0, vocab_size=1000, block_size=16, scale=1 / 16)  # 32 tokens/block
    a, b, c = (x.prompt_token_ids for x in arr)
    # 2 full trace blocks (64 tokens) + ceil(76 / 16) = 5 tokens of the third, and so on.
    assert (len(a), len(b), len(c)) == (64 + 5, 64 + 30, 19)
    assert a[:64] == b[:64] and a[64:69] != b[64:69]
    assert [x.max_tokens for x in arr] == [4, 2, 1]
    assert [x.at_s for x in arr] == [0.0, 0.5, 3.0]
    assert arr[1].source == f"{p}:2" and arr[1].request_id == "trace-000002"


def test_trace_time_scale_and_request_count(tmp_path: Path) -> None:
    p = _write_trace(tmp_path / "t.jsonl", ROWS)
    arr = trace(p, 2, seed=0, vocab_size=1000, block_size=16, time_scale=0.1)
    assert len(arr) == 2 and [x.at_s for x in arr] == [0.0, 0.05]
    assert len(arr[0].prompt_token_ids) == 2 * 16 + 3  # default scale: one block per 512


@pytest.mark.parametrize(("row", "message"), [
    ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing field 'hash_ids'"),
    ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]},
     "timestamp must be"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]},
     "input_length must be a positive integer"),
    ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]},
     "1 hash_ids for input_length 600"),
    ({"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]},
     "hash_ids must be a non-empty list of integers"),
])
def test_malformed_trace_lines_name_file_and_line(tmp_path: Path, row: dict,
                                                  message: str) -> None:
    p = _write_trace(tmp_path / "t.jsonl", [ROWS[0], row])
    with pytest.raises(InputError, match=rf"t.jsonl:2: {message}"):
        trace(p, 10, seed=0, vocab_size=100, block_size=16)


def test_trace_rejects_a_scale_that_splits_engine_blocks(tmp_path: Path) -> None:
    p = _write_trace(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(InputError, match=r"--scale: 512 x 0.05 = 25.6 tokens"):
        trace(p, 10, seed=0, vocab_size=100, block_size=16, scale=0.05)
    with pytest.raises(InputError, match=r"not a whole number of 16-token engine blocks"):
        trace(p, 10, seed=0, vocab_size=100, block_size=16, scale=1 / 64)


def test_real_mooncake_trace_replays_with_prefix_sharing() -> None:
    p = shared_data("traces/conversation_trace.jsonl")
    arr = build_workload(f"trace:{p}", 50, seed=0, rate=0, vocab_size=2048, block_size=16,
                         time_scale=0.01)
    assert len(arr) == 50 and arr[0].at_s == 0.0
    with open(p) as fh:
        rows = [json.loads(line) for line, _ in zip(fh, range(50), strict=False)]
    # Requests sharing a first hash id share their first engine block, and only those.
    for x, rx in zip(arr[:10], rows[:10], strict=True):
        for y, ry in zip(arr[10:20], rows[10:20], strict=True):
            same = rx["hash_ids"][0] == ry["hash_ids"][0]
            assert (x.prompt_token_ids[:16] == y.prompt_token_ids[:16]) == same


@pytest.mark.parametrize(("spec", "kwargs", "message"), [
    ("nope", {}, "--workload: expected one of docqa, chat, trace:PATH"),
    ("trace:", {}, "--workload"),
    ("trace:/no/such.jsonl", {}, "no such trace file"),
    ("docqa", {"num_requests": 0}, "--num-requests: must be >= 1"),
    ("docqa", {"rate": -1.0}, "--rate: must be >= 0"),
    ("chat", {"tenants": 0}, "--tenants: must be >= 1"),
])
def test_build_workload_rejects_bad_options(spec: str, kwargs: dict, message: str) -> None:
    args = {"num_requests": 3, "seed": 0, "rate": 1.0, "vocab_size": 10, "block_size": 16,
            **kwargs}
    n = args.pop("num_requests")
    with pytest.raises(InputError, match=message):
        build_workload(spec, n, **args)
