"""Prose kinds for the chats corpus: the model first writes a text, a second turn then works on that text.

Why: the package-built kinds (train/chats.py) ask about APIs and translate docstrings, while the benchmark asks
world-knowledge questions, answers over news passages, summarizes news articles and translates German
encyclopedic prose. The EAGLE head agreed with the 1.5B target on 0.42 of new chat answers but on 0.11-0.17 of
those four categories (docs/eagle.md; measured 2026-11-30). The pinned packages hold little general prose, so
these kinds make it: seeded subjects and events from the lists below (our own, disjoint from the benchmark's
sources by construction), a first turn that asks for a paragraph, an article or a question, and a second turn
(`restart`: the first exchange is dropped) that uses the first answer as its material:

  trivia    write a trivia question about a subject   -> the question alone, answered closed-book
  passage   write an encyclopedia paragraph            -> answer a question using that paragraph as the passage
  news      write a short news report on an event      -> summarize that report in one sentence
  german    write two or three German lexicon sentences -> translate them into English
  article   write a longer news article (~300 words)    -> summarize it in one sentence, or answer a question
                                                           over it (long inputs, as the suite's summarization
                                                           and rag prompts have)

A second turn runs only when its first answer passes the kind's check (`followup_accepts`): a question that
ends in "?", a German text that reads as German, a passage long enough to be one.
"""

from __future__ import annotations

import random
import re

PROSE_KINDS = ("trivia", "passage", "news", "german", "article")

_SUBJECTS = (
    "the Danube river", "the printing press", "the Great Barrier Reef", "photosynthesis", "the Silk Road",
    "the steam engine", "Mount Kilimanjaro", "the Hanseatic League", "penicillin", "the Sahara desert",
    "the violin", "the Amazon river", "the Byzantine empire", "plate tectonics", "the telegraph", "Lake Baikal",
    "the Gothic cathedral", "the bicycle", "the Fibonacci sequence", "the Andes", "the compass", "coral reefs",
    "the Renaissance", "the periodic table", "the Panama Canal", "the Vikings", "tea cultivation", "the Alps",
    "the mechanical clock", "the Mongol empire", "the human heart", "the Nile delta", "the piano", "windmills",
    "the Industrial Revolution", "the Arctic fox", "porcelain", "the Hubble space telescope", "the Inca road "
    "system", "the Black Sea", "the aqueducts of Rome", "the honeybee", "the Berlin Wall",
    "the Galapagos islands", "the metric system", "the saxophone", "the tides", "glass "
    "making", "the Trans-Siberian Railway", "the Maya calendar", "the blue whale", "the Suez Canal",
    "the Hundred Years' War", "paper money", "the lighthouse of Alexandria", "the Rhine", "the microscope",
    "the Icelandic volcanoes", "the Olympic torch relay", "the Sistine Chapel", "the Eiffel Tower", "the olive "
    "tree", "the cello", "the Atacama desert", "the Norman conquest", "cartography", "the rubber tree",
    "the Antarctic ice sheet", "the Golden Gate Bridge", "the Brothers Grimm fairy tales", "the abacus",
    "the Dead Sea", "the chess opening", "the hot air balloon", "the Magna Carta", "the Ganges", "the kiwi bird",
    "radio broadcasting", "the Colosseum", "the potato", "the Appalachian Trail", "the Sami people", "jade",
    "the submarine", "the Cape of Good Hope", "the gramophone", "the Terracotta Army", "the monsoon", "salt "
    "mining", "the Louvre", "the zeppelin", "the red panda", "the Bering Strait", "the harpsichord",
)
_ASPECTS = ("its history", "where it is found or used", "the numbers that describe it", "how it works or formed",
            "the people connected with it", "why it matters today")
_GERMAN_ASPECTS = ("", ", mit Angaben zur Geschichte", ", mit Angaben zur Verwendung", ", mit Angaben zu Ort und Größe")
_QUESTIONS = ("What is {s} known for?", "According to the passage, why is {s} important?",
              "What does the passage say about the history of {s}?", "Where is {s} found or used?",
              "What is one fact about {s} that the passage mentions?", "How did {s} change over time?")
_PLACES = ("Lisbon", "Hamburg", "a small town in Wales", "Osaka", "Nairobi", "Montreal", "the Scottish Highlands",
           "Buenos Aires", "Krakow", "Perth", "a village in Norway", "Seoul", "Marseille", "Denver", "Cape Town",
           "Helsinki", "Lyon", "Auckland", "Valencia", "Manchester", "Bergen", "Toronto", "Dublin")
_EVENTS = ("a new bridge opens in {p}", "a storm floods streets in {p}", "the local football club of {p} wins "
           "its league", "a museum in {p} returns a stolen painting", "a hospital in {p} opens a new wing",
           "a power cut hits {p} for a day", "scientists in {p} find a rare fossil", "a marathon in {p} breaks its "
           "record for runners", "a factory in {p} closes and 300 jobs are lost", "a zoo in {p} welcomes a baby "
           "elephant", "a school in {p} bans mobile phones", "a fire damages a historic church in {p}",
           "a tram line in {p} is delayed by two years", "a festival in {p} draws a record crowd",
           "a heatwave in {p} breaks temperature records", "a library in {p} reopens after repairs")
_ARTICLE_QUESTIONS = ("What happened in {p}, according to the passage?", "Who is quoted in the passage, and what "
                      "did they say?", "What numbers does the passage report?", "What happens next, according to "
                      "the passage?", "Why did this happen, according to the passage?")
