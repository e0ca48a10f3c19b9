"""Wikitext -> plain prose, for the Wikipedia part of the default corpus (default.py).

    clean_wikitext("[[Paris]] is the capital of [[France]].<ref>x</ref>")   # 'Paris is the capital of France.'

Templates, tables, refs, files, categories, emphasis and link syntax are removed (link labels and a few
text-bearing templates such as {{lang}} and {{convert}} are kept), headings become plain lines, citation sections
are dropped, HTML entities are decoded. A change here changes the default corpus's text: bump
default.DEFAULT_CORPUS_VERSION with it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

# Sections that hold citations and link lists rather than prose: dropped with everything under them.
DROP_SECTIONS = frozenset({
    "references", "external links", "further reading", "see also", "notes", "footnotes", "bibliography", "sources",
    "citations", "notes and references", "references and notes", "works cited", "general references",
    "other references", "primary sources", "secondary sources", "gallery", "links",
})
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.S)
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/>", re.I)
_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.S | re.I)
_MATH = re.compile(r"<math\b[^>]*>(.*?)</math\s*>", re.S | re.I)
_FILE_LINK = re.compile(r"\[\[\s*(?:file|image|media)\s*:", re.I)
_TEMPLATE_ARG_SEP = re.compile(r"\|(?![^\[]*\]\])")  # a '|' that is not inside a [[link|label]]
_DROP_ELEMENTS = re.compile(
    r"<(gallery|timeline|imagemap|score|references|graph|mapframe|hiero|chem|ce)\b[^>]*?(?:/>|>.*?</\1\s*>)",
    re.S | re.I,
)
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_INNER_TEMPLATE = re.compile(r"\{\{([^{}]*)\}\}")
_INNER_TABLE = re.compile(r"\{\|(?:(?!\{\|)[\s\S])*?\|\}")
_HTML_TAG = re.compile(
    r"</?(?:br|sub|sup|small|big|span|div|center|code|tt|s|u|i|b|em|strong|blockquote|poem|source|syntaxhighlight|"
    r"nowiki|pre|li|ol|ul|dl|dd|dt|hr|cite|abbr|onlyinclude|includeonly|noinclude|p|font|del|ins|var|kbd|q|"
    r"section|wbr|bdi|mark|ruby|rt|rp)\b[^>]*>",
    re.I,
)
_BREAK = re.compile(r"<(?:br|hr)\b[^>]*>", re.I)
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+\s*([^\]]*)\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_MAGIC = re.compile(r"__[A-Z]+__")
_DROP_NAMESPACES = frozenset({"file", "image", "media", "category"})
_VISIBLE_INTERWIKI = frozenset({"wikt", "wiktionary", "w", "wikipedia", "s", "wikisource", "wikiquote", "q", "b",
                                "wikibooks", "n", "wikinews", "v", "wikiversity", "commons", "species"})
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z]{2,8})*$")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def clean_wikitext(markup: str) -> str:
    """Plain prose from MediaWiki markup: templates, tables, refs, files, categories, emphasis and link syntax are
    removed (link labels and a few text-bearing templates such as {{lang}} and {{convert}} are kept), headings
    become plain lines, citation sections are dropped, HTML entities are decoded."""
    text = _COMMENT.sub("", markup)
    text = _SELF_CLOSING_REF.sub("", text)
    text = _REF.sub("", text)
    text = _MATH.sub(_math_text, text)
    text = _DROP_ELEMENTS.sub("", text)
    # Image captions may hold links, templates and lone brackets: remove each file link as a balanced unit.
    text = _remove_balanced(text, _FILE_LINK, "[[", "]]")
    # Templates and links nest inside each other ({{lang}} holds a link, a link label holds {{convert}}): resolve
    # the innermost ones until nothing changes, then drop whatever unbalanced template is left.
    while True:
        before = text
        text = _INNER_TEMPLATE.sub(_template_text, text)
        text = _INNER_LINK.sub(_link_text, text)
        if text == before:
            break
    text = _remove_balanced(text, re.compile(r"\{\{"), "{{", "}}")
    while True:  # tables nest too; drop innermost first
        text, n = _INNER_TABLE.subn("", text)
        if not n:
            break
    text = _BREAK.sub("\n", text)
    text = _HTML_TAG.sub("", text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1), text)
    text = _EMPHASIS.sub(lambda m: "'" * (len(m.group()) == 4), text)  # '''' = apostrophe + bold
    text = _MAGIC.sub("", text)
    text = html.unescape(text).replace("\xa0", " ").replace("\u200b", "")
    return _clean_lines(text)


def _remove_balanced(text: str, start: re.Pattern, opener: str, closer: str) -> str:
    """Remove every span that starts where `start` matches and ends where its opener/closer pairs balance (an
    unclosed span runs to the end of its paragraph)."""
    out = []
    pos = 0
    while (match := start.search(text, pos)) is not None:
        out.append(text[pos:match.start()])
        depth, i = 0, match.start()
        while i < len(text):
            if text.startswith(opener, i):
                depth += 1
                i += len(opener)
            elif text.startswith(closer, i):
                depth -= 1
                i += len(closer)
                if depth == 0:
                    break
            elif text.startswith("\n\n", i):
                break
            else:
                i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _math_text(match: re.Match) -> str:
    """Short plain formulas (<math>k</math>, <math>n = 2</math>) stay as text; LaTeX is dropped."""
    formula = match.group(1).strip()
    return formula if len(formula) <= 30 and not re.search(r"[\\{}^_]", formula) else ""


def _link_text(match: re.Match) -> str:
    target, _, label = match.group(1).partition("|")
    target = target.strip()
    visible_namespace = target.startswith(":")
    target = target.lstrip(":").strip()
    prefix, colon, rest = target.partition(":")
    prefix = prefix.strip().lower()
    if colon and not visible_namespace:
        if prefix in _DROP_NAMESPACES:
            return ""
        if prefix not in _VISIBLE_INTERWIKI and _LANG_PREFIX.match(prefix) and not label:
            return ""  # interlanguage link ([[de:Anarchismus]])
    if label.strip():
        return label.strip()
    if colon and prefix in _VISIBLE_INTERWIKI:
        target = rest.strip()
    if match.group(1).rstrip().endswith("|"):  # pipe trick: [[Paris, Texas|]] shows "Paris"
        target = re.sub(r"\s*\(.*\)$", "", target).split(",")[0]
    page, _, section = target.partition("#")
    return page or section


def _template_text(match: re.Match) -> str:
    parts = _TEMPLATE_ARG_SEP.split(match.group(1))
    name = parts[0].strip().lower().replace("_", " ")
    args = [a.strip() for a in parts[1:]]
    positional = [a for a in args if not re.match(r"^[\w\s-]+=", a)]
    named = dict(a.split("=", 1) for a in args if re.match(r"^[\w\s-]+=", a))
    named = {k.strip().lower(): v.strip() for k, v in named.items()}
    handler = _TEMPLATES.get(name)
    if handler is None and name.startswith("lang-"):
        handler = _first
    if handler is None:
        return ""
    try:
        return handler(positional, named)
    except (IndexError, ValueError):
        return ""


def _first(pos: list[str], named: dict[str, str]) -> str:
    return pos[0]


def _last(pos: list[str], named: dict[str, str]) -> str:
    return pos[-1]


def _second(pos: list[str], named: dict[str, str]) -> str:
    return pos[1]


def _convert(pos: list[str], named: dict[str, str]) -> str:
    # {{convert|5|km|mi}} -> "5 km"; {{convert|5|to|10|km}} -> "5 to 10 km"
    if len(pos) >= 4 and pos[1] in ("-", "–", "to", "and", "or", "by", "x", "×", "+", "+/-", "to(-)"):
        return f"{pos[0]} {'–' if pos[1] == '-' else pos[1]} {pos[2]} {pos[3]}"
    return f"{pos[0]} {pos[1]}" if len(pos) >= 2 else pos[0]


def _date(pos: list[str], named: dict[str, str]) -> str:
    # {{birth date|1946|6|14}} -> "June 14, 1946"; a year alone stays a year
    numbers = [p for p in pos if p.isdigit()][:3]
    if len(numbers) == 3:
        return f"{_MONTHS[int(numbers[1]) - 1]} {int(numbers[2])}, {numbers[0]}"
    if len(numbers) == 2:
        return f"{_MONTHS[int(numbers[1]) - 1]} {numbers[0]}"
    return numbers[0] if numbers else ""


def _age_dates(pos: list[str], named: dict[str, str]) -> str:
    # {{death date and age|1865|4|15|1809|2|12}}: the first date is the one shown
    return _date(pos[:3], named)


def _frac(pos: list[str], named: dict[str, str]) -> str:
    if len(pos) == 3:
        return f"{pos[0]} {pos[1]}/{pos[2]}"
    return "/".join(pos[:2]) if len(pos) == 2 else f"1/{pos[0]}"


def _quote(pos: list[str], named: dict[str, str]) -> str:
    return named.get("text") or named.get("quote") or (pos[0] if pos else "")


def _literal(value: str) -> Callable[[list[str], dict[str, str]], str]:
    return lambda pos, named: value


_TEMPLATES: dict[str, Callable[[list[str], dict[str, str]], str]] = {
    "lang": _last, "script": _last, "transl": _last, "transliteration": _last, "native name": _second,
    "nowrap": _first, "nobr": _first, "small": _first, "smaller": _first, "big": _first, "larger": _first,
    "sc": _first, "smallcaps": _first, "vr": _first, "nihongo": _first, "val": _first, "nts": _first,
    "angbr": lambda pos, named: f"⟨{pos[0]}⟩", "keypress": _first, "abbr": _first, "tooltip": _first,
    "as of": lambda pos, named: "As of " + " ".join(pos[:3]), "circa": lambda pos, named: f"c. {pos[0]}",
    "c.": lambda pos, named: f"c. {pos[0]}", "convert": _convert, "cvt": _convert, "frac": _frac,
    "birth date": _date, "death date": _date, "start date": _date, "end date": _date, "dts": _date,
    "birth date and age": _date, "death date and age": _age_dates, "quote": _quote, "cquote": _quote,
    "blockquote": _quote, "ndash": _literal("–"), "mdash": _literal("—"), "snd": _literal(" – "),
    "spaced ndash": _literal(" – "), "nbsp": _literal(" "), "·": _literal(" · "), "!": _literal("|"),
    "'s": _literal("'s"), "'": _literal("'"), "pipe": _literal("|"), "sfrac": _frac, "ill": _first,
    "interlanguage link": _first, "chem": lambda pos, named: "".join(pos), "mdashb": _literal("—"),
    "snds": _literal(" – "), "sup": _first, "sub": _first, "sic": _last, "vanchor": _first, "math": _first,
    "mvar": _first, "us$": lambda pos, named: f"US${pos[0]}", "e": lambda pos, named: f"×10^{pos[0]}",
    "hms": lambda pos, named: f"HMS {pos[0]}", "uss": lambda pos, named: f"USS {pos[0]}",
}


_EMPTY_PARENS = re.compile(r"\(\s*\)|\[\s*\]")
_PAREN_LEAD = re.compile(r"\(\s*(?:[,;:]\s*)+")
_PAREN_TRAIL = re.compile(r"(?:\s*[,;:])+\s*\)")
_SPACE_PUNCT = re.compile(r"[ \t]+([,.;:])(?=\s|$)")
_SPACES = re.compile(r"[ \t]{2,}")
_LIST_MARK = re.compile(r"^[*#:;]+\s*")


def _clean_lines(text: str) -> str:
    """Line-level cleanup: headings, citation sections, list markers, table leftovers, stray punctuation."""
    out: list[str] = []
    drop_level = 0  # inside a dropped section of this heading level (0: not dropping)
    for line in text.split("\n"):
        line = line.strip()
        heading = _HEADING.match(line)
        if heading:
            level, title = len(heading.group(1)), heading.group(2).strip()
            if drop_level and level > drop_level:
                continue
            drop_level = level if title.lower() in DROP_SECTIONS else 0
            if not drop_level and title:
                out.extend(["", title])
            continue
        if drop_level or line.startswith(("|", "!", "{|", "|}", "{{", "}}")):
            continue
        line = _LIST_MARK.sub("", line)
        for _ in range(2):  # "( ; , Akhilleus, )" -> "(Akhilleus)"; an emptied "( )" goes in the second round
            line = _PAREN_LEAD.sub("(", line)
            line = _PAREN_TRAIL.sub(")", line)
            line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_PUNCT.sub(r"\1", line)
        line = _SPACES.sub(" ", line).strip()
        if line and not re.fullmatch(r"[\W_]+", line):
            out.append(line)
        elif out and out[-1]:
            out.append("")
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()
