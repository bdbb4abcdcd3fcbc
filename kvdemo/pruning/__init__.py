"""Pruning before the LLM: which of a chunk's encoded visual tokens enter the memory at all (EVS, VidCom2, as vLLM
defines them), in front of any policy. Not a policy: a policy decides what stays once tokens are in; the budget
counts what entered. The choice as text (:mod:`.spec`, no torch: what this package's own name imports, so the
command line reads a choice before torch loads), the methods (:mod:`.evs`, :mod:`.vidcom2`), and one engine's
stage and its record of what was offered and entered (:mod:`.stage`)."""

from .spec import JOIN, METHODS, NONE, RATE, RETENTION, Method, PruneSpec, entry_label, parse_prune, split_entry

__all__ = [
    "JOIN",
    "METHODS",
    "NONE",
    "RATE",
    "RETENTION",
    "Method",
    "PruneSpec",
    "entry_label",
    "parse_prune",
    "split_entry",
]
