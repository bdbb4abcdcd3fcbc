"""Frames in: how a model family sizes frames (geometry) and a video file decoded, sampled and chunked by it (video)."""
