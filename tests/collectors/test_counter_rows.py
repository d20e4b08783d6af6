"""Row-wise counters (one entity's counters read together) against the one-at-a-time path,
and the readings a row keeps for counters that did not move."""

from __future__ import annotations

import random

from collectors.base import CounterTracker, Emitter

S = 1_000_000_000
NAMES = ("kvscope_nic_receive_bytes_total", "kvscope_nic_receive_packets_total",
         "kvscope_nic_receive_errors_total", "kvscope_nic_transmit_bytes_total")


def _step(rng: random.Random, raw: int) -> int:
    r = rng.random()
    if r < 0.1:
        return rng.randrange(0, 1000)  # a reset
    if r < 0.2 and raw < 2**32:
        return (raw + rng.randrange(1, 10_000)) % 2**32  # may wrap a 32-bit counter
    if r < 0.5:
        return raw  # did not move
    return raw + rng.randrange(1, 10**9)


def test_counter_row_gives_what_counter_gives_one_at_a_time():
    rng = random.Random(7)
    one, row = CounterTracker(), CounterTracker()
    raws = [2**32 - 50, 10, 0, 2**40]
    ts = S
    for cycle in range(300):
        labels = ("eth0",)
        a = Emitter("nic", ts, one)
        b = Emitter("nic", ts, row)
        for name, raw in zip(NAMES, raws, strict=True):
            a.counter(name, labels, raw, "eth0")
        b.counter_row(NAMES, labels, list(raws), "eth0")
        assert b.out.readings == a.out.readings
        assert [type(x.value) for x in b.out.readings] == [float] * len(NAMES)
        assert b.out.samples == a.out.samples
        one.end_cycle()
        row.end_cycle()
        raws = [_step(rng, x) for x in raws]
        ts += 0 if cycle % 17 == 5 else rng.randrange(1, 3 * S)  # a zero interval now and then


def test_a_row_not_updated_in_a_cycle_starts_a_new_baseline():
    t = CounterTracker()
    t.update_row("eth0", [10, 20], 0)
    assert t.update_row("eth0", [15, 20], S) == ([15, 20], [5.0, 0.0])
    t.end_cycle()
    t.end_cycle()  # not updated in the last cycle: forgotten
    assert t.update_row("eth0", [1, 2], 2 * S) == ([1, 2], None)


def test_counters_that_did_not_move_keep_their_reading_objects():
    t = CounterTracker()
    labels = ("eth0",)
    first = Emitter("nic", S, t)
    first.counter_row(NAMES, labels, [1, 2, 3, 4], "eth0")
    second = Emitter("nic", 2 * S, t)
    second.counter_row(NAMES, labels, [1, 5, 3, 4], "eth0")
    same = [x is y for x, y in zip(first.out.readings, second.out.readings, strict=True)]
    assert same == [True, False, True, True]
    assert second.out.readings[1].value == 5.0


def test_an_idle_row_gives_what_counter_gives_and_keeps_its_readings():
    one, row = CounterTracker(), CounterTracker()
    raws = [5, 2**32 - 1, 0, 2**40]
    labels = ("ifb0",)
    kept = None
    for cycle in range(5):
        ts = S * (cycle + 1)
        a = Emitter("nic", ts, one)
        b = Emitter("nic", ts, row)
        for name, raw in zip(NAMES, raws, strict=True):
            a.counter(name, labels, raw, "ifb0")
        b.counter_row(NAMES, labels, list(raws), "ifb0")
        assert b.out.readings == a.out.readings
        assert b.out.samples == a.out.samples
        assert [s.value for s in b.out.samples] == ([0.0] * len(NAMES) if cycle else [])
        if kept is not None:
            assert all(x is y for x, y in zip(b.out.readings, kept, strict=True))
        kept = b.out.readings
        one.end_cycle()
        row.end_cycle()
    assert len(row) == 1  # the idle row stays current: end_cycle keeps it
