"""The app launched as a real process and driven through gradio_client (one client = one session)."""

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client, handle_file

from conftest import APP_MAX_SESSIONS
from kvdemo.models.catalog import default_budget

ROOT = Path(__file__).resolve().parents[1]

# Outputs of /run and /run_sample, and of /ask, by position.
STATUS, PLOT, HEATMAP, GALLERY, REPORT, CHART, COVERAGE = range(7)
POLICY_TITLE, FULL_TITLE, POLICY_CHAT, FULL_CHAT, RUN_ASK_STATUS = 8, 9, 10, 11, 12
ASK_STATUS, ASK_POLICY_CHAT, ASK_FULL_CHAT, ASK_REPORT = range(4)
UNCHANGED = {"__type__": "update"}  # what an output the update left alone comes back as


def sample_settings(fps: float) -> tuple:
    """/run_sample's first parameters (model, policy, M, C, fps), positional: the sample at ``fps``."""
    return ("tiny", "infinipot-v", 1024, 768, fps)


def fetch_json(file_value):
    with urllib.request.urlopen(file_value["url"], timeout=30) as response:
        return json.loads(response.read())


def new_client(url) -> Client:
    return Client(url, download_files=False, verbose=False)


def answer_text(chat) -> str:
    return chat[-1]["content"][0]["text"]


def frames_done(status: str) -> int:
    match = re.search(r"(\d+)/\d+ frames", status)
    return int(match.group(1)) if match else 0


def visual_tokens_seen(answer: str) -> int:
    return int(re.search(r"(\d+) visual tokens", answer).group(1))


@pytest.fixture
def client(app_url):
    return new_client(app_url)


@pytest.mark.slow
def test_upload_run_ask_and_read_the_report(client, media):
    job = client.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run")
    updates = list(job)
    final = job.result()
    assert len(updates) >= 5, "updates stream while the video plays"
    assert "20/20 frames" in final[STATUS]
    report = fetch_json(final[REPORT])
    assert report["frames"] == 20 and report["policy"] == "infinipot-v"
    budget, _, _ = default_budget("tiny")
    assert report["peak_visual_tokens"] <= report["budget"] == budget
    assert report["baseline"]["peak_visual_tokens"] == 10 * 15  # 140 x 84 frames: the trained tiny model's pixel range
    answer = client.submit("What is cooking?", api_name="/ask").result()
    for chat in (answer[ASK_POLICY_CHAT], answer[ASK_FULL_CHAT]):
        assert chat[0]["role"] == "user" and chat[1]["role"] == "assistant"
        assert "first token" in chat[1]["content"][0]["text"]
    report = fetch_json(answer[ASK_REPORT])
    assert report["answers"][0]["question"] == "What is cooking?"
    assert answer[ASK_STATUS].startswith("✓ answered")
    # Once the next run streams, the question status no longer describes the previous run's answer.
    again = client.submit(*sample_settings(0.5), api_name="/run_sample")
    again.result()
    assert [update[RUN_ASK_STATUS] for update in again.outputs() if update[RUN_ASK_STATUS] != UNCHANGED] == [""]


@pytest.mark.slow
def test_bad_uploads_give_messages_and_the_next_run_works(client, media, tmp_path):
    junk = tmp_path / "notes.mp4"
    junk.write_text("this is not a video")
    bad = client.submit(handle_file(str(junk)), api_name="/run").result()
    assert "not a readable video file" in bad[STATUS]
    damaged = client.submit(handle_file(str(media / "corrupted.mp4")), api_name="/run").result()
    assert "1 damaged frame could not be decoded and was skipped" in damaged[STATUS]
    good = client.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run").result()
    assert "20/20 frames" in good[STATUS]


def test_error_messages_name_the_file_not_the_server_upload_folder(client, app, tmp_path):
    junk = tmp_path / "notes.mp4"
    junk.write_text("this is not a video")
    status = client.predict(handle_file(str(junk)), api_name="/run")[STATUS]
    assert "notes.mp4: not a readable video file" in status
    assert "/" not in status.replace("</", ""), f"a server path leaks into the message: {status}"
    assert str(app.cache) not in status


def test_impossible_budget_is_a_message(client, media):
    result = client.predict(
        handle_file(str(media / "flipping_a_pancake.mkv")), "tiny", "infinipot-v", 100, 200, api_name="/run"
    )
    assert "C must be smaller than M" in result[STATUS]


