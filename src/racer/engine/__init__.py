"""The decoding engine, with torch: it knows the draft tree and the drafter interface, no method."""

from racer.engine.decoder import Decoder, generate
from racer.engine.detokenize import Detokenizer, StopText
from racer.engine.loop import BatchDecoder, Update, top_ids
from racer.engine.model_facts import ModelFacts
from racer.engine.options import GenerationOptions, chat_template_takes, encode_prompt
from racer.engine.provenance import TokenSpans
from racer.engine.results import GenerationResult, StepStats
from racer.engine.sampling import SamplingParams
from racer.engine.selftest import UnsupportedModelError, self_test
from racer.engine.stopping import visible_text

__all__ = ["BatchDecoder", "Decoder", "Detokenizer", "StopText", "ModelFacts", "Update", "GenerationOptions", "GenerationResult", "SamplingParams", "StepStats",
           "TokenSpans", "UnsupportedModelError", "chat_template_takes", "encode_prompt", "generate", "self_test", "top_ids",
           "visible_text"]
