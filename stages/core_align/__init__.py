"""CoRe (ICML 2026, poster 64509): align a VLM's image-conditioned policy to its own
text-conditioned policy, a stop-gradient dynamic anchor, by step-wise distribution matching inside
SFT (`core`) and GRPO (`trainer`). Named `core_align` because `stages/core` is the project's
contract package."""