def test_negative_budgets_get_the_same_one_line_message_as_other_bad_budgets(client, app, media):
    before = app.log.read_text().count("Traceback")
    for budget, keep in ((-5, 768), (1024, -1)):
        result = client.predict(
            handle_file(str(media / "flipping_a_pancake.mkv")), budget=budget, keep=keep, api_name="/run"
        )
        assert "M and C must be positive" in result[STATUS]
        assert result[STATUS].count("\n") == 0, "one line"
        check = client.predict("infinipot-v", budget, keep, 2, 200704, None, api_name="/check_settings")
        assert check.startswith("⚠️") and "M and C must be positive" in check
    assert app.log.read_text().count("Traceback") == before


def test_as_you_type_check_applies_runs_rule_to_the_uploaded_video(client, media):
    pancake = handle_file(str(media / "flipping_a_pancake.mkv"))
    # 426x240 resized within 200704 pixels -> 252x420 = 9x15 = 135 tokens per chunk (one temporal grid).
    assert client.predict("infinipot-v", 1024, 889, 2, 200704, pancake, api_name="/check_settings").startswith("✓")
    verdict = client.predict("infinipot-v", 1024, 890, 2, 200704, pancake, api_name="/check_settings")
    assert verdict.startswith("⚠️") and "M - C = 134 leaves no room for one chunk (135 visual tokens" in verdict
    run = client.predict(pancake, budget=1024, keep=890, max_pixels=200704, api_name="/run")
    assert "M - C = 134 leaves no room for one chunk (135 visual tokens" in run[STATUS]
    # Without a video: a chunk of the bundled sample, what runs without an upload (112 x 112 for the tiny model: 16 tokens).
    assert "M=10 is smaller than one chunk (16" in client.predict(
        "infinipot-v", 10, 5, 2, 200704, None, "tiny", api_name="/check_settings"
    )


@pytest.mark.slow
def test_a_failed_run_keeps_the_previous_session_and_its_views(client, media, tmp_path):
    good = client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run")
    header_only = tmp_path / "header_only.mkv"  # opens (20 frames planned) but no frame decodes
    header_only.write_bytes((media / "flipping_a_pancake.mkv").read_bytes()[:2000])
    for bad_file in (header_only, tmp_path / "notes.mp4"):
        if not bad_file.exists():
            bad_file.write_text("not a video")
        failed = client.predict(handle_file(str(bad_file)), api_name="/run")
        status = failed[STATUS]
        assert f"{bad_file.name}:" in status and "Still showing the previous run: flipping_a_pancake.mkv" in status
        assert "frames at" not in status.split("Still showing")[0], "the status describes only the previous run"
        assert all(value == UNCHANGED for value in failed[PLOT:]), "every view still shows the previous run"
    answer = client.predict("What is cooking?", api_name="/ask")
    assert (
        visual_tokens_seen(answer_text(answer[ASK_FULL_CHAT]))
        == fetch_json(good[REPORT])["baseline"]["peak_visual_tokens"]
    )


@pytest.mark.slow
def test_sessions_do_not_see_each_others_streams(app_url, media):
    first = new_client(app_url)
    second = new_client(app_url)
    first.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run").result()
    other = second.submit("What is cooking?", api_name="/ask").result()
    assert "no video yet" in other[ASK_STATUS]


@pytest.mark.slow
def test_a_question_during_the_stream_is_answered_before_it_ends(client):
    run = client.submit(api_name="/run_sample")
    for update in run:
        if frames_done(update[STATUS]) > 0:
            break
    answer = client.submit("What is there now?", api_name="/ask").result()
    seen = visual_tokens_seen(answer_text(answer[ASK_FULL_CHAT]))
    final = run.result()
    assert "80/80 frames" in final[STATUS]
    assert 0 < seen < 80 // 2 * 16, "the baseline answered from the stream so far, mid-run"


def streaming(job) -> bool:
    """Whether ``job`` (a /run or /run_sample job) has streamed a chunk and not ended."""
    return not job.done() and any(frames_done(output[STATUS]) > 0 for output in job.outputs())


