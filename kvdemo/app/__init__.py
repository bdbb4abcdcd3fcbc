"""The Gradio app: stream a video or the webcam into a policy engine and a full-cache baseline, watch the
cache live, see what survives, and chat with both side by side.

Rooms: :mod:`.sessions` (models loaded once, settings, one session type for N engines and its turns),
:mod:`.settings` (what the user typed, checked as a run would), :mod:`.gpu` (the model work as calls with explicit
state, ZeroGPU-ready: the one feed and ask paths), :mod:`.handlers` (what both pages' buttons do),
:mod:`.page_updates` (what a page shows at each step), :mod:`.page` (both pages' shared events and their one error
guard); the single page: :mod:`.single_updates`, :mod:`.single_page` (its components) and :mod:`.single_events` (its
events); the Blocks of both pages: :mod:`.layout` (the only Gradio import); the comparison page: :mod:`.comparing` and :mod:`.compare_page`. No model logic here: handlers drive :mod:`kvdemo.stream.engine` and draw
with :mod:`kvdemo.viz`. The single page is a comparison with one contender.
"""

from .layout import build_demo, launch

__all__ = ["build_demo", "launch"]
