"""InfiniPot-V on hand-made tensors where the answer is known (paper 000, Sec. 3, App. A.1)."""

import math

import pytest
import torch

from kvdemo.policies import LayerSlice, PolicyParameterError, make_policy, policy_params
from kvdemo.policies.grid import pool_on_grid
from kvdemo.policies.infinipot_v import (
    REASON_RECENT,
    REASON_TAR,
    REASON_VAN,
    VARIANTS,
    calibrate_cv_thresholds,
    kernel_for_cv,
)

ROWS, COLS, DIM = 4, 4, 16
P = ROWS * COLS


def view_from(keys, values, frame, row, col, layer=0, num_layers=1, grid=(ROWS, COLS)):
    """keys/values [H, L, D]; provenance [H, L] or [L] (broadcast to heads)."""
    heads = keys.shape[0]
    as_heads = lambda x: torch.as_tensor(x).int().expand(heads, -1).contiguous()  # noqa: E731
    frame = as_heads(frame)
    return LayerSlice(
        layer=layer,
        num_layers=num_layers,
        keys=keys,
        values=values,
        frame=frame,
        row=as_heads(row),
        col=as_heads(col),
        grid=grid,
        newest_frame=int(frame.max()),
    )


def whole_frames(frames: int, grid=(ROWS, COLS), first: int = 0):
    rows, cols = grid
    token = torch.arange(frames * rows * cols)
    return first + token // (rows * cols), (token % (rows * cols)) // cols, token % cols


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
    return set(
        zip(
            view.frame[head][index[head]].tolist(),
            view.row[head][index[head]].tolist(),
            view.col[head][index[head]].tolist(),
        )
    )


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
    with pytest.raises(PolicyParameterError, match="increasing"):
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
    view = view_from(
        torch.randn(1, frames * P, DIM, generator=g), torch.rand(1, frames * P, DIM, generator=g), *whole_frames(frames)
    )
    selection = make_policy("infinipot-v").compress([view], 40)
    assert selection.info["recent_frames"] == [2]
    assert {(f, r, c) for f in (30, 31) for r in range(ROWS) for c in range(COLS)} <= kept_provenance(
        view, selection.indices[0]
    )


def test_heads_keep_different_tokens():
    frames = 6
    g = torch.Generator().manual_seed(8)
    view = view_from(
        torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames)
    )
    index = make_policy("infinipot-v").compress([view], 48).indices[0]
    assert not torch.equal(index[0], index[1])


def test_reasons_report_why_each_token_was_kept():
    frames = 8
    g = torch.Generator().manual_seed(9)
    view = view_from(
        torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames)
    )
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
    view = view_from(
        torch.randn(2, frames * P, DIM, generator=g), torch.rand(2, frames * P, DIM, generator=g), *whole_frames(frames)
    )
    index = make_policy("infinipot-v", **VARIANTS[variant]).compress([view], 50).indices[0]
    assert index.shape == (2, 50) and (index[:, 1:] > index[:, :-1]).all()


def test_frame_level_tar_keeps_whole_frames():
    frames = 8
    static, keys, values = static_scene(frames)
    keys[:, 2] = torch.nn.functional.normalize(
        torch.randn(2, P, DIM, generator=torch.Generator().manual_seed(3)), dim=-1
    )
    view = view_from(flat(keys), flat(values), *whole_frames(frames))
    index = make_policy("infinipot-v", alpha=1.0, tar="frame").compress([view], 2 * P).indices[0]
    assert set(view.frame[0][index[0]].tolist()) == {2, 7}  # the changed frame, and the recent one


# --- successive passes: provenance alignment vs the pseudo-frame reshape ------------------------------


def gather(view, index):
    """What the memory does with a selection: keys, values, provenance and arrival order gathered alike.
    ``index [H, n]`` need not be sorted (a shuffle leaves the slots out of stream order, as the memory's
    in-place compaction does)."""
    g = lambda x: torch.gather(x, 1, index)  # noqa: E731
    gd = lambda x: torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
    return LayerSlice(
        layer=view.layer,
        num_layers=view.num_layers,
        keys=gd(view.keys),
        values=gd(view.values),
        frame=g(view.frame),
        row=g(view.row),
        col=g(view.col),
        grid=view.grid,
        newest_frame=view.newest_frame,
        order=g(view.order),
    )


def shuffle(view, generator):
    """The same tokens in a different slot order per head."""
    heads, length = view.frame.shape
    return gather(view, torch.stack([torch.randperm(length, generator=generator) for _ in range(heads)]))


