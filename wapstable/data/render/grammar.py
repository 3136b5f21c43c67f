"""Random math expressions as CROHME-style token lists (every token separate, braces their own tokens).

A small recursive grammar, at four difficulties; a variant over the whole CROHME 2014 dictionary (data.symbols=crohme)
and one that draws each symbol about as often as CROHME's training labels do (data.frequencies=crohme). Everything
random comes from numpy Generators seeded by (seed, stream tag, ...), so the same seed gives the same expressions
on every machine.
"""

from functools import cache
from typing import NamedTuple

import numpy as np

DIGITS = list("0123456789")
# no l, o, O: they read as 1 and 0 even in print, and a recogniser cannot be blamed for that
LETTERS = list("abcdefghijkmnpqrstuvwxyz") + list("ABCFGHLMNPRSTVXY")
GREEK = ["\\alpha", "\\beta", "\\gamma", "\\delta", "\\theta", "\\lambda", "\\mu", "\\pi", "\\sigma", "\\phi"]
OPERATORS = ["+", "-", "\\times", "\\div", "\\pm"]
OP_WEIGHTS = [0.4, 0.3, 0.12, 0.08, 0.1]
RELATIONS = ["=", "<", ">", "\\leq", "\\geq", "\\neq"]
REL_WEIGHTS = [0.6, 0.08, 0.08, 0.08, 0.08, 0.08]
BRACKETS = [("(", ")"), ("[", "]"), ("\\{", "\\}")]
BRACKET_WEIGHTS = [0.7, 0.2, 0.1]
STRUCTURES = ["frac", "script", "sqrt", "bracket", "bigop"]


class Level(NamedTuple):
    """How one difficulty draws: `structs` caps the structures per expression, which bounds the length."""

    depth: int  # how deep structures nest
    structs: int
    terms: tuple[int, int]  # terms per top-level side
    inner: tuple[int, int]  # terms per side inside a structure
    p_struct: float  # chance that a term is a structure
    p_rel: float  # chance of a relation and a second side
    kinds: tuple[float, ...]  # weights of STRUCTURES


# Level 2, the default, keeps labels short (mostly under 25 tokens) but makes fractions, scripts and roots
# common, so a small model sees every 2-D layout early.
LEVELS = {
    1: Level(0, 0, (1, 4), (1, 1), 0.0, 0.35, (1, 1, 1, 1, 1)),
    2: Level(1, 3, (1, 2), (1, 2), 0.65, 0.3, (0.3, 0.3, 0.25, 0.08, 0.07)),
    3: Level(2, 4, (1, 3), (1, 2), 0.6, 0.4, (0.28, 0.28, 0.2, 0.12, 0.12)),
    4: Level(3, 7, (2, 4), (1, 2), 0.6, 0.5, (0.26, 0.26, 0.2, 0.14, 0.14)),
}


