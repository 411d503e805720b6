"""A small draft built from a Llama-family target's own pieces, and its KV-cached runtime.

The draft is a pre-norm Llama decoder (Touvron et al., 2023) at the target's width, with
``num_layers`` layers initialised from chosen target layers, the target's final norm, and the target's
input embeddings and output head, read from the target at load time (never stored with the draft).
Two settings of the same module serve two drafters:

- **trained draft** (:mod:`verispec.distill.train`): a copy of a few target layers, fine-tuned by
  token-level distillation, with the head cut to a frequent-token subset (``vocab_ids``): the tied head
  of SmolLM2-135M is 28M of its 135M weights, so a full head alone would cost a fifth of a target step.
  Draft probabilities are exactly zero outside the subset; rejection sampling stays lossless for any
  draft distribution, a token outside the subset is simply never proposed.
- **early exit** (:mod:`verispec.distill.early_exit`): the target's first N layers, shared (not copied),
  full head, no training (LayerSkip-style self-speculation, Elhoushi et al., 2024).

:class:`DraftKV` runs a :class:`DraftLM` as a :class:`~verispec.models.base.KVModel` with
preallocated ``[B, H_kv, S, D]`` caches, so it plugs into
:class:`~verispec.proposers.DraftModelProposer` unchanged. Its logits cover the full vocabulary
(``-inf`` outside the subset) so they go through the shared ``logits_to_probs`` like the target's.
On a CPU with the C++ kernel (:mod:`verispec.models.fast_llama`), its layers and head run there, from
a bfloat16 (or, for an int8 target, int8) copy of their weights taken when the ``DraftKV`` is made:
one kernel call per forward instead of some forty small torch operations. The draft's numerics never
affect what is generated (verification is exact for any draft distribution), only how often its
tokens are accepted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ConfigError
from verispec.models.base import LogitsMode, logit_rows
from verispec.models.threads import ThreadTuner


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a draft; stored in the draft's metadata."""

    hidden_size: int  # the target's width (embeddings and head are the target's)
    num_layers: int  # decoder layers in the draft
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # channels per head
    intermediate_size: int  # SwiGLU width
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary: width of the logits handed to the proposer
    draft_vocab: int  # tokens the head scores (== vocab_size for a full head)
    init_layers: tuple[int, ...]  # target layers the draft's layers were initialised from
    trained_head: bool = False  # the head's rows are trained (and stored) rather than the target's
    features: bool = False  # EAGLE: the input at t is fc([embed(x_{t+1}); h_t]), h the target's features

    def to_dict(self) -> dict:
        """JSON-ready form."""
        d = asdict(self)
        d["init_layers"] = list(self.init_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "init_layers": tuple(d["init_layers"])})


def target_modules(hf_model) -> tuple[nn.Module, Sequence[nn.Module], nn.Module, torch.Tensor, torch.Tensor]:
    """(embedding, decoder layers, final norm, head weight ``[V, hidden]``, rotary ``inv_freq``) of a target.

    Raises ConfigError for architectures the draft cannot mirror (not Llama-style, biases, odd RoPE).
    """
    cfg = hf_model.config
    inner = getattr(hf_model, "model", None)
    if getattr(cfg, "model_type", None) not in ("llama", "mistral", "qwen2") or inner is None:
        raise ConfigError(f"drafts can be built for Llama-family targets only, not {type(hf_model).__name__}")
    attn = inner.layers[0].self_attn
    if attn.q_proj.bias is not None or attn.o_proj.bias is not None or getattr(cfg, "mlp_bias", False):
        raise ConfigError("drafts do not support targets with attention or MLP biases yet")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"drafts support plain RoPE only, not {rope.get('rope_type')!r}")
    return (
        inner.embed_tokens,
        inner.layers,
        inner.norm,
        hf_model.get_output_embeddings().weight,
        inner.rotary_emb.inv_freq,
    )


