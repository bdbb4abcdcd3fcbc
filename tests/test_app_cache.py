"""Files the app serves are deleted once they are older than the cache's age (an hour by default; 20 s here):
uploads, every heatmap JPEG, reports and charts, including those of components updated with gr.update, which
Gradio's own delete_cache never registers."""

import time

from gradio_client import Client, handle_file

from conftest import launch_app

AGE_S = 20


def test_served_files_are_deleted_after_the_cache_age_and_the_app_keeps_serving(tmp_path_factory, media):
    folder = tmp_path_factory.mktemp("short-cache-app")
    for app in launch_app(folder, KVDEMO_CACHE_TTL_S=str(AGE_S)):
        client = Client(app.url, download_files=False, verbose=False)
        client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), "tiny", "protokv", 96, api_name="/run")
        client.predict("What is cooking?", api_name="/ask")
        client.predict(api_name="/export_chart")
        served = [p for p in app.cache.rglob("*") if p.is_file()]
        kinds = {p.suffix for p in served}
        assert {".jpeg", ".json", ".html", ".mkv"} <= kinds, kinds  # heatmaps and panels, reports, the chart, the upload
        time.sleep(AGE_S + AGE_S / 6 + 5)  # older than the age, and one sweep later
        left = [p for p in served if p.exists()]
        assert left == [], f"{len(left)} of {len(served)} served files are still there: {left[:5]}"
        assert "served file(s) older than" in app.log.read_text()
        final = client.predict(handle_file(str(media / "flipping_a_pancake.mkv")), api_name="/run")
        assert "20/20 frames" in final[0], "the app keeps serving"