class Grammar:
    """A recursive generator of token lists; `depth` counts how many more structures may nest inside."""

    letters, greek = LETTERS, GREEK
    operators, op_weights = OPERATORS, OP_WEIGHTS
    relations, rel_weights = RELATIONS, REL_WEIGHTS
    structures = STRUCTURES
    p_minus = 0.1  # the chance that a side starts with a minus

    def __init__(self, rng: np.random.Generator, difficulty: int):
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        self.rng = rng
        self.level = LEVELS[difficulty]
        kinds = np.asarray(self.level.kinds, dtype=float)
        self.kind_p = kinds / kinds.sum()
        self.structs = 0  # structures the expression being built may still add

    def pick(self, items, p=None):
        return items[self.rng.choice(len(items), p=p)]

    def expression(self) -> list[str]:
        self.structs = self.level.structs
        depth = self.level.depth
        out = self.side(depth, self.level.terms)
        if self.rng.random() < self.level.p_rel:
            out += [self.pick(self.relations, self.rel_weights), *self.side(depth, self.level.terms)]
        return out

    def side(self, depth: int, terms: tuple[int, int]) -> list[str]:
        n = int(self.rng.integers(terms[0], terms[1] + 1))
        out = ["-"] if self.rng.random() < self.p_minus else []
        for i in range(n):
            if i:
                out.append(self.pick(self.operators, self.op_weights))
            out += self.term(depth)
        return out

    def term(self, depth: int) -> list[str]:
        if depth <= 0 or self.structs <= 0 or self.rng.random() >= self.level.p_struct:
            return self.atoms()
        self.structs -= 1
        return self.structure(self.pick(self.structures, self.kind_p), depth)

    def structure(self, kind: str, depth: int) -> list[str]:
        inner = self.level.inner
        if kind == "frac":
            return ["\\frac", "{", *self.side(depth - 1, inner), "}", "{", *self.side(depth - 1, inner), "}"]
        if kind == "sqrt":
            return ["\\sqrt", "{", *self.side(depth - 1, inner), "}"]
        if kind == "script":
            return self.scripted(depth)
        if kind == "bracket":
            return self.bracket(depth)
        return self.bigop(depth)

    def atoms(self) -> list[str]:
        r = self.rng.random()
        if r < 0.3:
            return self.number()
        if r < 0.65:
            return [self.pick(self.letters)]
        if r < 0.8:
            return [self.pick(self.greek)]
        return [self.pick(DIGITS[2:]), self.pick(self.letters)]  # implicit product, "2 x"

    def number(self) -> list[str]:
        r = self.rng.random()
        n = 1 if r < 0.7 else 2 if r < 0.95 else 3
        first = self.pick(DIGITS[1:]) if n > 1 else self.pick(DIGITS)
        return [first, *(self.pick(DIGITS) for _ in range(n - 1))]

    def script_body(self, depth: int) -> list[str]:
        # scripts are small in real data: an index, an exponent, `i + 1`; deeper levels may nest structures
        if depth > 1 and self.rng.random() < 0.3:
            return self.side(depth - 1, (1, 2))
        if self.rng.random() < 0.2:
            return [self.pick(self.letters[:26]), self.pick(["+", "-"]), self.pick(DIGITS[1:])]
        r = self.rng.random()
        if r < 0.55:
            return [self.pick(DIGITS)]
        return [self.pick(self.letters[:26])] if r < 0.9 else [self.pick(self.greek)]

    def scripted(self, depth: int) -> list[str]:
        # mathtext rejects a double script, so the base is always a fresh atom or a closed bracket
        if depth > 1 and self.rng.random() < 0.2:
            base = self.bracket(depth - 1, scripts=False)
        else:
            base = [self.pick(self.letters)] if self.rng.random() < 0.8 else [self.pick(self.greek)]
        r = self.rng.random()
        out = list(base)
        if r < 0.6:
            out += ["^", "{", *self.script_body(depth), "}"]
        elif r < 0.85:
            out += ["_", "{", *self.script_body(depth), "}"]
        else:
            out += ["_", "{", *self.script_body(depth), "}", "^", "{", *self.script_body(depth), "}"]
        return out

    def bracket(self, depth: int, scripts: bool = True) -> list[str]:
        left, right = self.pick(BRACKETS, BRACKET_WEIGHTS)
        out = [left, *self.side(depth - 1, (2, max(2, self.level.inner[1]))), right]
        if scripts and left == "(" and self.rng.random() < 0.3:
            out += ["^", "{", self.pick(DIGITS[2:]), "}"]
        return out

    def bigop(self, depth: int) -> list[str]:
        if self.rng.random() < 0.5:
            var = self.pick(["i", "j", "k", "n"])
            upper = self.pick(["n", "N", "m", "\\infty", "9"], [0.5, 0.15, 0.15, 0.15, 0.05])
            lower = self.pick(["0", "1"])
            return ["\\sum", "_", "{", var, "=", lower, "}", "^", "{", upper, "}", *self.term(depth - 1)]
        var = self.pick(["x", "t", "u", "y"])
        out = ["\\int"]
        if self.rng.random() < 0.7:
            lower, upper = self.pick([("0", "1"), ("a", "b"), ("0", "\\infty"), ("1", "2"), ("0", "\\pi")])
            out += ["_", "{", lower, "}", "^", "{", upper, "}"]
        return [*out, *self.side(depth - 1, (1, 1)), "d", var]


# data.symbols=crohme: every symbol of the CROHME 2014 dictionary (wapstable.data.latex.CROHME_2014_SYMBOLS)
FULL_LETTERS = list("abcdefghijklmnopqrstuvwxyz") + list("ABCEFGHILMNPRSTVXY")
FULL_GREEK = [g for g in GREEK if g != "\\delta"] + ["\\Delta"]  # the dictionary has no \\delta
FUNCTIONS = ("\\sin", "\\cos", "\\tan", "\\log")  # drawn as their letters, one token each
FULL_OPERATORS = [*OPERATORS, "\\cdot", "/"]
FULL_OP_WEIGHTS = [0.36, 0.27, 0.1, 0.06, 0.06, 0.08, 0.07]
FULL_RELATIONS = [*RELATIONS, "\\rightarrow", "\\in"]
FULL_REL_WEIGHTS = [0.5, 0.07, 0.07, 0.07, 0.07, 0.07, 0.08, 0.07]
FULL_STRUCTURES = [*STRUCTURES, "function", "lim", "list", "abs"]


