"""LongMemEval-lite and a HotpotQA-style two-hop set, generated from a seed (spec section 4).

Two kinds of *samples*, each one memory haystack with its questions:

    chat    one user's multi-session history. Planted facts about the user (city, job, pet,
            food, hobby, drink) are stated in session 0 and some are changed in a later session
            ("I just moved to Oslo."): the question asks the value now, so the later fact wins.
            Distractor turns are chit-chat (no fact) and facts about other people ("My sister
            Ana lives in Paris."), which share the words a retriever matches on.
    hop     one two-hop question ("Where was the founder of Velmora Labs born?") over two gold
            passages (company -> founder, founder -> birthplace) and distractor passages about
            other companies and people.

Every observation (a user turn with the assistant's reply, or a passage) carries a *noise rank*:
the distractors kept at a noise level of n are those with rank < n (per session, or per
passage set), so the haystack of a
lower level is a subset of a higher one and the questions are the same at every level (paired
across levels). Gold facts are stored with the text the paper's structuring prompt should write
(`**Statement:** ... **Tags:** [...]`): the oracle parser's output and the structurer's target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

NAMES = ["Ana", "Ben", "Carla", "Dev", "Elif", "Farid", "Gina", "Hugo", "Iris", "Jonas", "Kira",
         "Luca", "Maya", "Nico", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wim",
         "Yara", "Zane", "Aldo", "Bea", "Cyril", "Dina", "Emil", "Fern"]
SURNAMES = ["Tal", "Moreau", "Ito", "Kowal", "Brandt", "Sousa", "Lind", "Okafor", "Reyes",
            "Novak", "Haas", "Dumas", "Park", "Quinn", "Varga", "Weiss", "Yilmaz", "Zhou"]
CITIES = ["Oslo", "Lisbon", "Paris", "Berlin", "Madrid", "Vienna", "Prague", "Dublin", "Athens",
          "Rome", "Warsaw", "Zurich", "Helsinki", "Krakow", "Porto", "Lyon", "Seville", "Munich",
          "Bergen", "Ghent", "Utrecht", "Tallinn", "Riga", "Bologna", "Valencia", "Geneva"]
RELATIVES = ["sister", "brother", "friend", "neighbour", "cousin", "colleague"]
# relation: (values, first statement, update statement, other person's statement, fact, tags
# (the lemma verb / key noun), question)
ATTRS: dict[str, dict] = {
    "city": dict(values=CITIES, first="I live in {v} these days.", update="I just moved to {v}.",
                 other="My {r} {n} lives in {v}.", fact="The user lives in {v}.", verb="live",
                 q="Where does the user live now?"),
    "job": dict(values=["nurse", "baker", "pilot", "teacher", "chemist", "lawyer", "plumber",
                        "architect", "dentist", "journalist", "farmer", "librarian", "chef",
                        "engineer", "translator", "painter"],
                first="I work as a {v}.", update="I started a new job as a {v}.",
                other="My {r} {n} works as a {v}.", fact="The user works as a {v}.", verb="work",
                q="What is the user's job now?"),
    "pet": dict(values=["dog", "cat", "parrot", "hamster", "rabbit", "turtle", "ferret", "goldfish",
                        "lizard", "canary", "tortoise", "pony"],
                first="My pet is a {v}.", update="We adopted a {v} and gave our old pet away.",
                other="My {r} {n} has a {v}.", fact="The user's pet is a {v}.", verb="pet",
                q="What pet does the user have now?"),
    "food": dict(values=["sushi", "pasta", "curry", "tacos", "ramen", "paella", "falafel",
                         "dumplings", "risotto", "pizza", "goulash", "pierogi", "lasagna"],
                 first="My favourite food is {v}.", update="These days my favourite food is {v}.",
                 other="My {r} {n} loves {v}.", fact="The user's favourite food is {v}.",
                 verb="favourite", q="What is the user's favourite food now?"),
    "hobby": dict(values=["chess", "climbing", "pottery", "surfing", "knitting", "archery",
                          "fencing", "rowing", "birdwatching", "gardening", "juggling", "sailing"],
                  first="My hobby is {v}.", update="I dropped my old hobby and took up {v}.",
                  other="My {r} {n} enjoys {v}.", fact="The user's hobby is {v}.",
                  verb="hobby", q="What is the user's hobby now?"),
    "drink": dict(values=["coffee", "tea", "cocoa", "kombucha", "lemonade", "mate", "espresso",
                          "chai", "kefir", "juice"],
                  first="I drink {v} every morning.", update="I switched to {v} in the mornings.",
                  other="My {r} {n} drinks {v}.", fact="The user drinks {v} every morning.",
                  verb="drink", q="What does the user drink in the morning now?"),
}
CHITCHAT = ["Can you suggest a book for the weekend?", "Thanks, that was helpful.",
            "What is a good way to stay focused?", "How do I make my plants grow faster?",
            "Any tips for sleeping better?", "Could you explain how compound interest works?",
            "I need ideas for a birthday gift.", "What should I pack for a short trip?",
            "Tell me a fun fact about space.", "How long should I boil an egg?",
            "Can you help me plan my week?", "What is the capital of Australia?",
            "Recommend a podcast about history.", "How do I fix a squeaky door?"]
REPLIES = ["That sounds great, thanks for sharing!", "Good to know, I will remember that.",
           "Here is a suggestion you might like.", "Sure, happy to help with that.",
           "Interesting! Tell me more whenever you like.", "Noted. Anything else on your mind?"]
SYL = ["vel", "mor", "tan", "qui", "ral", "zen", "dor", "lix", "bra", "nov", "sel", "kor", "ami",
       "tre", "gal", "pho", "run", "cas"]
SUFFIX = ["Labs", "Works", "Systems", "Foods", "Motors", "Media", "Textiles", "Robotics"]
HOP_Q = "Where was the founder of {c} born?"


@dataclass
class Obs:
    """One observation: a user turn (+ reply) or a passage, and the gold fact it states."""
    sample: str
    session: int
    turn: int
    text: str                   # the structurer's input (the user turn or the passage)
    chunk: str                  # what raw retrieval stores (turn + the assistant's reply)
    noise_rank: int             # -1 = never dropped (carries a question's fact); else rank
    fact: str = ""              # gold statement ("" = no fact)
    tags: list[str] = field(default_factory=list)


@dataclass
class Question:
    sample: str
    qid: str
    kind: str                   # single | update | hop
    question: str
    answer: str
    stale: list[str]            # earlier values of the asked attribute (for "later fact wins")


def oracle_text(fact: str, tags: list[str]) -> str:
    """The paper's structuring output for one fact (spec section 2), or NONE."""
    if not fact:
        return "NONE"
    return f"**Statement:** {fact} **Tags:** [{', '.join(tags)}]"


