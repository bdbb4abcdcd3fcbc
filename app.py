"""kvdemo's Gradio app: ``python app.py [--host H] [--port P] [--model NAME] [--share]``.

On Hugging Face Spaces this file is the entry point (see the README front matter); on ZeroGPU
Spaces ``spaces`` is imported before anything initialises CUDA. It logs each step of the start (the
imports and the model load take from seconds to minutes) and which model it loaded, on which device,
in which dtype.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

try:  # ZeroGPU: must come before torch initialises CUDA; absent elsewhere
    import spaces  # noqa: F401
except ImportError:
    spaces = None

log = logging.getLogger("kvdemo")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="kvdemo's Gradio app: watch a VLM's KV cache under a budget while it streams video"
    )
    parser.add_argument(
        "--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), help="interface to listen on"
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), help="port")
    parser.add_argument(
        "--model",
        default=os.environ.get("KVDEMO_MODEL", "auto"),
        help="tiny (trained offline model), tiny-random, auto (a real Qwen2.5-VL on a GPU, tiny "
        "otherwise) or a Hugging Face id",
    )
    parser.add_argument("--share", action="store_true", help="create a public Gradio link")
    args = parser.parse_args()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s kvdemo: %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # kvdemo's own steps only, not every library's

    log.info("importing torch and gradio")
    start = time.perf_counter()
    import gradio  # noqa: F401  (the slowest import: done here so the log says where the time goes)

    from kvdemo.app import launch
    from kvdemo.models.base import ModelError

    log.info("imported in %.1f s", time.perf_counter() - start)
    try:
        launch(host=args.host, port=args.port, model=args.model, share=args.share)
    except ModelError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
