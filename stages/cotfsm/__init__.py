"""CoT-FSM (arXiv 2510.22437): chains of thought as walks through a six-state machine, and
Q-value-guided activation steering at sentence ends. Start with `fsm.py` (the method's math).

    fsm.py      states, merged transitions, R = T_corr - T_inc, Q-iteration, steering vectors,
                the online rule and the baselines' choices
    traces.py   stage `traces`: the task family (templated sentences, Markov chain, label noise)
    train.py    stage `train`: the tiny Llama per training seed
    fit.py      stage `fit_fsm`: the offline phase on the model's own CoTs, layer choice
    steer.py    stage `steer_eval`: sampling with steering hooks, the four arms, budget grid
    compare.py  stage `compare`: claims (paired bootstrap CI + McNemar), README tables
"""
