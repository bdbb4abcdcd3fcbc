"""CoRDS on hand-made frame sets (paper 002; DESIGN.md states the method in words)."""

import math

import pytest
import torch

from kvdemo.analysis.coverage import coverage, coverage_summary, nearest_retained_cosine, nearest_retained_distances
from kvdemo.policies import LayerSlice, PolicyParameterError, make_policy, policy_params
from kvdemo.policies.cords import REASON_COVERAGE, REASON_FILL, REASON_RECENT, REASON_UNCOMPRESSED, layer_schedule

ROWS, COLS, DIM = 2, 2, 8
P = ROWS * COLS


def frames_view(key_centroids, value_centroids, noise=0.0, layer=0, num_layers=1, seed=0):
    """One frame per centroid (P tokens each = the centroid + noise); two heads with the same data."""
    g = torch.Generator().manual_seed(seed)
    k = torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in key_centroids])  # [F, D]
    v = torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in value_centroids])
    frames = k.shape[0]
    keys = k.repeat_interleave(P, 0) + noise * torch.randn(frames * P, DIM, generator=g)
    values = v.repeat_interleave(P, 0) + noise * torch.randn(frames * P, DIM, generator=g)
    token = torch.arange(frames * P)
    prov = lambda x: x.int().expand(2, -1).contiguous()  # noqa: E731
    return LayerSlice(
        layer=layer,
        num_layers=num_layers,
        keys=keys.expand(2, -1, -1).contiguous(),
        values=values.expand(2, -1, -1).contiguous(),
        frame=prov(token // P),
        row=prov((token % P) // COLS),
        col=prov(token % COLS),
        grid=(ROWS, COLS),
        newest_frame=frames - 1,
    )


def e(i, scale=1.0):
    x = torch.zeros(DIM)
    x[i] = scale
    return x


def first_picks(policy, view, keep):
    return policy.compress([view], keep).info["pick_order"][0][0].tolist()


def test_the_outlier_frame_is_picked_first():
    # 7 frames clustered around e0, one outlier along e5; the newest frame (recent tail) is in the cluster.
    keys = [e(0) + 0.01 * e(1, i) for i in range(7)] + [e(0)]
    keys[3] = e(5, 3.0)
    policy = make_policy("cords")
    picks = first_picks(policy, frames_view(keys, keys, noise=0.01), keep=3 * P)
    assert picks[0] == 3


def test_a_duplicate_direction_loses_to_a_new_direction_once_the_bonus_is_on():
    recent = e(0)
    duplicate = e(0, 4.0)  # same direction as the recent frame, far in distance, no new direction
    new = e(3, 2.5)  # a new direction, slightly less far (squared distance 7.25 vs 9)
    near = e(0, 1.2)  # close to the recent frame: spreads the min-max range
    frames = [duplicate, new, near, recent]
    view = frames_view(frames, frames)
    assert first_picks(make_policy("cords", bonus=0.0), view, keep=2 * P)[0] == 0
    assert first_picks(make_policy("cords", bonus=0.25), view, keep=2 * P)[0] == 1


@pytest.mark.parametrize("beta, expected", [(1.0, 0), (0.0, 1)])
def test_beta_one_selects_by_keys_and_zero_by_values(beta, expected):
    base = e(0)
    keys = [e(2, 5.0), base, base, base]  # frame 0 is far in key space
    values = [base, e(4, 5.0), base, base]  # frame 1 is far in value space
    policy = make_policy("cords", beta=beta, bonus=0.0)
    assert first_picks(policy, frames_view(keys, values), keep=2 * P)[0] == expected


def test_followers_hold_exactly_their_anchors_indices_and_every_layer_keeps_c():
    g = torch.Generator().manual_seed(2)
    views = []
    for layer in range(8):
        keys = [torch.randn(DIM, generator=g) for _ in range(10)]
        values = [torch.randn(DIM, generator=g) for _ in range(10)]
        views.append(frames_view(keys, values, noise=0.1, layer=layer, num_layers=8, seed=layer))
    keep = 5 * P + 2
    selection = make_policy("cords").compress(views, keep)
    source = selection.info["source_layer"]
    assert source == [0, 0, 0, 0, 0, 0, 0, 0]  # bottom 25% of 8 layers = layers 0-1; anchor 0
    everything = make_policy("cords", layers="all").compress(views, keep)
    assert everything.info["source_layer"] == [0, 0, 2, 2, 4, 4, 6, 6]
    for layer, anchor in enumerate(everything.info["source_layer"]):
        assert torch.equal(everything.indices[layer], everything.indices[anchor])
    assert not torch.equal(everything.indices[0], everything.indices[2])
    for index in selection.indices + everything.indices:
        assert index.shape == (2, keep)


def test_layer_schedules_match_the_paper():
    assert sorted(set(layer_schedule(28, "bottom25", True))) == [0, 2, 4]
    schedule = layer_schedule(28, "bottom25", True)
    assert schedule[:7] == [0, 0, 2, 2, 4, 4, 4] and set(schedule[7:]) == {4}
    assert layer_schedule(28, "bottom25", False)[:8] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert len(set(layer_schedule(28, "all", False))) == 28
    assert layer_schedule(28, "bottom25", True, above="keep") == [0, 0, 2, 2, 4, 4, 4] + [None] * 21
    with pytest.raises(PolicyParameterError):
        make_policy("cords", layers="top")


def test_partial_frame_fills_the_remainder_with_its_farthest_tokens():
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(DIM, generator=g) for _ in range(8)]
    view = frames_view(keys, keys, noise=0.05)
    policy = make_policy("cords")
    keep = 3 * P + 1  # recent frame (P) + 2 whole frames + 1 token
    selection = policy.compress([view], keep)
    index, reason = selection.indices[0], selection.info["reason"][0]
    assert index.shape == (2, keep)
    counts = [(reason == code).sum(dim=1).tolist() for code in (REASON_RECENT, REASON_COVERAGE, REASON_FILL)]
    assert counts == [[P, P], [2 * P, 2 * P], [1, 1]]
    picks = selection.info["pick_order"][0][0].tolist()
    partial_frame = picks[2]
    filled = index[0][reason[0] == REASON_FILL]
    assert view.frame[0][filled].tolist() == [partial_frame]
    # the kept token of the partial frame is its farthest from the selected frames' centroids
    chosen = {7, picks[0], picks[1]}
    k, v = policy._scaled(view.keys, view.values)
    centroids = torch.stack([k[0, f * P : (f + 1) * P].mean(0) for f in sorted(chosen)])
    vcentroids = torch.stack([v[0, f * P : (f + 1) * P].mean(0) for f in sorted(chosen)])
    tokens = torch.arange(partial_frame * P, (partial_frame + 1) * P)
    d = 0.25 * torch.cdist(k[0, tokens], centroids).square() + 0.75 * torch.cdist(v[0, tokens], vcentroids).square()
    assert filled.item() == tokens[d.min(dim=1).values.argmax()].item()


def test_recent_tail_is_always_kept():
    g = torch.Generator().manual_seed(4)
    keys = [torch.randn(DIM, generator=g) for _ in range(16)]  # r = round(0.125 * 16) = 2 frames
    selection = make_policy("cords").compress([frames_view(keys, keys)], 6 * P)
    index = selection.indices[0]
    frames = frames_view(keys, keys).frame[0][index[0]]
    assert (frames == 14).sum() == P and (frames == 15).sum() == P


def test_coverage_of_full_is_zero_and_of_a_policy_is_positive(tiny_random, pancake):
    from kvdemo.stream.engine import StreamEngine
    from kvdemo.stream.streaming import stream_video

    full = StreamEngine(tiny_random, "full", fps=2.0)
    cords = StreamEngine(tiny_random, "cords", budget=540, keep=405, fps=2.0)
    list(stream_video(tiny_random, pancake, {"full": full, "cords": cords}))
    self_cover = nearest_retained_distances(full.memory, full.memory)
    assert all(float(d.max()) < 1e-5 for d in self_cover.values())
    distances = nearest_retained_distances(full.memory, cords.memory)
    n = tiny_random.num_layers * tiny_random.num_kv_heads * 1350
    assert all(d.shape == (n,) for d in distances.values())
    assert float(distances["joint"].mean()) > 0
    summary = coverage(full.memory, cords.memory)
    assert 0 < summary["joint"]["cdf_at"]["0.1"] < 1
    with pytest.raises(ValueError, match="compressed"):
        nearest_retained_distances(cords.memory, full.memory)


def test_cli_coverage_compares_with_full(media, tmp_path):
    import json

    from kvdemo.cli import main

    out = tmp_path / "r.json"
    assert (
        main(
            [
                "run",
                "--video",
                str(media / "flipping_a_pancake.mkv"),
                "--policy",
                "cords",
                "--budget",
                "540",
                "--keep",
                "405",
                "--max-pixels",
                "200704",
                "--coverage",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["coverage"]) == {"cords", "full"}
    assert report["coverage"]["full"]["joint"]["mean"] < 1e-5 < report["coverage"]["cords"]["joint"]["mean"]


# --- the formulas, pinned: hand-worked frame sets and a plain-Python restatement ---------------------
#
# In every hand-worked case below the frames are exact (noise 0, so a frame's centroid is its vector) and
# the recent tail is the last frame(s). ``d`` is the bicriteria squared distance after kvdemo's per-head
# scaling, ``o`` the orthogonal bonus ``gamma (1 - max cos_K) + (1 - gamma) (1 - max cos_V)``; both are
# min-max normalised over the remaining candidates and the score is ``norm(d) + 0.25 norm(o)``.


def test_d2_takes_the_minimum_over_the_selected_set_not_the_mean():
    """Seed = two recent frames on a line, R1 at x=0 and R2 at x=10 (plus a constant e1 component).
    A at x=5: min d = 25, mean d = 25.  B at x=-4: min d = 16, mean d = (16 + 196) / 2 = 106.
    Bonus: A is almost parallel to R2 (o ~ 0.005), B's best cosine is 1/sqrt(17) (o ~ 0.76).
    D2 (min): A = 1 + 0 = 1 > B = 0 + 0.25.  A mean would give B = 1.25 > A = 0."""
    r1, r2, a, b = e(1), e(0, 10.0) + e(1), e(0, 5.0) + e(1), e(0, -4.0) + e(1)
    frames = [a, b, r1, r2]
    view = frames_view(frames, frames)
    policy = make_policy("cords", recent_ratio=0.5)  # r = round(0.5 * 4) = 2 recent frames
    assert first_picks(policy, view, keep=3 * P) == [0]


def test_distances_are_squared():
    """Keys: R = 0, X = e2, Y = 0; values: R = e0, X = e0, Y = e0 + e1. Scaling: keys' mean squared norm
    is 1/3, values' is 4/3, so X's key distance is 1 / (1/3) = 3 and Y's value distance 1 / (4/3) = 3/4.
    Squared (bonus off): X = 0.25 * 3 = 0.75 > Y = 0.75 * 0.75 = 0.5625.
    Plain distances would give X = 0.25 * sqrt(3) = 0.43 < Y = 0.75 * sqrt(3/4) = 0.65."""
    keys = [e(2), torch.zeros(DIM), torch.zeros(DIM)]
    values = [e(0), e(0) + e(1), e(0)]
    assert first_picks(make_policy("cords", bonus=0.0), frames_view(keys, values), keep=2 * P) == [0]


def test_keys_much_larger_than_values_are_scaled_before_beta_weighs_them():
    """Keys 1000x larger than values. Keys: R = K e0, X = K (e0 + e1), Y = K e0; values: R = e0,
    X = e0, Y = e0 + e1. Both spaces scale to the same shape, so X's key distance = Y's value distance
    = 1 / (4/3) = 0.75, and beta = 0.25 favours the value-side novelty: Y (0.5625 > 0.1875; the bonus
    agrees, 0.75 vs 0.25 of 1 - cos 45 deg). Without the scaling X's raw key distance (1e6) decides."""
    big = 1000.0
    keys = [e(0, big) + e(1, big), e(0, big), e(0, big)]
    values = [e(0), e(0) + e(1), e(0)]
    assert first_picks(make_policy("cords"), frames_view(keys, values), keep=2 * P) == [1]


def test_orthogonal_bonus_is_one_minus_the_largest_cosine():
    """Seed R = e0. X = -e0 (anti-parallel, d = 4), Y = sqrt(3) e1 (orthogonal, d = 1 + 3 = 4), Z = 1.1 e0
    (d = 0.01, spreads the distance range). norm(d): X = Y = 1, Z = 0.
    1 - max cos: X = 2, Y = 1, Z = 0 -> norm 1, 0.5, 0 -> X = 1.25 > Y = 1.125: X first.
    (1 - cos^2 would give X = 0, Y = 1: Y first.)"""
    frames = [-e(0), e(1, math.sqrt(3.0)), e(0, 1.1), e(0)]
    assert first_picks(make_policy("cords"), frames_view(frames, frames), keep=2 * P) == [0]


def test_min_max_runs_over_the_remaining_candidates_only():
    """Seed R = e0. X = 2 e0 (d = 1, same direction: o = 0), Y = e0 + sqrt(0.9) e1 (d = 0.9, o > 0).
    Over the candidates: X = 1 + 0 = 1 > Y = 0 + 0.25: X first. Over every frame (R has d = o = 0)
    Y would score 0.9 + 0.25 = 1.15 > X = 1."""
    frames = [e(0, 2.0), e(0) + e(1, math.sqrt(0.9)), e(0)]
    assert first_picks(make_policy("cords"), frames_view(frames, frames), keep=2 * P) == [0]


def _scaled_rows(rows):
    """kvdemo's per-head scaling: divide by sqrt(mean squared norm) over every token."""
    scale = math.sqrt(sum(sum(x * x for x in row) for row in rows) / len(rows))
    return [[x / scale for x in row] for row in rows]


def _sq(a, b):
    return sum((x - y) ** 2 for x, y in zip(a, b))


def _cos(a, b):
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / (max(na, 1e-12) * max(nb, 1e-12))


def _mean_rows(rows):
    return [sum(column) / len(rows) for column in zip(*rows)]


def reference_cords(keys, values, frame, keep, beta=0.25, gamma=0.25, bonus=0.25, eps=1e-6, recent_ratio=0.125):
    """CoRDS for one head, restated with Python loops from DESIGN.md and the docstring's own rules.

    ``keys``/``values``: one list of floats per token; ``frame``: the token's frame id.
    Returns (frames picked in order, the set of kept token indices).
    """
    k, v = _scaled_rows(keys), _scaled_rows(values)
    frames = sorted(set(frame))
    tokens = {f: [i for i, fi in enumerate(frame) if fi == f] for f in frames}
    r = min(max(1, round(recent_ratio * len(frame) / P)), max(1, keep // P))
    recent = frames[-r:]
    kc = {f: _mean_rows([k[i] for i in tokens[f]]) for f in frames}
    vc = {f: _mean_rows([v[i] for i in tokens[f]]) for f in frames}

    def d(a, b):
        return beta * _sq(kc[a], kc[b]) + (1 - beta) * _sq(vc[a], vc[b])

    selected, candidates, picks = list(recent), [f for f in frames if f not in recent], []
    budget = keep - sum(len(tokens[f]) for f in recent)
    taken = 0
    while candidates and taken < budget:
        dist = {c: min(d(c, s) for s in selected) for c in candidates}
        orth = {
            c: gamma * (1 - max(_cos(kc[c], kc[s]) for s in selected))
            + (1 - gamma) * (1 - max(_cos(vc[c], vc[s]) for s in selected))
            for c in candidates
        }

        def norm(x):
            low, high = min(x.values()), max(x.values())
            return {c: (x[c] - low) / (high - low + eps) for c in x}

        nd, no = norm(dist), norm(orth)
        best = max(candidates, key=lambda c: (nd[c] + bonus * no[c], -c))
        picks.append(best)
        selected.append(best)
        candidates.remove(best)
        taken += len(tokens[best])

    kept = [i for f in recent for i in tokens[f]]
    whole = list(recent)
    for f in picks:
        if len(kept) + len(tokens[f]) <= keep:
            kept += tokens[f]
            whole.append(f)
        else:  # the partial frame: its tokens farthest from every selected frame's centroid

            def token_distance(i):
                return min(beta * _sq(k[i], kc[s]) + (1 - beta) * _sq(v[i], vc[s]) for s in whole)

            kept += sorted(tokens[f], key=token_distance, reverse=True)[: keep - len(kept)]
            break
    return picks, set(kept)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_equals_a_plain_loop_restatement(seed):
    """14 frames of clustered keys 50x larger than the values: r = round(0.125 * 14) = 2 recent frames,
    keep = 7.5 frames, so the last pick is a partial frame. The slots are shuffled per head (the memory
    compacts in place, so slots are not in stream order; ``order`` gives each token's arrival)."""
    g = torch.Generator().manual_seed(seed)
    frames, heads = 14, 2
    cluster = torch.randn(heads, 3, DIM, generator=g)
    which = torch.randint(0, 3, (heads, frames), generator=g)
    key_c = 50 * (
        torch.gather(cluster, 1, which[..., None].expand(-1, -1, DIM))
        + 0.6 * torch.randn(heads, frames, DIM, generator=g)
    )
    value_c = torch.randn(heads, frames, DIM, generator=g)
    keys = key_c.repeat_interleave(P, 1) + 20 * torch.randn(heads, frames * P, DIM, generator=g)
    values = value_c.repeat_interleave(P, 1) + 0.4 * torch.randn(heads, frames * P, DIM, generator=g)
    token = torch.arange(frames * P)
    slot = torch.stack([torch.randperm(frames * P, generator=g) for _ in range(heads)])  # slot -> token
    at3 = lambda x: torch.gather(x, 1, slot[..., None].expand(-1, -1, DIM))  # noqa: E731
    view = LayerSlice(
        layer=0,
        num_layers=1,
        keys=at3(keys),
        values=at3(values),
        frame=(slot // P).int(),
        row=((slot % P) // COLS).int(),
        col=(slot % COLS).int(),
        grid=(ROWS, COLS),
        newest_frame=frames - 1,
        order=slot,
    )
    keep = 7 * P + 2
    selection = make_policy("cords").compress([view], keep)
    for head in range(heads):
        picks, kept = reference_cords(keys[head].tolist(), values[head].tolist(), (token // P).tolist(), keep)
        assert selection.info["pick_order"][0][head].tolist() == picks  # frame ranks = frame ids here
        assert set(slot[head][selection.indices[0][head]].tolist()) == kept


def test_defaults_are_the_documented_ones():
    defaults = {spec.name: spec.default for spec in policy_params("cords")}
    assert defaults == {
        "beta": 0.25,
        "gamma": 0.25,
        "bonus": 0.25,
        "eps": 1e-6,
        "recent_ratio": 0.125,
        "layers": "bottom25",
        "followers": True,
        "above": "reuse",
        "single_depth": 0.5,
    }
    kinds = {spec.name: spec.kind for spec in policy_params("cords")}
    assert kinds["above"] == "choice" and kinds["single_depth"] == "float"


def test_single_layer_defaults_to_the_middle_layer_and_is_a_parameter():
    assert set(layer_schedule(28, "single", True)) == {14}  # the paper's "Layer 14 only (single mid)"
    assert set(layer_schedule(28, "single", True, single_depth=0.0)) == {0}
    assert set(layer_schedule(36, "single", False, single_depth=0.5)) == {18}
    assert set(layer_schedule(28, "single", True, single_depth=1.0)) == {27}
    assert layer_schedule(28, "single", True, above="keep") == [None] * 14 + [14] + [None] * 13
    with pytest.raises(PolicyParameterError, match="single_depth"):
        make_policy("cords", single_depth=1.5)


def test_above_keep_leaves_layers_outside_the_active_set_uncompressed():
    g = torch.Generator().manual_seed(5)
    views = []
    for layer in range(4):
        keys = [torch.randn(DIM, generator=g) for _ in range(8)]
        views.append(frames_view(keys, keys, noise=0.1, layer=layer, num_layers=4, seed=layer))
    keep = 3 * P
    reuse = make_policy("cords").compress(views, keep)  # bottom 25% of 4 layers = layer 0
    kept = make_policy("cords", above="keep").compress(views, keep)
    assert reuse.info["uncompressed_layers"] == [] and kept.info["uncompressed_layers"] == [1, 2, 3]
    assert kept.info["source_layer"] == [0, None, None, None]
    assert torch.equal(kept.indices[0], reuse.indices[0])
    for layer in (1, 2, 3):
        assert torch.equal(reuse.indices[layer], reuse.indices[0])
        assert torch.equal(kept.indices[layer], torch.arange(8 * P).expand(2, -1))  # every token stays
        assert (kept.info["reason"][layer] == REASON_UNCOMPRESSED).all()
    with pytest.raises(PolicyParameterError, match="above"):
        make_policy("cords", above="drop")


def test_above_keep_through_the_engine_keeps_every_token_above_the_active_set(tiny_random, small_video):
    """6 temporal grids of 4 x 6 tokens; bottom 25% of the tiny model's layers = layer 0 only. Layer 0 stays
    under M; the other layers hold the whole stream (the documented price of ``above=keep``)."""
    from kvdemo.stream.engine import StreamEngine
    from kvdemo.stream.streaming import stream_video

    engine = StreamEngine(tiny_random, "cords", budget=72, keep=48, fps=2.0, policy_params={"above": "keep"})
    list(stream_video(tiny_random, small_video, {"cords": engine}))
    rows, cols = engine.memory.grid_shape
    assert (engine.memory.num_grids, rows, cols) == (6, 4, 6)
    assert engine.last_selection_info["uncompressed_layers"] == list(range(1, tiny_random.num_layers))
    assert engine.memory.frame[0].shape[1] <= 72
    everything = {(g, r, c) for g in range(engine.memory.num_grids) for r in range(rows) for c in range(cols)}
    for layer in range(1, tiny_random.num_layers):
        for head in range(tiny_random.num_kv_heads):
            held = zip(*(t[layer][head].tolist() for t in (engine.memory.frame, engine.memory.row, engine.memory.col)))
            assert set(held) == everything


# --- coverage CDF (Sec. 4.6) ---------------------------------------------------------------------------


def test_coverage_distances_and_cdf_on_a_hand_worked_cache():
    """One head, 4 tokens in 2-D, tokens 0 and 1 retained.
    keys   k0 = (1, 0), k1 = (0, 1), k2 = (1, 0), k3 = (1, 1)
    values v0 = (1, 0), v1 = (0, 1), v2 = (0, 1), v3 = (-1, 0)
    key:   1 - max cos -> 0, 0, 0, 1 - 1/sqrt(2)
    value: 0, 0, 0 (v2 = v1), 1 - max(-1, 0) = 1
    joint: 1 - max_j (cos_K + cos_V) / 2 -> 0, 0, 1 - max((1 + 0)/2, (0 + 1)/2) = 0.5,
           1 - max((1/sqrt(2) - 1)/2, (1/sqrt(2) + 0)/2) = 1 - 1/(2 sqrt(2))
    (token 2 is covered in each space alone, but by two different tokens: joint distance 0.5)."""
    keys = torch.tensor([[[1.0, 0], [0, 1], [1, 0], [1, 1]]])
    values = torch.tensor([[[1.0, 0], [0, 1], [0, 1], [-1, 0]]])
    d = nearest_retained_cosine(keys, values, torch.tensor([[0, 1]]))
    root = math.sqrt(2.0)
    torch.testing.assert_close(d["key"], torch.tensor([0, 0, 0, 1 - 1 / root]))
    torch.testing.assert_close(d["value"], torch.tensor([0.0, 0, 0, 1]))
    torch.testing.assert_close(d["joint"], torch.tensor([0, 0, 0.5, 1 - 1 / (2 * root)]))
    summary = coverage_summary(d)
    # CDF(t) = fraction of tokens within distance t of a retained token (0.5 <= 0.5 counts; 1 - 1/sqrt(2) = 0.29).
    assert summary["joint"]["cdf_at"] == pytest.approx({"0.05": 0.5, "0.1": 0.5, "0.2": 0.5, "0.3": 0.5, "0.5": 0.75})
    assert summary["key"]["cdf_at"] == pytest.approx({"0.05": 0.75, "0.1": 0.75, "0.2": 0.75, "0.3": 1.0, "0.5": 1.0})
    assert summary["value"]["cdf_at"]["0.5"] == pytest.approx(0.75)
    assert summary["joint"]["mean"] == pytest.approx((0.5 + 1 - 1 / (2 * root)) / 4)
    curve = summary["joint"]["curve"]
    assert curve["fraction"][0] == 0 and curve["fraction"][-1] == 1
    assert curve["distance"][0] == pytest.approx(0) and curve["distance"][-1] == pytest.approx(1 - 1 / (2 * root))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_are_scaled_to_unit_mean_squared_norm_across_blocks(monkeypatch, dtype):
    """Blocks of 7 tokens (a length of 30 ends in a partial block): every head's scaled keys and values have mean
    squared norm 1 and point as the cache's do, in float32, the numbers of widening, squaring and dividing whole."""
    import kvdemo.policies.cords as cords

    monkeypatch.setattr(cords, "SCALE_BLOCK", 7)
    generator = torch.Generator().manual_seed(2)
    keys = (torch.randn(3, 30, 8, generator=generator) * torch.tensor([1.0, 5.0, 0.1])[:, None, None]).to(dtype)
    values = (torch.randn(3, 30, 8, generator=generator) * 40).to(dtype)
    for x, scaled in zip((keys, values), cords.CoRDS._scaled(keys, values)):
        assert scaled.dtype == torch.float32
        wide = x.double()
        expected = wide / wide.square().sum(-1).mean(-1).sqrt()[:, None, None]
        torch.testing.assert_close(scaled.double(), expected, rtol=1e-6, atol=0)
        whole = x.float() / x.float().square().sum(-1).mean(-1).clamp_min(1e-12).sqrt()[:, None, None]
        assert torch.equal(scaled, whole)
