"""The Gradio app: stream a video or the webcam into a policy engine and a full-cache baseline, watch the
cache live, see what survives, and chat with both side by side.

Rooms: :mod:`.sessions` (models loaded once, sessions and their turns), :mod:`.settings` (what the user
typed, checked as a run would), :mod:`.gpu` (the model work as calls with explicit state, ZeroGPU-ready),
:mod:`.views` (what is shown of a session), :mod:`.handlers` (what the buttons do) and :mod:`.layout` (the
page and its wiring; the only Gradio import). No model logic here: handlers drive :mod:`kvdemo.engine` and
draw with :mod:`kvdemo.viz`.
"""

from .layout import build_demo, launch

__all__ = ["build_demo", "launch"]
