"""A second data set the codec was not tuned on: a small GPT-like transformer really trained with AdamW.

Unlike `deltafs.testing.generator` (which simulates AdamW's statistics), this builds a plain-torch model
(token + position embeddings, `nn.TransformerEncoder` with causal masking, pre-LayerNorm, GELU MLP, untied
head), initialises it from a seed and trains it on synthetic token sequences drawn from a seeded sparse Markov
chain (so the loss really falls). After each AdamW step it exports the fp32 masters as a trainer would publish
them: matrices and embeddings in bf16, every 1-D tensor (LayerNorm gains and biases, linear biases) in F32. That
gives many small 1-D F32 tensors, which change almost entirely every step, next to bf16 matrices of which only a
small fraction of elements change.

Measured (20M parameters: 20 layers, 162 F32 1-D tensors, seed 0, lr 1e-6, 2 warmup steps): per step 1.04-1.27%
of bf16 elements and 99.0-99.3% of F32 elements change (1.37-1.60% of all elements); `versions.json` records it.

CLI (writes OUT_DIR/v0 ... OUT_DIR/v{N-1}, each an HF-style directory, and OUT_DIR/versions.json):

    python -m deltafs.testing.trained OUT_DIR --versions 4 --params 20M [--lr 1e-6] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "TrainedConfig",
    "TrainedRun",
    "changed_fractions",
    "config_for",
    "parse_count",
    "write_version",
]


@dataclass(frozen=True)
class TrainedConfig:
    """Shapes of the GPT-like model and of its training batches."""

    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 20
    n_heads: int = 4
    d_ff: int = 1024
    context: int = 128
    batch: int = 4

    def num_params(self) -> int:
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        per_layer = 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d + 4 * d
        return 2 * v * d + self.context * d + self.n_layers * per_layer + 2 * d


def parse_count(text: str) -> int:
    """'20M', '1.5M', '300k', '2G' or a plain integer, as an integer."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (e.g. 20M, 300k, 1500000)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def config_for(params: int) -> TrainedConfig:
    """A config of roughly `params` parameters: width by size, then as many layers as fit (at least one)."""
    d = 64 if params < 1_000_000 else 128 if params < 4_000_000 else 256 if params < 60_000_000 else 512
    vocab = 1024 if params < 1_000_000 else 4096 if params < 4_000_000 else 8192
    base = TrainedConfig(vocab_size=vocab, d_model=d, n_layers=0, n_heads=max(1, d // 64), d_ff=4 * d)
    per_layer = TrainedConfig(vocab_size=vocab, d_model=d, n_layers=1, n_heads=base.n_heads,
                              d_ff=4 * d).num_params() - base.num_params()
    layers = max(1, round((params - base.num_params()) / per_layer))
    return TrainedConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=base.n_heads, d_ff=4 * d)


class TinyGPT(nn.Module):
    """Token + position embeddings, a causal pre-LN nn.TransformerEncoder, a final LayerNorm and a linear head."""

    def __init__(self, cfg: TrainedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, norm=nn.LayerNorm(cfg.d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # nn.TransformerEncoder deep-copies one layer, so every layer would start identical: re-draw each.
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not self and callable(reset):
                reset()
            elif isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        logits: torch.Tensor = self.head(self.encoder(x, mask=mask, is_causal=True))
        return logits


class _MarkovTokens:
    """Seeded synthetic text: each token has a few likely successors (Zipf-weighted), so there is something to
    learn and the loss falls step by step."""

    def __init__(self, vocab: int, seed: int, successors: int = 8) -> None:
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.next = torch.randint(0, vocab, (vocab, successors), generator=self.gen)
        weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
        self.weights = weights / weights.sum()
        self.vocab = vocab

    def batch(self, batch: int, length: int) -> torch.Tensor:
        out = torch.empty(batch, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.gen)
        for i in range(1, length):
            pick = torch.multinomial(self.weights, batch, replacement=True, generator=self.gen)
            out[:, i] = self.next[out[:, i - 1], pick]
        return out


class TrainedRun:
    """A seeded model and optimizer; `export()` is the current version, `step()` trains one step and exports.

    Versions are deterministic for a given (config, seed, lr) on one machine and torch build.
    """

    def __init__(self, cfg: TrainedConfig, *, seed: int = 0, lr: float = 1e-6, weight_decay: float = 0.01,
                 warmup_steps: int = 2, warmup_lr: float = 1e-4) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.model = TinyGPT(cfg)
        self.data = _MarkovTokens(cfg.vocab_size, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=warmup_lr, weight_decay=weight_decay)
        self.losses: list[float] = []
        # A few larger steps first move the model off its init (LayerNorms at exactly 1 and 0, Adam's sign-like
        # first updates) before the versions that are published.
        for _ in range(warmup_steps):
            self._train_step()
        for group in self.opt.param_groups:
            group["lr"] = lr

    def _train_step(self) -> None:
        tokens = self.data.batch(self.cfg.batch, self.cfg.context + 1)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.losses.append(float(loss.detach()))

    def export(self) -> dict[str, torch.Tensor]:
        """The published weights: 1-D tensors in F32, everything else in bf16 (copies, safe to keep)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            t = p.detach()
            out[name] = t.clone() if t.dim() == 1 else t.to(torch.bfloat16)
        return out

    def step(self) -> dict[str, torch.Tensor]:
        self._train_step()
        return self.export()

    def versions(self, count: int) -> Iterator[dict[str, torch.Tensor]]:
        """count versions: the current export, then one per training step."""
        yield self.export()
        for _ in range(count - 1):
            yield self.step()


def changed_fractions(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Changed elements (bit patterns differ) per dtype and overall: {"bfloat16": f, "float32": f, "all": f, ...}."""
    changed: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, a in old.items():
        b = new[name]
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size(), torch.int8)
        key = str(a.dtype).removeprefix("torch.")
        changed[key] = changed.get(key, 0) + int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())
        total[key] = total.get(key, 0) + a.numel()
    out: dict[str, Any] = {k: changed[k] / total[k] for k in sorted(total)}
    out["all"] = sum(changed.values()) / max(1, sum(total.values()))
    return out


def write_version(out_dir: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], cfg: TrainedConfig,
                  step: int) -> None:
    """One HF-style directory: model.safetensors and config.json."""
    from safetensors.torch import save_file  # local: only writing needs it

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt", "step": str(step)})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"model_type": "deltafs-trained-gpt", "deltafs_trained": asdict(cfg), "step": step}, f,
                  indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltafs.testing.trained", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--versions", type=int, default=4, help="versions to write (v0 is the model before the first"
                    " published step)")
    ap.add_argument("--params", default="20M", help="approximate parameter count, e.g. 20M, 2M, 300k")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the published steps (sets the"
                    " changed fraction: about 1%% of bf16 elements at 1e-6 for 20M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=2, help="unpublished steps at lr 1e-4 before v0")
    args = ap.parse_args(argv)
    if args.versions < 1:
        ap.error("--versions must be at least 1")
    cfg = config_for(parse_count(args.params))
    started = time.perf_counter()
    run = TrainedRun(cfg, seed=args.seed, lr=args.lr, warmup_steps=args.warmup_steps)
    summary: dict[str, Any] = {"config": asdict(cfg), "params": cfg.num_params(), "lr": args.lr, "seed": args.seed,
                               "warmup_steps": args.warmup_steps, "versions": []}
    prev: dict[str, torch.Tensor] | None = None
    for i, tensors in enumerate(run.versions(args.versions)):
        write_version(os.path.join(args.out_dir, f"v{i}"), tensors, cfg, step=args.warmup_steps + i)
        entry: dict[str, Any] = {"dir": f"v{i}", "loss": run.losses[-1] if run.losses else None}
        if prev is not None:
            entry["changed"] = changed_fractions(prev, tensors)
        summary["versions"].append(entry)
        prev = tensors
        print(f"v{i}: " + json.dumps(entry), file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(args.out_dir, "versions.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{cfg.num_params() / 1e6:.1f}M parameters, {cfg.n_layers} layers, {args.versions} versions in "
          f"{args.out_dir} ({summary['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