class CrohmeGrammar(Grammar):
    """The grammar over the whole CROHME 2014 dictionary: the base grammar's structures plus function names with
    their arguments, limits, lists with commas and dots, sets, absolute values, primes, factorials, decimals,
    quantifiers and arrows, in the forms the CROHME training labels use them."""

    letters, greek = FULL_LETTERS, FULL_GREEK
    operators, op_weights = FULL_OPERATORS, FULL_OP_WEIGHTS
    relations, rel_weights = FULL_RELATIONS, FULL_REL_WEIGHTS
    structures = FULL_STRUCTURES

    def __init__(self, rng: np.random.Generator, difficulty: int):
        super().__init__(rng, difficulty)
        kinds = np.asarray([*self.level.kinds, 0.22, 0.08, 0.1, 0.08], dtype=float)
        self.kind_p = kinds / kinds.sum()

    def expression(self) -> list[str]:
        if self.rng.random() >= 0.04:
            return super().expression()
        # \forall x \in A , ... / \exists x
        self.structs = self.level.structs
        out = [self.pick(["\\forall", "\\exists"]), self.pick(FULL_LETTERS[:26])]
        if self.rng.random() < 0.6:
            out += ["\\in", self.pick(list("ABCEFGHILMNPRSTVXY"))]
        if self.rng.random() < 0.5:
            out += [",", *self.side(self.level.depth, (1, 2))]
        return out

    def structure(self, kind: str, depth: int) -> list[str]:
        if kind == "sqrt":
            index = ["[", self.pick(["3", "n", "4"]), "]"] if self.rng.random() < 0.15 else []
            return ["\\sqrt", *index, "{", *self.side(depth - 1, self.level.inner), "}"]
        if kind == "function":
            return self.function(depth)
        if kind == "lim":
            return self.limit(depth)
        if kind == "list":
            return self.listing()
        if kind == "abs":
            return ["|", *self.side(depth - 1, (1, 2)), "|"]
        return super().structure(kind, depth)

    # the kinds of atom: one draw in [0, 1) takes the first kind whose bound it is under
    atom_bounds = (
        (0.25, "number"),
        (0.55, "letter"),
        (0.67, "greek"),
        (0.77, "product"),
        (0.85, "function"),
        (0.9, "prime"),
        (0.95, "decimal"),
        (1.0, "factorial"),
    )

    def atoms(self) -> list[str]:
        r = self.rng.random()
        kind = next(kind for bound, kind in self.atom_bounds if r < bound)
        return getattr(self, f"atom_{kind}")()

    def atom_number(self) -> list[str]:
        return self.number()

    def atom_letter(self) -> list[str]:
        return [self.pick(FULL_LETTERS)]

    def atom_greek(self) -> list[str]:
        return [self.pick(FULL_GREEK)]

    def atom_product(self) -> list[str]:  # an implicit product, "2 x"
        return [self.pick(DIGITS[2:]), self.pick(FULL_LETTERS[:26])]

    def atom_function(self) -> list[str]:
        return self.function(0)

    def atom_prime(self) -> list[str]:  # f ^ { \prime } ( x ), y ^ { ' }
        out = [self.pick(["f", "g", "y", "x", "u"]), "^", "{", self.pick(["\\prime", "'"]), "}"]
        return out + (["(", self.pick(["x", "t", "c"]), ")"] if self.rng.random() < 0.6 else [])

    def atom_decimal(self) -> list[str]:  # 0 . 5, 3 . 1 4
        return [*self.number(), ".", *(self.pick(DIGITS) for _ in range(int(self.rng.integers(1, 3))))]

    def atom_factorial(self) -> list[str]:
        return [self.pick(["n", "k", *DIGITS[2:]]), "!"]

    def function(self, depth: int) -> list[str]:
        name = self.pick(list(FUNCTIONS), [0.35, 0.3, 0.15, 0.2])
        out = [name]
        if name == "\\log" and self.rng.random() < 0.3:
            out += ["_", "{", *self.pick([["2"], ["1", "0"], ["a"], ["e"]]), "}"]
        elif self.rng.random() < 0.15:
            out += ["^", "{", "2", "}"]
        if self.rng.random() < 0.5:
            return out + [self.pick(["x", "\\theta", "t", "a", "z", "\\alpha", "n"])]
        arg = self.side(depth - 1, (1, 2)) if depth > 1 else self.atoms_plain()
        return [*out, "(", *arg, ")"]

    def atoms_plain(self) -> list[str]:
        r = self.rng.random()
        if r < 0.4:
            return [self.pick(FULL_LETTERS[:26])]
        if r < 0.6:
            return [self.pick(FULL_GREEK)]
        return [self.pick(DIGITS[1:]), self.pick(["x", "t", "\\theta", "\\pi"])]

    def limit(self, depth: int) -> list[str]:
        var = self.pick(["x", "n", "h", "t"])
        to = self.pick([["0"], ["\\infty"], ["a"], ["+", "\\infty"], ["-", "\\infty"], ["1"]])
        limits = ["\\limits"] if self.rng.random() < 0.05 else []
        return ["\\lim", *limits, "_", "{", var, "\\rightarrow", *to, "}", *self.term(depth - 1)]

    def listing(self) -> list[str]:
        v = self.pick(["x", "a", "y", "t", "\\alpha"])
        r = self.rng.random()
        if r < 0.3:  # x _ { 1 } , x _ { 2 } , \ldots , x _ { n }
            body = [
                v,
                "_",
                "{",
                "1",
                "}",
                ",",
                v,
                "_",
                "{",
                "2",
                "}",
                ",",
                "\\ldots",
                ",",
                v,
                "_",
                "{",
                "n",
                "}",
            ]
            return ["(", *body, ")"] if self.rng.random() < 0.5 else body
        if r < 0.55:  # 1 + 2 + \cdots + n
            op = self.pick(["+", "-", "\\times"])
            return [v, "_", "{", "1", "}", op, "\\cdots", op, v, "_", "{", "n", "}"]
        items = [
            [self.pick(FULL_LETTERS[:26])] if self.rng.random() < 0.5 else self.number()
            for _ in range(int(self.rng.integers(2, 4)))
        ]
        body = list(items[0])
        for item in items[1:]:
            body += [",", *item]
        if self.rng.random() < 0.2:
            body += [",", "\\ldots"]
        left, right = self.pick([("(", ")"), ("\\{", "\\}"), ("[", "]")], [0.5, 0.35, 0.15])
        return [left, *body, right]

    def bigop(self, depth: int) -> list[str]:
        out = super().bigop(depth)
        if out[0] == "\\sum" and self.rng.random() < 0.05:
            out.insert(1, "\\limits")
        return out


