"""Every policy the app offers, through gradio_client, at several budgets on the bundled sample and on the real
clip: each run ends with its status and report, every view the policy declares is drawn, a question is answered,
and the server logs no traceback. (ProtoKV broke in the app at budgets its tests
never used: a view drew a grid whose thumbnail the stream segment did not carry.)"""

import pytest
from gradio_client import handle_file

from kvdemo.app.layout import UI_POLICIES
from kvdemo.models.catalog import OFFLINE_MODELS, default_budget
from kvdemo.policies import policy_card, policy_class
from test_app import REPORT, STATUS, answer_text, fetch_json, new_client

pytestmark = pytest.mark.slow  # every policy through a launched app

#: Outputs of /run and /run_sample after the named ones: each policy-view slot's text, image and chart.
FIRST_PANEL = 13
#: Budgets (visual tokens): the sample's chunk is 16 tokens, the clip's 15 (the tiny model's pixel range); 512 is
#: more than either stream holds (the clip: 150, the sample at 1 fps: 320).
BUDGETS = (64, 192, 512)


def panel_titles(outputs) -> list[str]:
    """The titles of the policy views an update drew (a slot's text is '**title** — caption')."""
    texts = outputs[FIRST_PANEL::3]
    return [text.split("**")[1] for text in texts if isinstance(text, str) and text.startswith("**")]


@pytest.fixture(scope="module")
def client(app_url):
    return new_client(app_url)


@pytest.mark.parametrize("source", ["sample", "clip"])
@pytest.mark.parametrize("policy", UI_POLICIES)
def test_every_policy_runs_in_the_app_at_several_budgets(client, app, media, policy, source):
    before = app.log.read_text().count("Traceback")
    takes_keep = policy_class(policy).takes_keep()
    for budget in BUDGETS:
        keep = budget * 3 // 4 if takes_keep else None
        settings = dict(model="tiny", policy=policy, budget=budget, keep=keep, baseline=budget == 192)
        if source == "sample":
            job = client.submit(**settings, fps=1, api_name="/run_sample")
        else:
            job = client.submit(handle_file(str(media / "flipping_a_pancake.mkv")), **settings, api_name="/run")
        final = job.result()
        frames = "40/40 frames" if source == "sample" else "20/20 frames"
        assert final[STATUS].startswith(f"**{frames}**"), (budget, final[STATUS])
        report = fetch_json(final[REPORT])
        assert report["policy"] == policy and report["peak_visual_tokens"] <= budget
        drawn = set(panel_titles(final))
        if policy_card(policy).view_titles and any(event["event"] == "compress" for event in report["timeline"]):
            assert drawn == set(policy_card(policy).view_titles), f"{policy} at M={budget}: drew {drawn}"
        if budget == 192:
            _, policy_chat, full_chat, _ = client.predict("What colour was the circle?", api_name="/ask")
            assert "first token" in answer_text(policy_chat) and "first token" in answer_text(full_chat)
    assert app.log.read_text().count("Traceback") == before, app.log.read_text()[-3000:]


@pytest.mark.parametrize("model", [name for name in OFFLINE_MODELS if name.startswith("tiny-random-")])
def test_every_family_runs_in_the_app(client, app, media, model):
    """Each family's offline model streams the real clip in the app at its own default budget (the one choosing it
    in the list sets), stays under M, reports its stream text and linear state, and answers on both engines."""
    before = app.log.read_text().count("Traceback")
    budget, keep, pixels = default_budget(model)
    family = OFFLINE_MODELS[model].family
    for policy in ("infinipot-v", "protokv"):
        final = client.predict(
            handle_file(str(media / "flipping_a_pancake.mkv")),
            model=model,
            policy=policy,
            budget=budget,
            keep=keep if policy_class(policy).takes_keep() else None,
            max_pixels=pixels,
            baseline=True,
            api_name="/run",
        )
        assert final[STATUS].startswith("**20/20 frames**"), final[STATUS]
        report = fetch_json(final[REPORT])
        assert report["model"] == model and report["peak_visual_tokens"] <= budget
        assert any(event["event"] == "compress" for event in report["timeline"]), (
            "the default budget compresses the clip"
        )
        assert (report["text_tokens"] > 0) == family.startswith("qwen3"), "Qwen3-VL/3.5 streams carry their timestamps"
        assert (report["linear_state_bytes"] > 0) == (family == "qwen3_5")
        _, policy_chat, full_chat, _ = client.predict("What is in the video?", api_name="/ask")
        assert "first token" in answer_text(policy_chat) and "first token" in answer_text(full_chat)
    assert app.log.read_text().count("Traceback") == before, app.log.read_text()[-3000:]


