"""GIFT (arXiv 2510.22067): gaze-shift-guided attention enhancement at decoding time."""
