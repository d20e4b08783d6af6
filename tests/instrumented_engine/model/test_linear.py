"""Packed projections (`model.linear`): `F.linear`'s output (bitwise where the pack is exact,
which is every projection of the tiny and small presets), repacked when the weight changes,
off where they do not apply, and the model's outputs unchanged by them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from instrumented_engine.config import ModelConfig
from instrumented_engine.model import linear
from instrumented_engine.model.attention import build_metadata
from instrumented_engine.model.llama import build_model
from tests.instrumented_engine.helpers import tokens

needs_mkl = pytest.mark.skipif(not linear.ENABLED, reason="no MKL packed GEMM in this build")


def _shapes(preset: str) -> list[tuple[int, int]]:
    """(in, out) of every projection of a preset."""
    c = ModelConfig.preset(preset)
    h, i = c.hidden_size, c.intermediate_size
    return [(h, c.num_heads * c.head_dim), (h, c.num_kv_heads * c.head_dim),
            (c.num_heads * c.head_dim, h), (h, i), (i, h)]


@needs_mkl
@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_projection_is_f_linear(preset: str, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        for fan_in, fan_out in _shapes(preset):
            w = torch.randn(fan_out, fan_in, generator=g) * fan_in ** -0.5
            for rows in (linear.PACK_MIN_ROWS, 300, 777, 1024):
                x = torch.randn(rows, fan_in, generator=g)
                with torch.inference_mode():
                    got = linear.linear(x, w)
                ref = F.linear(x, w)
                pack = linear._PACKS[id(w)]
                assert pack.packed is not None  # the packed path was the one taken
                if pack.exact:
                    assert torch.equal(got, ref), (fan_in, fan_out, rows)
                else:
                    assert fan_in > 768  # only long reductions round differently
                    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
            # Projections with short reductions are bitwise F.linear.
            assert pack.exact or fan_in > 768
    finally:
        torch.set_num_threads(before)


@needs_mkl
def test_weight_written_in_place_or_replaced_is_packed_again() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(linear.PACK_MIN_ROWS, 32, generator=g)
    assert torch.equal(linear.linear(x, w), F.linear(x, w))
    w.copy_(torch.randn(64, 32, generator=g))  # load_state_dict writes like this
    assert torch.equal(linear.linear(x, w), F.linear(x, w))
    w2 = torch.randn(64, 32, generator=g)
    assert torch.equal(linear.linear(x, w2), F.linear(x, w2))
    key = id(w2)
    del w2
    gc.collect()
    assert key not in linear._PACKS  # dropped with its weight


def test_small_batches_other_dtypes_and_autograd_use_f_linear() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=g)
    few = torch.randn(linear.PACK_MIN_ROWS - 1, 40, generator=g)
    assert torch.equal(linear.linear(few, w), F.linear(few, w))
    assert id(w) not in linear._PACKS
    wd = w.double()
    xd = torch.randn(linear.PACK_MIN_ROWS, 40, dtype=torch.float64, generator=g)
    assert torch.equal(linear.linear(xd, wd), F.linear(xd, wd))
    assert id(wd) not in linear._PACKS
    wg = w.clone().requires_grad_(True)
    x = torch.randn(linear.PACK_MIN_ROWS, 40, generator=g)
    linear.linear(x, wg).sum().backward()
    assert wg.grad is not None
    assert id(wg) not in linear._PACKS
    xg = x.clone().requires_grad_(True)  # a frozen weight, activations that need gradients
    linear.linear(xg, w).sum().backward()
    assert xg.grad is not None
    assert id(w) not in linear._PACKS
    with torch.inference_mode():
        wi = torch.randn(48, 40, generator=g)  # an inference tensor: no version counter
        assert torch.equal(linear.linear(x, wi), F.linear(x, wi))
    assert id(wi) not in linear._PACKS


@needs_mkl
def test_a_failing_packed_op_falls_back_for_that_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> torch.Tensor:
        raise RuntimeError("changed signature")

    monkeypatch.setattr(linear, "_PACKED_LINEAR", broken)
    monkeypatch.setattr(linear, "ENABLED", True)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 24, generator=g)
    x = torch.randn(linear.PACK_MIN_ROWS, 24, generator=g)
    assert torch.equal(linear.linear(x, w), F.linear(x, w))  # the pack's check failed: F.linear
    monkeypatch.setattr(linear, "_PACKS", {})
    # A pack that passed its check, then the op fails: that weight runs F.linear from then on,
    # packing stays on for the others.
    p = linear._Pack(weakref.ref(w), w._version, w.data_ptr(), torch.empty(0))
    linear._PACKS[id(w)] = p
    assert torch.equal(linear.linear(x, w), F.linear(x, w))
    assert p.packed is None and linear._PACKS[id(w)] is p
    assert linear.ENABLED is True


@needs_mkl
@pytest.mark.parametrize("write", ["assign_data", "module_to"])
def test_a_weight_whose_storage_moves_is_packed_again(write: str) -> None:
    g = torch.Generator().manual_seed(5)
    m = torch.nn.Linear(48, 32, bias=False)
    x = torch.randn(linear.PACK_MIN_ROWS, 48, generator=g)
    assert torch.equal(linear.linear(x, m.weight), F.linear(x, m.weight))
    new = torch.randn(32, 48, generator=g)
    if write == "assign_data":
        m.weight.data = new  # the version does not move; the storage does
    else:
        m.weight.data = new.double()
        m.float()
    assert m.weight.dtype == torch.float32
    assert torch.allclose(linear.linear(x, m.weight), F.linear(x, m.weight), rtol=0, atol=1e-5)


@needs_mkl
def test_clear_drops_packs_after_writes_through_data() -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(32, 48, generator=g)
    x = torch.randn(linear.PACK_MIN_ROWS, 48, generator=g)
    linear.linear(x, w)
    assert linear._PACKS[id(w)].packed is not None
    w.data.copy_(torch.randn(32, 48, generator=g))  # moves neither version nor storage
    linear.clear()
    assert id(w) not in linear._PACKS
    assert torch.allclose(linear.linear(x, w), F.linear(x, w), rtol=0, atol=1e-5)


@needs_mkl
def test_packs_made_from_several_threads_keep_the_byte_count() -> None:
    import threading

    linear.clear()
    w = torch.randn(64, 64)
    x = torch.randn(linear.PACK_MIN_ROWS, 64)
    start = threading.Barrier(4)

    def run() -> None:
        start.wait()
        for _ in range(25):
            with torch.no_grad():
                w.add_(0.0)  # a new version: the next call packs again
            linear.linear(x, w)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert linear._packed_bytes == sum(p.nbytes for p in linear._PACKS.values())
    assert linear._packed_bytes <= w.numel() * w.element_size()
    linear.clear()
    assert linear._packed_bytes == 0


@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])
def test_model_outputs_are_unchanged_by_packing(preset: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.preset(preset, max_model_len=1024)
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    bs, n_blocks = 16, 48
    shape = (n_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    prompt = tokens(5, 600, vocab=cfg.vocab_size)
    table = list(range(n_blocks))

    def run() -> torch.Tensor:
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        outs = []
        # A long first chunk, then a 300-token chunk after its 300-token prefix (both packed).
        for lo, hi in ((0, 300), (300, 600)):
            meta = build_metadata([hi - lo], [hi], [table], bs, torch.device("cpu"))
            with torch.inference_mode():
                hidden = model(torch.tensor(prompt[lo:hi]), torch.arange(lo, hi), caches, meta)
                outs.append(model.compute_logits(hidden))
        return torch.cat(outs)

    monkeypatch.setattr(linear, "ENABLED", False)
    plain = run()
    monkeypatch.setattr(linear, "ENABLED", linear._REORDER is not None)
    packed = run()
    if preset == "medium":  # down_proj's 1,408-long sums round differently when packed
        assert torch.allclose(packed, plain, rtol=1e-4, atol=1e-4)
        assert (packed.argmax(-1) == plain.argmax(-1)).all()
    else:
        assert torch.equal(packed, plain)
    if linear.ENABLED:  # the packed run did pack (else the comparison proves nothing)
        w = model.layers[0].mlp.down_proj.weight
        assert linear._PACKS[id(w)].packed is not None


@needs_mkl
def test_packs_stop_at_the_memory_budget_and_give_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(linear.PACK_MIN_ROWS, 32, generator=g)
    base = linear._packed_bytes
    monkeypatch.setattr(linear, "PACK_BUDGET_BYTES", base + 64 * 32 * 4)  # room for one
    a, b = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    assert torch.equal(linear.linear(x, a), F.linear(x, a))
    assert torch.equal(linear.linear(x, b), F.linear(x, b))
    assert linear._PACKS[id(a)].packed is not None
    assert linear._PACKS[id(b)].packed is None  # over the budget: F.linear
    assert linear._packed_bytes == base + 64 * 32 * 4
    del a
    gc.collect()
    assert linear._packed_bytes == base
