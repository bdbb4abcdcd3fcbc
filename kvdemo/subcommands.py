"""Each command of ``python -m kvdemo``: its options, and the description and examples its ``--help`` prints, one
function per command (:func:`kvdemo.usage.build_parser` calls them in the order ``--help`` lists the commands).
What the commands do is :mod:`kvdemo.cli`."""

from __future__ import annotations

import argparse
from typing import Any

from .experiments.evaluation import DEFAULT_DELAYS, EVAL_KINDS, QUESTION_FORMS
from .pruning import METHODS as PRUNING_METHODS
from .world.synthetic import STREAM_KINDS

#: Every command's help keeps its description's and examples' line breaks.
FORMATTER = argparse.RawDescriptionHelpFormatter
#: What ``--prune`` takes, from the methods' own declarations.
PRUNE_HELP = (
    "pruning before the LLM, in front of the policy: "
    + ", ".join(f"{name}:{method.parameter.upper()}" for name, method in PRUNING_METHODS.items())
    + " (evs:0.75 prunes 3/4 of the visual tokens, vidcom2:0.25 keeps 1/4; vLLM's parameters); default none"
)
#: What ``--policies`` says of an engine entry with pruning in front of its policy.
PRUNED_ENTRY = "; METHOD:VALUE+POLICY puts pruning in front of one (evs:0.75+full)"


class PolicyHelp:
    """What the help texts say about the registered policies: read from ``catalog`` (the :mod:`kvdemo.policies`
    module) when it is given, which only ``--help`` does (importing the policies imports torch); generic wording
    otherwise."""

    def __init__(self, catalog: Any = None) -> None:
        self.catalog = catalog
        self.policies = dict(catalog.REGISTRY) if catalog is not None else {}
        self.listed = f"one of: {', '.join(self.policies)}" if self.policies else "a registered name"
        sized_by_m = [name for name, cls in self.policies.items() if cls.bounded and not cls.takes_keep()]
        self.no_keep = (
            f"{', '.join(sized_by_m)} take{'s' if len(sized_by_m) == 1 else ''} none: sized by M alone"
            if sized_by_m
            else "a policy sized by M alone takes none"
        )
        updating = [name for name in self.policies if "update" in catalog.policy_card(name).bench.benchmarks]
        self.update_owner = ", ".join(updating) if updating else "a policy with an update benchmark"
        # What each policy keeps, from its card (the run command's help lists them above its examples).
        self.summaries = "".join(f"\n  {name:<15} {catalog.policy_card(name).summary}" for name in self.policies)

    def named(self, text: str, default: str) -> str:
        """``text`` and the catalog's ``default`` (the name of a policy it defines, or of a tuple of them)."""
        if self.catalog is None:
            return text
        value = getattr(self.catalog, default)
        return f"{text}; default {value if isinstance(value, str) else ','.join(value)}"


