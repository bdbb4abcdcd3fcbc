"""Device discipline without a GPU: every tensor kvdemo creates lives beside the data it meets.

The emulated device (:mod:`kvdemo.devices.emulated_device`) runs whole compressions, the memory's writes and forks, the
offload store and the attention seam with real values while refusing what CUDA refuses; the ``meta`` device
stands in for a second device where only placement matters (``bind``); a static check reads the sources.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kvdemo.cache import attention
from kvdemo.cache.attention import grouped_sdpa, sdpa_backends, sdpa_scope
from kvdemo.devices.emulated_device import DEVICE, FACTORIES, DeviceMixError, EmulatedDevice, place_module
from kvdemo.policies import make_policy, policy_names
from kvdemo.policies.hybridkv import capped_allocation
from kvdemo.stream.engine import StreamEngine
from kvdemo.testing import qwen7b_rotation, synthetic_memory, synthetic_probe
from kvdemo.world.synthetic import sample_episode

PACKAGE = Path(__file__).resolve().parents[1] / "kvdemo"
POLICIES = ["sliding-window", "uniform", "infinipot-v", "cords", "hybridkv", "protokv"]
CPU = torch.device("cpu")


def test_the_emulated_device_refuses_what_cuda_refuses():
    with EmulatedDevice(), torch.inference_mode():
        x = torch.arange(6.0).to(DEVICE)
        assert x.device == DEVICE and torch.zeros(6, device=x.device).device == DEVICE
        assert (x + torch.zeros_like(x)).device == DEVICE and x.new_ones(2).device == DEVICE
        assert (x * torch.tensor(2.0)).device == DEVICE  # a 0-d host tensor is a scalar
        assert x[torch.tensor([0, 2])].device == DEVICE  # host indices are fine in [] indexing
        assert x.cpu().device == CPU and int(x.sum()) == 15
        with pytest.raises(DeviceMixError):
            x + torch.ones(6)  # a factory given no device makes a host tensor
        with pytest.raises(DeviceMixError):
            torch.cat([x, torch.ones(2)])
        with pytest.raises(DeviceMixError):
            x.numpy()
        host = torch.ones(6)
        assert host.to(DEVICE).device == DEVICE and host.device == CPU, "moving copies; the host tensor stays"
        window = host[2:5]
        assert window.copy_(x[:3]) is window  # copying from the device into host memory: the host tensor stays there
        assert window.device == CPU and (window + torch.ones(3)).device == CPU and host.tolist() == [1, 1, 0, 1, 2, 1]
        with pytest.raises(DeviceMixError):
            x + host


def test_hybridkv_budget_lines_that_mix_devices_are_refused():
    """HybridKV's budget lines written carelessly (a budget total made with no device, the held counts moved to the
    host) mix devices at their first compression: the emulated device says so, as CUDA does on the meta stand-in."""
    with EmulatedDevice(), torch.inference_mode():
        sparsity = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        held = torch.full((3, 4), 20, device=sparsity.device)
        total = torch.full((3,), 16 * 4, dtype=torch.long)  # no device
        with pytest.raises(DeviceMixError):
            capped_allocation(sparsity.double() * 16, held.cpu(), total)
        ok = capped_allocation(sparsity.double() * 16, held, torch.full((3,), 64, device=sparsity.device))
        assert ok.device == DEVICE and ok.sum(dim=1).tolist() == [64, 64, 64]


def _compress(policy_name: str, place) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One compression and its application on a small memory, ``place(memory)`` putting its layers somewhere
    first; the keys/values and provenance after it, on the host."""
    policy = make_policy(policy_name)
    budget = 64
    summary = policy.summary_slots(budget) if policy_name == "protokv" else 0
    keep = policy.split(budget)[0] if policy_name == "protokv" else 40
    memory = synthetic_memory(3, 2, 16, budget, (2, 4), torch.float32, visual_tokens=budget, summary_slots=summary)
    probe = synthetic_probe(3, 4, 16, torch.float32)
    rotary = qwen7b_rotation(16)
    with torch.inference_mode():
        place(memory)
        probe = [p.to(memory.devices[i]) for i, p in enumerate(probe)]
        memory.apply(policy.compress(memory.slices(rotary=rotary, probe=probe), keep))
        memory.to("cpu")
    return [torch.cat([s.keys, s.values]) for s in memory.layers], [s.packed.clone() for s in memory.layers]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("placement", ["device", "split"])
