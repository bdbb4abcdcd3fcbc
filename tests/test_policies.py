"""Baseline policies on small hand-made views, and the registry."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kvdemo.errors import BudgetError, PolicyParameterError, UnknownPolicyError, UserError
from kvdemo.policies import CARDS, REGISTRY, LayerSlice, PolicyCard, make_policy, param, policy_card, policy_params
from kvdemo.policies.grid import frame_rank
from kvdemo.policies.topk import arg_min, top_k_indices, top_k_mask, top_k_sorted, top_k_sum, top_k_values


class IdentityRotation:
    """A stand-in for a model's rotation (keys already "before RoPE")."""

    def rotate(self, x, position):
        return x

    def unrotate(self, x, position):
        return x


def make_view(frames: int, rows: int = 2, cols: int = 2, heads: int = 2, dim: int = 8, layer: int = 0, seed: int = 0):
    """Whole frames in stream order; keys/values random; room for a 16-slot summary (policies that own one)."""
    g = torch.Generator().manual_seed(seed)
    per = rows * cols
    token = torch.arange(frames * per)
    prov = lambda x: x.int().expand(heads, -1).contiguous()  # noqa: E731
    return LayerSlice(
        layer=layer,
        num_layers=1,
        keys=torch.randn(heads, frames * per, dim, generator=g),
        values=torch.randn(heads, frames * per, dim, generator=g),
        frame=prov(token // per),
        row=prov((token % per) // cols),
        col=prov(token % cols),
        grid=(rows, cols),
        newest_frame=frames - 1,
        position=torch.zeros(heads, frames * per, 3, dtype=torch.int32),
        rotary=IdentityRotation(),
        summary_slots=16,
        probe=torch.randn(2 * heads, 3, dim, generator=g),  # a probe text's queries (HybridKV), GQA group of 2
    )


@pytest.mark.parametrize("name", [n for n, cls in REGISTRY.items() if cls.bounded])
@pytest.mark.parametrize("keep", [1, 4, 7, 12])
def test_every_bounded_policy_returns_sorted_unique_indices_of_size_keep(name, keep):
    views = [make_view(6, layer=l, seed=l) for l in range(3)]
    for view in views:
        view.num_layers = 3
    selection = make_policy(name).compress(views, keep)
    assert len(selection.indices) == 3
    for layer, (view, index) in enumerate(zip(views, selection.indices)):
        if selection.valid is not None:  # ragged: heads keep different numbers, averaging keep
            check_ragged(index, selection.valid[layer], keep, view)
            continue
        reserve = [u for u in selection.offload or () if u.counted and layer in u.layers]
        if reserve:  # retrieval that counts toward M (ReKV): resident + what a question brings back fit keep
            retrieve = reserve[0].retrieve[reserve[0].layers.index(layer)]
            assert index.shape[0] == view.num_heads and bool((index.shape[1] + retrieve <= keep).all())
        else:
            assert index.shape == (view.num_heads, keep)
        assert index.dtype == torch.long
        assert (index[:, 1:] > index[:, :-1]).all(), "indices must be sorted and unique"
        assert not index.numel() or (index.min() >= 0 and index.max() < view.length)


def check_ragged(index, valid, keep, view):
    """A ragged layer: ``[H, width]`` indices padded to the largest head's count, ``valid`` marking each head's
    real entries first; every head's real entries sorted, unique and inside the view; ``keep`` per head on average."""
    assert valid.shape == index.shape and valid.dtype == torch.bool and index.dtype == torch.long
    counts = valid.sum(dim=1)
    assert int(counts.sum()) == keep * view.num_heads
    assert int(counts.max()) == index.shape[1], "padded to the largest count, no wider"
    for head in range(view.num_heads):
        assert valid[head].tolist() == [True] * int(counts[head]) + [False] * (index.shape[1] - int(counts[head]))
        kept = index[head, : int(counts[head])].tolist()
        assert kept == sorted(set(kept)), "sorted and unique"
        assert all(0 <= i < view.length for i in kept)


def test_the_ragged_check_runs_and_catches_disorder():
    """Some bounded policy returns ragged selections on these views (so the branch above is exercised), and the
    check rejects a ragged selection whose head lists an index twice or out of order."""
    views = [make_view(6, layer=l, seed=l) for l in range(3)]
    for view in views:
        view.num_layers = 3
    ragged = [
        (name, keep)
        for name, cls in REGISTRY.items()
        if cls.bounded
        for keep in (4, 7, 12)
        if make_policy(name).compress(views, keep).valid is not None
    ]
    assert ragged, "no policy gave a ragged selection: the ragged branch would be dead"
    name, keep = ragged[0]
    selection = make_policy(name).compress(views, keep)
    index, valid = selection.indices[0].clone(), selection.valid[0]
    head = int(valid.sum(dim=1).argmax())
    index[head, 1] = index[head, 0]
    with pytest.raises(AssertionError, match="sorted and unique"):
        check_ragged(index, valid, keep, views[0])


def test_sliding_window_keeps_the_newest_tokens():
    view = make_view(5)
    index = make_policy("sliding-window").compress([view], 6).indices[0]
    assert index.tolist() == [list(range(14, 20))] * 2


def test_uniform_keeps_whole_frames_evenly_spaced():
    view = make_view(7)  # 7 frames of 4 tokens
    index = make_policy("uniform").compress([view], 12).indices[0]  # 3 frames
    kept_frames = view.frame[0][index[0]].unique().tolist()
    assert kept_frames == [0, 3, 6]
    assert (torch.bincount(view.frame[0][index[0]].long())[[0, 3, 6]] == 4).all()  # whole frames


def test_uniform_fills_a_partial_frame_with_the_newest_leftover_tokens():
    view = make_view(7)
    index = make_policy("uniform").compress([view], 14).indices[0]  # 3 whole frames + 2 tokens
    frames = view.frame[0][index[0]]
    assert set(frames.tolist()) == {0, 3, 5, 6}
    assert (frames == 5).sum() == 2  # newest tokens of the newest unchosen frame


def test_uniform_single_frame_keeps_the_newest():
    view = make_view(4)
    index = make_policy("uniform").compress([view], 4).indices[0]
    assert view.frame[0][index[0]].tolist() == [3, 3, 3, 3]


def test_top_k_sorted_breaks_ties_towards_newer_tokens():
    scores = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert top_k_sorted(scores, 2).tolist() == [[1, 2]]


@pytest.mark.parametrize("k", [1, 5, 37, 63, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_top_k_kernels_match_a_plain_sort(k, dtype):
    """numpy's selection on a CPU (top_k_indices, top_k_sum, top_k_mask) against each row sorted in Python."""
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 64, generator=g).to(dtype)
    order = torch.randperm(64, generator=g).repeat(6, 1)
    for row in range(6):
        values = scores[row].tolist()
        best = sorted(range(64), key=lambda j: values[j], reverse=True)[:k]
        worst = sorted(range(64), key=lambda j: values[j])[:k]
        assert sorted(top_k_indices(scores, k)[row].tolist()) == sorted(best)
        assert top_k_indices(scores, k, ordered=True)[row].tolist() == best  # best first
        assert sorted(top_k_indices(scores, k, largest=False)[row].tolist()) == sorted(worst)
        assert float(top_k_sum(scores, k)[row]) == pytest.approx(sum(values[j] for j in best), rel=1e-6, abs=1e-6)
        assert sorted(torch.nonzero(top_k_mask(scores, k, order)[row]).flatten().tolist()) == sorted(best)
    # In place (the caller's tensor reordered within its rows): the same sums, and the same values in each row.
    scratch = scores.clone()
    assert torch.equal(top_k_sum(scratch, k, overwrite=True), top_k_sum(scores, k))
    assert torch.equal(scratch.sort(dim=1).values, scores.sort(dim=1).values)
    # A count per row (a ragged selection): row r keeps its own best k_r.
    counts = torch.tensor([k, max(1, k // 2), 1, k, 0, min(64, k + 3)])
    ragged = top_k_mask(scores, counts, order)
    for row in range(6):
        values = scores[row].tolist()
        best = sorted(range(64), key=lambda j: values[j], reverse=True)[: int(counts[row])]
        assert sorted(torch.nonzero(ragged[row]).flatten().tolist()) == sorted(best)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.float64])
def test_top_k_values_and_arg_min_match_a_plain_loop(dtype):
    """The values path (numpy's sort on a CPU) over [2, 5, 16] rows with repeated entries, against each row sorted in
    Python; arg_min (numpy's on a CPU) against the first smallest entry of each row, ties included."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-6, 6, (2, 5, 16), generator=g).to(dtype)  # many equal entries
    for k in (1, 8, 16):
        values = top_k_values(x, k)
        assert values.shape == (2, 5, k)
        for a in range(2):
            for b in range(5):
                assert values[a, b].tolist() == sorted(x[a, b].tolist(), reverse=True)[:k]
    if dtype.is_floating_point:
        smallest = arg_min(x)
        for a in range(2):
            for b in range(5):
                row = x[a, b].tolist()
                assert int(smallest[a, b]) == row.index(min(row))


def test_top_k_mask_breaks_exact_ties_towards_newer_tokens_on_the_numpy_path():
    scores = torch.zeros(3, 40)  # every score tied: the newest k (largest order) must win
    order = torch.stack(
        [torch.arange(40), torch.arange(40).flip(0), torch.randperm(40, generator=torch.Generator().manual_seed(0))]
    )
    for k in (3, 30):  # the k-largest and the (L - k)-smallest paths
        mask = top_k_mask(scores, k, order)
        for row in range(3):
            newest = sorted(range(40), key=lambda j: int(order[row, j]), reverse=True)[:k]
            assert sorted(torch.nonzero(mask[row]).flatten().tolist()) == sorted(newest)


def test_frame_rank_ranks_each_head_among_its_own_frames():
    frame = torch.tensor([[3, 3, 8, 9], [1, 5, 5, 9]])
    rank, held = frame_rank(frame)
    assert rank.tolist() == [[0, 0, 1, 2], [0, 1, 1, 2]]
    assert held.tolist() == [3, 3]


@pytest.mark.parametrize("spread", [1, 3, 1000])  # 1000: ids wider than the bitmap's span, ranked by a sort
def test_frame_rank_of_a_compacted_memory_matches_a_plain_loop(spread):
    """A compacted memory holds its frames out of order: each head's rank is still the position of the token's frame
    among the distinct frames that head holds (a plain loop over sorted distinct ids says which)."""
    generator = torch.Generator().manual_seed(spread)
    frame = (torch.randint(0, 12, (3, 40), generator=generator) * spread + 500).to(torch.int32)
    frame[1] = frame[1].flip(0)
    rank, held = frame_rank(frame)
    assert rank.dtype == torch.long and held.dtype == torch.long
    for h in range(3):
        ids = sorted(set(frame[h].tolist()))
        assert rank[h].tolist() == [ids.index(f) for f in frame[h].tolist()]
        assert int(held[h]) == len(ids)


def test_unknown_policy_and_parameter_are_clear_errors():
    with pytest.raises(UnknownPolicyError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(PolicyParameterError, match="has no parameter"):
        make_policy("uniform", alpha=0.3)


@pytest.mark.parametrize(
    "name, params, kind, message",
    [
        ("nope", {}, UnknownPolicyError, "unknown policy 'nope'; choose one of: infinipot-v, cords"),
        ("uniform", {"alpha": 0.3}, PolicyParameterError, "policy 'uniform' has no parameter(s) alpha; it takes none"),
        (
            "infinipot-v",
            {"alpha": "abc"},
            PolicyParameterError,
            "infinipot-v's alpha takes a number (float), got 'abc'",
        ),
        ("infinipot-v", {"alpha": 1.5}, PolicyParameterError, "infinipot-v's alpha must be in [0, 1], got 1.5"),
        (
            "infinipot-v",
            {"recent_ratio": "0"},
            PolicyParameterError,
            "infinipot-v's recent_ratio must be in (0, 1], got 0",
        ),
        ("protokv", {"near_share": 1}, PolicyParameterError, "protokv's near_share must be in (0, 1), got 1"),
        ("protokv", {"spatial_rate": "nan"}, PolicyParameterError, "protokv's spatial_rate must be in [0, 1), got nan"),
        (
            "infinipot-v",
            {"tar": "sideways"},
            PolicyParameterError,
            "infinipot-v's tar must be one of patch, frame, reverse, got 'sideways'",
        ),
        ("cords", {"followers": "maybe"}, PolicyParameterError, "cords's followers takes true or false, got 'maybe'"),
        (
            "protokv",
            {"pseudo_tokens": 2.5},
            PolicyParameterError,
            "protokv's pseudo_tokens takes a number (int), got 2.5",
        ),
        ("hybridkv", {"chunk": 0}, PolicyParameterError, "hybridkv's chunk must be in [1, inf), got 0"),
        ("hybridkv", {"pool_kernel": 4}, PolicyParameterError, "hybridkv's pool_kernel must be odd"),
    ],
)
def test_each_bad_policy_input_raises_its_own_kind_in_one_line(name, params, kind, message):
    with pytest.raises(kind) as error:
        make_policy(name, **params)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert isinstance(error.value, UserError) and not isinstance(error.value, BudgetError)


def test_parameter_help_and_choices_come_from_the_dataclass_fields():
    for name, cls in REGISTRY.items():
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
        specs = policy_params(name)
        assert [spec.name for spec in specs] == list(fields)
        for spec in specs:
            metadata = fields[spec.name].metadata
            assert spec.help == metadata["help"] and spec.help, f"{name}.{spec.name} has no help text"
            assert spec.choices == tuple(metadata.get("choices", ()))
            assert (spec.kind == "choice") == bool(spec.choices)
            if spec.choices:
                assert spec.default in spec.choices


UI_AND_BENCH_FACTS = (
    "summary",
    "help",
    "choices",
    "view_titles",
    "reason_names",
    "benchmarks",
    "bench_variants",
    "synthesize_all",
)


def test_the_policy_classes_hold_no_ui_or_bench_facts_and_every_one_has_a_card():
    for name, cls in REGISTRY.items():
        assert [fact for fact in UI_AND_BENCH_FACTS if hasattr(cls, fact)] == [], name
        card = policy_card(name)
        assert card.summary and isinstance(card, PolicyCard)
    assert set(CARDS) == set(REGISTRY)


def test_the_policy_written_in_the_docs_runs_and_keeps_what_it_says():
    text = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    section = text[text.index("## Writing a policy") :]
    code = re.search(r"^```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE).group(1)
    namespace: dict = {"__name__": "docs_policies_example"}
    try:
        exec(compile(code, "docs/policies.md", "exec"), namespace)
        (name,) = [n for n in REGISTRY if n not in BUILT_IN]
        assert policy_card(name).reasons == {0: "large value"}
        assert [(s.name, s.kind, s.default) for s in policy_params(name)] == [("norm", "float", 2.0)]
        assert policy_params(name)[0].help.startswith("p of the value norm")
        # Two heads of five tokens; head 0's values have norms 1, 5, 2, 4, 3 and head 1's the reverse order.
        scale = torch.tensor([[1.0, 5, 2, 4, 3], [3.0, 4, 2, 5, 1]])
        values = scale[..., None] * torch.tensor([0.6, 0.8])  # ||(0.6, 0.8)|| = 1 in the L2 norm
        view = LayerSlice(
            0,
            1,
            torch.zeros(2, 5, 2),
            values,
            torch.zeros(2, 5, dtype=torch.long),
            torch.zeros(2, 5, dtype=torch.long),
            torch.arange(5).expand(2, -1),
            (1, 5),
            0,
        )
        selection = make_policy(name, norm="1").compress([view], 3)  # L1: 1.4 x the L2 norm, the same order
        assert selection.indices[0].tolist() == [[1, 3, 4], [0, 1, 3]]
        assert (selection.info["reason"][0] == 0).all()
        with pytest.raises(PolicyParameterError, match="takes a number"):
            make_policy(name, norm="loud")
        with pytest.raises(PolicyParameterError, match=re.escape("largest-values's norm must be in [1, inf], got 0.5")):
            make_policy(name, norm=0.5)
    finally:
        for registry in (REGISTRY, CARDS):
            for added in [n for n in registry if n not in BUILT_IN]:
                del registry[added]


BUILT_IN = tuple(REGISTRY)


def test_declared_intervals_hold_their_defaults_and_their_ends_follow_the_brackets():
    for name in REGISTRY:
        for spec in policy_params(name):
            if spec.within:
                assert make_policy(name, **{spec.name: spec.default}), (name, spec.name)
    assert make_policy("infinipot-v", alpha=0).alpha == 0 and make_policy("infinipot-v", alpha=1).alpha == 1
    assert make_policy("infinipot-v", recent_ratio=1).recent_ratio == 1
    for name, params in [("infinipot-v", {"recent_ratio": 0}), ("protokv", {"near_share": 0}), ("cords", {"eps": 0})]:
        with pytest.raises(PolicyParameterError, match="must be in"):
            make_policy(name, **params)
    with pytest.raises(ValueError, match="an interval is written like"):
        param(1.0, "a number", within="0..1")
