"""The compiled kernels (:mod:`kvdemo.policies.fused`) against plain restatements, and the shared top-k's index
extraction: the fast paths select exactly what the definitions select, in float32 and bfloat16."""

import pytest
import torch

from kvdemo.devices.emulated_device import DEVICE, EmulatedDevice
from kvdemo.policies import LayerSlice, fused, make_policy
from kvdemo.policies.infinipot_v import recent_reference
from kvdemo.policies.topk import kept_indices

needs_compiler = pytest.mark.skipif(fused.compile_unavailable() is not None, reason=f"{fused.compile_unavailable()}")


@pytest.fixture
def compiled():
    fused.use_compiled(True)
    yield
    fused.use_compiled(None)


def scene(dtype, heads=2, frames=6, grid=(2, 3), dim=16, seed=0):
    """Keys: a static direction per patch plus noise that grows with the frame; values of spread-out norms."""
    g = torch.Generator().manual_seed(seed)
    p = grid[0] * grid[1]
    static = torch.randn(heads, 1, p, dim, generator=g)
    noise = torch.arange(frames, dtype=torch.float32)[None, :, None, None] * 0.3
    keys = (static + noise * torch.randn(heads, frames, p, dim, generator=g)).reshape(heads, frames * p, dim)
    values = (1 + 3 * torch.rand(heads, frames * p, 1, generator=g)) * torch.randn(heads, frames * p, dim, generator=g)
    token = torch.arange(frames * p)
    frame, row, col = token // p, (token % p) // grid[1], token % grid[1]
    as_heads = lambda x: x.int().expand(heads, -1).contiguous()  # noqa: E731
    return LayerSlice(
        layer=0,
        num_layers=1,
        keys=keys.to(dtype),
        values=values.to(dtype),
        frame=as_heads(frame),
        row=as_heads(row),
        col=as_heads(col),
        grid=grid,
        newest_frame=frames - 1,
    )


def restated_terms(keys, values, recent, row, rows):
    """The TaR similarity and VaN of every token by a plain loop in float64 over the cache's own numbers: a
    half-precision cache rounds each product and each norm to its dtype, as the eager code does."""
    dtype = keys.dtype
    rnd = (lambda x: x) if dtype == torch.float32 else (lambda x: x.to(dtype).double())  # noqa: E731
    reference, count = recent_reference(keys, recent, row, rows)
    heads, length, _ = keys.shape
    similarity = torch.zeros(heads, length, dtype=torch.float64)
    van = torch.zeros(heads, length, dtype=torch.float64)
    for h in range(heads):
        for t in range(length):
            k, r = keys[h, t].double(), reference[row[h, t]].double()
            norm = rnd(k.square().sum().sqrt().float()).double()
            similarity[h, t] = sum(float(rnd((k[d] * r[d]).float())) for d in range(k.numel())) / max(
                float(norm), 1e-12
            )
            similarity[h, t] /= max(float(count[row[h, t]]), 1.0)
            van[h, t] = float(rnd(values[h, t].double().square().sum().sqrt().float()))
    return similarity, van


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_terms_equal_a_plain_loop(compiled, dtype):
    view = scene(dtype)
    heads, per_frame = view.num_heads, view.tokens_per_frame
    recent = view.frame >= 5
    pos = view.row.long() * view.grid[1] + view.col.long()
    row = (torch.arange(heads)[:, None] * per_frame + pos).contiguous()
    reference, count = recent_reference(view.keys, recent, row, heads * per_frame)
    with torch.inference_mode():
        similarity, van = fused.run_compiled(
            fused.tar_and_van_terms, view.keys, view.values, reference, row, count, dtype != torch.float32
        )
    expected_similarity, expected_van = restated_terms(view.keys, view.values, recent, row, heads * per_frame)
    assert (
        torch.equal(van.double(), expected_van)
        if dtype == torch.bfloat16
        else torch.allclose(van.double(), expected_van)
    )
    assert torch.allclose(similarity.double(), expected_similarity, atol=1e-6, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.0])
def test_the_compiled_pass_keeps_what_the_eager_pass_keeps(compiled, dtype, alpha):
    views = [scene(dtype, seed=seed) for seed in range(3)]
    for view, layer in zip(views, range(3)):
        view.layer, view.num_layers = layer, 3
    keep = 20
    fused.use_compiled(False)
    eager = make_policy("infinipot-v", alpha=alpha).compress(views, keep)
    fused.use_compiled(True)
    calls = fused.compile_stats()["calls"]
    fast = make_policy("infinipot-v", alpha=alpha).compress(views, keep)
    # once for the three layers, which are one stack (one device, one length): every head of them as a row
    assert fused.compile_stats()["calls"] == calls + (1 if alpha > 0 else 0), "the compiled kernel ran"
    for a, b, ra, rb in zip(eager.indices, fast.indices, eager.info["reason"], fast.info["reason"]):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_kept_indices_of_equal_and_ragged_rows():
    """Rows keeping the same count come out ascending, with no validity mask; ragged rows are padded with index 0,
    marked invalid; both equal a sort of the kept slots. A count the caller knows is not read back from the device."""
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
    index, valid = kept_indices(mask)
    assert index.tolist() == [[0, 2, 3], [1, 2, 4]] and valid is None
    ragged = torch.tensor([[True, False, True, True, False], [False, False, True, False, False]])
    index, valid = kept_indices(ragged)
    assert index.tolist() == [[0, 2, 3], [2, 0, 0]] and valid.tolist() == [[True, True, True], [True, False, False]]
    empty, none = kept_indices(torch.zeros(2, 4, dtype=torch.bool))
    assert empty.shape == (2, 0) and none is None
    assert kept_indices(torch.zeros(0, 4, dtype=torch.bool))[0].shape == (0, 0)
    mode = EmulatedDevice()
    with mode:
        on_device, _ = kept_indices(mask.to(DEVICE), 3)
        reads = mode.host_reads
    assert reads == 0 and on_device.cpu().tolist() == [[0, 2, 3], [1, 2, 4]]


def test_eager_is_the_default_and_the_environment_turns_compiling_on(monkeypatch):
    fused.use_compiled(None)
    monkeypatch.delenv(fused.ENVIRONMENT, raising=False)
    assert not fused.compiled_enabled()
    monkeypatch.setenv(fused.ENVIRONMENT, "1")
    assert fused.compiled_enabled() == (fused.compile_stats()["error"] is None)
    fused.use_compiled(False)
    assert not fused.compiled_enabled()
    fused.use_compiled(None)


@pytest.mark.slow
@needs_compiler
def test_a_stream_whose_lengths_change_compiles_at_most_once():
    """Two simulated streams (the engine's trigger) at two budgets: the passes see different cache lengths and
    buffer capacities, and the dynamically shaped kernel compiles at most once (none if this process already did)."""
    from kvdemo.bench.passes import compiled_stream

    shape = dict(num_layers=3, num_kv_heads=2, num_heads=4, head_dim=16, budget=96, keep=72, grid=(3, 4))
    result = compiled_stream(make_policy("infinipot-v"), grids=20, budgets=(96, 64), shape=shape)
    assert result["passes"] > 10 and result["kept_lengths"] == [48, 72]
    assert result["compiles"] <= 1
    assert compiled_stream(make_policy("sliding-window"), grids=10, budgets=(96,), shape=shape) is None