def append(view, keys, values, first_frame, frames):
    """``frames`` whole new frames (keys/values ``[H, frames * p, D]``) after what ``view`` holds."""
    frame, row, col = whole_frames(frames, view.grid, first_frame)
    heads = view.keys.shape[0]
    cat = lambda a, b: torch.cat([a, torch.as_tensor(b).int().expand(heads, -1)], dim=1)  # noqa: E731
    arrivals = int(view.order.max()) + 1 + torch.arange(frame.shape[0]).expand(heads, -1)
    return LayerSlice(
        layer=view.layer,
        num_layers=view.num_layers,
        keys=torch.cat([view.keys, keys], 1),
        values=torch.cat([view.values, values], 1),
        frame=cat(view.frame, frame),
        row=cat(view.row, row),
        col=cat(view.col, col),
        grid=view.grid,
        newest_frame=first_frame + frames - 1,
        order=torch.cat([view.order, arrivals], 1),
    )


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


# --- the formulas, pinned: hand-worked non-square grids and a plain-loop restatement -------------------


def test_pooling_on_a_non_square_grid_by_hand():
    """Grid 2 rows x 3 cols, two frames. Frame 0 holds every patch:
        [[1, 2, 3],
         [4, 5, 6]]
    kernel 3 averages the held patches within one row and one column:
        (0,0): (1+2+4+5)/4 = 3, (0,1): 21/6 = 3.5, (0,2): (2+3+5+6)/4 = 4, row 1 the same.
    Frame 1 holds only (0,0) = 10 and (1,2) = 20: not neighbours, and frame 0 never mixes in.
    kernel 5 covers the whole frame: the frame's mean over the held patches."""
    grid = (2, 3)
    score = torch.tensor([[1.0, 2, 3, 4, 5, 6, 10, 20]])
    rank = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 5]])  # row * cols + col
    assert pool_on_grid(score, rank, pos, grid, 3)[0].tolist() == pytest.approx(
        [3.0, 3.5, 4.0, 3.0, 3.5, 4.0, 10.0, 20.0]
    )
    assert pool_on_grid(score, rank, pos, grid, 5)[0].tolist() == pytest.approx([3.5] * 6 + [15.0, 15.0])


def test_compress_pools_van_over_the_true_rows_and_columns():
    """One frame of 2 x 3 patches with value norms [[10, 1, 1], [2, 6, 6]]; VaN only, kernel 3 (CV = 0.76
    lies between tau2 = 0.5 and tau3 = 1). Pooled (see above): (r, 0) = 19/4 = 4.75, (r, 1) = 26/6,
    (r, 2) = 14/4 = 3.5 for both rows, so the two best are (0, 0) and (1, 0).
    Unpooled the best two would be (0, 0) = 10 and a 6; rows and columns swapped (a 3 x 2 grid) would
    pool the flat order [[10, 1], [1, 2], [6, 6]] and keep (0, 2) and (1, 0)."""
    grid = (2, 3)
    norms = torch.tensor([10.0, 1, 1, 2, 6, 6])
    values = norms[None, :, None] * torch.nn.functional.one_hot(torch.tensor(0), DIM).float()
    keys = torch.ones(1, 6, DIM)
    view = view_from(keys, values, *whole_frames(1, grid), grid=grid)
    selection = make_policy("infinipot-v", alpha=0.0, cv_thresholds=[0.1, 0.5, 1.0]).compress([view], 2)
    assert selection.info["kernel"] == [3]
    assert kept_provenance(view, selection.indices[0]) == {(0, 0, 0), (0, 1, 0)}


def _layers_with_cvs(cvs, grid=(2, 3), frames=2):
    """One view per layer whose VaN map has CV exactly ``cv``: half the norms 1 - cv, half 1 + cv
    (mean 1, population std cv)."""
    p = grid[0] * grid[1]
    views = []
    for layer, cv in enumerate(cvs):
        norms = torch.tensor([1 - cv, 1 + cv]).repeat(frames * p // 2)
        values = norms[None, :, None] * torch.ones(1, 1, DIM) / DIM**0.5
        views.append(
            view_from(
                torch.ones(1, frames * p, DIM),
                values,
                *whole_frames(frames, grid),
                layer=layer,
                num_layers=len(cvs),
                grid=grid,
            )
        )
    return views


def test_cv_thresholds_are_calibrated_once_on_the_first_pass():
    """First pass: CVs 0.1, 0.2, 0.3, 0.4. Their 25/50/75% quantiles (linear interpolation at ranks 0.75,
    1.5, 2.25) are 0.175, 0.25, 0.325, so kernels 7, 5, 3, 1. Second pass: smoother layers, CVs 0.05,
    0.1, 0.15, 0.17 -- all below tau1 = 0.175 of the first pass: kernel 7 everywhere (a recalibration
    would give 7, 5, 3, 1 again)."""
    policy = make_policy("infinipot-v")
    first = policy.compress(_layers_with_cvs([0.1, 0.2, 0.3, 0.4]), 8)
    assert first.info["cv"] == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-5)
    assert first.info["cv_thresholds"] == pytest.approx([0.175, 0.25, 0.325], abs=1e-5)
    assert first.info["kernel"] == [7, 5, 3, 1]
    second = policy.compress(_layers_with_cvs([0.05, 0.1, 0.15, 0.17]), 8)
    assert second.info["cv_thresholds"] == pytest.approx([0.175, 0.25, 0.325], abs=1e-5)
    assert second.info["kernel"] == [7, 7, 7, 7]


