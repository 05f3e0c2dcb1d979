"""Early Experience: agent learning from its own reward-free interaction (Zhang et al., ICML
2026, arXiv 2510.08558; no official code; method in section 2 as the secondary summaries give
it, spec section 2).

An imitation-learned policy sees only the expert's states. Early experience lets the agent act
at those states itself, K alternative actions executed for one step, and uses the resulting
next states, with no reward, as supervision in two ways: implicit world modelling (predict
s' from (s, a'), then imitate) and self-reflection (explain, from the two outcomes, why the
expert action is better, then imitate). Here, at tiny scale on a text mini-WebShop:

    shop.py         the environment (catalogue, goals, search/click/select/buy/back, in-domain
                    and OOD splits) on the agent harness's protocol, and the scripted expert
    experience.py   one-step alternatives from expert states, templated reflections, and the
                    IWM / SR / DPO training examples (the method's formulas)
    build.py, explore.py, train.py, evaluate.py, compare.py: the stages shop, experience,
                    train, evaluate, compare
"""