def _company(rng: random.Random) -> str:
    return (rng.choice(SYL) + rng.choice(SYL)).capitalize() + " " + rng.choice(SUFFIX)


def chat_sample(rng: random.Random, sid: str, n_sessions: int, n_attrs: int,
                max_noise: int) -> tuple[list[Obs], list[Question]]:
    """One user's sessions: `n_attrs` planted attributes, each stated in session 0 and changed
    once in a later session with probability 1/2; `max_noise` distractor turns per session."""
    attrs = rng.sample(sorted(ATTRS), n_attrs)
    history: dict[str, list[str]] = {a: [rng.choice(ATTRS[a]["values"])] for a in attrs}
    when: dict[tuple[str, int], int] = {}                         # (attr, version) -> session
    for a in attrs:
        when[(a, 0)] = 0
        if n_sessions > 1 and rng.random() < 0.5:
            new = rng.choice([v for v in ATTRS[a]["values"] if v != history[a][0]])
            history[a].append(new)
            when[(a, 1)] = rng.randrange(1, n_sessions)
    obs: list[Obs] = []
    for s in range(n_sessions):
        turns: list[tuple[str, str, list[str], int]] = []        # text, fact, tags, noise rank
        for a in attrs:
            for ver, v in enumerate(history[a]):
                if when[(a, ver)] == s:
                    spec = ATTRS[a]
                    text = (spec["first"] if ver == 0 else spec["update"]).format(v=v)
                    turns.append((text, spec["fact"].format(v=v), ["user", spec["verb"], v], -1))
        for rank in range(max_noise):                         # rank within the session
            if rng.random() < 0.5:
                turns.append((rng.choice(CHITCHAT), "", [], rank))
            else:
                a = rng.choice(sorted(ATTRS))
                r, n, v = rng.choice(RELATIVES), rng.choice(NAMES), rng.choice(ATTRS[a]["values"])
                text = ATTRS[a]["other"].format(r=r, n=n, v=v)
                fact = "The user's " + text[len("My "):]
                turns.append((text, fact, [r, n, ATTRS[a]["verb"], v], rank))
        rng.shuffle(turns)
        for t, (text, fact, tags, nr) in enumerate(turns):
            chunk = f"User: {text} Assistant: {rng.choice(REPLIES)}"
            obs.append(Obs(sid, s, t, text, chunk, nr, fact, tags))
    qs = [Question(sid, f"{sid}/{a}", "update" if len(history[a]) > 1 else "single",
                   ATTRS[a]["q"], history[a][-1], history[a][:-1]) for a in attrs]
    return obs, qs


def hop_sample(rng: random.Random, sid: str, max_noise: int) -> tuple[list[Obs], list[Question]]:
    """One two-hop question: company -> founder -> birthplace, with `max_noise` distractor
    passages (other companies' founders, other people's birthplaces)."""
    def person() -> str:
        return f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
    company, founder, city = _company(rng), person(), rng.choice(CITIES)
    passages = [(f"{company} was founded by {founder}.", [company, "found", founder], -1),
                (f"{founder} was born in {city}.", [founder, "born", city], -1)]
    for r in range(max_noise):
        if r % 2 == 0:
            c, p = _company(rng), person()
            if c == company:
                continue
            passages.append((f"{c} was founded by {p}.", [c, "found", p], r))
        else:
            p, c = person(), rng.choice(CITIES)
            if p == founder:
                continue
            passages.append((f"{p} was born in {c}.", [p, "born", c], r))
    rng.shuffle(passages)
    obs = [Obs(sid, 0, t, text, text, nr, text, tags)
           for t, (text, tags, nr) in enumerate(passages)]
    return obs, [Question(sid, f"{sid}/hop", "hop", HOP_Q.format(c=company), city, [])]


def generate(seed: int, *, n_chats: int, n_hops: int, n_sessions: int, n_attrs: int,
             max_noise: int) -> tuple[list[Obs], list[Question]]:
    """The samples of one corpus seed (chat samples `c<i>`, two-hop samples `h<i>`)."""
    rng = random.Random(seed)
    obs: list[Obs] = []
    qs: list[Question] = []
    for i in range(n_chats):
        o, q = chat_sample(rng, f"c{i}", n_sessions, n_attrs, max_noise)
        obs += o
        qs += q
    for i in range(n_hops):
        o, q = hop_sample(rng, f"h{i}", max_noise)
        obs += o
        qs += q
    return obs, qs