# data.frequencies=crohme: how often each symbol occurs in the labels of the CROHME 2014 training set (8,834
# expressions; the structure tokens { } ^ _ left out), counted once from their text. No image is used.
CROHME_COUNTS = {
    '1': 6207, '2': 6190, '+': 5406, 'x': 5031, '-': 4305, '(': 3939, ')': 3939, '\\frac': 3626, '=': 3612,
    'a': 2473, '3': 2455, 'n': 2238, '\\sqrt': 1791, '0': 1790, 'y': 1765, '4': 1635, 'b': 1598, 'z': 1074,
    'd': 1063, '5': 1003, 'i': 959, 'c': 941, '6': 795, '\\sin': 783, '7': 749, '9': 728, '8': 728, 't': 690,
    'f': 676, '\\sum': 625, 'k': 619, ',': 617, '\\int': 605, '\\times': 596, '\\cos': 575, 'p': 565, '\\theta': 544,
    '\\pi': 498, 'r': 487, 'm': 477, 'e': 463, '|': 448, '\\alpha': 383, '\\infty': 376, 'g': 347, '[': 339,
    ']': 339, 'u': 321, 'q': 309, 'j': 301, '\\rightarrow': 298, '\\beta': 295, '\\lim': 291, '\\tan': 286, 'v': 285,
    'X': 279, 'A': 277, 'h': 270, '\\log': 266, '.': 258, 'C': 258, 'B': 239, 's': 234, '\\leq': 221, '/': 195,
    'R': 187, 'F': 168, '\\pm': 153, '\\div': 152, 'l': 151, '\\cdots': 148, '\\geq': 147, 'E': 145, '\\cdot': 145,
    'o': 143, 'w': 139, 'L': 136, 'N': 135, 'Y': 117, 'S': 117, '\\neq': 112, '<': 106, 'V': 106, 'P': 106, 'H': 100,
    'M': 99, '!': 98, 'T': 97, '\\ldots': 92, '\\gamma': 90, 'G': 88, '\\phi': 83, '\\{': 69, '\\}': 69, 'I': 69,
    '\\prime': 64, '>': 56, '\\sigma': 52, '\\mu': 46, '\\Delta': 35, '\\lambda': 27, "'": 18, '\\in': 14,
    '\\forall': 8, '\\exists': 4,
}  # fmt: skip
UNIFORM_SHARE = 0.25  # each choice among symbols: 3/4 as CROHME's counts weigh them, 1/4 alike


