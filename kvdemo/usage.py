"""What ``python -m kvdemo`` and each of its commands say about themselves: the descriptions and the examples their
``--help`` prints (the parser is :mod:`kvdemo.cli`)."""

DESCRIPTION = """\
Stream a video into a vision-language model frame chunk by frame chunk, keep its KV cache under a hard
budget with a compression policy, and report what survives (and answers, if asked)."""

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
      CoRDS, with how well the kept tokens cover a full cache"""

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
      the moving-camera sample, HybridKV with its own budget and dynamic share"""

BENCH_DESCRIPTION = """\
Stream a long synthetic video through the full cache and a bounded policy on the offline tiny model (one
shared vision encoding), print per-chunk prefill and compression times, visual tokens and cache bytes,
then time one compression pass on caches of Qwen2.5-VL-7B shape (M=6144 -> C=4608) in fp32 and bf16."""

BENCH_EXAMPLES = """\
examples:
  python -m kvdemo bench
  python -m kvdemo bench --policy infinipot-v --frames 100 --skip-pass --json bench.json
  python -m kvdemo bench --policy infinipot-v --reference ../InfiniPot-V --pass-repeats 7"""

DOCTOR_DESCRIPTION = """\
The device checklist: every policy x the offline models of each family streamed twice on the device (bfloat16
on CUDA, float32 on the CPU): under M, memory unchanged by asking, identical across runs; every policy with the
memory's layers split across two devices (cpu + cuda:0, or cpu + an emulated device without a GPU); the SDPA
backend kvdemo's masked attention gets; timings per policy. Prints tables and writes JSON."""

DOCTOR_EXAMPLES = """\
examples:
  python -m kvdemo doctor                      # the GPU when there is one, else the CPU
  python -m kvdemo doctor --device cuda --real-shapes --json doctor.json"""

EVAL_DESCRIPTION = """\
Accuracy vs query delay on held-out generated streams (ProtoKV's protocol): every episode streams once
through one engine per policy (one shared vision encoding); each question is asked of every engine at
every delay after its evidence left view; only questions askable at every delay count."""

EVAL_EXAMPLES = """\
examples:
  python -m kvdemo eval --policies full,sliding-window,uniform,infinipot-v,cords --delays 0,4,8,16,32 \\
      --episodes 200 --seed 0 --budget 64 --keep 48 --json eval.json
  python -m kvdemo eval --kind moving --budget 64 --keep 48
      the same on streams with camera motion, a drifting background and reappearing objects"""

TRAIN_DESCRIPTION = """\
Train the offline tiny model (transformers' Qwen2_5_VLForConditionalGeneration, 0.92M parameters) from
scratch on generated streams, reproducibly (about 36 min on two quiet CPU cores), check it on held-out streams
and write its weights, config and tokenizer to --out (default ./tiny-trained; a model already there is never
overwritten without --overwrite, so the bundled weights stay as they are). --from DIR instead starts from DIR's
weights and runs the experimental choice stages (VideoMME's and OVO-Bench's option-letter questions mixed in;
about 70 min on a busy machine; they have not taught the letters yet: docs/lmms-eval.md)."""

RESULTS_DESCRIPTION = """\
Tabulate run folders side by side (written by `python -m kvdemo eval` and by lmms-eval's --model kvdemo: config,
metrics, predictions) and draw accuracy against the budget M (one line per policy, the full cache dashed) or
against the delay (one line per run), as a Plotly HTML and a PNG."""

MAKE_TASKS_DESCRIPTION = """\
Write offline lmms-eval tasks on generated streams into DIR: a VideoMME-format task and OVO-Bench-format
backward and forward tasks, scored by lmms-eval's own VideoMME and OVO-Bench functions, and kvdemo's bare-question
task (each question asked at a stream time). Run them with --include_path DIR and HF_HOME=DIR/hf (docs/lmms-eval.md)."""