def test_every_policy_compresses_on_another_device_as_on_the_cpu(policy, placement):
    """All layers on the emulated device, or split as ``device_map`` splits a model (layer 0 on the host, the
    others on the device): the same tokens kept, bit for bit, and no host tensor met a device tensor."""
    expected = _compress(policy, lambda memory: None)
    mode = EmulatedDevice()
    target = DEVICE if placement == "device" else {0: "cpu", 1: DEVICE, 2: DEVICE}
    with mode:
        got = _compress(policy, lambda memory: memory.to(target))
    assert mode.ops > 50, "the compression ran on the device"
    for a, b in zip(expected[0] + expected[1], got[0] + got[1]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES + ["full"])
def test_the_engine_streams_and_answers_on_another_device(policy, tiny_random):
    """The tiny model's weights on the emulated device: prefill through the attention seam, compressions, the
    question on a fork (HybridKV's retrieval from host memory, ProtoKV's biased pseudo-tokens) answer exactly
    as on the CPU, and asking leaves the memory bit-identical."""
    frames = sample_episode().video.frames[:24]
    budget = {"full": {}, "protokv": {"budget": 128}}.get(policy, {"budget": 64, "keep": 32})

    def run(model):
        engine = StreamEngine(model, policy, **budget)
        for start in range(0, len(frames), 4):
            engine.feed(frames[start : start + 4])
        live = lambda: [t.clone() for t in (*engine.memory.keys, *engine.memory.values)]  # noqa: E731 (the live slots)
        before = live()
        answer = engine.answer("What colour was the circle?").answer
        assert all(torch.equal(a, b) for a, b in zip(before, live()))
        return answer, engine.memory.visual_tokens

    with torch.inference_mode():
        expected = run(copy.deepcopy(tiny_random))
    model = copy.deepcopy(tiny_random)
    mode = EmulatedDevice()
    with mode, torch.inference_mode():
        place_module(model.hf)
        model.device = DEVICE
        got = run(model)
    assert got == expected and mode.ops > 1000


class _SplitModel:
    """A model whose decoder layers sit on two devices (``meta`` standing in for the second GPU)."""

    def __init__(self, model, devices: dict[int, torch.device]) -> None:
        self._model, self._devices = model, devices

    def __getattr__(self, name):
        return getattr(self._model, name)

    def layer_devices(self) -> dict[int, torch.device]:
        return dict(self._devices)


@pytest.mark.parametrize("name", ["tiny", "tiny-random-qwen3.5"])
def test_bind_keeps_each_memory_layer_beside_its_weights(name):
    """``bind`` after a stream (as a ZeroGPU worker or a ``device_map`` model gets it): each memory layer moves
    to its own model layer's device; Qwen3.5's linear-attention state follows its layers too."""
    from kvdemo.models.loading import load_model

    model = load_model(name)
    engine = StreamEngine(model, "full")
    side = 4 * model.geometry.factor
    frames = np.random.default_rng(0).integers(0, 256, (8, side, side, 3), dtype=np.uint8)
    with torch.inference_mode():
        for start in range(0, 8, 4):
            engine.feed(frames[start : start + 4])
    layers = len(model.layer_map)
    devices = {i: CPU if i < layers // 2 else torch.device("meta") for i in range(layers)}
    engine.bind(_SplitModel(model, devices))
    expected = [devices[m] for m, memory_layer in enumerate(model.layer_map) if memory_layer is not None]
    assert engine.memory.devices == expected and len(set(expected)) == 2
    for layer, state in engine.memory.linear_state.items():
        assert {t.device for t in state.values()} == {devices[layer]}


def test_grouped_and_expanded_attention_are_the_same_attention():
    """The CPU's grouped call (SDPA's GQA, one mask per KV head) and CUDA's expanded one (KV heads expanded to
    the query heads, the mask in the query's dtype) both equal a hand softmax, with a per-KV-head bias and the
    causal block, in float64."""
    g = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((6, 4), (2, 11), (2, 11))
    )
    bias = torch.randn(2, 7, generator=g, dtype=torch.float64)
    bias[1, 2] = float("-inf")
    mask = torch.zeros(2, 4, 11, dtype=torch.float64)
    mask[:, :, :7] = bias[:, None]
    mask[:, :, 7:] = torch.triu(torch.full((4, 4), float("-inf"), dtype=torch.float64), 1)
    scores = torch.einsum("hqd,hkd->hqk", query[0], key[0].repeat_interleave(3, 0)) * 0.3 + mask.repeat_interleave(3, 0)
    expected = torch.einsum("hqk,hkd->hqd", torch.softmax(scores, -1), value[0].repeat_interleave(3, 0))
    for expand in (False, True):
        out = grouped_sdpa(query, key, value, mask, 0.3, expand_kv=expand)
        torch.testing.assert_close(out[0], expected, rtol=1e-12, atol=1e-12)
    causal = torch.ones(4, 11, dtype=torch.bool).tril(7)
    plain_scores = torch.einsum("hqd,hkd->hqk", query[0], key[0].repeat_interleave(3, 0)) * 0.3
    plain = torch.softmax(plain_scores.masked_fill(~causal, float("-inf")), -1)
    for expand in (False, True):
        out = grouped_sdpa(query, key, value, causal, 0.3, expand_kv=expand)
        torch.testing.assert_close(
            out[0], torch.einsum("hqk,hkd->hqd", plain, value[0].repeat_interleave(3, 0)), rtol=1e-12, atol=1e-12
        )


