"""The app launched as a real process and driven through gradio_client (one client = one session)."""

import json
import urllib.request

import pytest
from gradio_client import Client, handle_file

from kvdemo.ui import default_budget


def fetch_json(file_value):
    with urllib.request.urlopen(file_value["url"], timeout=30) as response:
        return json.loads(response.read())


def status_of(outputs):
    return outputs[0]


@pytest.fixture
def client(app_url):
    return Client(app_url, download_files=False, verbose=False)


def test_upload_run_ask_and_read_the_report(client, media):
    job = client.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run")
    updates = list(job)
    final = job.result()
    assert len(updates) >= 5, "updates stream while the video plays"
    assert "20/20 frames" in status_of(final)
    report = fetch_json(final[4])
    budget, _, _ = default_budget("tiny")
    assert report["frames"] == 20 and report["policy"] == "infinipot-v"
    assert report["peak_visual_tokens"] <= report["budget"] == budget
    assert report["baseline"]["peak_visual_tokens"] == 10 * 15  # 140 x 84 frames for the trained tiny model
    answer = client.submit("What is cooking?", api_name="/ask").result()
    policy_chat, full_chat = answer[8], answer[9]
    for chat in (policy_chat, full_chat):
        assert chat[0]["role"] == "user" and chat[1]["role"] == "assistant"
        assert "first token" in chat[1]["content"][0]["text"]
    report = fetch_json(answer[4])
    assert report["answers"][0]["question"] == "What is cooking?"


def test_bad_uploads_give_messages_and_the_next_run_works(client, media, tmp_path):
    junk = tmp_path / "notes.mp4"
    junk.write_text("this is not a video")
    bad = client.submit(handle_file(str(junk)), api_name="/run").result()
    assert "not a readable video file" in status_of(bad)
    damaged = client.submit(handle_file(str(media / "corrupted.mp4")), api_name="/run").result()
    assert "damaged frame(s) could not be decoded" in status_of(damaged)
    good = client.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run").result()
    assert "20/20 frames" in status_of(good)


def test_impossible_budget_is_a_message(client, media):
    result = client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), "tiny", "infinipot-v", 100, 200, api_name="/run")
    assert "C must be smaller than M" in status_of(result)


def test_sessions_do_not_see_each_others_streams(app_url, media):
    first = Client(app_url, download_files=False, verbose=False)
    second = Client(app_url, download_files=False, verbose=False)
    first.submit(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run").result()
    other = second.submit("What is cooking?", api_name="/ask").result()
    assert "no video yet" in status_of(other)


def test_a_question_during_the_stream_is_answered_before_it_ends(client):
    import re

    run = client.submit(api_name="/run_sample")
    for update in run:
        if re.search(r"\b([1-9]\d*)/80 frames", status_of(update)):
            break
    answer = client.submit("What is there now?", api_name="/ask").result()
    full_text = answer[9][1]["content"][0]["text"]
    seen = int(re.search(r"(\d+) visual tokens", full_text).group(1))
    final = run.result()
    assert "80/80 frames" in status_of(final)
    assert 0 < seen < 80 // 2 * 16, "the baseline answered from the stream so far, mid-run"
