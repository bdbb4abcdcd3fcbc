"""Several policies on one stream (kvdemo.experiments.compare): the choices and their errors, the memory bound held by real
bytes, the CLI's one-file report, and the app's comparison page through gradio_client (directly and under ZeroGPU
emulation)."""

from __future__ import annotations

import json

import pytest
from gradio_client import handle_file

from kvdemo.cli import main
from kvdemo.errors import PolicyChoiceError, PolicyParameterError, UnknownPolicyError
from kvdemo.experiments.compare import compare_engines, memory_bound, parse_overrides
from kvdemo.stream.streaming import stream_video
from kvdemo.world.synthetic import sample_episode
from test_app import fetch_json, new_client

FOUR = ["infinipot-v", "cords", "protokv", "hybridkv"]
# Outputs of /compare_sample and /compare_run, and of /compare_ask, by position (the session state is not an output).
STATUS, PLOT, STRIPS, RUN_ASK_STATUS, ATTRIBUTION, ATTRIBUTION_TEXT, FIDELITY_PLOT, REPORT = range(8)
TITLES, CHATS = 8, 13
ASK_STATUS, ASK_ATTRIBUTION, ASK_ATTRIBUTION_TEXT, ASK_REPORT, ASK_CHATS = range(5)


@pytest.mark.parametrize(
    "names, text, message, kind",
    [
        (FOUR + ["uniform"], "", "at most 4", PolicyChoiceError),
        (["cords", "cords"], "", "each policy once", PolicyChoiceError),
        (["full"], "", "'full' is always compared", PolicyChoiceError),
        (["full", "bogus"], "", "unknown policy 'bogus'", UnknownPolicyError),
        (FOUR + ["bogus"], "", "unknown policy 'bogus'", UnknownPolicyError),
        ([], "", "at least one", PolicyChoiceError),
        (["cords"], "uniform: M=10", "names no compared policy", PolicyParameterError),
        (["cords"], "cords: M96", "not key=value", PolicyParameterError),
    ],
)
def test_bad_choices_are_one_line_errors(names, text, message, kind):
    with pytest.raises(kind, match=message):
        parse_overrides(names, text)


def test_a_policy_line_gives_it_its_own_budget_and_parameters(tiny_random):
    contenders = parse_overrides(["infinipot-v", "hybridkv"], "hybridkv: M=480 C=360 share=0.5\n")
    engines = compare_engines(tiny_random, contenders, 320, 240, 2.0)
    assert list(engines) == ["infinipot-v", "hybridkv", "full"]
    assert (engines["infinipot-v"].budget.M, engines["infinipot-v"].budget.C) == (320, 240)
    assert (engines["hybridkv"].budget.M, engines["hybridkv"].budget.C) == (480, 360)
    assert engines["hybridkv"].policy.share == 0.5 and engines["full"].budget.M is None
    with pytest.raises(PolicyParameterError, match="alpha"):
        compare_engines(tiny_random, parse_overrides(["cords"], "cords: alpha=x"), 320, 240, 2.0)


@pytest.mark.slow
def test_the_stated_memory_bound_holds_in_real_bytes():
    from kvdemo.models.loading import load_model

    model = load_model("tiny")
    video = sample_episode("moving").video.sampled(2.0).resized(model.geometry)
    engines = compare_engines(model, parse_overrides(FOUR), 64, 48, video.fps)
    for _ in stream_video(model, video, engines):
        pass
    per_token = engines["full"].memory.token_bytes()  # the memory's own count of one token's bytes
    bound = memory_bound(model, engines, 16.0, None)
    assert bound["bytes_per_token"] == per_token
    for name in FOUR:
        memory = engines[name].memory
        peak = max(event.cache_bytes for event in memory.timeline)
        # M bounds the visual tokens (summary slots included); the text prefix is never evicted and not in M.
        assert peak <= bound["bounded_bytes"][name] + memory.prefix_len * per_token, name
    full_growth = engines["full"].memory.timeline[-1].cache_bytes - engines["full"].memory.timeline[0].cache_bytes
    seconds = engines["full"].memory.timeline[-1].time_s - engines["full"].memory.timeline[0].time_s
    assert full_growth / seconds * 60 == pytest.approx(bound["full_bytes_per_minute"], rel=0.05)
    assert "memory grows with the number of policies: 4 bounded engines" in bound["text"]


