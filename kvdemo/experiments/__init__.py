"""Policies measured on streams: side by side on one stream (compare), accuracy vs query delay (evaluation; its
command eval_command, and sweep: the protocol live for the app), the run folders and their table (results)."""