def test_the_expanded_call_copies_neither_the_mask_nor_the_keys_per_query_head(monkeypatch):
    """With a mask, CUDA's expanded call hands SDPA each KV head as a batch entry: keys and values expanded to the
    group with stride 0, a per-KV-head mask as ``[H_kv, 1, q, kv]``, the shared causal one as it is (measured on an
    H200: the mask copied to ``[1, H_q, q, kv]`` held 207 MB more at Qwen2.5-VL-3B's 720-token chunk, keys and values
    repeated to the query heads 54 MB more, for the same bits)."""
    from kvdemo.cache import attention

    seen = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attention.F,
        "scaled_dot_product_attention",
        lambda q, k, v, attn_mask=None, **kw: (
            seen.append((q.shape, k.stride(), attn_mask.shape)) or real(q, k, v, attn_mask=attn_mask, **kw)
        ),
    )
    query = (
        torch.randn(1, 6, 4, 8).transpose(1, 2).contiguous().transpose(1, 2)
    )  # [1, H_q, q, D] as transformers hands it
    key = torch.randn(1, 2, 11, 8)
    grouped_sdpa(query, key, key, torch.zeros(2, 4, 11), 0.3, expand_kv=True)
    grouped_sdpa(query, key, key, torch.ones(4, 11, dtype=torch.bool).tril(7), 0.3, expand_kv=True)
    (q_shape, k_stride, mask_shape), (causal_q, causal_stride, causal_mask_shape) = seen
    assert q_shape == (2, 3, 4, 8) and k_stride[1] == 0 and mask_shape == (2, 1, 4, 11)
    assert causal_q == (2, 3, 4, 8) and causal_stride[1] == 0 and causal_mask_shape == (4, 11)


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_a_decode_step_is_the_same_attention_grouped_and_expanded(heads):
    """One query token (a decode step: both calls give SDPA a KV head's query heads as its query rows), with a
    per-KV-head bias, a bool mask or none, equals a hand softmax in float64."""
    q_heads, kv_heads = heads
    group = q_heads // kv_heads
    g = torch.Generator().manual_seed(5)
    query = torch.randn(1, q_heads, 1, 8, generator=g, dtype=torch.float64)
    key, value = (torch.randn(1, kv_heads, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(kv_heads, 1, 9, generator=g, dtype=torch.float64)
    bias[-1, 0, 3] = float("-inf")
    visible = torch.ones(1, 9, dtype=torch.bool)
    visible[0, 5] = False
    for mask, additive in (
        (None, torch.zeros(kv_heads, 1, 9, dtype=torch.float64)),
        (bias, bias),
        (visible, torch.zeros(1, 9, dtype=torch.float64).masked_fill(~visible, float("-inf"))),
    ):
        scores = torch.einsum("hd,hkd->hk", query[0, :, 0], key[0].repeat_interleave(group, 0)) * 0.4
        scores = scores + (additive.repeat_interleave(group, 0)[:, 0] if additive.dim() == 3 else additive)
        expected = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), value[0].repeat_interleave(group, 0))
        for expand in (False, True):
            out = grouped_sdpa(query, key, value, mask, 0.4, expand_kv=expand)
            assert out.shape == (1, q_heads, 1, 8)
            torch.testing.assert_close(out[0, :, 0], expected, rtol=1e-12, atol=1e-12)


def _sdpa_flags() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
    }