@pytest.mark.slow
def test_cli_compare_writes_one_report_per_engine_in_one_file(tmp_path, capsys):
    out = tmp_path / "compare.json"
    question = "What colour was the circle?"
    assert (
        main(
            [
                "compare",
                "--model",
                "tiny",
                "-M",
                "64",
                "-C",
                "48",
                "--ask",
                question,
                "--attribution",
                "--fidelity",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    report = json.loads(out.read_text())
    assert set(report["policies"]) == set(FOUR) and report["full"]["policy"] == "full"
    for name, engine_report in report["policies"].items():
        assert engine_report["policy"] == name and engine_report["peak_visual_tokens"] <= 64
        assert engine_report["frames"] == 80
    assert report["full"]["peak_visual_tokens"] == 640
    [record] = report["questions"]
    expected = sample_episode().answer_for(question).answer
    assert record["expected"] == expected
    assert set(record["answers"]) == set(FOUR) | {"full"}
    assert record["answers"]["full"]["correct"] is True and record["answers"]["full"]["answer"] == expected
    for name, answer in record["answers"].items():
        shares = answer["attribution"]["share"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        assert len(answer["attribution"]["frame_share"]) == 40
    assert record["answers"]["full"]["evidence_ratio"] > 1
    assert set(record["fidelity"]) == set(FOUR)
    assert all(len(f["layer_error"]) == 4 and f["first_token_kl"] >= 0 for f in record["fidelity"].values())
    assert report["memory"]["text"] in printed.err
    # Progress on stderr while it works: the model's load, a bar over the 80 frames, a line per question.
    assert "loading model tiny" in printed.err and "80/80" in printed.err
    assert "asking 5 engines question 1 of 1" in printed.err
    assert report["timing"]["stream_s"] == 40 and report["timing"]["model_s"] > 0
    assert "model work" in printed.out and "evidence ratio" in printed.out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "infinipot-v,cords,protokv,hybridkv,uniform"], "at most 4"),
        (["--policies", "cords,nope"], "nope"),
        (["--policies", "cords", "-M", "8", "-C", "4"], "cords: M=8 is smaller than one chunk"),
        (["--override", "cords: M=x"], "M"),
    ],
)
def test_cli_compare_errors_are_one_line(capsys, extra, message):
    assert main(["compare", "--model", "tiny", "--max-frames", "4", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and message in err[-1]


def compare_sample(client, policies=FOUR, overrides="", budget=96, keep=72):
    return client.predict(
        model="tiny",
        policies=policies,
        overrides=overrides,
        budget=budget,
        keep=keep,
        fps=2,
        max_pixels=15680,
        cap_mb=2048,
        sample_kind="static",
        api_name="/compare_sample",
    )


@pytest.mark.slow
def test_the_comparison_page_through_gradio_client(app_url):
    client = new_client(app_url)
    early = client.predict("What colour was the circle?", True, api_name="/compare_ask")
    assert "no video yet" in early[ASK_STATUS]
    final = compare_sample(client)
    assert "80/80 frames" in final[STATUS] and "memory grows with the number of policies" in final[STATUS]
    assert [t.split("**")[1] for t in final[TITLES : TITLES + 5]] == [*FOUR, "full cache"]
    assert final[STRIPS] is not None and final[PLOT] is not None
    report = fetch_json(final[REPORT])
    assert set(report["policies"]) == set(FOUR) and report["full"]["peak_visual_tokens"] == 640
    episode = sample_episode()
    first = client.predict(episode.questions[0].text, True, api_name="/compare_ask")
    second = client.predict(episode.questions[1].text, False, api_name="/compare_ask")  # multi-turn, no attribution
    for chat in second[ASK_CHATS : ASK_CHATS + 5]:
        assert [m["content"][0]["text"] for m in chat if m["role"] == "user"] == [q.text for q in episode.questions[:2]]
        assert "ground truth" in chat[-1]["content"][0]["text"]
    assert first[ASK_ATTRIBUTION] is not None and "Evidence ratio" in first[ASK_ATTRIBUTION_TEXT]
    answered = fetch_json(second[ASK_REPORT])["questions"]
    assert "attribution" in answered[0]["answers"]["full"] and "attribution" not in answered[1]["answers"]["full"]
    fidelity = client.predict(episode.questions[0].text, api_name="/compare_fidelity")
    assert all(name in fidelity[1] for name in FOUR) and "first-token KL" in fidelity[1]
    sweep = client.predict(
        "0, 8",
        1,
        model="tiny",
        policies=["infinipot-v", "cords"],
        overrides="",
        budget=64,
        keep=48,
        fps=2,
        max_pixels=15680,
        cap_mb=0,
        sample_kind="static",
        api_name="/compare_sweep",
    )
    table = sweep[1]
    assert "✓" in table and all(f"| {name} |" in table for name in ("infinipot-v", "cords", "full"))
    assert "| full | 1.00 | 1.00 |" in table  # the full cache answers every sample question at every delay


@pytest.mark.slow
def test_comparison_errors_are_messages_and_the_page_keeps_serving(app_url, media, tmp_path):
    client = new_client(app_url)
    too_many = compare_sample(client, FOUR + ["uniform"])
    assert "at most 4" in too_many[STATUS]
    assert "names no compared policy" in compare_sample(client, ["cords"], "uniform: M=9")[STATUS]
    assert "smaller than one chunk" in compare_sample(client, ["cords"], budget=8, keep=4)[STATUS]
    damaged = client.predict(
        handle_file(str(media / "corrupted.mp4")),
        model="tiny",
        policies=["cords"],
        overrides="",
        budget=96,
        keep=72,
        fps=2,
        max_pixels=15680,
        cap_mb=0,
        sample_kind="static",
        api_name="/compare_run",
    )
    assert "could not be decoded" in damaged[STATUS] and "9/9 frames" in damaged[STATUS]
    sweep = client.predict(
        "0, x",
        0,
        model="tiny",
        policies=["cords"],
        overrides="",
        budget=64,
        keep=48,
        fps=2,
        max_pixels=15680,
        cap_mb=0,
        sample_kind="static",
        api_name="/compare_sweep",
    )
    assert "delays" in sweep[1]
    good = client.predict(
        handle_file(str(media / "flipping_a_pancake.mkv")),
        model="tiny",
        policies=["cords", "uniform"],
        overrides="",
        budget=96,
        keep=72,
        fps=2,
        max_pixels=15680,
        cap_mb=0,
        sample_kind="static",
        api_name="/compare_run",
    )
    assert "20/20 frames" in good[STATUS]
    # Answers about a real video carry the offline model's warning, as on the single-policy tab...
    asked = client.predict("What is cooking?", True, api_name="/compare_ask")
    for chat in asked[ASK_CHATS : ASK_CHATS + 3]:  # cords, uniform, the full cache
        assert "on this video its answers mean little" in chat[-1]["content"][0]["text"]
    # ...and a comparison that fails leaves the previous one saying it is the previous one, in the status and the chart.
    failed = compare_sample(client, ["cords"], budget=8, keep=4)
    assert failed[STATUS].startswith("⚠️ **") and "smaller than one chunk" in failed[STATUS]
    assert "Still showing the previous comparison: flipping_a_pancake.mkv" in failed[STATUS]
    assert "the previous comparison (flipping_a_pancake.mkv" in failed[PLOT]["plot"]
    assert failed[STRIPS] == {"__type__": "update"}, "the previous strips stay, under the status that says so"
    again = client.submit(
        handle_file(str(media / "flipping_a_pancake.mkv")),
        model="tiny",
        policies=["cords"],
        overrides="",
        budget=96,
        keep=72,
        fps=2,
        max_pixels=15680,
        cap_mb=0,
        sample_kind="static",
        api_name="/compare_run",
    )
    final = again.result()
    assert "previous comparison" not in final[PLOT]["plot"] and "20/20 frames" in final[STATUS]
    assert again.outputs()[0][RUN_ASK_STATUS] == "", "a new comparison clears the last question's status"


@pytest.mark.slow
def test_the_comparison_under_zerogpu_emulation_answers_like_the_app(app_url, emulated_app_url):
    answers = []
    for url in (app_url, emulated_app_url):
        client = new_client(url)
        assert "80/80 frames" in compare_sample(client, ["infinipot-v", "hybridkv"])[STATUS]
        asked = client.predict("What colour was the star?", True, api_name="/compare_ask")
        answers.append(
            [chat[-1]["content"][0]["text"].split(" tokens in")[0] for chat in asked[ASK_CHATS : ASK_CHATS + 3]]
        )
        assert "first-token KL" in client.predict("What colour was the star?", api_name="/compare_fidelity")[1]
        sweep = client.predict(
            "0",
            0,
            model="tiny",
            policies=["infinipot-v"],
            overrides="",
            budget=64,
            keep=48,
            fps=2,
            max_pixels=15680,
            cap_mb=0,
            sample_kind="static",
            api_name="/compare_sweep",
        )
        answers[-1].append(sweep[1].split("\n\n", 1)[1])  # the accuracy table (a GPU call that yields as it goes)
    assert answers[0] == answers[1]


def test_cli_compare_on_a_damaged_file_says_what_was_lost(media, capsys, tmp_path):
    out = tmp_path / "damaged.json"
    assert (
        main(
            [
                "compare",
                "--model",
                "tiny",
                "--video",
                str(media / "corrupted.mp4"),
                "--policies",
                "cords",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "1 damaged frame could not be decoded and was skipped" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["policies"]["cords"]["lost_frames"] == 1 and report["full"]["frames"] == 9


@pytest.mark.slow
def test_a_comparison_freed_for_another_session_says_so_when_asked():
    """The comparison tab's sessions count against the app's session limit like the single-policy tab's."""
    from kvdemo.app.comparing import CompareUpdates
    from kvdemo.app.handlers import ask, run_stream
    from kvdemo.app.sessions import AppServices, CompareSettings

    services = AppServices.create("tiny", max_sessions=1)
    settings = CompareSettings("tiny", ["cords"], "", 64, 48, 2.0, 15680, 0.0)
    first = [u for u in run_stream(services, None, None, settings, CompareUpdates())][-1]["session"]
    second = [u for u in run_stream(services, None, None, settings, CompareUpdates())][-1]["session"]
    assert second.group is not None and first.group is None
    [said] = list(ask(first, "What colour was the circle?", CompareUpdates(), attribute=True))
    assert "freed to make room" in said["ask_status"]
    answered = list(ask(second, "What colour was the circle?", CompareUpdates(), attribute=True))[-1]
    assert answered["ask_status"].startswith("✓")
