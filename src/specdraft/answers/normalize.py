"""Figures and dates in free text: find them, normalise them, compare them; and SQuAD-style answer scoring.

A *mention* is a span of text that states one value:
  Number(value, unit)      value is an exact Fraction; unit is None, "$", "€", "£", "¥", "¢", "%" or "s" (a decade)
  Date(year, month, day)   any field may be None ("March 2020", "March 3", "May")

Normalisation rules (each has true and false cases in tests/test_answers.py):
  thousands separators   "4,500,000" = "4500000"
  decimals               "4.50" = "4.5"
  percent                "12%" = "12 percent" = "12 per cent"
  currency               "$4.5" = "4.5 dollars" = "US$4.5" (also €/euros, £/pounds, ¥, cents)
  scale words            "1.5 million" = "1,500,000"; "4.5m", "4.5 mn", "2bn", "3k", "a million", "two hundred"
  written-out numbers    zero .. nineteen, the tens, "twenty-five", "forty two"
  month names            "September" = "Sept." = "Sep" (a lone month only when capitalised, "may" is a verb)
  day-month order        "3 March 2020" = "March 3, 2020" = "March 3rd, 2020" = "the 3rd of March, 2020"
  numeric dates          "2020-03-03" (ISO) and "3/3/2020" (US month/day order, as in American news)
  years                  a bare integer 1000..2099 is a number that also matches a date with that year
A unit left out on one side is compatible ("4.5m" matches "$4.5 million"); two different units are not.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

_SMALL = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
          "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
WORD_VALUES = {**{w: i for i, w in enumerate(_SMALL)}, **_TENS}
SCALES = {"thousand": 10**3, "k": 10**3, "million": 10**6, "mn": 10**6, "m": 10**6, "mln": 10**6,
          "billion": 10**9, "bn": 10**9, "b": 10**9, "trillion": 10**12, "tn": 10**12}
MONTHS = {"january": 1, "february": 2, "march": 3, "april": 4, "may": 5, "june": 6, "july": 7, "august": 8,
          "september": 9, "october": 10, "november": 11, "december": 12,
          "jan": 1, "feb": 2, "mar": 3, "apr": 4, "jun": 6, "jul": 7, "aug": 8, "sep": 9, "sept": 9, "oct": 10,
          "nov": 11, "dec": 12}
UNITS = {"$": "$", "us$": "$", "dollar": "$", "dollars": "$", "usd": "$", "€": "€", "euro": "€", "euros": "€",
         "£": "£", "pound": "£", "pounds": "£", "¥": "¥", "yen": "¥", "cent": "¢", "cents": "¢", "%": "%",
         "percent": "%", "per cent": "%", "percentage points": "%"}

FULL_MONTHS = [k for k in MONTHS if len(k) > 4 or k in ("may", "june", "july")]
_alt = lambda words: "|".join(sorted(map(re.escape, words), key=len, reverse=True))  # noqa: E731
MONTH = rf"(?:{_alt(MONTHS)})\b\.?"
DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?\b"
YEAR = r"(?:1\d{3}|20\d\d)\b"
DIGITS = r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?![\d])"
WORDS = (rf"\b(?:(?:{_alt(_TENS)})(?:[- ](?:{_alt(_SMALL[1:10])}))?|{_alt(_SMALL)})\b(?:\s+hundred\b)?"
         r"|\b(?:a|an)\b(?=\s+(?:hundred|thousand|million|billion|trillion)\b)")
SCALE = rf"(?:{_alt(SCALES)})\b\.?"
UNIT_AFTER = r"(?:%|percentage points\b|per\s+cent\b|percent\b|dollars?\b|euros?\b|pounds?\b|cents?\b|usd\b|yen\b)"
CURRENCY_BEFORE = r"(?:US\$|\$|€|£|¥)"

_PATTERN = re.compile("|".join([
    rf"(?P<iso>\b(?P<iso_y>{YEAR})-(?P<iso_m>0?[1-9]|1[0-2])-(?P<iso_d>[0-3]?\d)\b)",
    r"(?P<us>\b(?P<us_m>0?[1-9]|1[0-2])/(?P<us_d>[0-3]?\d)/(?P<us_y>\d{4}|\d\d)\b)",
    rf"(?P<md>\b(?P<md_m>{MONTH})\s+(?P<md_d>{DAY})(?!\s*(?:,\s*)?\d{{3}}(?!\d))(?:\s*,?\s*(?P<md_y>{YEAR}))?)",
    rf"(?P<dm>\b(?P<dm_d>{DAY})(?:\s+of)?\s+(?P<dm_m>{MONTH})(?:\s*,?\s*(?P<dm_y>{YEAR}))?)",
    rf"(?P<my>\b(?P<my_m>{MONTH})(?:\s*,\s*|\s+of\s+|\s+)(?P<my_y>{YEAR}))",
    rf"(?P<mo>\b(?P<mo_m>{_alt(FULL_MONTHS)})\b)",
    rf"(?P<num>(?:(?P<cur>{CURRENCY_BEFORE})\s?)?(?P<val>{DIGITS}|{WORDS})(?P<ord>st|nd|rd|th)?(?P<dec>'?s\b)?"
    rf"(?:\s*(?P<scale>{SCALE}))?(?:\s*(?P<unit>{UNIT_AFTER}))?)",
]), re.IGNORECASE)


@dataclass(frozen=True)
class Number:
    value: Fraction
    unit: str | None = None

    def __str__(self) -> str:
        v = self.value
        text = str(v.numerator) if v.denominator == 1 else f"{float(v):g}"
        return {None: text, "%": f"{text}%", "s": f"{text}s", "¢": f"{text}¢"}.get(self.unit, f"{self.unit}{text}")


@dataclass(frozen=True)
class Date:
    year: int | None = None
    month: int | None = None
    day: int | None = None

    def __str__(self) -> str:
        return "-".join("?" if x is None else f"{x:02d}" for x in (self.year, self.month, self.day))


Value = Number | Date


@dataclass(frozen=True)
class Mention:
    value: Value
    text: str
    start: int
    end: int


def _word_number(text: str) -> Fraction:
    words = re.split(r"[-\s]+", text.lower().strip())
    if words[0] in ("a", "an"):
        return Fraction(1)
    hundred = words[-1] == "hundred"
    words = words[:-1] if hundred else words
    total = sum(WORD_VALUES[w] for w in words)
    return Fraction(total * (100 if hundred else 1))


def _number(match: re.Match) -> Number | None:
    raw = match["val"]
    if raw[0].isdigit() or raw[0] == ".":
        value = Fraction(raw.replace(",", ""))
    else:
        value = _word_number(raw)
    if match["scale"]:
        value *= SCALES[match["scale"].lower().rstrip(".")]
    unit = None
    if match["cur"]:
        unit = UNITS[match["cur"].lower()]
    if match["unit"]:
        after = UNITS[re.sub(r"\s+", " ", match["unit"].lower())]
        if unit is not None and after != unit:
            return None  # "$5 euros": contradictory
        unit = after
    if match["dec"] and not match["scale"] and value.denominator == 1:
        unit = unit or "s"  # "1990s", "the 80's"
    return Number(value, unit)


def _year(text: str | None) -> int | None:
    if not text:
        return None
    year = int(text)
    return year + (1900 if year >= 50 else 2000) if len(text) == 2 else year


def _day(text: str | None) -> int | None:
    return int(re.match(r"\d+", text).group()) if text else None


def _month(text: str) -> int:
    return MONTHS[text.lower().rstrip(".")]


def _value(match: re.Match) -> Value | None:
    kind = next(k for k in ("iso", "us", "md", "dm", "my", "mo", "num") if match[k] is not None)
    if kind == "iso":
        return Date(int(match["iso_y"]), int(match["iso_m"]), int(match["iso_d"]))
    if kind == "us":
        return Date(_year(match["us_y"]), int(match["us_m"]), int(match["us_d"]))
    if kind in ("md", "dm"):
        return Date(_year(match[f"{kind}_y"]), _month(match[f"{kind}_m"]), _day(match[f"{kind}_d"]))
    if kind == "my":
        return Date(_year(match["my_y"]), _month(match["my_m"]), None)
    if kind == "mo":
        return Date(None, _month(match["mo_m"]), None) if match["mo_m"][0].isupper() else None
    if match["val"].lower() in ("a", "an") and not match["scale"]:
        return None
    return _number(match)


def find_values(text: str) -> list[Mention]:
    """Every figure and date stated in `text`, left to right."""
    mentions = []
    for match in _PATTERN.finditer(text):
        value = _value(match)
        if value is not None:
            span = match.group().strip()
            start = match.start() + (len(match.group()) - len(match.group().lstrip()))
            mentions.append(Mention(value, span, start, start + len(span)))
    return mentions


def _as_year(value: Value) -> int | None:
    if isinstance(value, Number) and value.unit is None and value.value.denominator == 1 \
            and 1000 <= value.value <= 2099:
        return int(value.value)
    return None


def supports(stated: Value, claimed: Value) -> bool:
    """Does a value stated in the source confirm a value claimed in an answer?

    Numbers: equal values and compatible units (one side without a unit, or the same unit).
    Dates: every field the claim gives is given, and equal, by the statement ("March 2020" <- "March 3, 2020").
    A year: a bare integer 1000..2099 on one side and a date with that year on the other.
    """
    if isinstance(claimed, Number) and isinstance(stated, Number):
        return claimed.value == stated.value and (claimed.unit is None or stated.unit is None
                                                  or claimed.unit == stated.unit)
    if isinstance(claimed, Date) and isinstance(stated, Date):
        return all(c is None or c == s for c, s in ((claimed.year, stated.year), (claimed.month, stated.month),
                                                   (claimed.day, stated.day)))
    if isinstance(claimed, Number) and isinstance(stated, Date):
        return _as_year(claimed) is not None and _as_year(claimed) == stated.year
    if isinstance(claimed, Date) and isinstance(stated, Number):
        return claimed.month is None and claimed.day is None and claimed.year == _as_year(stated)
    return False


def same_value(a: Value, b: Value) -> bool:
    return supports(a, b) and supports(b, a)


FILLER = {"a", "an", "the", "in", "on", "of", "by", "at", "since", "until", "about", "around", "approximately",
          "roughly", "nearly", "almost", "over", "under", "more", "less", "fewer", "than", "some", "just", "only",
          "exactly", "estimated", "and", "to", "from", "between", "up", "per", "year", "years", "old", "age",
          "aged", "was", "is", "were", "it", "answer"}


def value_answer(text: str) -> Value | None:
    """The single value an answer gives, if it is a figure or date with at most one counted noun around it
    ("34", "34 years", "$4.5 million", "in March 2020", "about 300 people"); else None ("Route 66", "2 and 3")."""
    mentions = find_values(text)
    if not mentions or any(not same_value(m.value, mentions[0].value) for m in mentions[1:]):
        return None
    rest = text
    for m in reversed(mentions):
        rest = rest[: m.start] + " " + rest[m.end:]
    words = [w for w in re.findall(r"[A-Za-z]+", rest) if w.lower() not in FILLER]
    if len(words) > 1 or any(w[0].isupper() for w in words):
        return None
    return mentions[0].value


# SQuAD-style answer scoring: lower case, no punctuation, no articles, single spaces.

def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation) | {"‘", "’", "“", "”"})
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: list[str]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(g) for g in golds)


def token_f1(prediction: str, golds: list[str]) -> float:
    """Best bag-of-tokens F1 of the prediction against any gold answer."""
    best = 0.0
    pred_tokens = normalize_answer(prediction).split()
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
        elif common:
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def vote_key(answer: str) -> str:
    """What majority voting counts as the same answer: the normalised value when the answer is a figure or a
    date ("8" and "eight" agree), else the SQuAD-normalised text."""
    value = value_answer(answer)
    if isinstance(value, Number):
        return f"number:{value.value}"  # units aside: "4.5m" and "$4.5 million" are one answer
    return f"date:{value}" if value is not None else f"text:{normalize_answer(answer)}"
