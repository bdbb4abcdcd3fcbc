"""The app under ZeroGPU emulation (every GPU call in a forked child, state pickled in and out), driven
through gradio_client and headless Chromium: the same results as the app without it."""

import pytest
from gradio_client import handle_file

from test_app import ASK_FULL_CHAT, ASK_POLICY_CHAT, REPORT, STATUS, answer_text, fetch_json, frames_done, new_client

pytestmark = pytest.mark.slow  # the app with every GPU call in a forked child

#: What may differ: measured durations, and the buffers' allocated size (a memory that crossed the boundary
#: is re-allocated to what it holds plus its budget, not to the geometric slack it had grown in place).
MEASURED = ("ms", "allocated_bytes")


def without_timings(value):
    """A report without what may differ (the rest must be equal)."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in MEASURED and not k.endswith("_ms")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def run_and_ask(url, media, policy, budget, keep):
    client = new_client(url)
    job = client.submit(
        video=handle_file(str(media / "flipping_a_pancake.mkv")),
        policy=policy,
        budget=budget,
        keep=keep,
        api_name="/run",
    )
    final = job.result()
    assert "20/20 frames" in final[STATUS]
    first = client.submit("What is cooking?", api_name="/ask").result()
    second = client.submit("And what colour is it?", api_name="/ask").result()  # multi-turn
    report = fetch_json(second[-1])
    return report, [
        answer_text(first[ASK_POLICY_CHAT]),
        answer_text(second[ASK_POLICY_CHAT]),
        answer_text(second[ASK_FULL_CHAT]),
    ]


@pytest.mark.parametrize("policy, budget, keep", [("infinipot-v", 96, 72), ("protokv", 96, None), ("hybridkv", 96, 72)])
def test_the_emulated_app_streams_and_answers_like_the_app(app_url, emulated_app_url, media, policy, budget, keep):
    direct, direct_answers = run_and_ask(app_url, media, policy, budget, keep)
    emulated, emulated_answers = run_and_ask(emulated_app_url, media, policy, budget, keep)
    strip = lambda answers: [a.split("first token")[0] for a in answers]  # noqa: E731
    assert strip(emulated_answers) == strip(direct_answers)
    assert without_timings(emulated) == without_timings(direct)
    assert [a["question"] for a in emulated["answers"]] == ["What is cooking?", "And what colour is it?"]
    assert emulated["baseline"]["peak_visual_tokens"] == 150 and emulated["peak_visual_tokens"] <= budget


def test_a_question_mid_stream_under_emulation_is_answered_from_the_memory_so_far(emulated_app_url):
    client = new_client(emulated_app_url)
    run = client.submit(api_name="/run_sample")
    for update in run:
        if frames_done(update[STATUS]) > 0:
            break
    answer = client.submit("What colour was the circle?", api_name="/ask").result()
    final = run.result()
    assert "80/80 frames" in final[STATUS]
    seen = int(answer_text(answer[ASK_FULL_CHAT]).split(" visual tokens")[0].split()[-1])
    assert 0 < seen < fetch_json(final[REPORT])["baseline"]["peak_visual_tokens"]
