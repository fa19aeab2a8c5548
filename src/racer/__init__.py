"""racer: lossless, training-free speculative decoding for Hugging Face causal LMs."""

from racer.budget import AcceptanceModel, DraftBudget
from racer.cost import CostModel
from racer.datastore import Datastore, DatastoreError, build_datastore
from racer.drafters import METHODS, Drafter, make_drafter
from racer.engine import Decoder, GenerationResult, StepStats, generate
from racer.loading import DEFAULT_MODEL, ModelNotFoundError, load_model, load_tokenizer
from racer.tree import DraftTree, TreeBuilder
from racer.verify import UnsupportedModelError

__version__ = "0.1.0"
__all__ = ["Decoder", "DraftTree", "Drafter", "GenerationResult", "METHODS", "ModelNotFoundError",
           "StepStats", "TreeBuilder", "UnsupportedModelError", "DEFAULT_MODEL", "generate",
           "load_model", "load_tokenizer", "make_drafter", "Datastore", "DatastoreError", "build_datastore",
           "AcceptanceModel", "CostModel", "DraftBudget"]
