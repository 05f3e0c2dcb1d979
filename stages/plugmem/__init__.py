"""PlugMem: a task-agnostic plugin memory module for LLM agents (arXiv 2603.03296, ICML 2026;
code github.com/TIMAN-group/PlugMem).

Episodes become a knowledge graph of facts (propositional knowledge), tags and subgoals; a
question retrieves facts by tag votes and similarity, and a reasoning step condenses them before
the answering model reads them. Here, at tiny scale, with learned models:

    world.py       LongMemEval-lite chats (facts that change over time) and two-hop passages
    text.py        the structurer's and reader's prompts, the word-level tokenizer
    graph.py       the method: structuring format and parse, graph, merge (later fact wins),
                   tag votes, retrieval, reasoning, perfect reader, density
    corpus.py, train.py (train_structurer, train_reader), structure.py, memory.py, answer.py,
    compare.py: the stages
"""