def crohme_weights(items) -> np.ndarray:
    """Weights of a choice among symbols: their shares of CROHME_COUNTS, mixed a quarter with uniform."""
    counts = np.asarray([CROHME_COUNTS[i] for i in items], dtype=float)
    return (1 - UNIFORM_SHARE) * counts / counts.sum() + UNIFORM_SHARE / len(items)


@cache
def _choice_weights(items: tuple[str, ...]) -> np.ndarray | None:
    """crohme_weights of a choice among two or more symbols of CROHME_COUNTS; None for any other choice."""
    if len(items) > 1 and all(i in CROHME_COUNTS for i in items):
        return crohme_weights(items)
    return None


class CrohmeFrequencyGrammar(CrohmeGrammar):
    """The CROHME grammar with each symbol and construction drawn about as often as the CROHME 2014 training
    labels use it (data.frequencies=crohme): 1 and 2 more than 7 and 8, x more than w, fractions and scripts more,
    primes, factorials, bars and lists less, and scripted atoms (x ^ { 2 }, a _ { 1 }) inside fractions and
    roots, where the grammar's structures do not nest at difficulty 2."""

    op_weights = list(crohme_weights(FULL_OPERATORS))
    rel_weights = list(crohme_weights(FULL_RELATIONS))
    p_minus = 0.03

    def __init__(self, rng: np.random.Generator, difficulty: int):
        super().__init__(rng, difficulty)
        self.level = self.level._replace(p_rel=max(self.level.p_rel, 0.45))  # an = in 41 % of the labels
        # frac, script, sqrt, bracket, bigop, function, lim, list, abs
        kinds = np.asarray([0.4, 0.3, 0.2, 0.12, 0.14, 0.12, 0.04, 0.05, 0.04])
        self.kind_p = kinds / kinds.sum()

    atom_bounds = (
        (0.28, "number"),
        (0.58, "letter"),
        (0.72, "scripted"),
        (0.79, "greek"),
        (0.88, "product"),
        (0.94, "function"),
        (0.955, "prime"),
        (0.985, "decimal"),
        (1.0, "factorial"),
    )

    def pick(self, items, p=None):
        if p is None:
            p = _choice_weights(tuple(items)) if all(isinstance(i, str) for i in items) else None
        return super().pick(items, p)

    def atom_scripted(
        self,
    ) -> list[str]:  # x ^ { 2 }, a _ { 1 }: a script in any term, fractions and roots too
        base = self.pick(FULL_LETTERS) if self.rng.random() < 0.85 else self.pick(FULL_GREEK)
        return [base, "^" if self.rng.random() < 0.6 else "_", "{", *self.script_body(0), "}"]


GRAMMARS = {
    ("base", "grammar"): Grammar,
    ("crohme", "grammar"): CrohmeGrammar,
    ("crohme", "crohme"): CrohmeFrequencyGrammar,
}


def unique_expressions(
    n: int,
    rng: np.random.Generator,
    difficulty: int,
    exclude: frozenset[str] = frozenset(),
    symbols: str = "base",
    frequencies: str = "grammar",
) -> list[list[str]]:
    """`n` distinct expressions drawn by `rng` from the grammar of data.symbols and data.frequencies, none of them in
    `exclude` (the labels of the splits drawn before, so that no expression is in two splits)."""
    grammar = GRAMMARS[symbols, frequencies](rng, difficulty)
    seen, out = set(exclude), []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        tokens = grammar.expression()
        key = " ".join(tokens)
        if key not in seen:
            seen.add(key)
            out.append(tokens)
    if len(out) < n:
        raise RuntimeError(f"difficulty {difficulty} yields too few distinct expressions for {n} samples")
    return out


def seeded_rng(seed: int, *tags: int) -> np.random.Generator:
    """The random stream of `seed` for one use of it, named by `tags` (a stream tag, then split and index)."""
    # The seed goes last: SeedSequence pads its entropy with zeros, so [tag, seed] and [tag, seed, 0] would be
    # the same stream. The modulo makes negative seeds legal and keeps them apart from positive ones.
    return np.random.default_rng([*tags, int(seed) % 2**64])


# stream tags, so that no two uses of one seed share random numbers
PUBLIC_STREAM, LABEL_STREAM, RENDER_STREAM = 0, 1, 2


def generate_expressions(
    n: int, seed: int, difficulty: int, symbols: str = "base", frequencies: str = "grammar"
) -> list[list[str]]:
    """`n` distinct random expressions as CROHME-style token lists, the same for the same seed."""
    return unique_expressions(
        n, seeded_rng(seed, PUBLIC_STREAM), difficulty, symbols=symbols, frequencies=frequencies
    )
