"""InfiniPot-V on hand-made tensors where the answer is known (paper 000, Sec. 3, App. A.1)."""

import pytest
import torch

from kvdemo.policies import BudgetError, LayerView, make_policy
from kvdemo.policies.infinipot_v import (
    REASON_RECENT,
    REASON_TAR,
    REASON_VAN,
    VARIANTS,
    calibrate_cv_thresholds,
    kernel_for_cv,
    pool_on_grid,
)

ROWS, COLS, DIM = 4, 4, 16
P = ROWS * COLS


def view_from(keys, values, frame, row, col, layer=0, num_layers=1):
    """keys/values [H, L, D]; provenance [H, L] or [L] (broadcast to heads)."""
    heads = keys.shape[0]
    as_heads = lambda x: torch.as_tensor(x).int().expand(heads, -1).contiguous()  # noqa: E731
    frame = as_heads(frame)
    return LayerView(layer, num_layers, keys, values, frame, as_heads(row), as_heads(col), (ROWS, COLS), int(frame.max()))


def whole_frames(frames: int):
    token = torch.arange(frames * P)
    return token // P, (token % P) // COLS, token % COLS


def static_scene(frames: int, heads: int = 2, seed: int = 0):
    """Every patch keeps one random key direction over time (a static background); values of equal norm.

    Keys are unit sign vectors (entries +-1/4), so cosines are exact and ties are real ties.
    """
    g = torch.Generator().manual_seed(seed)
    static = (torch.randint(0, 2, (heads, P, DIM), generator=g).float() * 2 - 1) / DIM**0.5
    keys = static[:, None].expand(heads, frames, P, DIM).clone()
    values = torch.ones(heads, frames, P, DIM)
    return static, keys, values


def flat(x):
    return x.reshape(x.shape[0], -1, x.shape[-1])


def kept_provenance(view, index, head=0):
    return set(zip(view.frame[head][index[head]].tolist(), view.row[head][index[head]].tolist(), view.col[head][index[head]].tolist()))


def test_tar_keeps_the_moving_patch_and_evicts_the_static_past():
    frames = 8
    static, keys, values = static_scene(frames)
    moving = [(t, 1 + t % 3, 2) for t in range(frames)]  # an object moving down column 2
    g = torch.Generator().manual_seed(1)
    for t, r, c in moving:
        keys[:, t, r * COLS + c] = torch.randn(2, DIM, generator=g)
    view = view_from(flat(keys), flat(values), *whole_frames(frames))
    policy = make_policy("infinipot-v", alpha=1.0)  # TaR only
    keep = 2 * P  # recent window (1 frame = 16) + 16 past picks
    index = policy.compress([view], keep).indices[0]
    kept = kept_provenance(view, index)
    past_moving = {m for m in moving if m[0] < frames - 1}
    assert past_moving <= kept, "every past position of the moving object is distinctive"
    assert {(frames - 1, r, c) for r in range(ROWS) for c in range(COLS)} <= kept, "recent frame kept whole"
    static_past_kept = [k for k in kept if k[0] < frames - 1 and k not in past_moving]
    # 16 TaR picks = 7 past moving tokens + 9 others; among the others the static ones score -1 (fully
    # redundant), so the picks are moving-object tokens or patches the object left (distinctive vs recent).
    assert len(static_past_kept) == 16 - len(past_moving)
    # The recent frame has the object at (2, 2): the past background there differs from it, so TaR keeps
    # every past static token of patch (2, 2). The rest are fully redundant (cosine 1): exact ties, which
    # go to the newest past frame.
    newest_row = 1 + (frames - 1) % 3
    left_behind = {(t, newest_row, 2) for t in range(frames - 1) if 1 + t % 3 != newest_row}
    assert left_behind <= kept
    assert {k[0] for k in set(static_past_kept) - left_behind} == {frames - 2}


def test_van_keeps_the_high_norm_values():
    frames = 4
    _, keys, values = static_scene(frames)
    strong = [(0, 0, 1), (1, 3, 3), (2, 2, 0)]
    for t, r, c in strong:
        values[:, t, r * COLS + c] *= 10
    view = view_from(flat(keys), flat(values), *whole_frames(frames))
    policy = make_policy("infinipot-v", alpha=0.0, van="plain")  # VaN only, no pooling
    index = policy.compress([view], 3).indices[0]
    assert kept_provenance(view, index) == set(strong)
    reverse = make_policy("infinipot-v", alpha=0.0, van="reverse").compress([view], 3).indices[0]
    assert not kept_provenance(view, reverse) & set(strong)


def test_smooth_layer_pools_with_7_and_spiky_layer_with_1():
    frames = 4
    _, keys, _ = static_scene(frames)
    y, x = torch.meshgrid(torch.arange(ROWS), torch.arange(COLS), indexing="ij")
    smooth = (10 + 0.2 * (y + x)).float().flatten()  # low CV
    spiky = torch.ones(P)
    spiky[5] = 40.0  # high CV
    views = []
    for layer, norm in enumerate((smooth, spiky)):
        values = norm.repeat(frames)[None, :, None].expand(2, -1, DIM) / DIM**0.5
        views.append(view_from(flat(keys), values.contiguous(), *whole_frames(frames), layer=layer, num_layers=2))
    selection = make_policy("infinipot-v").compress(views, 2 * P)  # thresholds calibrated on this pass
    assert selection.info["kernel"] == [7, 1]
    assert selection.info["cv"][0] < selection.info["cv"][1]
    fixed = make_policy("infinipot-v", cv_thresholds=[0.05, 0.2, 0.5]).compress(views, 2 * P)
    assert fixed.info["kernel"] == [7, 1]