_GERMAN_SUBJECTS = (
    "die Dampfmaschine", "der Rhein", "das Fahrrad", "die Zugspitze", "der Buchdruck", "die Honigbiene",
    "der Bodensee", "die Straßenbahn", "das Klavier", "der Schwarzwald", "die Kartoffel", "der Leuchtturm",
    "die Nordsee", "das Mikroskop", "der Kölner Dom", "die Windmühle", "der Elbtunnel", "die Orgel",
    "das Porzellan", "der Wattenmeer-Nationalpark", "die Sonnenuhr", "der Igel", "die Hanse", "der Kompass",
    "die Eisenbahn", "das Brot", "der Föhn", "die Burg", "der Weinbau", "die Glocke", "der Fuchs", "die Donau",
    "die Schreibmaschine", "der Gletscher", "die Apfelsorte", "das Rathaus", "der Kuckuck",
    "die Seilbahn", "der Marktplatz", "die Brücke", "das Segelboot", "der Bernstein", "die Mühle",
)
# Once on the lists above, withdrawn because the benchmark's prompts name them (data/bench/prompts.jsonl: a qa
# question on the Ottoman empire, a summarization article on a vaccination campaign, a translation on a Kochfeld,
# an article on a meeting in Vienna). Chats made before hold a few conversations on them; the chats corpus leaves out
# every conversation that names one (`names_withdrawn`), so no training text shares a topic with the benchmark.
WITHDRAWN = ("Ottoman empire", "vaccination", "Kochfeld", "Vienna")
_WITHDRAWN_RE = re.compile(r"\b(" + "|".join(map(re.escape, WITHDRAWN)) + r")\b", re.IGNORECASE)
_GERMAN_WORDS = frozenset("der die das und ist ein eine einer eines von mit zu den dem im des sich nicht auf wird "
                          "wurde für als auch sind oder bei aus nach wie zum zur durch".split())


def prose_prompts(per_kind: int, seed: int) -> dict[str, list[tuple[str, str, str, bool]]]:
    """Up to `per_kind` (source, first user turn, second turn with "{answer}", restart) per prose kind.

    Its own seeded stream (never the package kinds' one), so adding these kinds leaves the older kinds'
    prompts unchanged."""
    rng = random.Random(f"prose:{seed}")
    out: dict[str, list[tuple[str, str, str, bool]]] = {kind: [] for kind in PROSE_KINDS}
    for _ in range(per_kind):
        subject, aspect = rng.choice(_SUBJECTS), rng.choice(_ASPECTS)
        out["trivia"].append((
            "generator:trivia",
            f"Write one trivia question about {subject} ({aspect}) that has a short factual answer. Reply with the "
            "question only.", "{answer}", True))
        subject, aspect = rng.choice(_SUBJECTS), rng.choice(_ASPECTS)
        out["passage"].append((
            "generator:passage",
            f"Write a short encyclopedia paragraph (about 100 words) about {subject}, mentioning {aspect}.",
            "Answer the question using the passage below.\n\nPassage: {answer}\n\nQuestion: "
            + rng.choice(_QUESTIONS).format(s=subject), True))
        event = rng.choice(_EVENTS).format(p=rng.choice(_PLACES))
        out["news"].append((
            "generator:news",
            f"Write a short news report (about 120 words) on this: {event}.",
            "Summarize the following news article in one sentence.\n\n{answer}", True))
        subject, aspect = rng.choice(_GERMAN_SUBJECTS), rng.choice(_GERMAN_ASPECTS)
        out["german"].append((
            "generator:german",
            f"Schreibe auf Deutsch zwei oder drei Sätze wie in einem Lexikon über {subject}{aspect}. Antworte nur "
            "mit dem Text.", "Translate the following German text into English.\n\n{answer}", True))
    # kinds added later draw from streams of their own, so that the older kinds' prompts stay as they were
    article_rng = random.Random(f"prose:article:{seed}")
    for _ in range(per_kind):
        place = article_rng.choice(_PLACES)
        event = article_rng.choice(_EVENTS).format(p=place)
        if article_rng.random() < 0.5:
            followup = "Summarize the following news article in one sentence.\n\n{answer}"
        else:
            followup = ("Answer the question using the passage below.\n\nPassage: {answer}\n\nQuestion: "
                        + article_rng.choice(_ARTICLE_QUESTIONS).format(p=place))
        out["article"].append((
            "generator:article",
            f"Write a news article of about 300 words on this: {event}. Quote a local official or witness, and "
            "give some numbers.", followup, True))
    return out


def names_withdrawn(text: str) -> bool:
    """Whether the text names a subject withdrawn from the lists for overlapping the benchmark (WITHDRAWN)."""
    return _WITHDRAWN_RE.search(text) is not None


def looks_german(text: str) -> bool:
    words = re.findall(r"[a-zäöüß]+", text.lower())
    return len(words) >= 8 and sum(w in _GERMAN_WORDS for w in words) >= 0.12 * len(words)


def followup_accepts(kind: str, first_answer: str) -> bool:
    """Whether the first answer is fit material for the kind's second turn (other kinds: any answer)."""
    text = first_answer.strip()
    if kind == "trivia":
        return 10 <= len(text) <= 300 and text.endswith("?") and "\n" not in text
    if kind == "german":
        return 60 <= len(text) <= 1200 and looks_german(text)
    if kind in ("passage", "news"):
        return 250 <= len(text) <= 2000
    if kind == "article":
        return 900 <= len(text) <= 3500
    return bool(text)
