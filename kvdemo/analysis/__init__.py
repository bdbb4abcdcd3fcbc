"""Reading a memory and an answer: what survives of each frame, how well a compressed cache covers the full one, what an answer looked at and what compression changed."""
