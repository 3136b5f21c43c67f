"""CROHME-style LaTeX tokens: tokenise a truth string, normalise it to WAP's caption conventions, check a vocab.

WAP's captions (and its 111-token dictionary) write every digit and letter as its own token, brace every
script, fraction and root argument, and have no `\\left`/`\\right`: `\\frac{12}{x^2}` is
`\\frac { 1 2 } { x ^ { 2 } }`. CROHME truths are hand-written LaTeX with every variant TeX accepts, so
InkML labels go through normalize_crohme() before they meet the vocabulary.

Also home to DataError and the fail/skip policy shared by the data readers.
"""

import logging

from wapstable.config import OnError
from wapstable.data.sample import Sample
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError

log = logging.getLogger(__name__)

ON_ERROR = tuple(o.value for o in OnError)  # the schema's choices, for callers that pass a plain string


class DataError(UserError):
    """A problem with the user's data (a file, a sample, a token); the message names it and what to change."""


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error must be one of {ON_ERROR}, got {on_error!r}")


def on_data_error(message: str, on_error: str, errors: list[str], logger: logging.Logger = log) -> None:
    """Apply the data.on_error policy to one problem: raise it ("fail") or log and record it ("skip")."""
    if on_error == "fail":
        raise DataError(message + " (set data.on_error=skip to drop such samples)")
    logger.warning("skipping: %s", message)
    errors.append(message)


# ----------------------------------------------------------------------------------------------------------------
# tokenising


def tokenize_latex(s: str) -> list[str]:
    """Split LaTeX into tokens: `\\name` commands, `\\` + one symbol (`\\{`, `\\,`), single characters.

    Whitespace separates but is never a token, so multi-letter runs and numbers become one token per character.
    """
    out = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c.isspace():
            i += 1
        elif c == "\\":
            j = i + 1
            while j < n and s[j].isascii() and s[j].isalpha():
                j += 1
            if j == i + 1 and j < n:
                j += 1  # a control symbol: \{ \} \, \; \! \\ and "\ "
            out.append(s[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return out


# ----------------------------------------------------------------------------------------------------------------
# normalising

# Spellings of one symbol that CROHME truths use interchangeably; the right side is what WAP's dictionary has.
ALIASES = {
    "\\lt": "<",
    "\\gt": ">",
    "\\ne": "\\neq",
    "\\le": "\\leq",
    "\\ge": "\\geq",
    "\\leqslant": "\\leq",
    "\\geqslant": "\\geq",
    "\\to": "\\rightarrow",
    "\\dots": "\\ldots",  # WAP's dictionary keeps \ldots and \cdots apart, as the ink differs
    "\\lbrace": "\\{",
    "\\rbrace": "\\}",
    "\\lbrack": "[",
    "\\rbrack": "]",
    "\\vert": "|",
    "\\lvert": "|",
    "\\rvert": "|",
    "\\dfrac": "\\frac",
    "\\tfrac": "\\frac",
    "\\ast": "*",
}

# Layout-only tokens: nothing of them is visible in the ink.
DROP = {
    "$",
    "\\displaystyle",
    "\\textstyle",
    "\\limits",
    "\\nolimits",
    "\\,",
    "\\;",
    "\\:",
    "\\!",
    "\\ ",
    "~",
    "\\quad",
    "\\qquad",
    "\\rm",
    "\\it",
    "\\bf",
}
DROP |= {f"{size}{side}" for size in ("\\big", "\\Big", "\\bigg", "\\Bigg") for side in ("", "l", "r", "m")}

# Commands whose argument stays but whose own token and braces go: `\mbox{if}` -> `i f`.
UNWRAP = {"\\mbox", "\\hbox", "\\text", "\\textrm", "\\mathrm", "\\mathit", "\\operatorname"}

SCRIPTS = {"^", "_"}


def _flatten(tokens: list[str], expr: str) -> list[str]:
    """Aliases applied, layout tokens dropped, `\\left(` -> `(` and `\\left.` -> nothing."""
    out = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        i += 1
        if t in ("\\left", "\\right"):
            if i >= len(tokens):
                raise DataError(f"{t} without a delimiter in '{expr}'")
            d = tokens[i]
            i += 1
            if d != ".":  # `\left.` is an invisible delimiter
                out.append(ALIASES.get(d, d))
        elif t not in DROP:
            out.append(ALIASES.get(t, t))
    return out


class _Parser:
    """Recursive descent over flat tokens that braces every argument of scripts, \\frac and \\sqrt."""

    def __init__(self, tokens: list[str], expr: str):
        self.toks = tokens
        self.pos = 0
        self.expr = expr

    def error(self, what: str) -> DataError:
        return DataError(f"{what} in '{self.expr}'")

    def peek(self) -> str | None:
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def seq(self, stop: str | None) -> list[str]:
        out = []
        while (t := self.peek()) is not None and t != stop:
            if t == "}":
                raise self.error("an unmatched '}'")
            out += self.atom()[0]
        return out

    def group(self) -> list[str]:
        self.pos += 1  # the "{"
        body = self.seq("}")
        if self.peek() != "}":
            raise self.error("an unclosed '{'")
        self.pos += 1
        return ["{", *body, "}"]

    def atom(self) -> tuple[list[str], bool]:
        """One unit and whether it is a brace group: a group, a command with its arguments, or a token."""
        t = self.toks[self.pos]
        if t == "{":
            return self.group(), True
        self.pos += 1
        if t in SCRIPTS:
            return [t, *self.arg(t)], False
        if t == "\\frac":
            return [t, *self.arg(t), *self.arg(t)], False
        if t == "\\sqrt":
            index = []
            if self.peek() == "[":
                self.pos += 1
                body = self.seq("]")
                if self.peek() != "]":
                    raise self.error("an unclosed '[' after \\sqrt")
                self.pos += 1
                index = ["[", *body, "]"]
            return [t, *index, *self.arg(t)], False
        if t in UNWRAP:
            inner, braced = self.atom_of(t)
            return (inner[1:-1] if braced else inner), False
        return [t], False

    def atom_of(self, owner: str) -> tuple[list[str], bool]:
        if self.peek() in (None, "}"):
            raise self.error(f"{owner} without an argument")
        return self.atom()

    def arg(self, owner: str) -> list[str]:
        tokens, braced = self.atom_of(owner)
        return tokens if braced else ["{", *tokens, "}"]


def normalize_crohme(tokens: list[str]) -> list[str]:
    """CROHME truth tokens in WAP's conventions: no `$`, `\\left`/`\\right` or spacing, one spelling per symbol,
    and every argument of `^`, `_`, `\\frac`, `\\sqrt` braced (`x^2` -> `x ^ { 2 }`).

    Raises DataError for LaTeX that does not parse (unbalanced braces, a script without an argument).
    """
    expr = " ".join(tokens)
    return _Parser(_flatten(tokens, expr), expr).seq(None)


# ----------------------------------------------------------------------------------------------------------------
# vocabulary


def check_vocab(samples: list[Sample], vocab: Vocab, on_error: str) -> tuple[list[Sample], list[str]]:
    """Samples whose tokens are all in `vocab`, and one message per dropped sample naming it and its tokens.

    With on_error="fail" the first such sample raises DataError instead.
    """
    check_on_error(on_error)
    kept, errors = [], []
    for s in samples:
        unknown = sorted({t for t in s.tokens if t not in vocab.index})
        if unknown:
            on_data_error(
                f"sample {s.id!r} has tokens not in the vocabulary: {' '.join(unknown)} "
                "(add them to the dictionary file)",
                on_error,
                errors,
            )
        else:
            kept.append(s)
    return kept, errors
