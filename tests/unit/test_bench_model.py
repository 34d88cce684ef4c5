"""Model sources: parsing, the synthetic shapes, loading a save_pretrained folder, and the
compile-friendly fixes (LongRoPE pinned, idle sliding window dropped)."""

from __future__ import annotations

import pytest

from vcfslm.engine.model import ModelSourceError, ModelSpec, parse_model_spec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("text,expected", [
    ("synthetic:tiny", ModelSpec("synthetic", "tiny")),
    ("synthetic:phi-3-mini", ModelSpec("synthetic", "phi-3-mini")),
    ("synthetic:phi-3-mini,layers=8", ModelSpec("synthetic", "phi-3-mini", 8)),
    ("microsoft/Phi-3-mini-128k-instruct", ModelSpec("hub", "microsoft/Phi-3-mini-128k-instruct")),
])
def test_parse_model_spec(text, expected):
    assert parse_model_spec(text) == expected
    assert str(parse_model_spec(text)) == text


@pytest.mark.parametrize("text", ["synthetic:gpt", "synthetic:tiny,layers=0", "synthetic:tiny,depth=2",
                                  "/no/such/folder", "./missing", "not a model"])
def test_parse_model_spec_rejects(text):
    with pytest.raises(ModelSourceError):
        parse_model_spec(text)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match="config.json"):
        parse_model_spec(str(tmp_path))


def test_phi3_mini_config_is_the_published_shape():
    from vcfslm.engine.model import phi3_mini_config

    c = phi3_mini_config()
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (32, 3072, 8192, 32064)
    assert (c.num_attention_heads, c.num_key_value_heads) == (32, 32)
    assert c.rope_parameters["rope_type"] == "longrope"
    assert len(c.rope_parameters["short_factor"]) == 48
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(c)
    assert sum(p.numel() for p in model.parameters()) == 3_821_079_552


@pytest.fixture(scope="module")
def tiny():
    from vcfslm.engine.model import load_model

    return load_model("synthetic:tiny", seed=3, max_context=64)


def test_synthetic_tiny_is_bf16_and_deterministic(tiny):
    from vcfslm.engine.model import load_model

    assert {p.dtype for p in tiny.model.parameters()} == {torch.bfloat16}
    again = load_model("synthetic:tiny", seed=3, max_context=64)
    other = load_model("synthetic:tiny", seed=4, max_context=64)
    w = tiny.model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(w, again.model.model.layers[0].mlp.down_proj.weight)
    assert not torch.equal(w, other.model.model.layers[0].mlp.down_proj.weight)
    assert tiny.facts["params"] == sum(p.numel() for p in tiny.model.parameters())
    # the input embedding is read one row per token: not part of a decode step's bytes
    embed = tiny.model.get_input_embeddings().weight
    assert tiny.step_weight_bytes == tiny.weight_bytes - embed.numel() * 2


def test_rotary_buffers_are_real_and_pinned_to_the_short_factor(tiny):
    from vcfslm.engine.model import tiny_config

    rope = tiny.model.model.rotary_emb
    assert rope.inv_freq.dtype == torch.float32 and torch.isfinite(rope.inv_freq).all()
    short = torch.tensor(tiny_config().rope_parameters["short_factor"])
    expected = 1.0 / (short * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(rope.inv_freq, expected)
    assert tiny.rope_pinned and rope.rope_type != "longrope"


def test_long_contexts_keep_longrope_switching():
    from vcfslm.engine.model import load_model

    loaded = load_model("synthetic:tiny", max_context=8192)
    assert not loaded.rope_pinned
    assert loaded.model.model.rotary_emb.rope_type == "longrope"


def test_idle_sliding_window_is_dropped():
    from vcfslm.engine.model import drop_idle_sliding_window, phi3_mini_config

    c = phi3_mini_config(layers=1)
    assert not drop_idle_sliding_window(c, 300_000)
    assert c.sliding_window == 262144
    assert drop_idle_sliding_window(c, 1152)
    assert c.sliding_window is None


def test_loads_a_save_pretrained_folder(tmp_path, tiny):
    from vcfslm.engine.model import load_model

    tiny.model.save_pretrained(tmp_path / "phi3")
    assert list((tmp_path / "phi3").glob("*.safetensors"))
    loaded = load_model(str(tmp_path / "phi3"), max_context=64)
    assert loaded.spec.kind == "dir"
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    ids = torch.randint(100, 16000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = tiny.model(ids).logits
        b = loaded.model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_footprint_shapes_match_the_synthetic_configs():
    """The inventory's memory check and the roofline use footprint's shapes: keep them true."""
    from vcfslm import footprint
    from vcfslm.engine.model import kv_bytes_per_token, load_model, phi3_mini_config, tiny_config

    for shape, config in ((footprint.TINY, tiny_config()), (footprint.PHI3_MINI, phi3_mini_config())):
        head_dim = config.hidden_size // config.num_attention_heads
        assert (shape.layers, shape.hidden, shape.kv_heads, shape.head_dim) == (
            config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, head_dim)
        assert shape.kv_bytes_per_token == kv_bytes_per_token(config)
    model = load_model("synthetic:tiny").model
    assert sum(p.numel() for p in model.parameters()) == footprint.TINY.params


def save_word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level fast tokenizer covering every id of the model (real weights ship a real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "The", "capital", "of", "France", "is"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def test_a_folder_with_a_tokenizer_records_a_greedy_continuation_as_text(tmp_path, tiny):
    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.model import load_model, load_tokenizer
    from vcfslm.engine.numerics import greedy_text

    folder = tmp_path / "phi3"
    tiny.model.save_pretrained(folder)
    assert load_tokenizer(str(folder)) is None  # weights only: no text can be recorded
    assert load_tokenizer("synthetic:tiny") is None
    save_word_tokenizer(folder, tiny.config.vocab_size)
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer("The capital of France is")["input_ids"] == [3, 4, 5, 6, 7]
    engine = DecodeEngine(load_model(str(folder), max_context=64).model, "eager")
    record = greedy_text(engine, tokenizer, tokens=6)
    assert record["prompt"] == "The capital of France is" and record["tokens"] == 6
    words = record["text"].split()
    assert len(words) == 6 and all(w.startswith("w") or w in tokenizer.get_vocab() for w in words)


def test_model_write_gives_a_folder_that_loads_as_the_synthetic_model(tmp_path, tiny):
    """`vcfslm model write`: save_pretrained's safetensors and a tokenizer, read back by the
    checkpoint loader to the bit."""
    from vcfslm.engine.checkpoint import write_checkpoint
    from vcfslm.engine.model import load_model, load_tokenizer

    folder = tmp_path / "tiny"
    facts = write_checkpoint("synthetic:tiny", folder, seed=3)
    assert facts["params"] == tiny.facts["params"] and list(folder.glob("*.safetensors"))
    assert load_tokenizer(str(folder)) is not None
    loaded = load_model(str(folder), max_context=64)
    ids = torch.randint(100, 16000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids).logits, tiny.model(ids).logits, rtol=0, atol=0)
