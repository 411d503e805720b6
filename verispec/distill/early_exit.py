"""Self-speculation without training: draft with the target's first layers, its final norm and head.

LayerSkip (Elhoushi et al., 2024, "LayerSkip: Enabling Early Exit Inference and Self-Speculative
Decoding") drafts by exiting the target early. Here the exit is a separate module that shares the
target's weight tensors (nothing is copied, the target's config and layer list are never touched) and
keeps its own small cache. Models not trained for early exit give low acceptance at shallow exits;
see benchmarks/DRAFTS.md for measured figures.
"""

from __future__ import annotations

from verispec.config import ConfigError
from verispec.distill.model import DraftConfig, DraftKV, DraftLM, target_modules
from verispec.proposers import DraftModelProposer


def early_exit_model(target_kv, num_layers: int, max_batch_size: int = 1) -> DraftKV:
    """A KVModel running the first ``num_layers`` layers of ``target_kv.hf_model`` plus its norm and head."""
    hf = getattr(target_kv, "hf_model", target_kv)
    embed, layers, norm, head, inv_freq = target_modules(hf)
    if not 1 <= num_layers < len(layers):
        raise ConfigError(f"early exit needs 1 <= num_layers < {len(layers)}, got {num_layers}")
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = DraftConfig(
        hidden_size=c.hidden_size,
        num_layers=num_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=float(c.rms_norm_eps),
        vocab_size=int(head.shape[0]),
        draft_vocab=int(head.shape[0]),
        init_layers=tuple(range(num_layers)),
    )
    model = DraftLM(cfg, embed.weight, head, inv_freq, vocab_ids=None)
    for mine, theirs in zip(model.layers, layers[:num_layers]):
        mine.adopt(theirs, share=True)
    model.norm = norm.weight
    return DraftKV(
        model,
        getattr(target_kv, "tokenizer", None),
        max_length=getattr(target_kv, "max_length", 2048),
        max_batch_size=max_batch_size,
        use_kernel=False,  # it is the target's own float32 stack, shared, not a bfloat16 copy of it
    )


class EarlyExitProposer(DraftModelProposer):
    """:class:`~verispec.proposers.DraftModelProposer` over the target's own first ``num_layers`` layers."""

    def __init__(self, target_kv, num_layers: int = 8, max_batch_size: int = 1):
        super().__init__(
            early_exit_model(target_kv, num_layers, max_batch_size), max_batch_size=max_batch_size
        )
        self.num_layers = num_layers
