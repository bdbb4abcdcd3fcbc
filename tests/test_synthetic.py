"""The stream generator: deterministic per seed, objects on the patch grid, labels and ground truth
checked against plain restatements, grading."""

import numpy as np
import pytest

from kvdemo.synthetic import (
    CELL,
    CLUTTER,
    COLOUR_NAMES,
    COLOURS,
    MIN_LABEL_PIXELS,
    NOTHING,
    NOTHING_COLOUR,
    SHAPES,
    StreamSpec,
    generate_episode,
    grade,
    grade_answer,
    sample_episode,
    synthetic_video,
    shape_mask,
)
from kvdemo.video import VideoError


def test_the_same_seed_gives_the_same_stream_and_another_seed_another():
    a, b = generate_episode((3, 1)), generate_episode((3, 1))
    np.testing.assert_array_equal(a.video.frames, b.video.frames)
    np.testing.assert_array_equal(a.shape_labels, b.shape_labels)
    assert a.objects == b.objects and a.questions == b.questions and a.clutter == b.clutter
    c = generate_episode((3, 2))
    assert c.video.frames.shape != a.video.frames.shape or not np.array_equal(c.video.frames, a.video.frames)


def test_frames_pairs_and_times():
    episode = generate_episode(5, StreamSpec(pairs=(6, 6)))
    video = episode.video
    assert video.frames.shape == (12, 112, 112, 3) and video.frames.dtype == np.uint8
    assert episode.pairs == 6 and episode.colour_labels.shape == (6, 16)
    np.testing.assert_allclose(video.times_s, np.arange(12) / 2.0)
    assert episode.pair_seconds == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_objects_are_drawn_on_the_patch_grid_in_their_colour(seed):
    episode = generate_episode(seed, StreamSpec(pairs=(10, 10)))
    frames = episode.video.frames
    for item in episode.objects:
        mask = shape_mask(item.shape, item.side)
        offset = (2 * CELL - item.side) // 2
        for index, (row, col) in enumerate(item.cells):
            top, left = row * CELL + offset, col * CELL + offset
            patch = frames[item.first_frame + index, top : top + item.side, left : left + item.side]
            assert (patch[mask] == COLOURS[item.colour]).all()
        assert all(0 <= r <= 6 and 0 <= c <= 6 for r, c in item.cells)
        steps = np.abs(np.diff(np.array(item.cells), axis=0))
        assert steps.max(initial=0) <= 1  # one 14-px step at a time
        assert 1 <= item.last_pair - item.first_pair + 1 <= 5 and item.first_frame % 2 == 0
    assert len({o.shape for o in episode.objects}) == len(episode.objects)  # one object per shape


def test_token_labels_match_a_plain_count_of_pixels():
    """Recount who covers each 28 x 28 token over each pair from the drawn frames, pixel by pixel."""
    episode = generate_episode(11, StreamSpec(pairs=(5, 5), objects=(4, 4), clutter=(2, 2), visible_pairs=(3, 5)))
    frames, owners = episode.video.frames, {}
    items = list(episode.objects) + list(episode.clutter)
    # Redraw ownership in drawing order (clutter first, objects over it).
    owner = np.full(frames.shape[:3], -1)
    for j, item in enumerate(episode.clutter):
        k = len(episode.objects) + j
        for f in range(item.first_frame, item.last_frame + 1):
            for y in range(item.height):
                for x in range(item.width):
                    if item.kind == "bar" or shape_mask("circle", item.height)[y, x]:
                        owner[f, item.top + y, item.left + x] = k
    for k, item in enumerate(episode.objects):
        mask, offset = shape_mask(item.shape, item.side), (2 * CELL - item.side) // 2
        for index, (row, col) in enumerate(item.cells):
            ys, xs = np.nonzero(mask)
            owner[item.first_frame + index, row * CELL + offset + ys, col * CELL + offset + xs] = k
    for pair in range(episode.pairs):
        for token in range(16):
            r, c = divmod(token, 4)
            region = owner[2 * pair : 2 * pair + 2, 28 * r : 28 * r + 28, 28 * c : 28 * c + 28]
            counts = {k: int((region == k).sum()) for k in range(len(items))}
            best = max(counts, key=lambda k: (counts[k], -k)) if counts else None
            if best is None or counts[best] < MIN_LABEL_PIXELS:
                expected = (NOTHING_COLOUR, NOTHING)
            elif best < len(episode.objects):
                expected = (COLOUR_NAMES.index(items[best].colour), SHAPES.index(items[best].shape))
            else:
                expected = (COLOUR_NAMES.index(items[best].colour), CLUTTER)
            owners[(pair, token)] = expected
            assert (episode.colour_labels[pair, token], episode.shape_labels[pair, token]) == expected, (pair, token)
    labelled = [v for v in owners.values() if v[1] != NOTHING]
    assert labelled, "the episode has labelled tokens"


def test_questions_carry_the_ground_truth_and_the_evidence_times():
    episode = generate_episode(4, StreamSpec(pairs=(20, 20), objects=(3, 3)))
    by_shape = {o.shape: o for o in episode.objects}
    colour = [q for q in episode.questions if q.kind == "colour"]
    assert len(colour) == 3
    for q in colour:
        item = by_shape[q.subject]
        assert q.text == f"What colour was the {item.shape}?" and q.answer == item.colour
        assert q.shown_s == item.first_frame / 2 and q.left_s == (item.last_frame + 1) / 2
    first = [q for q in episode.questions if q.kind == "first"]
    starts = sorted(o.first_pair for o in episode.objects)
    if starts[0] < starts[1]:
        assert first[0].answer == min(episode.objects, key=lambda o: o.first_frame).shape
    else:
        assert not first


def test_grading_reads_the_question_loosely_and_the_answer_strictly():
    episode = sample_episode()
    question = next(q for q in episode.questions if q.kind == "colour")
    late = question.left_s + 1
    assert grade(episode, question.text.upper().replace("COLOUR", "color"), question.answer, late).correct is True
    wrong = next(c for c in COLOURS if c != question.answer)
    result = grade(episode, question.text, wrong, late)
    assert result.correct is False and question.answer in result.note
    assert grade(episode, question.text, question.answer, question.shown_s).correct is None  # not shown yet
    assert grade(episode, "What is the capital of France?", "Paris", late).correct is None
    assert grade_answer("red", " Red.") and not grade_answer("red", "reddish")


def test_bad_specs_are_clear_errors():
    with pytest.raises(VideoError, match="multiples of 28"):
        StreamSpec(size=(100, 112))
    with pytest.raises(VideoError, match="one per shape"):
        StreamSpec(objects=(2, 7))


def test_synthetic_video_is_deterministic_and_moves():
    a, b = synthetic_video(8, 112, 168, seed=5), synthetic_video(8, 112, 168, seed=5)
    np.testing.assert_array_equal(a.frames, b.frames)
    assert np.abs(a.frames[1:].astype(int) - a.frames[:-1].astype(int)).mean() > 0.5