def wait_for(condition, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_question_is_served_while_three_sessions_stream(app_url):
    """Three sessions stream at once (more than the stream slots: one waits in the queue); one asks
    mid-stream and is answered from its memory so far while its own and another session's streams run:
    questions never wait for other sessions' streams."""
    clients = [new_client(app_url) for _ in range(3)]
    # The asking session streams first (the queue's order among simultaneous submits is not fixed), then two
    # more sessions arrive: one takes the other stream slot, one waits.
    runs = [clients[0].submit(*sample_settings(8), api_name="/run_sample")]  # 80 frames (its own 2 fps)
    wait_for(lambda: streaming(runs[0]))
    runs += [c.submit(*sample_settings(8), api_name="/run_sample") for c in clients[1:]]
    wait_for(lambda: any(streaming(run) for run in runs[1:]))
    answer = clients[0].submit("What is there now?", api_name="/ask").result()
    still_streaming = [streaming(run) for run in runs]
    seen = visual_tokens_seen(answer_text(answer[ASK_FULL_CHAT]))
    for _ in runs[1:]:  # they have shown what they had to: stop each once it streams (the waiting one then starts)
        wait_for(lambda: any(streaming(run) for run in runs[1:]) or all(run.done() for run in runs[1:]))
        for other, run in zip(clients[1:], runs[1:]):
            if streaming(run):
                other.predict(api_name="/stop")
                run.result()
    final = runs[0].result()
    assert "80/80 frames" in final[STATUS]
    full_at_end = fetch_json(final[REPORT])["baseline"]["peak_visual_tokens"]
    assert 0 < seen < full_at_end, "answered from the memory so far, not after the stream ended"
    assert still_streaming[0] and any(still_streaming[1:]), "answered while its own and another session's streams ran"
    for run in runs[1:]:
        run.result()
    # The run that found both stream slots taken said so in its status, with its place.
    said = [output[STATUS] for run in runs[1:] for output in run.outputs()]
    assert any(
        status.startswith("⏳ **queued: next in line** for one of the app's 2 stream slots") for status in said
    ), said


def test_stop_ends_the_run_with_a_status_and_a_report_of_what_ran(client):
    run = client.submit(*sample_settings(8), api_name="/run_sample")
    for update in run:
        if frames_done(update[STATUS]) >= 4:
            break
    client.predict(api_name="/stop")
    final = run.result()
    done = frames_done(final[STATUS])
    assert "stopped at" in final[STATUS] and 4 <= done < 80
    report = fetch_json(final[REPORT])
    assert report["frames"] == done and "stopped by the user" in report["stopped"]["run"]
    assert "80/80" not in final[STATUS]


@pytest.mark.slow
def test_the_apps_report_has_the_clis_format(client, media, tmp_path):
    from kvdemo.cli import main

    final = client.predict(handle_file(str(media / "corrupted.mp4")), api_name="/run")
    app_report = fetch_json(final[REPORT])
    out = tmp_path / "cli.json"
    assert (
        main(
            [
                "run",
                "--video",
                str(media / "corrupted.mp4"),
                "--budget",
                "1024",
                "--keep",
                "768",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )  # the model's pixel range in both
    cli_report = json.loads(out.read_text())
    assert set(cli_report) <= set(app_report), f"missing in the app's report: {set(cli_report) - set(app_report)}"
    assert app_report["lost_frames"] == cli_report["lost_frames"] > 0
    assert app_report["video"] == cli_report["video"] and app_report["frames"] == cli_report["frames"]


@pytest.mark.slow
def test_chart_html_is_made_on_demand_and_runs_leave_no_chart_in_the_cache(client, app, app_url):
    def charts():
        return sorted(app.cache.rglob("*.html"))

    before = charts()
    final = client.predict(*sample_settings(0.5), api_name="/run_sample")
    assert final[CHART] in (None, UNCHANGED), "no chart file with the run"
    assert charts() == before, "a run copies no chart into Gradio's cache"
    chart = client.predict(api_name="/export_chart")
    with urllib.request.urlopen(chart["url"], timeout=30) as response:
        html = response.read().decode()
    assert "<html>" in html and "plotly" in html and "visual tokens" in html
    assert len(charts()) == len(before) + 1
    # plotly.js is not inside (4.8 MB each time): the page loads the app's one copy, from where the client reached it.
    assert len(html) < 200_000
    script = re.search(r'<script charset="utf-8" src="([^"]+)"', html).group(1)
    assert script.startswith(app_url) and script.endswith(".min.js")
    with urllib.request.urlopen(script, timeout=30) as response:
        assert b"plotly.js" in response.read(2000)


@pytest.mark.slow
def test_the_least_recently_used_session_is_freed_past_the_limit(app_url):
    oldest = new_client(app_url)
    oldest.predict(*sample_settings(0.5), api_name="/run_sample")
    for _ in range(APP_MAX_SESSIONS):
        new_client(app_url).predict(*sample_settings(0.5), api_name="/run_sample")
    status = oldest.predict("Still there?", api_name="/ask")[ASK_STATUS]
    assert f"freed to make room: the app keeps at most {APP_MAX_SESSIONS} sessions" in status


def test_every_api_parameter_and_output_has_a_name(client):
    api = client.view_api(return_format="str", print_info=False)
    assert not re.findall(r"\b(param|value)_\d+", api), api
    for endpoint in (
        "/run",
        "/run_sample",
        "/ask",
        "/stop",
        "/export_chart",
        "/new_conversation",
        "/check_settings",
        "/compare_run",
        "/compare_sample",
        "/compare_ask",
        "/compare_stop",
        "/compare_fidelity",
        "/compare_sweep",
        "/compare_new_conversation",
    ):
        assert f'api_name="{endpoint}"' in api
    assert 'predict(question, api_name="/ask")' in api


def test_the_docs_gradio_client_example_runs(app_url, media, capsys):
    page = (ROOT / "docs" / "app.md").read_text()
    section = page.split("## Scripting the app", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:7860" in code and "clip.mp4" in code
    code = code.replace("http://127.0.0.1:7860", app_url).replace(
        '"clip.mp4"', repr(str(media / "flipping_a_pancake.mkv"))
    )
    exec(compile(code, "docs/app.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "20/20 frames" in printed and re.search(
        r"peak visual tokens \d+ of M = 64 after [1-9]\d* compressions", printed
    )
    assert "✓ answered by infinipot-v and the full cache" in printed and "first token" in printed, (
        "the answer was printed"
    )


def test_the_app_logs_its_start_and_the_model_it_loaded(app, client):
    log = app.log.read_text()
    steps = ["importing torch and gradio", "loading model tiny", "loaded tiny", "starting the web server"]
    positions = [log.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), log[:2000]
    assert re.search(r"loaded tiny \(qwen2_5_vl, \d+ attention layers, \d+ KV heads\) on cpu as float32", log)


@pytest.mark.slow
def test_a_huge_budget_costs_what_the_stream_holds_and_absurd_ones_are_one_line(client, app, media):
    """M = 1,000,000 reserved ~2.2 GB for a 150-token stream; 10^12 and 10^25 are one-line messages everywhere."""
    before = app.log.read_text().count("Traceback")
    clip = handle_file(str(media / "flipping_a_pancake.mkv"))
    final = client.predict(clip, budget=1_000_000, keep=750_000, api_name="/run")
    report = fetch_json(final[REPORT])
    allocated = max(event["allocated_bytes"] for event in report["timeline"])
    baseline = max(event["allocated_bytes"] for event in report["baseline"]["timeline"])
    assert allocated <= baseline, "an M the stream never reaches allocates no more than the full cache"
    for budget in (10**12, 1e25):
        run = client.predict(clip, budget=budget, keep=768, api_name="/run")[STATUS]
        check = client.predict("infinipot-v", budget, 768, 2, 12544, None, api_name="/check_settings")
        assert check.startswith("⚠️") and "more visual tokens than any stream holds" in check and "\n" not in check
        assert "more visual tokens than any stream holds" in run.splitlines()[0], run
        # The advice names what both tabs offer (neither offers a "full" policy), the M run above.
        compared = client.predict(budget=budget, keep=768, api_name="/compare_sample")[0]
        for said in (run, check, compared):
            assert "set M above the stream's visual tokens (e.g. M=1000000)" in said and "full policy" not in said, said
    assert app.log.read_text().count("Traceback") == before


@pytest.mark.slow
def test_questions_and_the_replayed_dialogue_are_bounded(client, app):
    """A 100,000-character question tried to allocate 48.5 GB; a few long turns spoiled every later answer
    (the whole dialogue is replayed before each question). Now: a one-line message beside the question box,
    and the oldest turns leave the replay, which the answer says."""
    from kvdemo.dialogue import MAX_QUESTION_TOKENS
    from kvdemo.world.synthetic import sample_episode

    client.predict(*sample_settings(2), api_name="/run_sample")
    before = app.log.read_text().count("Traceback")
    status, policy_chat, full_chat, _ = client.predict("x" * 100_000, api_name="/ask")
    assert status == f"⚠️ the question is 100000 tokens long; at most {MAX_QUESTION_TOKENS} (shorten it)"
    assert policy_chat == [] and full_chat == []
    long_turn = "Describe every object you saw in the video, in order, with its colour. " * 6  # 426 tokens
    for _ in range(5):
        client.predict(long_turn, api_name="/ask")
    question = next(q for q in sample_episode().questions if q.kind == "colour")
    status, _, full_chat, _ = client.predict(question.text, api_name="/ask")
    answer = answer_text(full_chat)
    assert status.startswith("✓ answered by") and "oldest turns were left out of the replayed dialogue" in answer
    assert "✓ matches the ground truth" in answer, answer
    assert app.log.read_text().count("Traceback") == before


@pytest.mark.slow
def test_what_a_new_user_meets_is_said_where_they_look(client, app, tmp_path):
    """Through the API: the Ask box's messages come back as its own line (not the page's status,
    not an update object) with the chats as lists; a 0-byte upload is named, not the server's temp path; Run with
    no upload asks for one; ProtoKV's count of visual tokens is split in the status line; the chart has
    logarithmic axes on request."""
    fresh = new_client(app.url)
    said, policy_chat, full_chat, _ = fresh.predict("What colour was the circle?", api_name="/ask")
    assert said == "⚠️ no video yet: run a video or the webcam first, then ask" and policy_chat == full_chat == []
    nothing = fresh.predict(None, api_name="/run")[STATUS]
    assert nothing.startswith("⚠️ **upload a video first (or click Run the bundled sample)**")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    status = fresh.predict(handle_file(str(empty)), api_name="/run")[STATUS]
    assert status.startswith("⚠️ **empty.mp4: the file is empty**") and str(app.cache) not in status
    final = fresh.predict("tiny", "protokv", 96, None, 2, log_scale=True, api_name="/run_sample")
    assert re.search(
        r"32 visual tokens held \+ 64 summary slots reserved \(\d+ in use\) \(M=96\)",
        final[STATUS],
    ), final[STATUS]
    assert '"type":"log"' in final[PLOT]["plot"]
    said, policy_chat, _, _ = fresh.predict("", api_name="/ask")
    assert said == "⚠️ type a question first" and policy_chat == []
    said, policy_chat, _, _ = fresh.predict("What colour was the circle?", api_name="/ask")
    assert said == "✓ answered by protokv and the full cache" and len(policy_chat) == 2, "the warning is gone"


@pytest.mark.slow
def test_the_bundled_sample_offers_the_moving_camera_kind(client, app):
    """The sample's kind is a choice (and an API parameter). Choosing "moving" shows what that stream
    holds and its questions; running it streams that stream, and its questions are graded against its own
    ground truth, not the still sample's."""
    from kvdemo.world.synthetic import sample_episode

    fresh = new_client(app.url)
    moving = sample_episode("moving")
    manifest, examples, kind = fresh.predict("moving", api_name="/sample_kind")
    assert kind["info"].startswith("moving: the camera pans"), "the help text follows the choice"
    assert "kind moving" in manifest and "The camera pans" in manifest
    assert [row[0] for row in examples["samples"]] == [q.text for q in moving.questions]
    final = fresh.predict("tiny", "infinipot-v", 96, 72, 2, sample_kind="moving", api_name="/run_sample")
    assert f"{moving.video.num_frames}/{moving.video.num_frames} frames" in final[STATUS], final[STATUS]
    question = moving.questions[0]
    said, policy_chat, _, _ = fresh.predict(question.text, api_name="/ask")
    assert said.startswith("✓ answered"), said
    graded = answer_text(policy_chat)
    assert (
        f"✓ matches the ground truth ({question.answer})" in graded
        or f"✗ the ground truth is {question.answer}" in graded
    ), graded
    still, _, kind = fresh.predict("static", api_name="/sample_kind")
    assert kind["info"].startswith("still: a fixed camera"), kind
    assert "kind static" in still and still != manifest
