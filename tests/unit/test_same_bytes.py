"""Same inputs, same bytes: a DVC output must hash the same in two fresh processes (two clones
repro'ing the same commit). The TRACE tagger is fitted and saved in two processes with different
hash seeds; its file is compared byte for byte (sklearn's vectorizers cached a memory address)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FIT_AND_SAVE = """
import sys
from pathlib import Path
from stages.trace import label, trace
texts = ["The sum is 7.", "So 3 + 4 = 7.", "Check: 7 - 4 = 3.", "Because 3 + 4 makes 7.",
         "Hence the answer is 7.", "Perhaps it is 8.", "Unless we erred, 7.", "Wait, recheck."]
labels = ["CDWBQRME", "DC", "E", "W", "C", "Q", "R", "M"]  # every label on and off somewhere
model = label.build_classifier(label.Config(max_iter=50))
model.fit(texts * 3, label.label_matrix(labels * 3))
trace.ClassifierTagger(model, 0.5).save(Path(sys.argv[1]))
"""


def test_tagger_file_is_the_same_bytes_in_two_processes(tmp_path: Path):
    digests = []
    for hash_seed in ("1", "2"):
        out = tmp_path / hash_seed
        out.mkdir()
        subprocess.run([sys.executable, "-c", FIT_AND_SAVE, str(out)], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONHASHSEED": hash_seed,
                            "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
        digests.append(hashlib.md5((out / "tagger.pkl").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
