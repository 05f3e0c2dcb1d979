"""The one entry point of every dvc.yaml `cmd`: `python -m stages <pipeline> <stage>`.

It finds the repo, loads and validates the params of every stage of the pipeline (so a typo
anywhere fails before any compute), runs the stage inside an MLflow child run, and writes the
returned metrics atomically to `<paths.metrics>/<stage>.json` for DVC.

Run as a program it first re-executes itself with PYTHONHASHSEED=0 and, on x86-64, torch's, MKL's
and oneDNN's AVX2 kernels (the same bytes whatever seed the caller had and whichever vector
instructions the CPU has beyond AVX2), then ties its life to the process that started it (a
killed `dvc repro` takes its stage with it): stages/core/proc.py.
"""

from __future__ import annotations

if __name__ == "__main__":  # before any heavy import: the first interpreter may be replaced
    from stages.core import proc

    proc.fixed_process_env()
    proc.die_with_parent()

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    # imported here, not above: a client that hands its stage to the fork server never needs
    # them (0.2 s of pydantic & co. saved per stage)
    from stages.core.config import ParamsError, UnknownNameError
    from stages.core.runner import run_stage

    parser = argparse.ArgumentParser(prog="python -m stages", description=__doc__)
    parser.add_argument("pipeline")
    parser.add_argument("stage")
    parser.add_argument("--check", action="store_true",
                        help="validate params of the whole pipeline and exit, computing nothing")
    args = parser.parse_args(argv)
    from stages.core.checks import DataValidationError

    try:
        run_stage(args.pipeline, args.stage, check_only=args.check)
    except (ParamsError, UnknownNameError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DataValidationError as exc:
        print(f"error: data check failed in stage {args.pipeline}/{args.stage}: {exc}",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    from stages.core import forkserver

    # under `paperline repro`: run in a fork of a process that has torch & co. imported
    code = forkserver.delegate(sys.argv[1:])
    sys.exit(main() if code is None else code)
