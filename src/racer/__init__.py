"""racer: lossless, training-free speculative decoding for Hugging Face causal LMs.

Layers, each a folder: ``drafting`` (draft methods, torch-free), ``budget`` (how much of
a draft to verify), ``engine`` (the decoding loop with torch), ``fastpaths`` (optional
CPU fast paths), ``bench`` (the benchmark); ``loading`` and ``cli`` around them.
"""

from racer.budget import AcceptanceModel, CostModel, DraftBudget
from racer.drafting import METHODS, Drafter, DraftTree, Method, Needs, TreeBuilder, make_drafter, parse_method
from racer.drafting.datastore import Datastore, DatastoreError, build_datastore
from racer.engine import (BatchDecoder, Decoder, Detokenizer, GenerationOptions, GenerationResult, StepStats, StopText,
                          TokenSpans, UnsupportedModelError, chat_template_takes, encode_prompt, generate, visible_text)
from racer.fastpaths import FastPaths
from racer.loading import DEFAULT_MODEL, ModelNotFoundError, load_model, load_tokenizer, use_threads

__version__ = "0.1.0"
__all__ = ["AcceptanceModel", "BatchDecoder", "CostModel", "DEFAULT_MODEL", "Datastore", "DatastoreError", "Decoder", "Detokenizer", "DraftBudget",
           "DraftTree", "Drafter", "FastPaths", "GenerationOptions", "GenerationResult", "METHODS", "Method",
           "ModelNotFoundError", "Needs", "StepStats", "StopText", "TokenSpans", "TreeBuilder", "UnsupportedModelError", "build_datastore",
           "chat_template_takes", "encode_prompt", "generate", "load_model", "load_tokenizer", "make_drafter",
           "parse_method", "use_threads", "visible_text"]
