"""The agent harness shared by the agent papers (DDR, Early Experience, PlugMem).

An agent reads text and acts through tools; the harness runs it, counts what it costs and what
it got wrong, stores what happened and trains a small model to imitate an expert:

    protocol.py      tools with pydantic argument schemas, `parse_call` (named parse failures),
                     `Env` (reset/step/legal_actions/success), `InvalidAction`
    react.py         the ReAct prompt format (Thought / Action / Observation, arXiv 2210.03629)
                     and `parse_turn`, which reads a model's reply as one turn
    rollout.py       `run_episodes`: episodes stepped together, one batched backend call per
                     round; budgets in turns, model calls and tokens (a per-episode ledger);
                     model agents (the project's LLM backend) and scripted ones (experts, random)
    trajectories.py  episodes + steps parquet tables with great-expectations suites, written and
                     read back only through the checked functions; `summarise`
    imitation.py     imitation learning on the shared SFT engine: prompt = history so far,
                     target = the expert's next turn

A paper package builds its environments on `protocol.Env`, its experts as `ScriptedAgent`s and
its learned agents as `ModelAgent`s over `stages.models.backend` (the local tiny model, or a
served model through the OpenAI-compatible backend at the `gpu` profile); the tests in
tests/unit/test_agents.py run the whole chain on a toy key-finding environment.
"""
