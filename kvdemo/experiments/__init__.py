"""Policies measured on streams: side by side on one stream (compare), accuracy vs query delay (evaluation), the run folders and their table (results)."""
