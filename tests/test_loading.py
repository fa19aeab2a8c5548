import os
import socket
import subprocess
import sys

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
    with pytest.raises(ModelNotFoundError, match="there is no folder .*nothing-here"):
        load_model(str(tmp_path / "nothing-here"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        load_model(str(tmp_path / "weights.bin"))


def test_a_folder_that_is_not_a_model_names_the_missing_file(real, tmp_path):
    model, tokenizer = real
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model(str(empty))
    weights_only = tmp_path / "weights-only"
    model.save_pretrained(weights_only)
    with pytest.raises(ModelNotFoundError, match="has no tokenizer: none of tokenizer.json"):
        load_model(str(weights_only))
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer.save_pretrained(tokenizer_only)
    model.config.save_pretrained(tokenizer_only)
    with pytest.raises(ModelNotFoundError, match="has no weights"):
        load_model(str(tokenizer_only))


def test_a_hub_id_not_in_the_cache_is_refused_at_once_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as caught:
        load_model("no-such-org/no-such-model")
    message = str(caught.value)
    assert "'no-such-org/no-such-model' is not a local folder and not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set, so the hub was not asked" in message and "hf download" in message


def test_a_hub_that_cannot_be_reached_is_said_without_retries(tmp_path):
    """No network (here: a hub address where nothing listens): one quick refusal that
    says so, not the hub client's retries and a claim about a local folder."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}",
           "HF_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "racer.cli", "generate", "hi", "--model", "no-such-org/no-model"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"the hub at http://127.0.0.1:{port} cannot be reached" in proc.stderr
    assert "looked in local folder" not in proc.stderr


def test_the_first_conversion_is_announced(tmp_path, monkeypatch):
    from racer import loading

    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    heard: list[str] = []
    folder = loading._embedded_folder(heard.append)
    assert (folder / "model.safetensors").is_file()
    assert len(heard) == 2 and "converting its GGUF" in heard[0] and heard[1].startswith("converted in")
    heard.clear()
    loading._embedded_folder(heard.append)  # cached now: nothing to say
    assert heard == []


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype="int3")
    with pytest.raises(ValueError, match="device"):
        load_model(device="warp-drive")
    import torch

    if not torch.cuda.is_available():  # refused before any weights load, with what this torch sees
        with pytest.raises(ValueError, match="device: 'cuda' cannot be used on this machine.*sees cpu"):
            load_model(device="cuda")


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
