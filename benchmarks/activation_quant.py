"""What 8-bit activations would cost in quality: teacher-forced agreement with float32 on Spec-Bench.

The int8 format multiplies int8 weights (one scale per row) by int16 activations (one scale per input
row). Eight-bit activations would let the kernel use ``vpdpbusd`` (four products per lane, no
widening) and halve the multiply instructions of a verification; this script measures what they do to
the model before anyone builds them. Each linear layer's input is quantised in emulation (round to
nearest, symmetric; per row, or per group of columns), its weights as the int8 format quantises them,
and the logits of the float32 model's own greedy answer are compared position by position:

- ``KL``: mean KL(float32 || variant) of the next-token distributions, in nats;
- ``top-1``: the share of positions where the variant's argmax is float32's.

Variants: ``w8a16`` (what verispec runs), ``w8a8`` (per row), ``w8a8-gN`` (per group of N columns, as
llama.cpp's 8-bit activation blocks of 32), ``smooth-w8a8`` (per row after SmoothQuant's migration of
activation range into the weights, exact in float, calibrated on this repository's README and engine
source, never on the prompts scored; so its figures move a little when those files change).

    python benchmarks/activation_quant.py --per-category 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from verispec.bench.prompts import load_prompts, select
from verispec.models.fast_llama import _quantize_rows
from verispec.models.loading import load_hf
from verispec.tokenizers import encode_prompt

REPO = Path(__file__).resolve().parent.parent


def quantise(x: torch.Tensor, levels: int, group: int | None = None) -> torch.Tensor:
    """Round activations ``x`` ``[..., K]`` to ``levels`` symmetric steps per row (or per ``group``
    columns); the weights go through the int8 format's own ``_quantize_rows``."""
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    scale = x.abs().amax(-1, keepdim=True) / levels
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp(-levels, levels) * scale
    return q.reshape(shape)


def smooth(model: torch.nn.Module, amax: dict[str, torch.Tensor], alpha: float) -> None:
    """SmoothQuant's per-channel migration, folded into the norms, v/o and up/down pairs (exact in float).

    ``amax[name]``: ``[K]`` largest |activation| per input channel of each layer's qkv, o, gate/up
    and down products, from calibration text.
    """
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads

    def factor(act: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        wmax = torch.stack([w.abs().amax(0) for w in weights]).amax(0)  # [K]
        return (act.clamp(min=1e-5) ** alpha / wmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        s = factor(amax[f"{i}.qkv"], [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        layer.input_layernorm.weight.data /= s
        for proj in (att.q_proj, att.k_proj, att.v_proj):
            proj.weight.data *= s
        # o's input channels are the value heads' (repeated per GQA group): one factor per KV channel
        so = factor(amax[f"{i}.o"], [att.o_proj.weight]).reshape(kv_heads, heads // kv_heads, head_dim)
        so_kv = so.amax(1)  # [kv_heads, head_dim]
        att.v_proj.weight.data /= so_kv.reshape(-1)[:, None]
        att.o_proj.weight.data *= so_kv.repeat_interleave(heads // kv_heads, 0).reshape(-1)
        sd = factor(amax[f"{i}.down"], [mlp.down_proj.weight])
        mlp.up_proj.weight.data /= sd[:, None]
        mlp.down_proj.weight.data *= sd
        sg = factor(amax[f"{i}.gu"], [mlp.gate_proj.weight, mlp.up_proj.weight])
        layer.post_attention_layernorm.weight.data /= sg
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight.data *= sg


def calibrate(model: torch.nn.Module, tokenizer: object) -> dict[str, torch.Tensor]:
    """Per-channel max |input| of every product, over 1500 tokens of this repository's own text."""
    text = (REPO / "README.md").read_text()[:6000] + (REPO / "verispec" / "engine.py").read_text()[:4000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :1500]  # [1, T]
    amax: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable:
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)  # [K]
            amax[name] = torch.maximum(amax.get(name, x), x)

        return hook

    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name, module in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                             ("gu", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):  # fmt: skip
            hooks.append(module.register_forward_pre_hook(record(f"{i}.{name}")))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return amax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", default=None, help="Spec-Bench format (default: ../shared/...)")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    args = parser.parse_args()

    model, tokenizer, instruct = load_hf(args.model)
    original = {n: p.data.clone() for n, p in model.named_parameters()}
    amax = calibrate(model, tokenizer)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    activation: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {"fn": None}

    def quantise_input(_module: torch.nn.Module, args: tuple) -> tuple | None:
        fn = activation["fn"]
        return None if fn is None else (fn(args[0]),)

    for m in linears:
        m.register_forward_pre_hook(quantise_input)

    def load(params: dict[str, torch.Tensor]) -> None:
        for n, p in model.named_parameters():
            p.data.copy_(params[n])

    def int8_params(smoothed: bool) -> dict[str, torch.Tensor]:
        """The parameters with every product's weights as the int8 format holds them (after
        SmoothQuant's migration if ``smoothed``), made once and reloaded for each prompt."""
        load(original)
        if smoothed:
            smooth(model, amax, args.alpha)
        for m in linears:
            codes, scale = _quantize_rows(m.weight.data)  # [N, K] int8, [N]
            m.weight.data.copy_(codes.float() * scale[:, None])
        return {n: p.data.clone() for n, p in model.named_parameters()}

    int8 = {smoothed: int8_params(smoothed) for smoothed in (False, True)}

    variants: dict[str, tuple[bool, Callable[[torch.Tensor], torch.Tensor]]] = {
        "w8a16": (False, lambda x: quantise(x, 32767)),
        "w8a8": (False, lambda x: quantise(x, 127)),
        "w8a8-g32": (False, lambda x: quantise(x, 127, 32)),
        "w8a8-g64": (False, lambda x: quantise(x, 127, 64)),
        "w8a8-g192": (False, lambda x: quantise(x, 127, 192)),
        "smooth-w8a8": (True, lambda x: quantise(x, 127)),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for prompt in select(load_prompts(args.prompts), None, args.per_category):
        ids = torch.tensor([encode_prompt(tokenizer, prompt.text, chat=instruct)])  # [1, P]
        load(original)
        activation["fn"] = None
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)  # [1, P + n]
            ref = model(seq).logits[0, ids.shape[1] - 1 : -1].log_softmax(-1)  # [n, V]
        for name, (smoothed, fn) in variants.items():
            load(int8[smoothed])
            activation["fn"] = fn
            with torch.no_grad():
                got = model(seq).logits[0, ids.shape[1] - 1 : -1].log_softmax(-1)  # [n, V]
            activation["fn"] = None
            kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
            top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            results[name].append((kl, top1))
    print(f"{len(results['w8a16'])} prompts, {args.max_new_tokens} tokens each")
    for name, rows in results.items():
        t = torch.tensor(rows)  # [prompts, 2]
        kl, top1 = t[:, 0].mean(), t[:, 1].mean()
        print(f"{name:12s} KL {kl:.5f}  top-1 {top1:.4f}  (lowest prompt {t[:, 1].min():.3f})")


if __name__ == "__main__":
    main()
