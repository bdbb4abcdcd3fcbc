"""CoRDS on hand-made frame sets (paper 002; DESIGN.md states the method in words)."""

import pytest
import torch

from kvdemo.coverage import coverage, nearest_retained_distances
from kvdemo.policies import BudgetError, LayerView, make_policy
from kvdemo.policies.cords import REASON_COVERAGE, REASON_FILL, REASON_RECENT, layer_schedule

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
    return LayerView(layer, num_layers, keys.expand(2, -1, -1).contiguous(), values.expand(2, -1, -1).contiguous(),
                     prov(token // P), prov((token % P) // COLS), prov(token % COLS), (ROWS, COLS), frames - 1)


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
    assert set(layer_schedule(28, "single", True)) == {0}
    assert len(set(layer_schedule(28, "all", False))) == 28
    with pytest.raises(BudgetError):
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


def test_coverage_of_full_is_zero_and_of_a_policy_is_positive(tiny, pancake):
    from kvdemo.engine import StreamEngine, stream_video

    full = StreamEngine(tiny, "full", fps=2.0)
    cords = StreamEngine(tiny, "cords", budget=540, keep=405, fps=2.0)
    list(stream_video(tiny, pancake, {"full": full, "cords": cords}))
    self_cover = nearest_retained_distances(full.memory, full.memory)
    assert all(float(d.max()) < 1e-5 for d in self_cover.values())
    distances = nearest_retained_distances(full.memory, cords.memory)
    n = tiny.num_layers * tiny.num_kv_heads * 1350
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
    assert main(["run", "--video", str(media / "flipping_a_pancake.mkv"), "--policy", "cords", "--budget", "540",
                 "--keep", "405", "--coverage", "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["coverage"]) == {"cords", "full"}
    assert report["coverage"]["full"]["joint"]["mean"] < 1e-5 < report["coverage"]["cords"]["joint"]["mean"]
