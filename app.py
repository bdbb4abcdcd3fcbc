"""kvdemo's Gradio app: ``python app.py [--host H] [--port P] [--model NAME] [--share]``.

On Hugging Face Spaces this file is the entry point (see the README front matter); on ZeroGPU
Spaces ``spaces`` is imported before anything initialises CUDA.
"""

from __future__ import annotations

import argparse
import os

try:  # ZeroGPU: must come before torch initialises CUDA; absent elsewhere
    import spaces  # noqa: F401
except ImportError:
    spaces = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), help="interface to listen on")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), help="port")
    parser.add_argument("--model", default=os.environ.get("KVDEMO_MODEL", "auto"),
                        help="tiny (trained offline model), tiny-random, auto (a real Qwen2.5-VL on a GPU, tiny "
                             "otherwise) or a Hugging Face id")
    parser.add_argument("--share", action="store_true", help="create a public Gradio link")
    args = parser.parse_args()

    from kvdemo.models.qwen_vl import ModelError
    from kvdemo.ui import launch

    try:
        launch(host=args.host, port=args.port, model=args.model, share=args.share)
    except ModelError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