def test_defaults_are_the_papers():
    """App. A.2: alpha = 0.5, r = 0.125 f; the thresholds are calibrated (None) by default."""
    defaults = {spec.name: spec.default for spec in policy_params("infinipot-v")}
    assert defaults == {"alpha": 0.5, "recent_ratio": 0.125, "tar": "patch", "van": "pool", "cv_thresholds": None}


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _quantile(values, q):
    """Linear interpolation between the closest ranks (numpy's and torch's default)."""
    values = sorted(values)
    at = q * (len(values) - 1)
    low = math.floor(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def reference_infinipot(layers, grid, keep, alpha, recent_ratio, thresholds=None):
    """InfiniPot-V restated with Python loops from the paper (Eq. 4-5, Alg. 2) and the docstring's rules.

    ``layers``: per layer, per KV head, a list of tokens ``(frame, row, col, key, value)`` (lists of floats).
    Returns (per layer per head the set of kept ``(frame, row, col)``, the thresholds used, the kernels).
    Exact ties (common: pooling windows clipped by a small grid cover the same patches) go to the token
    listed later (the newer one, as the tokens are listed in stream order).
    """
    p = grid[0] * grid[1]
    norms = [[[math.sqrt(sum(x * x for x in t[4])) for t in head] for head in layer] for layer in layers]
    cvs = []
    for layer in norms:
        flat = [n for head in layer for n in head]
        mean = sum(flat) / len(flat)
        cvs.append(math.sqrt(sum((n - mean) ** 2 for n in flat) / len(flat)) / mean)
    if thresholds is None:
        thresholds = tuple(_quantile(cvs, q) for q in (0.25, 0.5, 0.75))
    kernels = [7 if cv < thresholds[0] else 5 if cv < thresholds[1] else 3 if cv < thresholds[2] else 1 for cv in cvs]
    kept_sets = []
    for layer, heads in enumerate(layers):
        half = kernels[layer] // 2
        kept_layer = []
        for head, tokens in enumerate(heads):
            van = norms[layer][head]
            where = {t[:3]: i for i, t in enumerate(tokens)}
            pooled = []
            for f, r, c, _, _ in tokens:
                near = [
                    van[where[(f, rr, cc)]]
                    for rr in range(r - half, r + half + 1)
                    for cc in range(c - half, c + half + 1)
                    if (f, rr, cc) in where
                ]
                pooled.append(sum(near) / len(near))
            held = sorted({t[0] for t in tokens})
            r_frames = min(max(1, round(recent_ratio * len(tokens) / p)), max(1, keep // p))
            recent_frames = set(held[-r_frames:])
            recent = [i for i, t in enumerate(tokens) if t[0] in recent_frames]
            forced = set()
            if alpha > 0:
                share = max(len(recent), round(alpha * keep))
                score = {}
                for i, t in enumerate(tokens):
                    if t[0] not in recent_frames:
                        same = [tokens[j][3] for j in recent if tokens[j][1:3] == t[1:3]]
                        score[i] = -sum(_cos(t[3], k) for k in same) / len(same) if same else 0.0
                forced = set(recent) | set(
                    sorted(score, key=lambda i: (score[i], i), reverse=True)[: share - len(recent)]
                )
            rest = sorted(
                (i for i in range(len(tokens)) if i not in forced), key=lambda i: (pooled[i], i), reverse=True
            )
            kept_layer.append({tokens[i][:3] for i in forced | set(rest[: keep - len(forced)])})
        kept_sets.append(kept_layer)
    return kept_sets, thresholds, kernels


def _stream(layers, heads, frames, grid, seed):
    """Keys ``[layers, heads, frames, p, D]`` 100x larger than the values: a static background per patch
    plus per-frame change; values whose norm spread differs by layer (so do the CVs) and is 5x smaller
    after the first 14 frames (so later passes are smoother than the first)."""
    g = torch.Generator().manual_seed(seed)
    p = grid[0] * grid[1]
    background = torch.randn(layers, heads, 1, p, DIM, generator=g)
    keys = 100 * (background + 0.8 * torch.randn(layers, heads, frames, p, DIM, generator=g))
    spread = torch.tensor([0.15, 0.4, 0.8, 1.6])[:layers, None, None, None]
    decay = torch.where(torch.arange(frames) < 14, 1.0, 0.2)[None, None, :, None]
    norms = 1 + spread * decay * torch.rand(layers, heads, frames, p, generator=g)
    directions = torch.nn.functional.normalize(torch.randn(layers, heads, frames, p, DIM, generator=g), dim=-1)
    return keys, norms[..., None] * directions


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_successive_passes_equal_a_plain_loop_restatement(alpha):
    """Four layers on a 3 x 5 grid, three passes. First pass: 14 whole frames (r = round(0.125 * 14) = 2),
    keep = 158 (10.5 frames, so the kept cache holds partial frames); each later pass sees that cache plus
    4 new frames (f = 218 / 15, r = 2), compares past tokens with the recent frames by patch, pools VaN over
    the held neighbours only, and keeps the thresholds of the first pass. Keys are 100x the values. Between
    passes the slots are shuffled per head (the memory compacts in place: slots are not in stream order)."""
    grid, layers, heads, keep = (3, 5), 4, 2, 158
    p = grid[0] * grid[1]
    keys, values = _stream(layers, heads, 26, grid, seed=21)

    def frames_of(layer, start, count):
        flat = lambda x: x[layer, :, start : start + count].reshape(heads, count * p, DIM)  # noqa: E731
        return flat(keys), flat(values)

    def tokens_of(layer, head, start, count):
        return [
            (
                start + t,
                i // grid[1],
                i % grid[1],
                keys[layer, head, start + t, i].tolist(),
                values[layer, head, start + t, i].tolist(),
            )
            for t in range(count)
            for i in range(p)
        ]

    policy = make_policy("infinipot-v", alpha=alpha)
    views = [
        view_from(*frames_of(layer, 0, 14), *whole_frames(14, grid), layer=layer, num_layers=layers, grid=grid)
        for layer in range(layers)
    ]
    reference = [[tokens_of(layer, head, 0, 14) for head in range(heads)] for layer in range(layers)]
    thresholds, next_frame, g = None, 14, torch.Generator().manual_seed(22)
    for _ in range(3):
        selection = policy.compress(views, keep)
        expected, thresholds, kernels = reference_infinipot(reference, grid, keep, alpha, 0.125, thresholds)
        assert selection.info["kernel"] == kernels
        views = [shuffle(gather(view, index), g) for view, index in zip(views, selection.indices)]
        for layer in range(layers):
            for head in range(heads):
                assert (
                    kept_provenance(views[layer], torch.arange(keep).expand(heads, -1), head) == expected[layer][head]
                )
        reference = [
            [[t for t in reference[layer][head] if t[:3] in expected[layer][head]] for head in range(heads)]
            for layer in range(layers)
        ]
        views = [append(view, *frames_of(layer, next_frame, 4), next_frame, 4) for layer, view in enumerate(views)]
        reference = [
            [reference[layer][head] + tokens_of(layer, head, next_frame, 4) for head in range(heads)]
            for layer in range(layers)
        ]
        next_frame += 4
    # The last pass's CVs crossed a first-pass threshold: a recalibration (always a permutation of 7, 5, 3, 1
    # for four distinct CVs) could not give these kernels.
    assert sorted(kernels) != [1, 3, 5, 7] and kernels[0] > 1


@pytest.mark.parametrize("kernel", [3, 5])
def test_pooling_keeps_heads_and_frames_apart_as_a_plain_loop_does(kernel):
    """Three heads, each holding its own scattered tokens of up to six frames (out of order, as in a compacted
    memory): every token's pooled score is the mean over the held tokens of its own head and frame within the
    kernel's window."""
    generator = torch.Generator().manual_seed(kernel)
    rows, cols = 3, 4
    cells = torch.stack([torch.randperm(6 * rows * cols, generator=generator)[:20] for _ in range(3)])  # [H, L]
    rank, pos = cells // (rows * cols), cells % (rows * cols)
    score = torch.rand(3, 20, generator=generator) * 10
    pooled = pool_on_grid(score, rank, pos, (rows, cols), kernel)
    reach = kernel // 2
    for h in range(3):
        for t in range(20):
            r, i, j = int(rank[h, t]), int(pos[h, t]) // cols, int(pos[h, t]) % cols
            near = [
                float(score[h, u])
                for u in range(20)
                if int(rank[h, u]) == r
                and abs(int(pos[h, u]) // cols - i) <= reach
                and abs(int(pos[h, u]) % cols - j) <= reach
            ]
            assert float(pooled[h, t]) == pytest.approx(sum(near) / len(near), rel=1e-6), (h, t)
