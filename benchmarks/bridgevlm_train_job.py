"""One BridgeVLM training job (arm, seed) on this tree's code against an earlier commit's.

    .venv/bin/python benchmarks/bridgevlm_train_job.py [--base 662ceee~1] [--arms answer_only
        bridgevlm] [--repeats 1] [--write]

The `cpu` profile's `train` stage (pipelines/bridgevlm/params.yaml: 24 jobs of 500 steps x 16,
the validation split answered every 100 steps for the checkpoint choice, then the test split)
runs each job in a spawned worker. Here each run is a fresh process that calls `train_job` on
the pipeline's data (`pipelines/bridgevlm/data/pairs`: `paperline repro bridgevlm` first), as a
worker's first job does, with the code of `--base` (a git worktree) or of this tree, in
alternating order, from the repository root (the checks' cache there is warm after a repro,
as it is for a worker, which the stage process's own checks have just warmed). CPU seconds are
the process's own (user + system), start-up imports included; the saved model files and the
returned metrics (timings aside) must be identical between the two codes, or the run fails.

`--write` replaces the "BridgeVLM training job" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_section  # noqa: E402

ONE_RUN = r"""
import hashlib, json, resource, sys, time
from pathlib import Path
code, arm, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, code)
import stages
assert Path(stages.__file__).resolve().parent == Path(code, "stages").resolve(), stages.__file__
from stages.core.config import read_yaml, section_for
from stages.bridgevlm import train as T
pipe = Path(sys.argv[4])
cfg = T.Config.model_validate(section_for(read_yaml(pipe / "params.yaml"), "train", "cpu",
                                          "params.yaml"))
t0 = time.perf_counter()
records, m = T.train_job((cfg, str(pipe / "data" / "pairs"), arm, 0, str(out), 1))
u = resource.getrusage(resource.RUSAGE_SELF)
files = {str(f.relative_to(out)): hashlib.md5(f.read_bytes()).hexdigest()
         for f in sorted(out.rglob("*")) if f.is_file()}
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": u.ru_utime + u.ru_stime,
                  "files": files, "records": records,
                  "metrics": {k: v for k, v in m.items() if "seconds" not in k}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="662ceee~1", help="the earlier commit")
    parser.add_argument("--arms", nargs="+", default=["answer_only", "bridgevlm"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    pipe = ROOT / "pipelines" / "bridgevlm"
    if not (pipe / "data" / "pairs" / "train.parquet").is_file():
        raise SystemExit(f"{pipe}/data/pairs: run `paperline repro bridgevlm` first")
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="paperline-bench-") as scratch:
        worktree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), base],
                       cwd=ROOT, check=True)
        try:
            for arm in args.arms:
                got: dict[str, list[dict]] = {"base": [], "tree": []}
                for i in range(args.repeats):
                    for which in (("base", "tree") if i % 2 == 0 else ("tree", "base")):
                        code = worktree if which == "base" else ROOT
                        out = Path(scratch) / f"{which}-{arm}-{i}"
                        proc = subprocess.run(
                            [sys.executable, "-c", ONE_RUN, str(code), arm, str(out), str(pipe)],
                            capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(code)})
                        if proc.returncode:
                            raise SystemExit(proc.stderr[-3000:])
                        got[which].append(json.loads(proc.stdout.splitlines()[-1]))
                        print(f"{arm} {which}: {got[which][-1]['cpu']:.1f} CPU s, "
                              f"{got[which][-1]['wall']:.1f} s wall", flush=True)
                for key in ("files", "metrics", "records"):
                    seen = {json.dumps(run[key], sort_keys=True)
                            for runs in got.values() for run in runs}
                    if len(seen) != 1:
                        raise SystemExit(f"{arm}: the two codes gave different {key}")
                med = {k: statistics.median(r["cpu"] for r in v) for k, v in got.items()}
                rows.append((arm, med["base"], med["tree"]))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                           check=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    body = "\n".join([
        f"`.venv/bin/python benchmarks/bridgevlm_train_job.py --base {args.base} --arms "
        f"{' '.join(args.arms)} --repeats {args.repeats} --write`: one `train_job` of BridgeVLM's "
        f"`cpu` profile (500 steps x 16, validation every 100 steps, then the test split; seed "
        f"0) in a fresh process, as a spawned worker's first job, on the code of {base} and of "
        f"this tree (HEAD {head}), alternating; CPU seconds of the process, start-up included. "
        f"Every saved model file, test metric and logged training record was identical "
        f"between the two. Load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        f"| arm | CPU s, {base} | CPU s, this tree | this tree / {base} |",
        "|---|---|---|---|",
        *(f"| {arm} | {b:.1f} | {t:.1f} | {t / b:.2f} |" for arm, b, t in rows),
        "",
        "What changed: prompt pieces tokenized once per tokenizer, and the structure question "
        "left out of model selection (its score does not read it).",
    ])
    print(body)
    if args.write:
        write_section("BridgeVLM training job", body)


if __name__ == "__main__":
    main()
