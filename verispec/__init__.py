"""verispec: lossless speculative decoding for Hugging Face causal LMs."""

from verispec.api import GenerationResult, generate, speculative_generate
from verispec.config import ConfigError, GenerationConfig, SamplingConfig
from verispec.models.loading import load_model
from verispec.ngrams import NgramLookup
from verispec.proposers import DraftModelProposer, PromptLookup, Proposer
from verispec.stats import GenerationStats
from verispec.tokenizers import TokenizerMismatchError

__all__ = [
    "ConfigError",
    "DraftModelProposer",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "NgramLookup",
    "PromptLookup",
    "Proposer",
    "SamplingConfig",
    "TokenizerMismatchError",
    "generate",
    "load_model",
    "speculative_generate",
]
__version__ = "0.1.0"
