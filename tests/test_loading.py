import pytest

from racer import ModelNotFoundError, load_model
from racer.engine import Decoder


def test_embedded_tokenizer_is_fixed(real):
    model, tokenizer = real
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    ids = tokenizer("Hello world").input_ids
    assert ids[0] != tokenizer.bos_token_id and tokenizer.decode(ids) == "Hello world"
    assert model.generation_config.eos_token_id in (2, [2])


def test_chat_answer_stops_at_im_end(real):
    model, tokenizer = real
    result = Decoder(model, tokenizer, "none").generate("What is the capital of France? Answer in one word.",
                                                        chat=True, max_new_tokens=64)
    assert result.stop_reason == "eos"
    assert result.tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in result.text


def test_conversion_is_cached_as_safetensors(real):
    from racer.loading import cache_dir

    # A ".tmpPID" folder is another process's conversion still being written (a server
    # a test started converts beside this worker); only finished folders are the cache.
    folders = [f for f in (cache_dir() / "models").glob("SmolLM2-135M-Instruct-*") if ".tmp" not in f.name]
    assert folders and all((f / "model.safetensors").is_file() for f in folders)


def test_missing_model_says_what_and_where(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="local folder"):
        load_model(str(tmp_path / "nothing-here"))


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype="int3")
    with pytest.raises(ValueError, match="device"):
        load_model(device="warp-drive")


def test_local_folder_loads_the_same_model(real, tmp_path):
    """Any local folder works like the default: save the embedded model, load it back."""
    model, tokenizer = real
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path))
    ids = tokenizer("The quick brown fox").input_ids
    a = Decoder(model, tokenizer, "none").generate(ids, max_new_tokens=8).tokens
    b = Decoder(again, tok2, "none").generate(ids, max_new_tokens=8).tokens
    assert a == b