def test_kvdemos_calls_on_cuda_leave_cudnn_out_and_restore_the_flags():
    """On CUDA kvdemo's SDPA calls choose among the enabled backends but cuDNN's (a plan per new key length); the
    process-wide flags are back as they were afterwards; a caller that enabled cuDNN alone keeps it; off CUDA, or
    with cuDNN already off, nothing is switched. The flags are process state, so this runs without a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = _sdpa_flags()
    cuda = torch.device("cuda")
    assert sdpa_backends(torch.device("cpu")) is None
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(every):  # every backend on, whatever this process had
        assert sdpa_backends(cuda) == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_scope(cuda):
            assert _sdpa_flags() == {"flash": True, "efficient": True, "math": True, "cudnn": False}
        assert _sdpa_flags() == {"flash": True, "efficient": True, "math": True, "cudnn": True}
        with sdpa_scope(torch.device("cpu")):
            assert _sdpa_flags()["cudnn"]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the doctor's "cuDNN alone"
        assert sdpa_backends(cuda) is None
        with sdpa_scope(cuda):
            assert _sdpa_flags() == {"flash": False, "efficient": False, "math": False, "cudnn": True}
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        assert sdpa_backends(cuda) == [SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert sdpa_backends(cuda) is None  # cuDNN already off: nothing to switch
    assert _sdpa_flags() == before


def test_grouped_attention_runs_inside_the_backend_scope_of_its_device(monkeypatch):
    """Every SDPA call of :func:`grouped_sdpa` (grouped or expanded, with or without a mask) happens inside
    :func:`sdpa_scope` of the query's device."""
    entered: list[torch.device] = []
    inside: list[bool] = []
    scope = attention.sdpa_scope

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        inside.append(True)
        with scope(device):
            yield
        inside.append(False)

    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention, "sdpa_scope", recording)
    monkeypatch.setattr(
        attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(inside[-1]) or real(*a, **k)
    )
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    for mask in (None, torch.zeros(2, 3, 5), torch.ones(3, 5, dtype=torch.bool)):
        for expand in (False, True):
            grouped_sdpa(query, key, key, mask, 0.3, expand_kv=expand)
    assert calls == [True] * 6 and entered == [torch.device("cpu")] * 6