#: Values no component takes, sent through the API: (endpoint, keyword arguments, the one-line error).
BAD_INPUTS = [
    ("/run_sample", dict(budget="abc"), "M (max visual tokens): a number, got 'abc'"),
    ("/run_sample", dict(budget=[1]), "M (max visual tokens): a number, got [1]"),
    ("/run_sample", dict(fps="x"), "Sampling fps: a number, got 'x'"),
    ("/run_sample", dict(fps=100), "Sampling fps: between 0.5 and 8, got 100"),
    ("/run_sample", dict(max_pixels="lots"), "Max pixels per frame: a number, got 'lots'"),
    ("/run_sample", dict(policy="nosuch"), "Policy: unknown choice 'nosuch'; the choices: " + ", ".join(UI_POLICIES)),
    ("/run_sample", dict(sample_kind="weird"), "Bundled sample: unknown choice 'weird'; the choices: static, moving"),
    ("/run_sample", dict(baseline="maybe"), "Full-cache baseline: true or false, got 'maybe'"),
    (
        "/run",
        dict(video="/etc/passwd"),
        "Upload a video (mp4, mkv, mov, webm, avi): a file (gradio_client's handle_file(path)), got '/etc/passwd'",
    ),
    ("/ask", dict(question=["a"]), "Ask both engines: text, got ['a']"),
    (
        "/check_settings",
        dict(policy="nosuch"),
        "Policy: unknown choice 'nosuch'; the choices: " + ", ".join(UI_POLICIES),
    ),
    ("/compare_sample", dict(budget="abc"), "M (shared): a number, got 'abc'"),
    (
        "/compare_sample",
        dict(policies="infinipot-v"),
        "Policies (at most 4): a list of choices among " + ", ".join(UI_POLICIES) + ", got 'infinipot-v'",
    ),
    (
        "/compare_sample",
        dict(policies=["nosuch"]),
        "Policies (at most 4): unknown choice 'nosuch'; the choices: " + ", ".join(UI_POLICIES),
    ),
    ("/compare_sweep", dict(more="x"), "More held-out streams of the sample's kind: a number, got 'x'"),
    ("/compare_ask", dict(question="hi", attribute="x"), "what each answer looked at: true or false, got 'x'"),
]


#: Values the components take and the handlers refuse: (endpoint, keyword arguments, output index, part of the message).
HANDLED_INPUTS = [
    ("/run_sample", dict(max_pixels=0), 0, "max pixels must be at least"),
    ("/run_sample", dict(budget=-5, keep=768), 0, "M and C must be positive"),
    ("/run_sample", dict(budget=10**12, keep=768), 0, "more visual tokens than any stream holds"),
    ("/compare_sample", dict(policies=[]), 0, "at least one"),
    ("/compare_sweep", dict(delays="x"), 1, "delays are seconds separated by commas"),
]


def test_values_no_component_takes_are_one_line_errors_and_the_log_stays_clean(client, app):
    """A string for a number, an unknown choice, a path for a file, sent by API, come back as one line naming the
    field (Gradio's preprocessing alone would leave a traceback in the log for each); the app keeps serving."""
    from gradio_client.exceptions import AppError

    before = app.log.read_text()
    for endpoint, values, message in BAD_INPUTS:
        with pytest.raises(AppError) as raised:
            client.predict(**values, api_name=endpoint)
        assert str(raised.value) == message, endpoint
    for endpoint, values, output, message in HANDLED_INPUTS:  # values components take, which the handlers refuse
        assert message in client.predict(**values, api_name=endpoint)[output], endpoint
    log = app.log.read_text()[len(before) :]
    assert "Traceback" not in log and log.count("rejected a call to") == len(BAD_INPUTS), log[-3000:]
    assert client.predict("infinipot-v", 96, 72, 2, 12544, None, "tiny", api_name="/check_settings").startswith("✓")
