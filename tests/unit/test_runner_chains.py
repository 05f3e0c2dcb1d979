"""How the Prefect runner cuts a plan into chains (one `dvc repro` each) and reads back each
stage's state and time from DVC's output (flows/runner.py `chains`, `chain_outcomes`)."""

from __future__ import annotations

from flows.runner import StagePlan, chain_name, chain_outcomes, chains


def _s(name: str, up: list[str] = (), action: str = "run", gpus: int = 0,
       cacheable: bool = True) -> StagePlan:
    return StagePlan(name=name, target=f"dvc.yaml:{name}", addressing=name,
                     upstream=[f"dvc.yaml:{u}" for u in up], action=action, gpus=gpus,
                     run_cacheable=cacheable)


def _names(plan: list[StagePlan]) -> list[list[str]]:
    return [[s.name for s in c] for c in chains(plan)]


def test_a_straight_chain_is_one_unit():
    plan = [_s("a"), _s("b", ["a"]), _s("c", ["b"])]
    assert _names(plan) == [["a", "b", "c"]]
    assert chain_name(chains(plan)[0]) == "a → b → c"


def test_fan_out_and_join_break_chains():
    # a -> b -> d, a -> c -> d: b and c may run in parallel, d waits for both
    plan = [_s("a"), _s("b", ["a"]), _s("c", ["a"]), _s("d", ["b", "c"]), _s("e", ["d"])]
    assert _names(plan) == [["a"], ["b"], ["c"], ["d", "e"]]


def test_skipped_gpu_and_uncacheable_stages_stand_alone():
    plan = [_s("t", action="skip"), _s("a", ["t"]), _s("b", ["a"]), _s("g", ["b"], gpus=1),
            _s("h", ["g"]), _s("u", ["h"], cacheable=False), _s("v", ["u"])]
    assert _names(plan) == [["t"], ["a", "b"], ["g"], ["h"], ["u"], ["v"]]


def test_interleaved_plan_order_keeps_each_chain_whole():
    plan = [_s("a"), _s("x"), _s("b", ["a"]), _s("y", ["x"]), _s("c", ["b"])]
    assert _names(plan) == [["a", "b", "c"], ["x", "y"]]
    long = chains([_s(f"s{i}", [f"s{i - 1}"] if i else []) for i in range(5)])[0]
    assert chain_name(long) == "s0 → … → s4 (5 stages)"


def test_outcomes_and_seconds_from_dvc_output():
    chain = [_s("a"), _s("b", ["a"]), _s("c", ["b"])]
    lines = ["Stage 'up' is cached - skipping run, checking out outputs",
             "Running stage 'a':", "> python a.py", "Stage 'b' is cached - skipping run, "
             "checking out outputs", "Running stage 'c':", "done"]
    times = [1.0, 2.0, 2.5, 5.0, 6.0, 9.0]
    out = chain_outcomes(chain, lines, times, start=0.0, end=10.0)
    assert out == {"dvc.yaml:a": {"state": "ran", "seconds": 5.0},  # from the task's start
                   "dvc.yaml:b": {"state": "restored", "seconds": 1.0},
                   "dvc.yaml:c": {"state": "ran", "seconds": 4.0}}


def test_a_failure_names_the_stage_dvc_was_running_and_blocks_the_rest():
    chain = [_s("a"), _s("b", ["a"]), _s("c", ["b"])]
    lines = ["Running stage 'a':", "Running stage 'b':", "ERROR: failed to reproduce 'b'"]
    out = chain_outcomes(chain, lines, [1.0, 3.0, 4.0], start=0.0, end=4.5, failed=True)
    assert [v["state"] for v in out.values()] == ["ran", "failed", "blocked"]
    # failed before DVC started any stage of the chain (e.g. restoring its upstream)
    out = chain_outcomes(chain, ["ERROR: x"], [1.0], start=0.0, end=1.0, failed=True)
    assert [v["state"] for v in out.values()] == ["failed", "blocked", "blocked"]