def add_stream_options(stream: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What run and compare share, added to ``stream`` (their parent parser): the stream (a file or the bundled
    sample), its sampling, the model, questions, output."""
    stream.add_argument(
        "--video", help="video file (mp4, mkv, mov, webm, avi...); default: the bundled sample (a generated stream)"
    )
    stream.add_argument(
        "--sample",
        choices=STREAM_KINDS,
        default="static",
        help="without --video: which bundled sample, static (fixed camera, the default) or moving (camera "
        "pans and zooms, background drifts, objects reappear)",
    )
    stream.add_argument(
        "--model", help="tiny, tiny-random, auto, or a Hugging Face id / local path (default: $KVDEMO_MODEL or auto)"
    )
    stream.add_argument("--fps", type=float, default=2.0, help="sampling fps (default 2)")
    stream.add_argument("--max-frames", type=int, help="stop after this many sampled frames")
    stream.add_argument(
        "--max-pixels", type=int, help="max pixels per frame after resize (default: the model's own range)"
    )
    stream.add_argument(
        "--min-pixels", type=int, help="min pixels per frame after resize (default: the model's own range)"
    )
    stream.add_argument(
        "--ask", action="append", default=[], metavar="QUESTION", help="question asked after the stream (repeatable)"
    )
    stream.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap (default 64)")
    stream.add_argument("--prune", metavar="METHOD:VALUE", help=PRUNE_HELP)
    stream.add_argument("--json", metavar="OUT", help="write the report here")
    return stream


RUN_DESCRIPTION = """\
Stream one video (default: the bundled sample) through one policy: the cache holds at most M visual
tokens and each compression keeps C of them. Prints progress, answers to --ask questions and a summary;
--json writes the full run report (occupancy timeline, survivors, answers)."""

RUN_EXAMPLES = """\
examples:
  python -m kvdemo run
      the bundled sample through infinipot-v with an automatic budget
  python -m kvdemo run --sample moving -M 64 -C 48 --ask "Which shape appeared first?"
      the moving-camera sample
  python -m kvdemo run --video clip.mp4 -M 6144 -C 4608 --ask "What happens at the end?" --json report.json
  python -m kvdemo run --video clip.mp4 --param alpha=1 --param tar=frame
      an InfiniPot-V ablation from the paper's Table 5 (TaR only, frame-level)
  python -m kvdemo run --video clip.mp4 --policy cords --coverage
      CoRDS, with how well the kept tokens cover a full cache
  python -m kvdemo run --policy full --prune evs:0.75
      EVS before the LLM, the full cache behind it
  python -m kvdemo run -M 64 -C 48 --prune vidcom2:0.5
      VidCom2 (half enter) in front of the default policy
  python -m kvdemo run --realtime --ask "What colour was the circle?" --ask-at 5,12
      the sample played live at its own pace, the question asked at 5 s and 12 s while the stream goes on;
      prints each answer and how far behind live the memory was"""


def add_run(commands: Any, stream: argparse.ArgumentParser, about: PolicyHelp) -> None:
    """``run``: one video through one policy."""
    run = commands.add_parser(
        "run",
        help="stream a video through one policy (and optionally ask questions)",
        parents=[stream],
        description=RUN_DESCRIPTION,
        epilog=(f"policies:{about.summaries}\n\n" if about.policies else "") + RUN_EXAMPLES,
        formatter_class=FORMATTER,
    )
    run.add_argument("--policy", help=about.named(f"compression policy, {about.listed}", "DEFAULT_POLICY"))
    # M and C are read as text and checked by the budget's one rule (1e25 is a one-line error, not argparse's).
    run.add_argument(
        "--budget", "-M", help="M: max visual tokens held (default: about a third of the stream's, at most 6144)"
    )
    run.add_argument("--keep", "-C", help=f"C: visual tokens kept by a compression (default 0.75 M; {about.no_keep})")
    run.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter, value read as JSON (repeatable), e.g. --param alpha=0.3",
    )
    run.add_argument("--frames-per-chunk", type=int, default=2, help="frames per prefill chunk (default 2)")
    run.add_argument(
        "--coverage",
        action="store_true",
        help="also stream a full cache and report how well the kept tokens cover it (CoRDS Sec. 4.6)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--realtime",
        action="store_true",
        help="play the video at its own pace, as a live source: each frame is captured when its time comes, and "
        "each chunk's lag behind live (captured -> in the memory) is printed and reported",
    )
    run.add_argument(
        "--ask-at",
        type=seconds_list,
        metavar="S1,S2,...",
        help="stream seconds at which the --ask questions are asked, without pausing the stream (one question: "
        "asked at each; else one second per question; past the stream's end: at its end)",
    )
    run.add_argument(
        "--max-waiting",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --realtime or --ask-at: seconds of frames that may wait for the device; past that the oldest "
        "waiting frames are dropped and counted (default 10)",
    )
    run.add_argument(
        "--pause-to-answer",
        action="store_true",
        help="with --ask-at: decode each answer whole before the next chunk (the stream pauses meanwhile, as "
        "kvdemo did before live scheduling), to compare the lag",
    )


def seconds_list(text: str) -> list[float]:
    """``5,12.5`` -> ``[5.0, 12.5]``: stream seconds, each finite and 0 or more (argparse's type for ``--ask-at``)."""
    try:
        seconds = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stream seconds separated by commas, e.g. 5,12; got {text!r}") from None
    if not seconds or not all(0 <= s < float("inf") for s in seconds):
        raise argparse.ArgumentTypeError(f"stream seconds, each 0 or more, e.g. 5,12; got {text!r}")
    return seconds


COMPARE_DESCRIPTION = """\
Stream one video (default: the bundled sample) into up to four policies and the full cache at once (one vision
encoding feeds them all), ask every engine the same questions, and write one report per engine in one file:
occupancy, survivors, graded answers, and with --attribution / --fidelity what each answer looked at and how far
each policy's attention output is from the full cache's."""

COMPARE_EXAMPLES = """\
examples:
  python -m kvdemo compare --policies infinipot-v,cords,protokv,hybridkv -M 64 -C 48 \\
      --ask "What colour was the circle?" --attribution --fidelity --json compare.json
  python -m kvdemo compare --sample moving --override "hybridkv: M=96 C=72 share=0.5"
      the moving-camera sample, HybridKV with its own budget and dynamic share
  python -m kvdemo compare --policies evs:0.75+full,infinipot-v,evs:0.5+infinipot-v -M 64 -C 48
      pruning alone (the full cache behind it), eviction alone, and pruning in front of eviction"""


def add_compare(commands: Any, stream: argparse.ArgumentParser, about: PolicyHelp) -> None:
    """``compare``: up to four policies and the full cache on one stream."""
    comparing = commands.add_parser(
        "compare",
        help="up to four policies and the full cache side by side on one stream",
        parents=[stream],
        description=COMPARE_DESCRIPTION,
        epilog=COMPARE_EXAMPLES,
        formatter_class=FORMATTER,
    )
    comparing.set_defaults(frames_per_chunk=2, param=[])  # what the checks shared with run read
    comparing.add_argument(
        "--policies", help=about.named("comma-separated, at most 4" + PRUNED_ENTRY, "COMPARE_POLICIES")
    )
    comparing.add_argument("--budget", "-M", help="M shared by every policy (default: 2/3 of the model's, 64 for tiny)")
    comparing.add_argument(
        "--keep", "-C", help="C shared by the policies that take one (default: 2/3 of the model's, 48 for tiny)"
    )
    comparing.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="'POLICY: M=.. C=.. prune=.. KEY=VALUE ..'",
        help="a policy's own budget, pruning and parameters (repeatable)",
    )
    comparing.add_argument(
        "--attribution", action="store_true", help="record what each answer looked at (kvdemo.analysis.explain)"
    )
    comparing.add_argument(
        "--fidelity",
        action="store_true",
        help="per-layer attention-output error and first-token KL of each policy against the full cache, per question",
    )
    comparing.add_argument(
        "--full-cap-mb", type=float, default=2048, help="the full cache stops here (default 2048; 0: no cap)"
    )
    comparing.add_argument("--quiet", action="store_true", help="no progress (bar and a line per question)")


EVAL_DESCRIPTION = """\
Accuracy vs query delay on held-out generated streams (ProtoKV's protocol): every episode streams once
through one engine per policy (one shared vision encoding); each question is asked of every engine at
every delay after its evidence left view; only questions askable at every delay count."""

EVAL_EXAMPLES = """\
examples:
  python -m kvdemo eval --policies full,sliding-window,uniform,infinipot-v,cords --delays 0,4,8,16,32 \\
      --episodes 200 --seed 0 --budget 64 --keep 48 --json eval.json
  python -m kvdemo eval --kind moving --budget 64 --keep 48
      the same on streams with camera motion, a drifting background and reappearing objects
  python -m kvdemo eval --policies full,evs:0.75+full,vidcom2:0.25+full,infinipot-v,evs:0.5+infinipot-v
      pruning before the LLM (METHOD:VALUE+POLICY), alone and in front of eviction"""


def add_eval(commands: Any, about: PolicyHelp) -> None:
    """``eval``: accuracy vs query delay on held-out streams."""
    evaluate = commands.add_parser(
        "eval",
        help="accuracy vs query delay on held-out generated streams",
        description=EVAL_DESCRIPTION,
        epilog=EVAL_EXAMPLES,
        formatter_class=FORMATTER,
    )
    evaluate.add_argument(
        "--policies", help=about.named("comma-separated policy names" + PRUNED_ENTRY, "EVAL_POLICIES")
    )
    evaluate.add_argument(
        "--delays",
        default=",".join(str(d) for d in DEFAULT_DELAYS),
        help="query delays in seconds of stream time, comma-separated (default 0,4,8,16,32)",
    )
    evaluate.add_argument("--episodes", type=int, default=200, help="held-out streams (default 200)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the held-out streams (default 0)")
    evaluate.add_argument(
        "--kind",
        choices=EVAL_KINDS,
        default="static",
        help="stream kind: static (fixed camera, the default), moving (camera pans and zooms, the "
        "background drifts, objects reappear) or mixed (the two alternating)",
    )
    evaluate.add_argument(
        "--budget",
        "-M",
        default="64",
        help="M for the bounded policies (visual tokens; default 64: 4 s of a generated stream)",
    )
    evaluate.add_argument("--keep", "-C", help="C for the policies that take one (visual tokens; default 0.75 M)")
    evaluate.add_argument("--model", default="tiny", help="the model (default: the trained tiny model)")
    evaluate.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the tiny model's matrices "
        "are small, and on a busy machine more threads stall each other)",
    )
    evaluate.add_argument(
        "--questions",
        choices=QUESTION_FORMS,
        default="bare",
        help="bare questions (default) or a benchmark's multiple-choice prompt of them (answer: the letter)",
    )
    evaluate.add_argument(
        "--prune", metavar="METHOD:VALUE", help=PRUNE_HELP + "; in front of every policy named without its own"
    )
    evaluate.add_argument("--json", metavar="OUT", help="write the results here")
    evaluate.add_argument(
        "--runs",
        default="runs",
        metavar="DIR",
        help="write the run folder (config, metrics, predictions) under DIR (default runs; '' for none)",
    )
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")
