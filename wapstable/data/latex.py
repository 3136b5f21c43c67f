"""CROHME-style LaTeX tokens: tokenise a truth string, normalise it to WAP's caption conventions, check a vocab.

WAP's captions (and its 111-token dictionary) write every digit and letter as its own token, brace every
script, fraction and root argument, and have no `\\left`/`\\right`: `\\frac{12}{x^2}` is
`\\frac { 1 2 } { x ^ { 2 } }`. CROHME truths are hand-written LaTeX with every variant TeX accepts, so
InkML labels go through normalize_crohme() before they meet the vocabulary.

Also home to DataError and the fail/skip policy shared by the data readers.
"""

import logging

from wapstable.data.schema import OnError
from wapstable.data.vocab import EOL, Vocab
from wapstable.errors import UserError

log = logging.getLogger(__name__)

ON_ERROR = tuple(o.value for o in OnError)  # the schema's choices, for callers that pass a plain string


class DataError(UserError):
    """A problem with the user's data (a file, a sample, a token); the message names it and what to change.

    `reason` is a short category ("malformed XML", "truth does not parse", ...) under which a skipped sample is
    counted in the run's data report.
    """

    def __init__(self, message: str, reason: str = "other"):
        super().__init__(message)
        self.reason = reason


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error must be one of {ON_ERROR}, got {on_error!r}")


def on_data_error(
    message: str, on_error: str, errors: list[str], logger: logging.Logger = log, reason: str = "other"
) -> None:
    """Apply the data.on_error policy to one problem: raise it ("fail") or log and record it ("skip")."""
    if on_error == "fail":
        raise DataError(message + " (set data.on_error=skip to drop such samples)", reason)
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

# The CROHME 2014 symbol set as WAP's dictionary.txt has it (110 symbols; `<eol>` is index 0 of a vocabulary).
# `\limits` is listed there but never emitted here: normalize_crohme drops it as layout, like `\displaystyle`.
CROHME_2014_SYMBOLS = tuple(
    r"""
    ! ( ) + , - . / 0 1 2 3 4 5 6 7 8 9 < = > A B C E F G H I L M N P R S T V X Y [ ] ^ _ a b c d e f g h i j k l
    m n o p q r s t u v w x y z { | } ' \Delta \alpha \beta \cdot \cdots \cos \div \exists \forall \frac \gamma
    \geq \in \infty \int \lambda \ldots \leq \lim \limits \log \mu \neq \phi \pi \pm \prime \rightarrow \sigma
    \sin \sqrt \sum \tan \theta \times \{ \}
    """.split()
)
assert len(CROHME_2014_SYMBOLS) == 110 == len(set(CROHME_2014_SYMBOLS))
# The tokens that draw nothing of their own (structure and layout): no symbol box, in rendered data or in InkML.
INKLESS = frozenset({"{", "}", "^", "_", "\\limits"})

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
    "\\Pi": "\\pi",  # one 2014 test truth writes `2 \Pi` for 2 pi; CROHME has no capital Pi
}
# One command for two symbols: `| x \parallel y |` is the ink |x||y| (a 2014 test truth).
SPLIT_ALIASES = {"\\parallel": ("|", "|")}

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
KNOWN_COMMANDS = (
    {t for t in CROHME_2014_SYMBOLS if t.startswith("\\")}
    | set(ALIASES)
    | set(SPLIT_ALIASES)
    | {t for t in DROP | UNWRAP if t[1:].isalpha()}
    | {"\\left", "\\right"}
)
# Words of the CROHME 2014 test truths for a layout LaTeX cannot say: `\sqrt {x} ABOVE {n}` is the n-th root,
# `A ABOVE {\sqrt} BELOW {B}` the fraction A over B. The tokeniser spells them letter by letter.
LAYOUT_WORDS = ("ABOVE", "BELOW")


def _split_fused(t: str) -> list[str]:
    """A command glued to the letters after it (`\\ltN` for `\\lt N`) as the known command and its letters."""
    if not t.startswith("\\") or t in KNOWN_COMMANDS or not t[1:].isalpha():
        return [t]
    for end in range(len(t) - 1, 1, -1):
        if t[:end] in KNOWN_COMMANDS:
            return [t[:end], *t[end:]]
    return [t]