def test_kernel_mapping_and_calibration():
    thresholds = (0.1, 0.2, 0.3)
    assert [kernel_for_cv(cv, thresholds) for cv in (0.05, 0.1, 0.25, 0.3, 2.0)] == [7, 5, 3, 1, 1]
    assert calibrate_cv_thresholds([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx((0.2, 0.3, 0.4))
    with pytest.raises(BudgetError, match="increasing"):
        make_policy("infinipot-v", cv_thresholds=[0.3, 0.2, 0.1])


def test_pooling_averages_over_the_neighbours_that_exist():
    # One frame, 4x4 grid; hold only three tokens: (0,0)=1, (0,1)=3, (3,3)=10.
    score = torch.tensor([[1.0, 3.0, 10.0]])
    rank = torch.zeros(1, 3, dtype=torch.long)
    pos = torch.tensor([[0, 1, 15]])
    pooled = pool_on_grid(score, rank, pos, (ROWS, COLS), 3)
    assert pooled.tolist() == [[2.0, 2.0, 10.0]]  # (3,3) has no held neighbour: it keeps its own value
    assert pool_on_grid(score, rank, pos, (ROWS, COLS), 1).tolist() == score.tolist()


@pytest.mark.parametrize("alpha, mode", [(0.0, "van"), (1.0, "tar")])
def test_alpha_extremes_reduce_to_one_criterion(alpha, mode):
    frames = 6
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g)
    view = view_from(keys, values, *whole_frames(frames))
    keep = 40
    selection = make_policy("infinipot-v", alpha=alpha, van="plain").compress([view], keep)
    index, reason = selection.indices[0], selection.info["reason"][0]
    if mode == "van":
        expected = torch.topk(values.norm(dim=-1), keep, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(index, expected)
        assert (reason == REASON_VAN).all()
    else:
        assert not (reason == REASON_VAN).any()
        assert (reason == REASON_RECENT).sum(dim=1).tolist() == [P, P]  # r = round(0.125 * 6) = 1 frame


def test_recent_frames_are_always_kept_even_when_they_exceed_the_tar_share():
    frames = 16
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g)
    view = view_from(keys, values, *whole_frames(frames))
    # r = round(0.125 * 16) = 2 frames = 32 tokens > alpha * C = 0.1 * 64
    selection = make_policy("infinipot-v", alpha=0.1).compress([view], 64)
    index = selection.indices[0]
    assert selection.info["recent_frames"] == [2]
    assert {(f, r, c) for f in (14, 15) for r in range(ROWS) for c in range(COLS)} <= kept_provenance(view, index)
    assert (selection.info["reason"][0] == REASON_RECENT).sum(dim=1).tolist() == [32, 32]


def test_keep_below_one_frame_takes_the_newest_frames_best_tokens():
    frames = 4
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g)
    view = view_from(keys, values, *whole_frames(frames))
    selection = make_policy("infinipot-v", van="plain").compress([view], 5)
    index = selection.indices[0]
    assert index.shape == (2, 5)
    assert (view.frame[0][index[0]] == frames - 1).all() and (view.frame[1][index[1]] == frames - 1).all()
    newest = values[:, -P:].norm(dim=-1)
    assert torch.equal(index - (frames - 1) * P, torch.topk(newest, 5, dim=-1).indices.sort(dim=-1).values)


def test_recent_window_shrinks_to_the_whole_frames_that_fit():
    frames = 32  # r = round(0.125 * 32) = 4 frames = 64 tokens, but C = 40 holds 2 whole frames
    g = torch.Generator().manual_seed(7)
    view = view_from(torch.randn(1, frames * P, DIM, generator=g), torch.rand(1, frames * P, DIM, generator=g), *whole_frames(frames))
    selection = make_policy("infinipot-v").compress([view], 40)
    assert selection.info["recent_frames"] == [2]
    assert {(f, r, c) for f in (30, 31) for r in range(ROWS) for c in range(COLS)} <= kept_provenance(view, selection.indices[0])


def test_heads_keep_different_tokens():
    frames = 6
    g = torch.Generator().manual_seed(8)
    view = view_from(torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames))
    index = make_policy("infinipot-v").compress([view], 48).indices[0]
    assert not torch.equal(index[0], index[1])


