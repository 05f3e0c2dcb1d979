"""A tiny masked-diffusion language model (MDLM) trained with the LLaDA objective, and its
decoding primitives: block decoding with low-confidence remasking, coarse completions.

Model. A Hugging Face `BertForMaskedLM` built from a `BertConfig` (bidirectional self-attention:
every position sees every other one, later tokens included; no causal mask), saved with
`save_pretrained` (safetensors) and loaded with `AutoModelForMaskedLM.from_pretrained`, like
LLaDA-8B (Nie et al., "Large Language Diffusion Models", arXiv 2502.09992), which is a
Transformer without the causal mask. `Config.arch: llama` builds that block itself (the
Llama block, bidirectional: transformers' `EuroBertForMaskedLM`); the pipeline's default is
BERT (pipelines/diffureason/README.md compares the two). Its tokenizer is the house character
tokenizer (`stages.models.tokenizer.build_tokenizer`) plus a `<mask>` token.

Layout of a sequence (fixed length, so a response position is the same position everywhere):

    <bos> prompt [PAD ... PAD] | response: L tokens, `<eos>`-padded after the answer
    <------------ P ---------> | <-------------------- L -------------------------->

Padding carries attention mask 0; the prompt always starts at position 1 and the response at
position P, so with fixed-width numbers every operand and every step has a fixed position (a
left-padded prompt moved the operands with the prompt's length, and a 3-layer model did not
learn to copy them: 6% greedy accuracy where this layout learns the task).

LLaDA objective (arXiv 2502.09992, Eq. 3 and its SFT form Eq. 5): draw t ~ U(0, 1] per
sequence, mask each response token independently with probability t (the prompt is never
masked), and minimise

    L(theta) = - E_{t, x0, xt} [ (1 / t) * sum_i 1[xt_i = MASK] * log p_theta(x0_i | xt) ] / L

(`llada_loss`): the 1/t weight makes it an upper bound of the negative log-likelihood. The
`<eos>` padding of the response is trained like any token (LLaDA SFT does the same), so the
model learns where an answer ends.

Block-structured masking (`train_mdlm(schedule="block")`, `block_mask`; a diagnostic, not
LLaDA's objective: our reading of block diffusion, Arriola et al., arXiv 2503.09573): per row
one response block k; the blocks before it clean, block k masked at ratio t (weight 1/t), the
blocks after it masked entirely (weight 1, the 1/t of ratio 1). It trains exactly what the
block decoder below sees, where LLaDA's single ratio usually leaves a later copy of a masked
token in view (pipelines/diffureason/README.md measures both).

Decoding (LLaDA §2.4, "low-confidence remasking", semi-autoregressive blocks): the response is
cut into blocks of B tokens, decoded left to right; inside a block, T_b steps each predict every
masked position of the block, commit the most confident ones (a share of the block per step,
`commit_schedule`) and leave the rest masked. One step is ONE forward pass over the whole
sequence (no KV cache): a row decoded in T_b steps per block costs T_b network function
evaluations (NFE) per block. `fill` is the one primitive: it fills every masked position of an
`allowed` set in a given number of steps, for a block (decoding), for all remaining positions at
once in 1-2 steps (a coarse completion, DiffuReason's cheap rollout) or for a few re-masked
positions (DiffuReason's in-place revision).

The autoregressive twin (`build_ar_twin`) is the house Llama-style decoder of the same width,
depth and heads (`stages.models.base.build_model`), trained on the same problems.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

MASK = "<mask>"


class Config(BaseModel):
    """Size of the diffusion model and of its autoregressive twin (same numbers for both)."""

    model_config = ConfigDict(extra="forbid")

    arch: Literal["bert", "llama", "modernbert"] = Field(
        "bert", description="bidirectional HF class: `llama` = EuroBERT (transformers' "
                             "EuroBertForMaskedLM: the Llama block, RMSNorm + RoPE + SwiGLU, "
                             "without the causal mask: LLaDA's architecture, and the AR twin's "
                             "block exactly); `bert`: the original post-norm BERT (learned "
                             "absolute positions); `modernbert`: pre-norm, RoPE, GeGLU")
    hidden_size: int = Field(128, ge=16, le=8192, description="width d [spec: 128]")
    num_layers: int = Field(4, ge=1, le=64, description="layers [spec: 4]")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads")
    intermediate_size: int = Field(256, ge=16, le=32768, description="MLP width")
    max_positions: int = Field(128, ge=16, le=8192, description="position embeddings")


# --- model ----------------------------------------------------------------------------------

def add_mask_token(tokenizer: Any) -> int:
    """Add `<mask>` to a house tokenizer (once) and return its id."""
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK})
    return int(tokenizer.mask_token_id)


def build_mdlm(cfg: Config, tokenizer: Any) -> Any:
    """A fresh bidirectional masked LM over `tokenizer` (which must have `<mask>`):
    `BertForMaskedLM`, `EuroBertForMaskedLM` (arch `llama`) or `ModernBertForMaskedLM`."""
    from transformers import (BertConfig, BertForMaskedLM, EuroBertConfig, EuroBertForMaskedLM,
                              ModernBertConfig, ModernBertForMaskedLM)

    if tokenizer.mask_token_id is None:
        raise ValueError("build_mdlm: the tokenizer has no mask token; call add_mask_token")
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads "
                         f"{cfg.num_heads}")
    if cfg.arch == "llama":
        # The AR twin's sizes and RoPE (stages.models.base.build_model) with bidirectional
        # attention: the same parameters one for one; EuroBERT's RMSNorm epsilon (1e-5) is
        # left as it is (Llama's default is 1e-6; benchmarks/diffureason_learning.py ran so).
        config = EuroBertConfig(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
            max_position_embeddings=cfg.max_positions, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True, attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            mask_token_id=tokenizer.mask_token_id, attn_implementation="sdpa")
        return EuroBertForMaskedLM(config)
    if cfg.arch == "modernbert":
        # every layer global (a window as long as the context): a block attends to all of it
        config = ModernBertConfig(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_positions,
            layer_types=["full_attention"] * cfg.num_layers, local_attention=cfg.max_positions,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, cls_token_id=tokenizer.bos_token_id,
            sep_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
            attn_implementation="sdpa")
        return ModernBertForMaskedLM(config)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                        intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=cfg.max_positions, type_vocab_size=1,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    return BertForMaskedLM(config)


def build_ar_twin(cfg: Config, tokenizer: Any) -> Any:
    """The autoregressive twin: the house Llama decoder at the same width, depth and heads."""
    from stages.models import base

    return base.build_model(base.Config(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                        num_heads=cfg.num_heads,
                                        intermediate_size=cfg.intermediate_size,
                                        max_positions=cfg.max_positions), tokenizer)


def load_mdlm(path: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) from a `save_pretrained` folder with the real HF loading code."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a save_pretrained folder")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.mask_token_id is None:
        raise ValueError(f"{folder}: its tokenizer has no mask token; not a diffusion LM")
    model = AutoModelForMaskedLM.from_pretrained(str(folder), local_files_only=True)
    model.eval()
    return model, tok


# --- layout ---------------------------------------------------------------------------------

def encode(tokenizer: Any, prompt: str, response: str | None, prompt_len: int,
           response_len: int) -> list[int]:
    """One fixed-length row: `<bos> prompt` padded to `prompt_len`, then the response `<eos>`-padded to
    `response_len` (all `<mask>` when `response` is None). Too long -> ValueError naming it."""
    ids = tokenizer.convert_tokens_to_ids(list(prompt))
    if tokenizer.unk_token_id in ids:
        bad = sorted({c for c, i in zip(prompt, ids) if i == tokenizer.unk_token_id})
        raise ValueError(f"prompt {prompt!r}: characters {bad} are not in the vocabulary")
    head = [tokenizer.bos_token_id] + ids
    if len(head) > prompt_len:
        raise ValueError(f"prompt {prompt!r}: {len(head)} tokens with <bos>, more than "
                         f"prompt_len = {prompt_len}")
    row = head + [tokenizer.pad_token_id] * (prompt_len - len(head))
    if response is None:
        return row + [tokenizer.mask_token_id] * response_len
    body = tokenizer.convert_tokens_to_ids(list(response))
    if len(body) > response_len:
        raise ValueError(f"response {response!r}: {len(body)} tokens, more than response_len "
                         f"= {response_len}")
    return row + body + [tokenizer.eos_token_id] * (response_len - len(body))


def decode_response(tokenizer: Any, row: Any, prompt_len: int) -> str:
    """The response text up to its first `<eos>`; a still-masked position reads as `_`."""
    out = []
    for i in row[prompt_len:].tolist():
        if i == tokenizer.eos_token_id:
            break
        out.append("_" if i == tokenizer.mask_token_id else tokenizer.convert_ids_to_tokens(i))
    return "".join(out)


# --- objective and training -----------------------------------------------------------------

def llada_mask(x0: Any, response: Any, t: Any, mask_id: int, generator: Any) -> tuple[Any, Any]:
    """x_t: each `response` position of x0 masked with probability t (one t per row).
    Returns (x_t, masked) with `masked` the boolean positions that were masked."""
    import torch

    u = torch.rand(x0.shape, generator=generator)
    masked = (u < t[:, None]) & response
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


def block_mask(x0: Any, prompt_len: int, block_size: int, t: Any, mask_id: int,
               generator: Any) -> tuple[Any, Any, Any]:
    """Block-structured x_t (`train_mdlm(schedule="block")`, module docstring): per row one
    response block k uniform over the blocks; blocks before k clean, block k masked with
    probability t, blocks after k masked entirely (ratio 1). Returns (x_t, masked, weight) with
    `weight` the per-position ELBO weight: 1/t in block k, 1 after it (the 1/t of a ratio-1
    mask), 0 before."""
    import torch

    rows, width = x0.shape
    n_blocks = -(-(width - prompt_len) // block_size)
    block = torch.full((width,), -1, dtype=torch.long)
    block[prompt_len:] = torch.arange(width - prompt_len) // block_size
    k = torch.randint(0, n_blocks, (rows,), generator=generator)
    u = torch.rand(x0.shape, generator=generator)
    current = block[None, :] == k[:, None]
    later = block[None, :] > k[:, None]
    masked = (current & (u < t[:, None])) | later
    weight = torch.where(current, 1.0 / t[:, None], later.float())
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked, weight


def llada_loss(logits: Any, x0: Any, masked: Any, t: Any, response_len: int,
               weight: Any = None) -> Any:
    """(1/B) sum_rows (1/t) * sum_{masked i} CE(logits_i, x0_i) / L  (module docstring);
    `weight` (rows, S) replaces the per-row 1/t by a per-position weight (`block_mask`)."""
    import torch

    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), x0,
                                           reduction="none")          # (rows, S)
    if weight is None:
        per_row = (ce * masked).sum(1) / t / response_len
    else:
        per_row = (ce * masked * weight).sum(1) / response_len
    return per_row.mean()


def train_mdlm(model: Any, rows: Any, prompt_len: int, mask_id: int, *, steps: int,
               batch_size: int, lr: float, seed: int, warmup: float = 0.05,
               min_lr_ratio: float = 0.1, eps: float = 1e-3, t_min: float = 0.0,
               schedule: Literal["llada", "block"] = "llada", block_size: int = 0,
               log: Callable[[dict[str, float], int], None] | None = None,
               log_every: int = 50) -> dict[str, float]:
    """Train `model` in place on fixed-length rows (LongTensor (N, S)) with the LLaDA
    objective: AdamW (beta2 0.98), linear warm-up then cosine decay to `lr * min_lr_ratio`,
    gradient clipping at 1. t ~ U(eps, 1] keeps 1/t finite. `t_min` > 0 (a diagnostic, not
    LLaDA: benchmarks/diffureason_learning.py) draws t from [t_min, 1] instead, the same t in
    the mask and in the 1/t weight; 1 masks every response token. `schedule="block"` masks
    block-wise as the decoder sees the response (`block_mask`, blocks of `block_size`)."""
    import torch

    if schedule not in ("llada", "block"):
        raise ValueError(f"schedule {schedule!r}: expected 'llada' or 'block'")
    if schedule == "block" and block_size < 1:
        raise ValueError(f"schedule 'block' needs block_size >= 1, got {block_size}")

    gen = torch.Generator().manual_seed(seed)
    n, width = rows.shape
    response = torch.zeros(width, dtype=torch.bool)
    response[prompt_len:] = True
    attn = (rows != model.config.pad_token_id).long()
    response_len = width - prompt_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, int(warmup * steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        frac = (step - warm) / max(1, steps - warm)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(0, n, (batch_size,), generator=gen)
        x0, a = rows[idx], attn[idx]
        t = eps + (1 - eps) * torch.rand(batch_size, generator=gen)
        if t_min > 0:
            t = t_min + (1 - t_min) * t
        if schedule == "block":
            xt, masked, weight = block_mask(x0, prompt_len, block_size, t, mask_id, gen)
        else:
            xt, masked = llada_mask(x0, response.expand_as(x0), t, mask_id, gen)
            weight = None
        logits = model(input_ids=xt, attention_mask=a).logits
        loss = llada_loss(logits, x0, masked, t, response_len, weight)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None and (step + 1) % log_every == 0:
            log({"train/loss": sum(losses[-log_every:]) / log_every}, step + 1)
    model.eval()
    tail = losses[-max(1, len(losses) // 10):]
    return {"train_loss": sum(tail) / len(tail), "train_steps": float(steps)}


def masked_loss(model: Any, rows: Any, prompt_len: int, mask_id: int, t: float = 0.5,
                seed: int = 0, batch_size: int = 256) -> float:
    """Mean cross-entropy on the masked response tokens at mask ratio t (held-out rows)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            x0 = rows[i:i + batch_size]
            response = torch.zeros_like(x0, dtype=torch.bool)
            response[:, prompt_len:] = True
            xt, masked = llada_mask(x0, response, torch.full((len(x0),), t), mask_id, gen)
            logits = model(input_ids=xt, attention_mask=(x0 != model.config.pad_token_id).long()
                           ).logits
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), x0,
                                                   reduction="none")
            total += float((ce * masked).sum())
            count += int(masked.sum())
    return total / max(count, 1)


