"""PlugMem (stages/plugmem): the structuring format and its parse, the graph's merge (later fact
wins), tag votes and ranking on hand-made embeddings, reasoning's time order, the perfect
reader, density, the corpus's nesting of noise levels, the tokenizer, and named errors."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from pydantic import ValidationError

from stages.models.embed import EmbedConfig, embed
from stages.plugmem import compare, corpus, graph as G, memory, text, world


def test_parse_structured_format_none_and_failures():
    got = G.parse_structured("**Statement:** The user lives in Oslo. **Tags:** [user, live, Oslo]")
    assert got == [("The user lives in Oslo.", ["user", "live", "Oslo"])]
    assert G.parse_structured(" NONE ") == []
    two = ("**Statement:** A was founded by B. **Tags:** [A, found, B]\n"
           "**Statement:** B was born in C. **Tags:** [B, born, C]")
    assert [s for s, _ in G.parse_structured(two)] == ["A was founded by B.", "B was born in C."]
    for bad in ("The user lives in Oslo.", "**Statement:** x **Tags:** user",
                "### Statement: x", "", "**Statement:** x **Tags:** [a]]"):
        with pytest.raises(G.ParseError):
            G.parse_structured(bad)
    # the oracle parser's text always parses back to its fact
    assert G.parse_structured(world.oracle_text("The user's pet is a cat.",
                                                ["user", "pet", "cat"]))[0][0] == \
        "The user's pet is a cat."


def _graph(facts: list[tuple[str, list[float], list[str]]], merge: bool = True) -> G.Graph:
    g = G.Graph(dim=2)
    for t, (s, e, tags) in enumerate(facts):
        g.insert(s, np.array(e, dtype=np.float32), tags, (0, t), merge=merge)
    return g


def test_merge_later_fact_wins_and_keeps_other_peoples_facts():
    g = _graph([("The user lives in Oslo.", [1, 0], ["user", "live", "Oslo"]),
                ("The user's sister Ana lives in Paris.", [1, 0.1], ["sister", "Ana", "live",
                                                                      "Paris"]),
                ("The user lives in Rome.", [1, 0], ["user", "live", "Rome"])])
    assert g.active == [False, True, True] and g.merges == 1
    assert G.same_fact("The user lives in Oslo.", ["user", "live", "Oslo"],
                       "The user lives in Rome.", ["user", "live", "Rome"])
    assert not G.same_fact("The user lives in Oslo.", ["user", "live", "Oslo"],
                           "The user lives in Oslo.", ["user", "live", "Oslo"])   # no change
    # without merging both values stay active (the contradiction the spec warns of)
    assert _graph([("The user lives in Oslo.", [1, 0], ["user", "live", "Oslo"]),
                   ("The user lives in Rome.", [1, 0], ["user", "live", "Rome"])],
                  merge=False).active == [True, True]
    # tags deduplicated by exact string, each indexing its facts
    assert g.tag_index["live"] == [0, 1, 2] and g.tag_index["user"] == [0, 2]


def test_votes_by_hand():
    # facts: f0 along x, f1 along y, f2 diagonal; the query along x
    g = _graph([("f0", [1, 0], ["alpha"]), ("f1", [0, 1], ["beta"]), ("f2", [1, 1], ["gamma"])],
               merge=False)
    q = np.array([1.0, 0.0])
    tag_emb = {"alpha": np.array([1.0, 0.0]), "beta": np.array([0.0, 1.0]),
               "gamma": np.array([1.0, 1.0])}
    # top_a = 1: f0 gets +2; query tag "beta" matches tag beta exactly (cos 1): 5 x 1 to f1;
    # query tag "b2" (embedded near beta, cos 0.8 < 0.9): no vote at tau 0.9, 1 vote at 0.7
    q_tags = ["beta", "b2"]
    q_tag_emb = np.array([[0.0, 1.0], [-0.6, 0.8]])   # b2: cos 0.8 beta, 0.14 gamma
    v = G.vote(g, q, q_tags, q_tag_emb, tag_emb, top_a=1, tau_tag=0.9)
    assert v == {0: 2.0, 1: 5.0}
    v = G.vote(g, q, q_tags, q_tag_emb, tag_emb, top_a=1, tau_tag=0.7)
    assert v == {0: 2.0, 1: 6.0}              # b2's best tag, beta, gives 1 x importance
    assert G.vote(g, q, q_tags, q_tag_emb, tag_emb, top_a=1, tau_tag=0.7,
                  use_tags=False) == {0: 2.0}
    # ranking is by cos(query, fact), not by votes: f0 (1.0) before f1 (0.0)
    assert G.retrieve(g, q, {0: 2.0, 1: 6.0}, top_k=10) == [0, 1]
    assert G.retrieve(g, q, {0: 2.0, 1: 6.0, 2: 0.0}, top_k=2) == [0, 2]
    # an inactive fact gets no vote
    g.active[1] = False
    assert G.vote(g, q, q_tags, q_tag_emb, tag_emb, top_a=1, tau_tag=0.7) == {0: 2.0}


def test_reason_time_order_perfect_reader_density():
    g = _graph([("old", [1, 0], ["a"]), ("mid", [0, 1], ["b"]), ("new", [1, 1], ["c"])],
               merge=False)
    assert G.reason(g, [2, 0, 1], keep=2) == ["old", "new"]        # best two, oldest first
    assert G.perfect_reader("The user lives in Oslo.\nThe user lives in Rome.", "Rome", ["Oslo"])
    assert not G.perfect_reader("The user lives in Rome.\nThe user lives in Oslo.", "Rome",
                                ["Oslo"])
    assert not G.perfect_reader("nothing here", "Rome", [])
    assert not G.perfect_reader("Romeo", "Rome", [])                 # whole words only
    assert G.density(0.6, 0.2, 200) == pytest.approx(2.0)            # 0.4 per 200 -> 2 / 1k
    assert np.isnan(G.density(0.5, 0.5, 0))


def test_query_tags_and_segments():
    assert G.query_tags("Where was the founder of Velmora Labs born?") == \
        ["founder", "Velmora Labs", "born"]
    assert G.query_tags("What pet does the user have now?") == ["pet", "user", "have"]
    e = np.array([[1, 0], [1, 0.1], [0, 1], [0.1, 1]], dtype=np.float32)
    assert G.segments(e, 0.75) == [0, 0, 1, 1]
    assert G.segments(e, -1.1) == [0, 0, 0, 0]


def _cfg(**kw) -> corpus.Config:
    base = dict(seeds=[0, 1], val_seeds=[5], train_seeds=[9], n_chats=3, n_hops=2,
                n_train_chats=2, n_train_hops=1, n_sessions=3, n_attrs=4, noise_levels=[1, 3])
    return corpus.Config(**{**base, **kw})


def test_corpus_answers_derivable_and_noise_nested():
    obs, qs = corpus.build(_cfg())
    assert set(qs["kind"]) == {"single", "update", "hop"}
    for r in qs.iter_rows(named=True):
        mine = obs.filter((pl.col("split") == r["split"]) & (pl.col("seed") == r["seed"])
                          & (pl.col("sample") == r["sample"]))
        # the gold answer is stated by a question-carrying (never dropped) observation
        kept = mine.filter(pl.col("noise_rank") == -1)
        assert any(r["answer"] in f for f in kept["fact"])
        if r["kind"] == "update":   # the answer is the later statement of the asked value
            stale = json.loads(r["stale"])[0]
            t_new = kept.filter(pl.col("fact").str.contains(rf"\b{r['answer']}\b"))["session"]
            t_old = kept.filter(pl.col("fact").str.contains(rf"\b{stale}\b"))["session"]
            assert t_new.min() > t_old.max()
    assert obs["noise_rank"].max() == 2                                # ranks 0..max level - 1
    o2, q2 = corpus.build(_cfg())
    assert o2.equals(obs) and q2.equals(qs)                            # seeded


def test_named_errors():
    with pytest.raises(ValidationError, match="disjoint"):
        _cfg(val_seeds=[0])
    with pytest.raises(ValidationError, match="increasing"):
        _cfg(noise_levels=[3, 1])
    with pytest.raises(ValidationError, match="unknown"):
        memory.Config(arms=["none", "graphrag"], noise_levels=[1])
    with pytest.raises(ValidationError, match="none"):
        memory.Config(arms=["raw"], noise_levels=[1])


def test_tokenizer_round_trip_and_hashed_embedding():
    tok = text.build_word_tokenizer(["The user lives in Oslo.", "Where does the user live now?",
                                     "I live in Oslo these days."])
    s = text.structurer_prompt("I live in Oslo these days.") + \
        " **Statement:** The user lives in Oslo. **Tags:** [user, live, Oslo]"
    assert tok.decode(tok(s)["input_ids"], skip_special_tokens=True) == s
    s2 = text.reader_prompt(["The user lives in Oslo."], "Where does the user live now?")
    ids = tok(s2, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == s2
    assert text.count_tokens(tok, "The user lives in Oslo.") == 6      # The| user| lives| in| Oslo|.
    e = embed(["the user lives in oslo", "the user lives in oslo", "a cat"],
              EmbedConfig(kind="hashed", dim=64))
    assert np.allclose(np.linalg.norm(e, axis=1), 1) and np.allclose(e[0], e[1])


def test_compare_cells_and_claims():
    m = {}
    for s in range(3):
        for n in (1, 2):
            m[f"plugmem/n{n}/s{s}/acc"] = 0.5 + 0.1 * s
            m[f"raw/n{n}/s{s}/acc"] = 0.4 + 0.1 * s + 0.01 * n
            m[f"none/n{n}/s{s}/acc"] = 0.1
    assert compare.cells(m, "raw", "acc") == {f"n{n}/s{s}": 0.4 + 0.1 * s + 0.01 * n
                                              for s in range(3) for n in (1, 2)}

    class Ctx:
        def stage_metrics(self, stage):
            return m
    out = compare.run(compare.Config(), Ctx())
    assert out["cells"] == 6 and out["claim/acc_vs_raw/verdict"] == 1.0
    assert out["claim/acc_vs_raw/diff"] == pytest.approx(0.085)


def test_answer_line_by_hand():
    from stages.plugmem.graph import answer_line, line_bucket, perfect_reader

    block = ["The user lives in Riga.", "The user's pet is a cat.", "The user drinks cocoa.",
             "The user's hobby is chess.", "The user's pet is a catfish now."]
    assert answer_line(block, "cat") == 2                # a word: not the `cat` in `catfish`
    assert answer_line(block, "Riga") == 1
    assert answer_line(block, "chess") == 4
    assert answer_line(block, "fencing") == 0
    assert answer_line(block + ["The user's pet is a cat again."], "cat") == 6   # the last one
    assert answer_line([], "cat") == 0
    assert [line_bucket(i) for i in (0, 1, 2, 3, 4, 9)] == ["absent", "1", "2", "3", "4+", "4+"]
    # values that start or end with a non-word character: `\b` would miss `C++` before a full
    # stop and `.5` anywhere; a value inside a longer token still does not count
    code = ["The user codes in C++.", "The user's score is 3.5 now.", "The user rates .5"]
    assert answer_line(code, "C++") == 1
    assert answer_line(code, "3.5") == 2 and answer_line(code, ".5") == 3
    assert answer_line(["The user codes in C++x."], "C++") == 0
    assert perfect_reader("in Go\nin C++.", "C++", ["Go"])
    assert not perfect_reader("in C++\nin Go.", "C++", ["Go"])
