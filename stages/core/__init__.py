"""The stage contract: params loading and validation, atomic writes, run context, tracking, data checks."""