# --- decoding -------------------------------------------------------------------------------

def commit_schedule(n_masked: Any, steps: int) -> Any:
    """How many positions each of `steps` steps commits, per row: n // steps each, the
    remainder one more in the first steps (LLaDA's `get_num_transfer_tokens`). (rows, steps)."""
    import torch

    if steps < 1:
        raise ValueError(f"steps = {steps}: expected >= 1")
    base = n_masked // steps
    extra = n_masked % steps
    sched = base[:, None].repeat(1, steps)
    sched += (torch.arange(steps)[None, :] < extra[:, None]).long()
    return sched


def forward_logits(model: Any, x: Any, pad_id: int, batch_size: int = 512) -> Any:
    """Logits of a batch of rows, in chunks of `batch_size` rows (no gradient)."""
    import torch

    outs = []
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            xi = x[i:i + batch_size]
            outs.append(model(input_ids=xi, attention_mask=(xi != pad_id).long()).logits)
    return torch.cat(outs)


def fill(model: Any, x: Any, conf: Any, allowed: Any, steps: int, *, mask_id: int,
         pad_id: int, banned: list[int], temperature: float = 0.0, generator: Any = None,
         batch_size: int = 512) -> tuple[Any, Any]:
    """Fill every masked position of x inside `allowed` (bool, same shape) in `steps` forward
    passes with low-confidence remasking: each pass predicts every masked position (seeing the
    whole row, masks included), commits per row the `commit_schedule` count of the most
    confident masked `allowed` positions and leaves the others masked. temperature 0: argmax;
    > 0: Gumbel-max sampling of logits / temperature. The confidence of a committed token is
    its probability under the softmax it was drawn from (kept in `conf`, same shape as x).
    Returns new (x, conf); the caller charges `len(x) * steps` NFE."""
    import torch

    x, conf = x.clone(), conf.clone()
    todo = (x == mask_id) & allowed
    sched = commit_schedule(todo.sum(1), steps)
    for s in range(steps):
        if not bool(todo.any()):
            break
        logits = forward_logits(model, x, pad_id, batch_size).float()
        logits[..., banned] = -math.inf
        if temperature > 0:
            scaled = logits / temperature
            u = torch.rand(scaled.shape, generator=generator).clamp_(1e-10, 1 - 1e-10)
            pred = (scaled - torch.log(-torch.log(u))).argmax(-1)
        else:
            scaled = logits
            pred = logits.argmax(-1)
        probs = torch.softmax(scaled, -1).gather(-1, pred[..., None])[..., 0]
        score = torch.where(todo, probs, torch.full_like(probs, -1.0))
        k = sched[:, s]
        order = score.argsort(dim=1, descending=True)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(x.shape[1]).expand_as(order))
        take = (rank < k[:, None]) & todo
        x = torch.where(take, pred, x)
        conf = torch.where(take, probs, conf)
        todo = todo & ~take
    return x, conf


def banned_ids(tokenizer: Any) -> list[int]:
    """Tokens a decoder never writes into a response: mask, pad, bos, unk."""
    return [int(tokenizer.mask_token_id), int(tokenizer.pad_token_id),
            int(tokenizer.bos_token_id), int(tokenizer.unk_token_id)]
