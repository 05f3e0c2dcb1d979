"""`CoReGRPOTrainer`: the engine's GRPO trainer plus CoRe's anchor term (the math:
`stages.core_align.core`; all [reconstructed] from the abstract).

Per micro-batch, rollouts y ~ pi_theta(.|x) sampled from the policy's prompt x (x_img in CoRe),
the same completion tokens scored after the item's text prompt x_txt:

    loss = TRL's clipped GRPO loss (+ beta KL to the reference: lambda_ref = beta, 0 or 0.01)
           + lambda * mean_t KL( pi_theta(.|x, y_<t) || sg pi_theta(.|x_txt, y_<t) )

The anchor is the *current* policy under no_grad (dynamic). Only `policy_loss` is overridden,
plus the attachment of each rollout's text prompt to its generation batch; generation,
advantages, the optimizer and the diagnostics are the engine's.

The text prompt of a rollout comes from an `anchor_prompt` dataset column or, since
`train_grpo` builds its dataset from `prompt` and `answer` only, from the mapping
`anchor_prompts = {policy prompt: text prompt}` given to the trainer; pass it as
`trainer_cls=functools.partial(CoReGRPOTrainer, anchor_prompts=...)` (a partial of a module-level
class pickles into worker processes, a class made on the fly would not).

What the engine does not do yet (hence the text stand-in for x_img in the tests): it samples and
scores from token ids only. An image prompt needs the policy's prompt to be embeddings (encoder +
projector), which TRL's `_generate_and_score_completions` / `_get_per_token_logps_and_entropies`
never pass; `image_branch` is the one method a VLM overrides to score the completions from them.

Imported only when training starts (it imports TRL).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stages.core_align.core import Branch, anchor_kl, response_logits
from stages.train.grpo_trainer import GRPOTrainer


class CoReGRPOTrainer(GRPOTrainer):
    """`params` must carry `anchor: AnchorKLParams` (e.g. `stages.core_align.core.CoReGRPOParams`).
    `anchor_prompts`: {policy prompt: its text prompt x_txt}, unless the dataset carries an
    `anchor_prompt` column."""

    def __init__(self, *args: Any, params: Any, anchor_prompts: Mapping[str, str] | None = None,
                 **kwargs: Any):
        if params.replay_batches:
            raise ValueError("CoRe's anchor term needs replay_batches = 0: the text prompts are "
                             "attached to fresh rollouts only")
        super().__init__(*args, params=params, **kwargs)
        self.anchor_prompts = dict(anchor_prompts or {})

    # --- the anchor's input: x_txt of every rollout ---------------------------------------------

    def anchor_prompt(self, row: Mapping[str, Any]) -> str:
        if "anchor_prompt" in row:
            return row["anchor_prompt"]
        if row["prompt"] not in self.anchor_prompts:
            raise KeyError(f"no text anchor for the prompt {row['prompt']!r}: give the trainer "
                           f"anchor_prompts or the dataset an anchor_prompt column")
        return self.anchor_prompts[row["prompt"]]

    def anchor_prompt_ids(self, inputs: list[dict[str, Any]]) -> list[list[int]]:
        """Token ids of each rollout's x_txt, tokenised as TRL tokenises prompts (a VLM whose
        prompts are encoded piece by piece overrides this)."""
        return self.processing_class(text=[self.anchor_prompt(r) for r in inputs])["input_ids"]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        # left-padded like prompt_ids, so TRL's shuffle and split of the generation batch keep
        # each row with its anchor
        ids = self.anchor_prompt_ids(inputs)
        width = max(len(x) for x in ids)
        pad = self.processing_class.pad_token_id
        device = out["prompt_ids"].device
        out["anchor_prompt_ids"] = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids],
                                                device=device)
        out["anchor_prompt_mask"] = torch.tensor([[0] * (width - len(x)) + [1] * len(x)
                                                  for x in ids], device=device)
        return out

    # --- the loss -------------------------------------------------------------------------------

    def image_branch(self, inputs: dict[str, Any]) -> Branch:
        """The policy's own prompt (x_img in CoRe). Token ids here; a VLM overrides this to
        return the prompt's embeddings (`Branch(inputs_embeds=..., attention_mask=...)`)."""
        return Branch(input_ids=inputs["prompt_ids"], attention_mask=inputs["prompt_mask"])

    def policy_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        loss = super().policy_loss(model, inputs)        # TRL's clip (+ beta KL), scaled
        completion, mask = inputs["completion_ids"], inputs["completion_mask"]
        student = response_logits(model, self.image_branch(inputs), completion, mask)
        with torch.no_grad():                            # sg(theta): the dynamic anchor
            anchor = response_logits(model, Branch(input_ids=inputs["anchor_prompt_ids"],
                                                   attention_mask=inputs["anchor_prompt_mask"]),
                                     completion, mask)
        # the same temperature as the log-probs of TRL's loss
        kl = anchor_kl(student / self.temperature, anchor / self.temperature, mask)
        self._metrics[self.mode]["core/anchor_kl"].append(kl.detach().item())
        term = self.params.anchor.lam * kl
        if self.mode == "train":
            term = term / self.current_gradient_accumulation_steps
        return loss + term