def _flatten(tokens: list[str], expr: str) -> list[str]:
    """Aliases applied, layout tokens dropped, `\\left(` -> `(` and `\\left.` -> nothing, fused commands split,
    and the letters of ABOVE / BELOW (followed by a group) made one word."""
    tokens = [p for t in tokens for p in _split_fused(t)]
    out = []
    i = 0
    while i < len(tokens):
        word = "".join(tokens[i : i + 5])
        if word in LAYOUT_WORDS and tokens[i + 5 : i + 6] == ["{"]:
            out.append(word)
            i += 5
            continue
        t = tokens[i]
        i += 1
        if t in ("\\left", "\\right"):
            if i >= len(tokens):
                raise DataError(f"{t} without a delimiter in '{expr}'", "truth does not parse")
            d = tokens[i]
            i += 1
            if d != ".":  # `\left.` is an invisible delimiter
                out.append(ALIASES.get(d, d))
        elif t in SPLIT_ALIASES:
            out += SPLIT_ALIASES[t]
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
        return DataError(f"{what} in '{self.expr}'", "truth does not parse")

    def peek(self) -> str | None:
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def seq(self, stop: str | None) -> list[str]:
        """Atoms up to `stop`, a bare group's braces dropped and a superscript before a subscript put after it."""
        atoms: list[list[str]] = []
        closed = False  # whether the last thing read ended in a "}"
        while (t := self.peek()) is not None and t != stop:
            if t == "}":
                if stop is None and closed:
                    self.pos += 1  # a doubled closing brace after a group, `_ {x \to 1}}`: a typo, dropped
                    continue
                raise self.error("an unmatched '}'")
            if t == "ABOVE":
                atoms.append(self.above(atoms.pop() if atoms else None))
                closed = atoms[-1][-1] == "}"
                continue
            tokens, braced = self.atom()
            closed = tokens[-1] == "}"
            if (
                braced
            ):  # a group that is no argument groups only: `{ v _ { 0 } } ^ { 2 }` is `v _ { 0 } ^ { 2 }`
                tokens = tokens[1:-1]
                if not tokens:
                    continue
            if tokens[0] == "_" and atoms and atoms[-1][0] == "^" and (len(atoms) < 2 or atoms[-2][0] != "_"):
                atoms.insert(len(atoms) - 1, tokens)  # `x ^ { 2 } _ { 1 }` is `x _ { 1 } ^ { 2 }`
                continue
            atoms.append(tokens)
        return [t for a in atoms for t in a]

    def raw_group(self, owner: str) -> list[str]:
        """The tokens of the brace group at the cursor, unparsed and without its braces."""
        if self.peek() != "{":
            raise self.error(f"{owner} without a group")
        depth, start = 0, self.pos
        while (t := self.peek()) is not None:
            self.pos += 1
            depth += (t == "{") - (t == "}")
            if depth == 0:
                return self.toks[start + 1 : self.pos - 1]
        raise self.error("an unclosed '{'")

    def above(self, before: list[str] | None) -> list[str]:
        """`R ABOVE {n}` with R a root: the root of index n; `A ABOVE {...} BELOW {B}`: A over B."""
        self.pos += 1  # the ABOVE
        index = self.raw_group("ABOVE")
        if before is None:
            raise self.error("ABOVE with nothing before it")
        if self.peek() == "BELOW":
            self.pos += 1
            below = _Parser(self.raw_group("BELOW"), self.expr).seq(None)
            numerator = before if before[0] == "{" else ["{", *before, "}"]
            return ["\\frac", *numerator, "{", *below, "}"]
        if before[0] != "\\sqrt" or before[1] == "[":
            raise self.error("ABOVE after something that is not a square root")
        return ["\\sqrt", "[", *_Parser(index, self.expr).seq(None), "]", *before[1:]]

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
    and every argument of `^`, `_`, `\\frac`, `\\sqrt` braced (`x^2` -> `x ^ { 2 }`). One spelling per expression
    too, as the ink shows it: the braces of a group that is no argument are dropped (`{a} + b` -> `a + b`), and a
    subscript comes before its base's superscript (`x^2_1` -> `x _ { 1 } ^ { 2 }`).

    Raises DataError for LaTeX that does not parse (unbalanced braces, a script without an argument).
    """
    expr = " ".join(tokens)
    return _Parser(_flatten(tokens, expr), expr).seq(None)


def crohme_vocab() -> Vocab:
    """The vocabulary of data=crohme: `<eol>` and the 110 symbols of the CROHME 2014 dictionary."""
    return Vocab([EOL, *sorted(CROHME_2014_SYMBOLS)])


# ----------------------------------------------------------------------------------------------------------------
# vocabulary
