"""Batched completions from a causal LM: greedy or sampled, several samples per prompt.

Shared by every stage that needs model text (evaluation, BIS rollouts, MC continuations, GRPO
evals). A small pure API over Hugging Face `generate`:

    model, tokenizer = load_model("models/base")          # offline, eval mode, left padding
    outs = generate(model, tokenizer, ["Q: 1+2=? A:"], max_new_tokens=32,
                    do_sample=True, temperature=0.8, num_samples=8, batch_size=256, seed=0)
    outs[0]  # 8 completion strings (prompt not included, stopped at <eos>, specials removed)

Speed on CPU: the KV cache is on, prompts are sorted by length so a batch pads little (left
padding, so every row's next token sits in the last column), `batch_size` sequences run
together, and a batch ends as soon as every row has emitted `<eos>`. Greedy decoding with
`num_samples > 1` decodes once and repeats the answer. Sampling is reproducible for a given
seed, batch size and prompt list; the global torch RNG is left as it was.

Device: `load_model` puts the model on `default_device()`: $PAPERLINE_DEVICE when set (`cpu`,
`cuda`, `cuda:1`, ...), else the first CUDA GPU when one is visible, else the CPU. A stage that
runs on a GPU worker then generates there with no params change; callers move their batches to
`model.device`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def default_device() -> str:
    """$PAPERLINE_DEVICE if set, else `cuda` when torch sees a GPU, else `cpu`."""
    import os

    import torch

    chosen = os.environ.get("PAPERLINE_DEVICE", "").strip()
    if chosen:
        return chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | Path, *, dtype: Any = None, device: str | None = None
               ) -> tuple[Any, Any]:
    """(model, tokenizer) from a local `save_pretrained` folder, on `device` (default:
    `default_device()`); never downloads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a save_pretrained folder")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kwargs)
    model.to(device or default_device())
    model.eval()
    return model, tokenizer


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = 64,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, num_samples: int = 1, batch_size: int = 64,
             seed: int = 0) -> list[list[str]]:
    """For each prompt, `num_samples` decoded completions (greedy when `do_sample` is False).

    `batch_size` counts generated sequences, so a batch holds `batch_size // num_samples`
    prompts (at least one). `top_k=0` disables top-k filtering (the HF default of 50 would
    silently truncate a small vocabulary).
    """
    import torch

    if num_samples < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("num_samples, batch_size and max_new_tokens must be >= 1")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature = {temperature}: must be > 0 when sampling")
    prompts = list(prompts)
    if not prompts:
        return []
    repeats = num_samples if do_sample else 1
    per_batch = max(1, batch_size // repeats)
    was_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = tokenizer(prompts)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    results: list[list[str]] = [[] for _ in prompts]
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                              "pad_token_id": pad_id, "eos_token_id": tokenizer.eos_token_id,
                              "use_cache": True}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k,
                      num_return_sequences=repeats)
    else:  # silence "temperature is set but do_sample=False" from saved generation configs
        kwargs.update(temperature=None, top_p=None, top_k=None)
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            torch.manual_seed(seed)
            for start in range(0, len(order), per_batch):
                idx = order[start:start + per_batch]
                batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]},
                                      return_tensors="pt").to(device)
                with torch.inference_mode():
                    out = model.generate(**batch, **kwargs)
                new = out[:, batch["input_ids"].shape[1]:]
                texts = tokenizer.batch_decode(new, skip_special_tokens=True)
                for j, i in enumerate(idx):
                    got = texts[j * repeats:(j + 1) * repeats]
                    results[i] = got if do_sample else got * num_samples
    finally:
        tokenizer.padding_side = was_side
    return results