class DraftLayer(nn.Module):
    """One pre-norm decoder layer: RMSNorm, GQA with RoPE, RMSNorm, SwiGLU."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.in_norm = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def adopt(self, hf_layer: nn.Module, *, share: bool) -> None:
        """Take a target layer's weights: the same tensors (``share``) or copies of them."""
        pairs = [
            ("q", hf_layer.self_attn.q_proj), ("k", hf_layer.self_attn.k_proj),
            ("v", hf_layer.self_attn.v_proj),
            ("o", hf_layer.self_attn.o_proj), ("gate", hf_layer.mlp.gate_proj), ("up", hf_layer.mlp.up_proj),
            ("down", hf_layer.mlp.down_proj),
        ]  # fmt: skip
        for name, src in pairs:
            w = src.weight if share else nn.Parameter(src.weight.detach().float().clone())
            getattr(self, name).weight = w
        for name, src in (
            ("in_norm", hf_layer.input_layernorm),
            ("post_norm", hf_layer.post_attention_layernorm),
        ):
            setattr(self, name, src.weight if share else nn.Parameter(src.weight.detach().float().clone()))


class DraftLM(nn.Module):
    """Token ids -> draft logits over ``vocab_ids`` (the head's subset of the target vocabulary)."""

    def __init__(
        self,
        cfg: DraftConfig,
        embed: torch.Tensor,
        head: torch.Tensor,
        inv_freq: torch.Tensor,
        vocab_ids: torch.Tensor | None,
    ):
        """``embed`` ``[V, hidden]`` and ``head`` ``[V, hidden]`` are the target's (not trained, not saved);
        ``vocab_ids`` ``[draft_vocab]`` int64 picks the head rows (None: the full vocabulary)."""
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.embed = embed.detach()
        self.vocab_ids = vocab_ids
        # [draft_vocab, hidden]: a view when the head is the target's full head, a small copy otherwise.
        rows = head.detach() if vocab_ids is None else head.detach()[vocab_ids].clone()
        self.head = nn.Parameter(rows.float()) if cfg.trained_head else rows
        self.inv_freq = inv_freq.detach().float()  # [head_dim / 2]
        h = cfg.hidden_size
        # EAGLE (verispec.distill.eagle): fuse the next token's embedding with a feature vector.
        self.fc = nn.Linear(2 * h, h, bias=False) if cfg.features else None

    def inputs(self, ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input ``[B, T, hidden]``: the embeddings of ``ids`` ``[B, T]``, or with
        ``cfg.features`` ``fc([embed(ids); features])`` (``features`` ``[B, T, hidden]``)."""
        if self.fc is None:
            return F.embedding(ids, self.embed)  # [B, T, hidden]
        return self.fc(self.pairs(ids, features))

    def pairs(self, ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """What EAGLE's ``fc`` reads: ``[embed(ids); features]`` ``[B, T, 2 hidden]``."""
        if features is None:
            raise ValueError("this draft reads the target's features: pass them with the token ids")
        x = F.embedding(ids, self.embed)  # [B, T, hidden]
        return torch.cat([x, features.to(x.dtype)], dim=-1)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: ``[..., hidden]`` features -> ``[..., draft_vocab]`` logits."""
        return self._norm(x, self.norm) @ self.head.T

    def move(self, device: torch.device | str) -> DraftLM:
        """Move parameters and the target's borrowed tensors (embeddings, head rows, RoPE) to ``device``."""
        self.to(device)
        self.embed = self.embed.to(device)
        self.inv_freq = self.inv_freq.to(device)
        if not isinstance(self.head, nn.Parameter):
            self.head = self.head.to(device)
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(device)
        return self

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a trained draft stores: layers, final norm, the head when trained (never embeddings)."""
        return {k: v for k, v in self.state_dict().items()}

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, T]`` positions -> cos, sin ``[n, 1, T, head_dim]``."""
        freqs = positions[..., None].float() * self.inv_freq  # [n, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [n, 1, T, D]
        return emb.cos(), emb.sin()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_norm_eps) * weight

    def _qkv(self, layer: DraftLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``[n, T, hidden]`` -> q ``[n, H, T, D]``, k and v ``[n, H_kv, T, D]`` (RoPE applied)."""
        n, t, _ = x.shape
        d = self.cfg.head_dim
        h = self._norm(x, layer.in_norm)
        q = layer.q(h).view(n, t, -1, d).transpose(1, 2)
        k = layer.k(h).view(n, t, -1, d).transpose(1, 2)
        v = layer.v(h).view(n, t, -1, d).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _finish(self, layer: DraftLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual adds after attention ``[n, H, T, D]``, then the SwiGLU block."""
        n, _, t, _ = attn.shape
        x = x + layer.o(attn.transpose(1, 2).reshape(n, t, -1))
        h = self._norm(x, layer.post_norm)
        return x + layer.down(F.silu(layer.gate(h)) * layer.up(h))

    def forward(self, ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """Training path, no cache: ``[B, T]`` ids -> ``[B, T, draft_vocab]`` logits (causal)."""
        b, t = ids.shape
        x = self.inputs(ids, features)  # [B, T, hidden]
        cos, sin = self._rope(torch.arange(t, device=ids.device).expand(b, t))
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, cos, sin)
            attn = F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
            )  # [B, H, T, D]
            x = self._finish(layer, x, attn)
        return self.scores(x)  # [B, T, draft_vocab]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DraftKV:
    """A :class:`DraftLM` behind the ``KVModel`` protocol, with ``[B, H_kv, S, D]`` caches per layer.

    Cache invariant (``base.py``): row ``r`` holds ``lengths[r]`` tokens; positions past it are
    masked and overwritten by the next write, so ``truncate`` only lowers the length.
    """

    def __init__(
        self,
        model: DraftLM,
        tokenizer: object | None = None,
        max_length: int = 2048,
        max_batch_size: int = 1,
        use_kernel: bool | None = None,
        weights: str = "bfloat16",
    ):
        """``use_kernel``: None = run on the C++ kernel when the model is on a CPU and the kernel
        builds (and ``VERISPEC_NO_KERNEL`` is unset); False = torch operations only. The kernel holds
        a copy of the weights as they are now: make a new ``DraftKV`` after changing them.
        ``weights``: the format of that copy, one of :data:`KERNEL_WEIGHTS`."""
        if weights not in KERNEL_WEIGHTS:
            raise ValueError(f"weights must be one of {KERNEL_WEIGHTS}, not {weights!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.vocab_size = model.cfg.vocab_size
        self._capacity = 0
        self._lengths = torch.zeros(0, dtype=torch.int64)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.last_features: torch.Tensor | None = None
        """The last forward's output features ``[n, T, hidden]`` (before the final norm)."""
        self.weights = weights
        self._kernel: object | None = None
        self._mats: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        """The kernel's copies of the matrices, ``name -> (weight [N, K], per-row scales [N] for int8
        or None)``; "head" is the output head, "fc" EAGLE's ``fc`` ``[hidden, 2 hidden]`` (in torch,
        float32, it took about half of each draft forward)."""
        if use_kernel is not False:
            self._kernel, self._mats = _draft_kernel(model, self.max_length, weights)
        if self._kernel is not None and model.fc is not None:
            self._mats["fc"] = _kernel_matrix(weights, model.fc.weight)
        self._tuners: defaultdict[str, ThreadTuner] = defaultdict(ThreadTuner)
        """Thread count of the kernel's calls from measured times (as the target's), one tuner per
        kind of call ("layers", "head", "fc"): their costs are on different scales."""
        self.reset(max_batch_size)

    @property
    def uses_kernel(self) -> bool:
        """Whether forwards run on the C++ kernel."""
        return self._kernel is not None

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` tokens held per row (a copy)."""
        return self._lengths.clone()

    def memory_bytes(self) -> int:
        """Bytes of the draft's own weights and caches (shared target tensors not counted)."""
        own = sum(p.numel() * p.element_size() for p in self.model.layers.parameters())
        for mat in self._mats.values():  # the kernel's copies: weights and int8 scales
            own += sum(t.numel() * t.element_size() for t in mat if t is not None)
        if self.model.fc is not None:
            own += self.model.fc.weight.numel() * self.model.fc.weight.element_size()
        if self.model.vocab_ids is not None:
            own += self.model.head.numel() * self.model.head.element_size()
        return own + sum(c.numel() * c.element_size() for c in self.k_cache + self.v_cache)

    def reset(self, batch_size: int) -> None:
        """Empty every row; the caches grow when ``batch_size`` exceeds them."""
        cfg = self.model.cfg
        if batch_size > self._capacity:
            shape = (batch_size, cfg.num_kv_heads, self.max_length, cfg.head_dim)
            self.k_cache = [torch.zeros(shape) for _ in range(cfg.num_layers)]
            self.v_cache = [torch.zeros(shape) for _ in range(cfg.num_layers)]
            self._capacity = batch_size
            if self._kernel is not None:
                self._kernel.set_cache(self.k_cache, self.v_cache)
        self._lengths = torch.zeros(batch_size, dtype=torch.int64)

    def truncate(self, lengths: torch.Tensor | Sequence[int], rows: list[int] | None = None) -> None:
        """Row ``rows[i]`` keeps its first ``lengths[i]`` tokens (``[n]``)."""
        idx = torch.arange(len(self._lengths)) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
        new = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
        self._lengths[idx] = torch.minimum(new, self._lengths[idx])

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        rows: list[int] | None = None,
        logits: LogitsMode = "all",
        features: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Append ``[n, T]`` ids to ``rows``; return ``[n, T, V]`` / ``[n, V]`` logits or None.

        ``features`` ``[n, T, hidden]``: the feature paired with each token (EAGLE drafts only).
        """
        m, cfg = self.model, self.model.cfg
        idx = torch.arange(len(self._lengths)) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        n, t = ids.shape
        starts = self._lengths[idx]  # [n]
        end = int(starts.max()) + t
        if end > self.max_length:
            raise ValueError(f"a row would exceed max_length={self.max_length}")
        pos = starts[:, None] + torch.arange(t)  # [n, T]
        if self._kernel is not None:
            return self._forward_kernel(ids, idx, starts, pos, logits, features)
        cos, sin = m._rope(pos)
        # Query at position p sees keys 0..p of its own row.
        mask = torch.arange(end)[None, None, :] <= pos[:, :, None]  # [n, T, end]
        groups = cfg.num_heads // cfg.num_kv_heads
        x = m.inputs(ids, features)  # [n, T, hidden]
        for li, layer in enumerate(m.layers):
            q, k, v = m._qkv(layer, x, cos, sin)  # [n, H, T, D], [n, H_kv, T, D]
            kc, vc = self.k_cache[li], self.v_cache[li]
            for j in range(n):
                s = int(starts[j])
                kc[idx[j], :, s : s + t] = k[j]
                vc[idx[j], :, s : s + t] = v[j]
            keys = kc[idx, :, :end].repeat_interleave(groups, 1)  # [n, H, end, D]
            vals = vc[idx, :, :end].repeat_interleave(groups, 1)
            attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None])  # [n, H, T, D]
            x = m._finish(layer, x, attn)
        self._lengths[idx] = starts + t
        self.last_features = x
        if logits == "none":
            return None
        scores = self.logits(x[:, -1] if logits == "last" else x)
        return scores

    def _forward_kernel(
        self,
        ids: torch.Tensor,
        idx: torch.Tensor,
        starts: torch.Tensor,
        pos: torch.Tensor,
        logits: LogitsMode,
        features: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The forward on the kernel: first-layer inputs ``[n, T, hidden]`` from torch (embeddings,
        EAGLE's ``fc``), then one call for the layers and the head."""
        n, t = ids.shape
        if "fc" in self._mats:
            pair = self.model.pairs(ids, features).float().reshape(n * t, -1).contiguous()  # [n*T, 2 hidden]
            fc, fc_scale = self._mats["fc"]
            x = self._tuners["fc"].run(lambda: self._kernel.linear(pair, fc, None, fc_scale), tokens=n * t)
        else:
            x = self.model.inputs(ids, features).float().reshape(n * t, -1).contiguous()  # [n*T, hidden]
        wanted = logit_rows(n, t, logits)
        slots, flat = idx.repeat_interleave(t), pos.reshape(-1)
        scores = self._tuners["layers"].run(
            lambda: self._kernel.forward_hidden(x, slots, flat, wanted), tokens=n * t
        )
        self._lengths[idx] = starts + t
        self.last_features = self._kernel.last_hidden().view(n, t, -1)
        if logits == "none":
            return None
        scores = scores.view(n, t, -1) if logits == "all" else scores  # [n, (T,) draft_vocab]
        return self._full_vocab(scores)

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` output features -> ``[..., V]`` float32 logits over the target's whole
        vocabulary (``-inf`` outside the head's subset, so the shared ``logits_to_probs`` applies)."""
        return self._full_vocab(self.head_scores(features))

    @torch.inference_mode()
    def head_scores(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` output features -> ``[..., draft_vocab]`` float32 logits over the head's
        own tokens (``model.vocab_ids`` maps them to the target's; all of them when it is None)."""
        m = self.model
        if self._kernel is not None:
            lead = features.shape[:-1]
            normed = m._norm(features.float(), m.norm.float()).reshape(-1, m.cfg.hidden_size).contiguous()
            head, head_scale = self._mats["head"]  # [draft_vocab, hidden]
            scores = self._tuners["head"].run(lambda: self._kernel.linear(normed, head, None, head_scale))
            return scores.view(*lead, -1)
        return m.scores(features).float()  # [..., draft_vocab]

    def _full_vocab(self, scores: torch.Tensor) -> torch.Tensor:
        """``[..., draft_vocab]`` -> ``[..., V]``, ``-inf`` outside the head's subset."""
        m = self.model
        if m.vocab_ids is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], m.cfg.vocab_size), float("-inf"))
        full[..., m.vocab_ids] = scores
        return full

    __call__ = forward


KERNEL_WEIGHTS = ("bfloat16", "int8")
"""Weight formats of a draft on the C++ kernel. bfloat16 (``DraftKV``'s default) reads half of
float32's bytes per draft token and changes the target's own top-1 token at 0.5% of positions
(``fast_llama.py``); int8 (per-row scales, as the target's int8 format) halves them again. Shipped
drafts run in int8 (``verispec.distill.shipped.draft_weights_for``): a draft token costs its reads
(benchmarks/DRAFTS.md, sessions 10 and 25)."""


def _kernel_matrix(weights: str, *ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ts`` stacked by rows ``[N, K]`` in ``weights``, with per-row scales ``[N]`` for int8."""
    full = torch.cat([t.detach().float() for t in ts])
    if weights == "int8":
        from verispec.models.fast_llama import _quantize_rows

        return _quantize_rows(full)
    return full.to(torch.bfloat16).contiguous(), None


def _draft_kernel(
    model: DraftLM, max_length: int, weights: str = "bfloat16"
) -> tuple[object | None, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """A ``FastLlamaKernel`` running ``model``'s layers, final norm and head (copies in ``weights``),
    fed with first-layer inputs (``forward_hidden``), and the copied matrices by name (see
    ``DraftKV._mats``); ``(None, {})`` when the model is not on a CPU or the kernel is unavailable."""
    from verispec.models.fast_llama import _load_kernel, kernel_available

    if model.norm.device.type != "cpu" or not kernel_available():
        return None, {}
    cfg = model.cfg
    k = _load_kernel().FastLlamaKernel(
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.rms_norm_eps,
    )
    mats: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def w(name: str, *ts: torch.Tensor) -> torch.Tensor:
        mats[name] = _kernel_matrix(weights, *ts)
        return mats[name][0]

    def sc(name: str) -> torch.Tensor | None:
        return mats[name][1]

    def vec(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().contiguous()

    for i, layer in enumerate(model.layers):
        qkv, o, gu, down = (f"{i}.{m}" for m in ("qkv", "o", "gu", "down"))
        k.add_layer(
            vec(layer.in_norm), w(qkv, layer.q.weight, layer.k.weight, layer.v.weight), None,
            w(o, layer.o.weight), None, vec(layer.post_norm), w(gu, layer.gate.weight, layer.up.weight),
            w(down, layer.down.weight), sc(qkv), sc(o), sc(gu), sc(down),
        )  # fmt: skip
    k.set_head(None, vec(model.norm), w("head", model.head), None, sc("head"))
    freqs = torch.arange(max_length, dtype=torch.float32)[:, None] * model.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, head_dim], as DraftLM._rope
    k.set_rope(emb.cos().contiguous(), emb.sin().contiguous())
    k.set_keep_hidden(True)
    return k, mats
