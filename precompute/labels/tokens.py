"""Token rules: the closed classes a token can be told apart by without semantics (numbers, dates, URLs, currency,
punctuation, word pieces, archaic forms, function words, boilerplate), and how a token is shown in a label.

    token_kind(" 1843")                                  # TokenKind(category='numbers/time', kind='year', ...)
    token_kind("tion", context=["na", "tion"], index=1)  # a word piece: morphology, 'suffix'
    KIND_PHRASES["year"]                                 # ('year numbers', 'year'): plural and singular phrase

A token no rule claims is a content word (category None), left to semantics (offline.py, contrast.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_MONTHS = {"january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
           "dec"}
_AMBIGUOUS_MONTHS = {"may", "march", "mar", "jan", "dec", "sep", "oct", "nov", "jun", "jul", "aug", "apr", "feb"}
_WEEKDAYS = {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
_TIME_WORDS = {"second", "seconds", "minute", "minutes", "hour", "hours", "day", "days", "week", "weeks", "month",
               "months", "year", "years", "decade", "decades", "century", "centuries", "today", "yesterday",
               "tomorrow", "ago", "morning", "evening", "night", "tonight", "o'clock", "am", "pm", "daily", "weekly",
               "annual", "annually", "era"}
_NUMBER_WORDS = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                 "thirteen", "fifteen", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty",
                 "ninety", "hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion",
                 "trillion", "dozen", "first", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                 "tenth", "half", "twice", "thrice"}
_CURRENCY_WORDS = {"dollar", "dollars", "usd", "euro", "euros", "eur", "gbp", "yen", "cents", "cent", "shilling",
                   "shillings", "pence", "rupees", "yuan"}
_CURRENCY_SYMBOLS = set("$€£¥₹")
_ARCHAIC_PRONOUNS = {"thee", "thou", "thy", "thine", "ye"}
_ARCHAIC_FORMS = {"hath", "doth", "hast", "dost", "shalt", "wilt", "saith", "spake", "unto", "thereof", "wherefore",
                  "whence", "thither", "hither", "behold", "verily", "begat", "art", "didst", "wast", "shouldest"}
FUNCTION_WORDS = {
    "determiner": {"the", "a", "an", "this", "that", "these", "those", "some", "any", "each", "every", "no",
                   "all", "both", "either", "neither", "such", "another", "other"},
    "preposition": {"of", "in", "on", "at", "to", "for", "with", "by", "from", "into", "onto", "upon", "about",
                    "over", "under", "between", "through", "during", "before", "after", "against", "without",
                    "within", "among", "across", "toward", "towards", "behind", "beyond", "near", "since", "until",
                    "via", "per", "around", "along", "above", "below", "beside", "besides", "throughout"},
    "conjunction": {"and", "or", "but", "nor", "so", "yet", "if", "because", "although", "though", "while",
                    "whereas", "unless", "whether", "than", "as", "when", "where", "whereby"},
    "pronoun": {"i", "me", "my", "mine", "you", "your", "yours", "he", "him", "his", "she", "her", "hers", "it",
                "its", "we", "us", "our", "ours", "they", "them", "their", "theirs", "who", "whom", "whose",
                "which", "what", "myself", "yourself", "himself", "herself", "itself", "ourselves", "themselves"},
    "auxiliary verb": {"is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did", "have", "has",
                       "had", "will", "would", "shall", "should", "can", "could", "may", "might", "must"},
    "particle": {"not", "n't", "there", "here", "then", "also", "very", "too", "just", "only", "up", "out", "off",
                 "down", "s", "'s", "’s", "t", "ll", "re", "ve", "d"},
}
_BOILERPLATE_WORDS = {"copyright", "©", "cookie", "cookies", "privacy", "subscribe", "unsubscribe", "newsletter",
                      "login", "signup", "advertisement", "disclaimer", "reserved", "trademark", "™", "®",
                      "javascript", "browser", "sitemap", "retrieved", "isbn"}
_URL = re.compile(r"(https?:|://|www\.|\.(com|org|net|edu|gov|io|co|uk|de|html?|php|aspx?|pdf)\b|@[a-z0-9-]+\.)",
                  re.IGNORECASE)
_YEAR = re.compile(r"(1[5-9]\d\d|20[0-4]\d)(s)?")
_NUMBER = re.compile(r"[\d.,:/%\-]*\d[\d.,:/%\-]*")
_SENTENCE_END = (".", "!", "?", "\n", ":", '"', "“")


@dataclass(frozen=True)
class TokenKind:
    """What the rules make of one token: a category (None = a content word, left to semantics) and a finer role."""

    category: str | None
    kind: str  # a key of KIND_PHRASES
    core: str  # the token without surrounding whitespace
    word: str = ""  # the whole word (letters and digits) the token is part of, e.g. '1843' for the piece '4'

    @property
    def example(self) -> str:
        """How the token is shown in a label: numbers and content words whole, pieces and function words as is."""
        whole = self.category in ("numbers/time", "finance", "urls") or self.category is None
        return (self.word or self.core) if whole else self.core


# kind -> (plural phrase for several tokens, singular phrase for one dominant token)
KIND_PHRASES = {
    "url": ("URL pieces", "URL piece"),
    "currency": ("currency names and symbols", "currency"),
    "money": ("money amounts", "money amount"),
    "year": ("year numbers", "year"),
    "clock time": ("clock times", "clock time"),
    "percentage": ("percentages", "percentage"),
    "date": ("dates", "date"),
    "number": ("numbers", "number"),
    "number word": ("number words", "number word"),
    "month": ("month names", "month name"),
    "weekday": ("weekday names", "weekday name"),
    "time word": ("time words", "time word"),
    "punctuation": ("punctuation", "punctuation"),
    "whitespace": ("line breaks and spacing", "line break"),
    "suffix": ("word endings", "suffix"),
    "prefix": ("word-start pieces", "word start"),
    "inner": ("word-internal pieces", "word-internal piece"),
    "archaic pronoun": ("archaic 2nd-person pronouns", "archaic 2nd-person pronoun"),
    "archaic form": ("archaic verb forms", "archaic form"),
    "determiner": ("determiners", "determiner"),
    "preposition": ("prepositions", "preposition"),
    "conjunction": ("conjunctions", "conjunction"),
    "pronoun": ("pronouns", "pronoun"),
    "auxiliary verb": ("auxiliary verbs", "auxiliary verb"),
    "particle": ("particles and adverbs", "particle"),
    "boilerplate": ("web boilerplate", "boilerplate word"),
    "proper noun": ("names", "name"),
    "content": ("words", "word"),
}


def _word_span(text: str, start: int, end: int, inside: Callable[[str], bool]) -> tuple[int, int]:
    while start > 0 and inside(text[start - 1]):
        start -= 1
    while end < len(text) and inside(text[end]):
        end += 1
    return start, end


def _alnum(ch: str) -> bool:
    return ch.isalnum()


def _not_space(ch: str) -> bool:
    return not ch.isspace()


def token_kind(token: str, context: Sequence[str] | None = None, index: int = 0) -> TokenKind:
    """Classify one token, using its context (tokens around it) when given to see the word it is part of.

    Without a context (next tokens, logit signature) a token without a leading space that continues in lower case
    is taken as a word piece, which is what byte-level BPE tokens without a space are.
    """
    core = token.strip()
    if context is not None and 0 <= index < len(context):
        text = "".join(context)
        start = sum(len(t) for t in context[:index]) + (len(token) - len(token.lstrip()))
        end = start + len(core)
        chunk = text[slice(*_word_span(text, start, end, _not_space))]
        w_start, w_end = _word_span(text, start, end, _alnum)
        word = text[w_start:w_end] if core and core[0].isalnum() else core
        prev = context[index - 1] if index > 0 else ""
        is_piece = core.isalnum() and (w_start < start or w_end > end)
        piece = "suffix" if w_start < start and w_end == end else "prefix" if w_start == start else "inner"
        at_sentence_start = index == 0 or prev.rstrip(" ").endswith(_SENTENCE_END) or not prev.strip()
    else:
        chunk, word, prev = core, core, ""
        is_piece = core.isalpha() and not token[:1].isspace() and core[:1].islower() and len(core) <= 6
        piece = "suffix"
        at_sentence_start = True
    return TokenKind(*_classify(core, chunk, word, prev, is_piece, piece, at_sentence_start), core, word)


def _classify(core: str, chunk: str, word: str, prev: str, is_piece: bool, piece: str,
              at_sentence_start: bool) -> tuple[str | None, str]:
    """(category or None for a content word, kind) by the token rules, most specific first."""
    lower = core.lower()
    if not core:
        return "grammatical scaffolding", "whitespace"
    if _URL.search(chunk):
        return "urls", "url"
    if lower in _CURRENCY_WORDS or any(ch in _CURRENCY_SYMBOLS for ch in core):
        return "finance", "currency"
    if _NUMBER.fullmatch(word) or _NUMBER.fullmatch(core):
        number = word if _NUMBER.fullmatch(word) else core
        if any(ch in _CURRENCY_SYMBOLS for ch in prev):
            return "finance", "money"
        if _YEAR.fullmatch(number):
            kind = "year"
        elif re.fullmatch(r"\d{1,2}:\d\d", number):
            kind = "clock time"
        elif "%" in number:
            kind = "percentage"
        elif re.fullmatch(r"\d{1,4}[/-]\d{1,2}[/-]\d{1,4}", number):
            kind = "date"
        else:
            kind = "number"
        return "numbers/time", kind
    if not any(ch.isalnum() for ch in core):
        if core in _BOILERPLATE_WORDS:
            return "boilerplate", "boilerplate"
        return "grammatical scaffolding", "punctuation"
    if is_piece:
        return "morphology", piece
    if lower in _MONTHS and (lower not in _AMBIGUOUS_MONTHS or core[0].isupper()):
        return "numbers/time", "month"
    if lower in _WEEKDAYS:
        return "numbers/time", "weekday"
    if lower in _TIME_WORDS:
        return "numbers/time", "time word"
    if lower in _NUMBER_WORDS:
        return "numbers/time", "number word"
    if lower in _ARCHAIC_PRONOUNS:
        return "grammatical scaffolding", "archaic pronoun"
    if lower in _ARCHAIC_FORMS:
        return "grammatical scaffolding", "archaic form"
    for kind, words in FUNCTION_WORDS.items():
        if lower in words:
            return "grammatical scaffolding", kind
    if lower in _BOILERPLATE_WORDS:
        return "boilerplate", "boilerplate"
    if core[0].isupper() and not at_sentence_start:
        return None, "proper noun"
    return None, "content"


def quote(token: str) -> str:
    """A token as a label shows it: stripped, in single quotes (an apostrophe inside becomes ’)."""
    return "'" + token.strip().replace("'", "’") + "'"