def _factories_without_a_device(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``torch.<factory>(...)`` calls in ``path`` that name no device (``new_*``/``*_like`` derive theirs)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_every_tensor_factory_in_the_core_names_its_device():
    """In the policies, the memory, the offload store and the attention seam, a tensor is made on the device of
    the data it meets (``device=``, or ``new_*``/``*_like``); host tensors say ``device="cpu"`` on purpose."""
    files = sorted((PACKAGE / "policies").rglob("*.py")) + [
        PACKAGE / "cache" / f"{n}.py" for n in ("memory", "attention", "offload")
    ]
    assert len(files) > 8
    found = [line for path in files for line in _factories_without_a_device(path)]
    assert found == []


def test_the_static_check_finds_a_factory_without_a_device(tmp_path):
    source = tmp_path / "kvdemo" / "example.py"
    source.parent.mkdir()
    source.write_text(
        "import torch\n\ndef f(x):\n    total = torch.full((3,), 8, dtype=torch.long)\n"
        "    ok = torch.zeros(3, device=x.device)\n    return torch.zeros_like(x) + total + ok\n"
    )
    assert _factories_without_a_device(source, tmp_path) == [
        "kvdemo/example.py:4: torch.full((3,), 8, dtype=torch.long)"
    ]


@pytest.mark.slow
def test_the_doctor_runs_its_small_matrix_on_the_cpu(tmp_path, capsys):
    """``python -m kvdemo doctor`` on a CPU-only machine: every policy with the trained tiny model and one random
    model of a newer family, the split-layer checks on the emulated device, a table and the JSON."""
    from kvdemo.cli import main

    out = tmp_path / "doctor.json"
    assert (
        main(
            ["doctor", "--device", "cpu", "--models", "tiny,tiny-random-qwen3-vl", "--frames", "16", "--json", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    rows = report["models"]
    bounded = [p for p in policy_names() if p != "full"]  # the doctor runs every registered policy
    assert {(r["model"], r["policy"]) for r in rows} == {
        (m, p) for m in ("tiny", "tiny-random-qwen3-vl") for p in bounded + ["full"]
    }
    for row in rows:
        assert row["under_M"] and row["memory_unchanged_by_asking"] and row["same_across_runs"], row
        if row["policy"] != "full":
            assert row["compressions"] > 0, row  # M is half the full cache: every bounded policy compresses
    assert [r["same_tokens"] for r in report["split"]] == [True] * len(bounded)
    assert report["attention"]["backend"].startswith("cpu") and report["ok"]
    assert report["key_lengths"] == []  # timed on CUDA only
    decode = report["decode"]  # kvdemo's decode beside transformers' generate on the exported tiny model
    assert decode["kvdemo_ms"] > 0 and decode["generate_ms"] > 0 and decode["new_tokens"] == 32
    assert decode["ratio"] == pytest.approx(decode["kvdemo_ms"] / decode["generate_ms"])
    printed = capsys.readouterr()
    assert "all checks passed" in printed.out and "transformers' generate" in printed.out
    # A line per step on stderr while it works (the tables stay on stdout): 2 models x every policy, then the rest.
    total = 2 * (len(bounded) + 1)
    runs = re.findall(rf"^doctor: \[ *\d+ s\] (\S+) x (\S+), streamed twice \((\d+)/{total}\)$", printed.err, re.M)
    assert [int(n) for _, _, n in runs] == list(range(1, total + 1)) and {(m, p) for m, p, _ in runs} == {
        (r["model"], r["policy"]) for r in rows
    }
    assert "doctor:" not in printed.out


def test_the_doctors_attention_table_runs_every_call_and_compares_the_blocks():
    """The CUDA table of :func:`attention_memory`, run small on the CPU: every call runs and is timed, the float32
    softmax in blocks of 3 query tokens gives the one-block output up to float32 rounding, and the peak is left to
    CUDA's allocator statistics."""
    from kvdemo.bench.attention_checks import attention_memory

    three_tokens = 3 * 4 * 4 * (24 + 8)  # float32 logits of 4 query heads over 32 keys
    rows = attention_memory(
        torch.device("cpu"), shapes=(("small", 4, 2),), chunk=8, past=24, repeats=1, block_bytes=three_tokens
    )
    assert [r["call"] for r in rows] == [
        "SDPA, per-KV-head mask",
        "SDPA, causal mask",
        "float32 softmax, blocks",
        "float32 softmax, one block",
    ]
    assert all("error" not in r and r["ms"] > 0 and r["peak_mb"] is None for r in rows)
    assert rows[2]["same_as_one_block"] and rows[3]["same_as_one_block"] and rows[2]["max_abs_diff"] < 1e-5


def test_the_doctor_refuses_a_clip_too_short_for_its_budget_or_no_stream_before_any_work(capsys, monkeypatch):
    """A clip too short for the model matrix's budget (``--frames 8``: M - C = 8 holds no 16-token chunk) is refused
    before anything runs (not after the split checks, on the budget's own error), as is a full-depth stream of no
    seconds (not clamped to two frames)."""
    from kvdemo.bench import doctor as checklist
    from kvdemo.cli import main

    monkeypatch.setattr(checklist, "attention_backend", lambda device: pytest.fail("the checklist started"))
    assert main(["doctor", "--device", "cpu", "--models", "tiny", "--frames", "8"]) == 2
    error = capsys.readouterr().err
    assert "--frames 8 is too short" in error and "at least 16" in error
    assert main(["doctor", "--device", "cpu", "--full-depth", "qwen2.5-vl-3b", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err


def test_the_emulated_device_counts_launches_and_host_reads_as_a_gpu_would():
    """Each line below is worked by hand: a kernel launch, a view (nothing runs), a value the host waits for."""
    mode = EmulatedDevice()
    with mode, torch.inference_mode():
        x = torch.arange(20.0).view(4, 5).to(DEVICE)  # 1 launch: the copy onto the device
        x[:, :2]  # a view
        x.view(20)  # a view
        y = x * 2  # 1 launch
        torch.nonzero(y > 10)  # 2 launches (gt, nonzero), 1 read (nonzero's size)
        int(y.sum())  # 1 launch, 1 read
        x[y > 10]  # 2 launches, 1 read (a boolean index)
        y.cpu()  # 1 read
        x.add_(1)  # 1 launch
        torch.zeros(3, device=DEVICE)  # 1 launch (a fill on the device)
        torch.ones_like(y)  # 1 launch
        counts = torch.tensor([1, 2, 3], device=DEVICE)  # 1 launch (the copy)
        torch.repeat_interleave(torch.arange(3, device=DEVICE), counts)  # 2 launches, 1 read (the output's size)
        torch.repeat_interleave(torch.arange(3, device=DEVICE), counts, output_size=6)  # 2 launches, no read
    assert (mode.launches, mode.host_reads) == (15, 5)