def test_reasons_report_why_each_token_was_kept():
    frames = 8
    g = torch.Generator().manual_seed(9)
    view = view_from(torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames))
    keep = 64
    selection = make_policy("infinipot-v").compress([view], keep)
    reason = selection.info["reason"][0]
    assert reason.shape == (2, keep)
    counts = [(reason == code).sum(dim=1).tolist() for code in (REASON_RECENT, REASON_TAR, REASON_VAN)]
    assert counts == [[16, 16], [16, 16], [32, 32]]  # r=1 frame; TaR share 0.5*64 = 32 incl. recent


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_table5_variant_runs_and_keeps_exactly_c(variant):
    frames = 8
    g = torch.Generator().manual_seed(10)
    view = view_from(torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames))
    index = make_policy("infinipot-v", **VARIANTS[variant]).compress([view], 50).indices[0]
    assert index.shape == (2, 50) and (index[:, 1:] > index[:, :-1]).all()


def test_frame_level_tar_keeps_whole_frames():
    frames = 8
    static, keys, values = static_scene(frames)
    keys[:, 2] = torch.nn.functional.normalize(torch.randn(2, P, DIM, generator=torch.Generator().manual_seed(3)), dim=-1)
    view = view_from(flat(keys), flat(values), *whole_frames(frames))
    index = make_policy("infinipot-v", alpha=1.0, tar="frame").compress([view], 2 * P).indices[0]
    assert set(view.frame[0][index[0]].tolist()) == {2, 7}  # the changed frame, and the recent one


# --- successive passes: provenance alignment vs the pseudo-frame reshape ------------------------------


def gather(view, index):
    g = lambda x: torch.gather(x, 1, index)  # noqa: E731
    gd = lambda x: torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
    return LayerView(0, 1, gd(view.keys), gd(view.values), g(view.frame), g(view.row), g(view.col), view.grid, view.newest_frame)


def append(view, keys, values, first_frame, frames):
    frame, row, col = whole_frames(frames)
    heads = view.keys.shape[0]
    cat = lambda a, b: torch.cat([a, torch.as_tensor(b).int().expand(heads, -1)], dim=1)  # noqa: E731
    return LayerView(0, 1, torch.cat([view.keys, keys], 1), torch.cat([view.values, values], 1),
                     cat(view.frame, frame + first_frame), cat(view.row, row), cat(view.col, col), view.grid, first_frame + frames - 1)


def pseudo_frame_tar(view, keep, recent_frames=1):
    """The reference implementation's reshape: cache position -> (pseudo frame, pseudo patch)."""
    heads, length, dim = view.keys.shape
    k = torch.nn.functional.normalize(view.keys, dim=-1).view(heads, length // P, P, dim)
    recent = k[:, -recent_frames:]
    score = (-torch.einsum("hfpd,hrpd->hfp", k, recent) / recent_frames).flatten(1)
    score[:, -recent_frames * P :] = 10.0
    ramp = torch.arange(length) * 1e-9
    return torch.topk(score + ramp, keep, dim=-1).indices.sort(dim=-1).values


def test_changed_patch_survives_successive_passes_only_with_provenance_alignment():
    """Patch (2, 3) of frame 0 takes the key patch (0, 0) has in every frame: distinctive at its own patch.
    After the first pass it is the oldest token held, so the pseudo-frame reshape puts it at pseudo-patch
    (0, 0) and compares it with the recent frames' patch (0, 0): a perfect copy, evicted."""
    static, keys, values = static_scene(16, heads=1, seed=11)
    changed = (0, 2, 3)
    keys[:, changed[0], changed[1] * COLS + changed[2]] = static[:, 0]
    first = view_from(flat(keys[:, :8]), flat(values[:, :8]), *whole_frames(8))
    ours, pseudo = first, first
    policy = make_policy("infinipot-v", alpha=1.0)
    survived = {"provenance": [], "pseudo": []}
    next_frame = 8
    for _ in range(3):
        ours = gather(ours, policy.compress([ours], 6 * P).indices[0])
        pseudo = gather(pseudo, pseudo_frame_tar(pseudo, 6 * P))
        for name, view in (("provenance", ours), ("pseudo", pseudo)):
            survived[name].append(changed in kept_provenance(view, torch.arange(view.length)[None]))
        new_keys, new_values = flat(keys[:, next_frame : next_frame + 2]), flat(values[:, next_frame : next_frame + 2])
        ours = append(ours, new_keys, new_values, next_frame, 2)
        pseudo = append(pseudo, new_keys, new_values, next_frame, 2)
        next_frame += 2
    assert survived["provenance"] == [True, True, True]
    assert survived["pseudo"][0] and not all(survived["pseudo"]), survived


def test_bfloat16_cache_selects_like_float32():
    frames = 8
    static, keys, values = static_scene(frames)
    g = torch.Generator().manual_seed(12)
    for t in range(frames):
        keys[:, t, (1 + t % 3) * COLS + 2] = torch.randn(2, DIM, generator=g)
    values = values * (1 + torch.rand(values.shape, generator=g))
    view32 = view_from(flat(keys), flat(values), *whole_frames(frames))
    view16 = view_from(flat(keys).bfloat16(), flat(values).bfloat16(), *whole_frames(frames))
    policy = make_policy("infinipot-v", alpha=1.0)
    assert torch.equal(policy.compress([view32], 2 * P).indices[0], policy.compress([view16], 2 * P).indices[0])
