"""The real loading path (``load_model`` on a checkpoint folder, AutoConfig/AutoTokenizer and
transformers' own classes) for both families, offline: tiny checkpoints are written here first."""

import json

import pytest
import torch

from kvdemo.models.loading import load_model
from kvdemo.models.tiny import SPECIAL_TOKENS, tiny_config
from kvdemo.stream.engine import StreamEngine
from kvdemo.stream.streaming import stream_video


def save_byte_tokenizer(folder):
    """A real Hugging Face fast tokenizer (byte-level, no merges) with Qwen's chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(byte_chars))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, additional_special_tokens=list(SPECIAL_TOKENS))
    fast.save_pretrained(folder)
    return {token: fast.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def qwen2_config(ids):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=264,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_load_a_checkpoint_folder_and_stream(tmp_path, small_video, family):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    ids = save_byte_tokenizer(tmp_path)
    if family == "qwen2_5_vl":
        config = tiny_config()
        for name, token in (("video_token_id", "<|video_pad|>"), ("image_token_id", "<|image_pad|>")):
            setattr(config, name, ids[token])
        model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        model = Qwen2VLForConditionalGeneration(qwen2_config(ids))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family

    loaded = load_model(str(tmp_path))
    assert loaded.family == family and not loaded.random_weights
    assert loaded.tokens_per_second == (2.0 if family == "qwen2_5_vl" else None)
    assert loaded.stop_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert loaded.tokenize("<|im_start|>hi") == [ids["<|im_start|>"], *loaded.tokenize("hi")]
    for a, b in zip(model.parameters(), loaded.hf.parameters()):
        assert torch.equal(a, b)

    engine = StreamEngine(loaded, "uniform", budget=72, keep=36, fps=2.0, max_new_tokens=4)
    list(stream_video(loaded, small_video, {"p": engine}))
    assert engine.memory.visual_tokens <= 72 and engine.frames_fed == 12
    # Qwen2-VL: temporal position s + g; Qwen2.5-VL at 2 fps: s + 2 g (6 grids -> last at 5 or 10)
    s = engine.memory.prefix_len
    assert engine.memory.cursor.next - 1 == s + (10 if family == "qwen2_5_vl" else 5)
    answer = engine.answer("what?")
    assert answer.tokens <= 4
