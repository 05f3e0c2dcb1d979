"""DDR: Deep Data Research, question-free exploration of a database (arXiv 2602.02039).

An explorer gets a database and no question ("Analyze patient 17"), explores it through
read-only SQL tools for a budget of turns, and is scored on a hidden checklist of facts about
the entity. Here, at tiny scale:

    world.py       hidden narratives per entity -> SQLite databases (visible) + notes (hidden) +
                   checklists whose every item carries the gold SQL that derives it
    env.py         the DDR tools over a read-only connection behind a SELECT-only guard
                   (sqlglot), the per-turn insight extractor (deterministic), exploration entropy
    explorers.py   scripted breadth-first / depth-first / random / reactive explorers (reference
                   arms, the breadth-first one is also the imitation expert)
    judge.py       the deterministic fact-matching judge on the paper's JSON contract, accuracy
                   (sample- and item-averaged, I_m and I_t), the top-k message curve
    databases.py, expert.py, train_explorer.py, explore.py, score.py, compare.py: the stages
"""
