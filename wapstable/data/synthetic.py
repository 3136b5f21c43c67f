"""Synthetic handwritten-math data: random LaTeX expressions rendered with matplotlib mathtext.

A small recursive grammar emits CROHME-style token lists (every token separate, braces their own tokens),
mathtext rasterises them through Agg straight into memory, and torchvision's v2 kernels bend the result a little
so it looks less typeset. Everything random is drawn from numpy Generators seeded by (seed, split, index), so a
config gives bit-identical data however many worker processes render it. The splits are rendered once and
cached as an .npz under `cache_dir/synthetic/<hash of the parameters>/`, the parameters holding every data key that
changes the pixels and the hash of the code that draws them (DRAWING_CODE).
"""

import hashlib
import importlib.metadata
import itertools
import json
import logging
import math
import multiprocessing as mp
import time
from contextlib import contextmanager
from functools import cache, lru_cache
from pathlib import Path
from typing import NamedTuple

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import _mathtext
from matplotlib.font_manager import FontProperties
from matplotlib.mathtext import MathTextParser

from wapstable.data.cache import check_writable, code_hash, pack_images, read_npz, unpack_images, write_npz
from wapstable.data.sample import Sample, no_boxes
from wapstable.errors import UserError

log = logging.getLogger(__name__)

# The modules whose code draws the splits (the grammar, mathtext's and the stroke fonts' renderers, the raster, the
# file's layout): a change to them renders the splits again by itself (cache.code_hash). The version numbers below
# date from before the hash; bumping them still renders again.
DRAWING_CODE = (
    "wapstable.data.synthetic",
    "wapstable.data.handwriting",
    "wapstable.data.crohme",
    "wapstable.data.cache",
)
# 2: each sample's symbol boxes are cached beside its pixels (the pixels are those of version 1)
FORMAT_VERSION = 2
# data.style=handwritten's strokes (2: roots drawn in every font set)
HANDWRITING_VERSION = 2
SPLITS = ("train", "valid", "test")
# data.jitter, data.distort, data.allographs, data.script_place, data.font_mix, data.spacing and data.size_jitter at
# their defaults (config.DataConfig): a handwritten glyph as its expression's font has drawn it, where mathtext put
# it, at data.symbol_size
GLYPH_STRAYING = {
    "jitter": 1.0,
    "distort": 0.0,
    "allographs": 0.0,
    "script_place": 0.0,
    "font_mix": 0.0,
    "spacing": 0.0,
    "size_jitter": 0.0,
    "more_forms": 0.0,
}
# the keys of GLYPH_STRAYING that are chances, with what 0 and 1 draw (for the refusal of a value over 1)
GLYPH_CHANCES = {
    "allographs": ("the fonts' glyphs only", "the other hand-written forms wherever a symbol has them"),
    "script_place": ("every script where mathtext puts it", "every script where writers put it"),
    "font_mix": ("each expression in one stroke font", "a stroke font drawn for every glyph"),
    "more_forms": ("those symbols as the fonts draw them", "every one of them in one of its other forms"),
}
MARGIN = 4  # px of background kept around the ink
FONTS = ("cm", "stix", "stixsans", "dejavuserif", "dejavusans")

# -----------------------------------------------------------------------------
# grammar

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


class _Level(NamedTuple):
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
    1: _Level(0, 0, (1, 4), (1, 1), 0.0, 0.35, (1, 1, 1, 1, 1)),
    2: _Level(1, 3, (1, 2), (1, 2), 0.65, 0.3, (0.3, 0.3, 0.25, 0.08, 0.07)),
    3: _Level(2, 4, (1, 3), (1, 2), 0.6, 0.4, (0.28, 0.28, 0.2, 0.12, 0.12)),
    4: _Level(3, 7, (2, 4), (1, 2), 0.6, 0.5, (0.26, 0.26, 0.2, 0.14, 0.14)),
}


class _Grammar:
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


class _CrohmeGrammar(_Grammar):
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


class _CrohmeFrequencyGrammar(_CrohmeGrammar):
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
    ("base", "grammar"): _Grammar,
    ("crohme", "grammar"): _CrohmeGrammar,
    ("crohme", "crohme"): _CrohmeFrequencyGrammar,
}


def _unique_expressions(
    n: int,
    rng: np.random.Generator,
    difficulty: int,
    exclude: frozenset[str] = frozenset(),
    symbols: str = "base",
    frequencies: str = "grammar",
) -> list[list[str]]:
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


def _rng(seed: int, *tags: int) -> np.random.Generator:
    # The seed goes last: SeedSequence pads its entropy with zeros, so [tag, seed] and [tag, seed, 0] would be
    # the same stream. The modulo makes negative seeds legal and keeps them apart from positive ones.
    return np.random.default_rng([*tags, int(seed) % 2**64])


# stream tags, so that no two uses of one seed share random numbers
_PUBLIC, _LABELS, _RENDER = 0, 1, 2


def generate_expressions(
    n: int, seed: int, difficulty: int, symbols: str = "base", frequencies: str = "grammar"
) -> list[list[str]]:
    """`n` distinct random expressions as CROHME-style token lists, the same for the same seed."""
    return _unique_expressions(n, _rng(seed, _PUBLIC), difficulty, symbols=symbols, frequencies=frequencies)


def tokens_to_mathtext(tokens: list[str]) -> str:
    """The mathtext source ("$...$") that renders `tokens`."""
    # Mathtext does not ignore blanks: `x ^ {2}` sets the 2 full size. So tokens are glued, with a blank only
    # where a command word would otherwise swallow the next letter (`\pi x`, not `\pix`).
    parts = []
    tokens = [t for t in tokens if t != "\\limits"]  # mathtext sets \lim's and \sum's limits below anyway
    for prev, tok in zip([""] + tokens[:-1], tokens):
        if prev[:1] == "\\" and prev[1:].isalpha() and tok[:1].isalpha():
            parts.append(" ")
        parts.append(tok)
    return "$" + "".join(parts) + "$"


# -----------------------------------------------------------------------------
# rendering

_parser: MathTextParser | None = None


class _QuietGlue(logging.Filter):
    """Drops mathtext's "Underful Vlist" dumps (a root over a script holding a fraction): the image is fine; and its
    notes that a font set borrows a glyph from another (\\cdots in cm), once per image."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Substituting symbol"):
            return False
        return not (isinstance(record.args, tuple) and record.args[:1] in (("Underful",), ("Overful",)))


logging.getLogger("matplotlib.mathtext").addFilter(_QuietGlue())


@lru_cache(maxsize=64)
def _font_properties(font: str, font_size: int) -> FontProperties:
    return FontProperties(size=font_size, math_fontfamily=font)


def _crop(img: np.ndarray, margin: int = MARGIN, boxes: np.ndarray | None = None):
    """The image cropped to its ink plus `margin`; with `boxes` (K, 4), also the boxes moved along with it."""
    rows, cols = np.flatnonzero(img.any(1)), np.flatnonzero(img.any(0))
    top = left = 0
    if rows.size:
        top, left = int(rows[0]), int(cols[0])
        img = img[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    img = np.pad(img, margin)
    if boxes is None:
        return img
    return img, boxes + np.array([margin - left, margin - top] * 2, np.float32)


def _smooth_field(rng: np.random.Generator, h: int, w: int, sigma: float) -> torch.Tensor:
    # Uniform noise blurred by a Gaussian is smooth on the scale of sigma, so it is drawn and blurred on a grid
    # 4x coarser and upsampled: the same kind of field for a small fraction of the convolution cost. Averaging
    # 4x fewer samples leaves it 4x stronger, hence the division, which keeps torchvision's meaning of alpha.
    step = 4
    s = sigma / step
    k = int(8 * s + 1) | 1
    noise = torch.from_numpy(rng.random((2, 1, h // step + 2, w // step + 2), dtype=np.float32) * 2 - 1)
    t = torch.arange(k, dtype=torch.float32) - k // 2
    g = torch.exp(-0.5 * (t / s) ** 2)
    g = g / g.sum()
    noise = F.pad(noise, (k // 2, k // 2, k // 2, k // 2), mode="replicate")
    noise = F.conv2d(F.conv2d(noise, g.view(1, 1, k, 1)), g.view(1, 1, 1, k))
    return F.interpolate(noise, size=(h, w), mode="bilinear", align_corners=True)[:, 0] / step


def _box_masks(boxes: np.ndarray, h: int, w: int) -> torch.Tensor:
    """(K, h, w) float masks, 1 on the pixels each box (x0, y0, x1, y1, edges in pixels) covers."""
    ys = torch.arange(h, dtype=torch.float32)[None, :, None] + 0.5
    xs = torch.arange(w, dtype=torch.float32)[None, None, :] + 0.5
    b = torch.from_numpy(np.nan_to_num(boxes, nan=-1.0).astype(np.float32))[:, :, None, None]
    inside = (xs >= b[:, 0]) & (xs < b[:, 2]) & (ys >= b[:, 1]) & (ys < b[:, 3])
    return inside.float()


def _mask_boxes(masks: torch.Tensor, boxes: np.ndarray) -> np.ndarray:
    """The boxes enclosing each warped mask (K, h, w) where it is at least 0.3; NaN where a mask vanished or the
    box had none to begin with."""
    out = np.full((len(masks), 4), np.nan, np.float32)
    on = masks >= 0.3
    rows, cols = on.any(2), on.any(1)  # (K, h), (K, w)
    for k in range(len(masks)):
        r, c = torch.nonzero(rows[k]).flatten(), torch.nonzero(cols[k]).flatten()
        if r.numel() and not np.isnan(boxes[k, 0]):
            out[k] = (int(c[0]), int(r[0]), int(c[-1]) + 1, int(r[-1]) + 1)
    return out


def _augment(img: np.ndarray, rng: np.random.Generator, boxes: np.ndarray | None = None):
    """The image bent by `rng` (affine, elastic, blur); with `boxes` (K, 4), also the boxes bent alike: each box's
    filled rectangle is warped by the very same affine and elastic grids as the pixels, and the box enclosing the
    warped rectangle is kept (so the elastic part is exact at the box's pixels, not only at its corners). The
    random draws are the same with and without boxes, so the image is too."""
    # Every parameter comes from `rng` rather than torch's global generator, so an image depends only on its
    # own seed: no fork_rng, no state leaking between samples or workers.
    # torchvision is imported here, not at the top: its import takes 1.5 s (it loads torch._dynamo), and a run whose
    # data is cached never augments.
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    h, w = img.shape
    pad = 8 + int(0.12 * max(h, w))  # room for the ends of a wide line to rotate and shear into
    x = torch.from_numpy(np.pad(img, pad).astype(np.float32))[None]
    masks = None
    if boxes is not None and len(boxes):
        masks = _box_masks(boxes + pad, *x.shape[-2:])
    affine = dict(
        angle=float(rng.uniform(-3.0, 3.0)),
        translate=[0.0, 0.0],
        scale=float(rng.uniform(0.9, 1.1)),
        shear=[float(rng.uniform(-12.0, 12.0)), float(rng.uniform(-3.0, 3.0))],
        interpolation=InterpolationMode.BILINEAR,
    )
    x = TF.affine(x, **affine)
    if masks is not None:
        masks = TF.affine(masks, **affine)
    if rng.random() < 0.7:
        # torchvision's ElasticTransform: a smooth random field, scaled by alpha, in grid units of [-1, 1]
        hh, ww = x.shape[-2:]
        alpha, sigma = float(rng.uniform(15.0, 40.0)), float(rng.uniform(3.0, 5.0))
        d = _smooth_field(rng, hh, ww, sigma)
        displacement = torch.stack([d[0] * (alpha / ww), d[1] * (alpha / hh)], dim=-1)[None]
        x = TF.elastic(x, displacement, interpolation=InterpolationMode.BILINEAR)
        if masks is not None:
            masks = TF.elastic(masks, displacement, interpolation=InterpolationMode.BILINEAR)
    if rng.random() < 0.3:
        s = float(rng.uniform(0.3, 0.8))
        x = TF.gaussian_blur(x, [3, 3], [s, s])
    out = x[0].round_().clamp_(0, 255).to(torch.uint8).numpy()
    out[out < 8] = 0  # faint interpolation dust would otherwise widen the crop
    if boxes is None:
        return out
    return out, (_mask_boxes(masks, boxes) if masks is not None else boxes.copy())


# -----------------------------------------------------------------------------
# where each token is: the glyphs and rules mathtext lays out, matched to the tokens that made them

INKLESS = frozenset({"{", "}", "^", "_", "\\limits"})  # tokens that draw nothing of their own
MULTI_GLYPH = frozenset({"\\sin", "\\cos", "\\tan", "\\log", "\\lim"})  # drawn as their letters

_box_sink: list | None = None  # inside _collect_boxes, render() appends each image's token boxes here
box_failures = 0  # expressions whose layout could not be matched to their tokens (their boxes are all NaN)


class _Recorder:
    """Hooks on mathtext's layout while one expression is parsed. Every Char and Rule gets a creation number: the
    parser creates a symbol's Char as it reads the symbol, and a fraction's bar or a root's sign when it has read
    their arguments, so creation order follows the tokens (see _creation_order). Every ship() records where it
    put each Char and Rule; the last ship of a parse is the one that draws the image (to_raster's, already moved
    into the image's coordinates). The hooks are removed when the parse ends."""

    def __init__(self):
        self.count = itertools.count()
        self.items: list[tuple[int, str, tuple, str]] = []  # (creation number, "g" or "r", box, symbol)

    @contextmanager
    def on(self):
        rec, M = self, _mathtext
        saved = (M.Char.__init__, M.Rule.__init__, M.Char.render, M.Rule.render, M.ship)
        char_init, rule_init, char_render, rule_render, ship = saved

        def new_char_init(node, *args, **kwargs):
            char_init(node, *args, **kwargs)
            node._wap_seq = next(rec.count)

        def new_rule_init(node, *args, **kwargs):
            rule_init(node, *args, **kwargs)
            node._wap_seq = next(rec.count)

        def new_char_render(node, output, *args, **kwargs):
            n = len(output.glyphs)
            char_render(node, output, *args, **kwargs)
            for ox, oy, info in output.glyphs[n:]:
                m = info.metrics
                box = (ox + m.xmin, oy - m.ymax, ox + m.xmax, oy - m.ymin)
                rec.items.append((getattr(node, "_wap_seq", -1), "g", box, node.c))

        def new_rule_render(node, output, x, y, w, h):
            rule_render(node, output, x, y, w, h)
            rec.items.append((getattr(node, "_wap_seq", -1), "r", (x, y - h, x + w, y), ""))

        def new_ship(*args, **kwargs):
            rec.items = []
            return ship(*args, **kwargs)

        M.Char.__init__, M.Rule.__init__ = new_char_init, new_rule_init
        M.Char.render, M.Rule.render, M.ship = new_char_render, new_rule_render, new_ship
        try:
            yield self
        finally:
            M.Char.__init__, M.Rule.__init__, M.Char.render, M.Rule.render, M.ship = saved


def _creation_order(tokens: list[str]) -> list[tuple[int, str, str]] | None:
    """(token index, "g" glyph or "r" rule, the glyph's character or "") in the order mathtext creates the nodes it
    draws: a symbol where it stands (a function name as its letters), a fraction's bar after its denominator, a
    root's sign and bar after its radicand (its index, `\\sqrt [ 3 ]`, before). None for an unbalanced label."""
    order: list[tuple[int, str, str]] = []
    groups: list[
        tuple[int | None, int]
    ] = []  # open { ... }: (the structure it belongs to, its groups after it)
    pending: tuple[int, int] | None = None  # a structure waiting for its next group: (index, groups left)
    index = False  # inside a root's [ index ]
    for i, tok in enumerate(tokens):
        if (
            tok == "["
            and pending is not None
            and tokens[pending[0]] == "\\sqrt"
            and tokens[i - 1] == "\\sqrt"
        ):
            index = True
        elif tok == "]" and index:
            index = False
        elif tok == "{":
            if pending is not None:
                groups.append((pending[0], pending[1] - 1))
                pending = None
            else:
                groups.append((None, 0))
        elif tok == "}":
            if not groups:
                return None
            owner, after = groups.pop()
            if owner is not None and after:
                pending = (owner, after)
            elif owner is not None:
                order += (
                    [(owner, "g", ""), (owner, "r", "")] if tokens[owner] == "\\sqrt" else [(owner, "r", "")]
                )
        elif tok == "\\frac":
            pending = (i, 2)
        elif tok == "\\sqrt":
            pending = (i, 1)
        elif tok in MULTI_GLYPH:
            order += [(i, "g", c) for c in tok[1:]]
        elif tok not in INKLESS:
            order.append((i, "g", tok))
    return order if not groups and pending is None and not index else None


def _same_symbol(token: str, c: str) -> bool:
    return (
        c == token
        or c == token.lstrip("\\")
        or token == "-"
        and c == "\N{MINUS SIGN}"
        or token == "'"
        and c == "\\prime"
    )


def _match(tokens: list[str], items: list) -> list[tuple[int, str, tuple, str]] | None:
    """The recorded glyphs and rules (items) each with the index of the token that made it: (token index, kind,
    box, character); None when the layout does not match the tokens one to one (a count or a symbol differs)."""
    order = _creation_order(tokens)
    nodes = sorted(items, key=lambda item: item[0])
    if order is None or [kind for _, kind, _ in order] != [item[1] for item in nodes]:
        return None
    out = []
    for (i, kind, want), (_, _, box, c) in zip(order, nodes):
        if kind == "g" and tokens[i] != "\\sqrt" and not _same_symbol(want, c):
            return None
        out.append((i, kind, box, c))
    return out


def _ink_box(box, img: np.ndarray) -> tuple[float, float, float, float]:
    """The box of the ink within `box` grown by 1 px (the font's metrics are not the pixels it draws)."""
    h, w = img.shape
    x0, y0 = max(0, math.floor(box[0]) - 1), max(0, math.floor(box[1]) - 1)
    x1, y1 = min(w, math.ceil(box[2]) + 1), min(h, math.ceil(box[3]) + 1)
    sub = img[y0:y1, x0:x1]
    rows, cols = np.flatnonzero(sub.any(1)), np.flatnonzero(sub.any(0))
    if not rows.size:
        return (x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))
    return (x0 + cols[0], y0 + rows[0], x0 + cols[-1] + 1, y0 + rows[-1] + 1)


def _token_boxes(tokens: list[str], items: list, img: np.ndarray) -> np.ndarray | None:
    """(len(tokens), 4) boxes x0, y0, x1, y1 in `img`'s pixels, NaN for a token without ink; None when the layout
    does not match the tokens one to one (a count or a symbol differs)."""
    matched = _match(tokens, items)
    if matched is None:
        return None
    boxes = no_boxes(len(tokens))
    for i, kind, box, _ in matched:
        if tokens[i] == "\\sqrt" and kind == "r":
            continue  # the sign marks the root; its bar spans the radicand, whose own tokens are there
        _grow(boxes, i, _ink_box(box, img))  # a function name's letters make one box
    return boxes


def _grow(boxes: np.ndarray, i: int, box) -> None:
    """Row `i` of `boxes` widened to enclose `box` (x0, y0, x1, y1); a NaN row becomes `box`."""
    boxes[i, :2] = np.fmin(boxes[i, :2], box[:2])
    boxes[i, 2:] = np.fmax(boxes[i, 2:], box[2:])


@contextmanager
def _collect_boxes():
    """Inside, every render() also computes the boxes of its tokens and appends them to the yielded list."""
    global _box_sink
    before, _box_sink = _box_sink, []
    try:
        yield _box_sink
    finally:
        _box_sink = before


def _laid_out(tokens: list[str], font: str, font_size: int, record: bool) -> tuple[np.ndarray, list]:
    """Mathtext's image of `tokens` and, with `record`, the glyphs and rules of its layout (_Recorder.items)."""
    global _parser
    if _parser is None:
        _parser = MathTextParser("agg")
    source, prop = tokens_to_mathtext(tokens), _font_properties(font, font_size)
    if not record:
        return np.asarray(_parser.parse(source, dpi=72, prop=prop).image, dtype=np.uint8), []
    MathTextParser._parse_cached.cache_clear()  # a cached parse lays nothing out, so it records nothing
    recorder = _Recorder()
    with recorder.on():
        img = np.asarray(_parser.parse(source, dpi=72, prop=prop).image, dtype=np.uint8)
    return img, recorder.items


def _parse(
    tokens: list[str], font: str, font_size: int, record: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    global box_failures
    if not record:
        return _laid_out(tokens, font, font_size, record=False)[0], None
    try:
        img, items = _laid_out(tokens, font, font_size, record=True)
        boxes = _token_boxes(tokens, items, img)
    except AttributeError:  # a matplotlib whose mathtext internals differ: the image, without boxes
        img, boxes = _parse(tokens, font, font_size, record=False)[0], None
    if boxes is None:
        box_failures += 1
        boxes = no_boxes(len(tokens))
    return img, boxes


def render(
    tokens: list[str], font: str, font_size: int, rng: np.random.Generator | None, augment: bool
) -> np.ndarray:
    """A (H, W) uint8 image of `tokens`, ink 255 on 0, cropped to the ink plus a small margin.

    `font` is a mathtext font set (cm, stix, stixsans, dejavuserif, dejavusans). With `augment`, the image is
    randomly bent by `rng` (None = a fresh unseeded generator, for previews). Inside `_collect_boxes()` the
    boxes of the tokens (render_boxes) are computed too, moved through the same crops and warps; the image is the
    same either way.
    """
    img, boxes = _parse(tokens, font, font_size, record=_box_sink is not None)
    if augment:
        rng = rng if rng is not None else np.random.default_rng()
        if boxes is None:
            img = _augment(_crop(img, 0), rng)
        else:
            img, boxes = _crop(img, 0, boxes)
            img, boxes = _augment(img, rng, boxes)
    if boxes is None:
        return _crop(img)
    img, boxes = _crop(img, MARGIN, boxes)
    _box_sink.append(boxes)
    return img


def render_boxes(
    tokens: list[str], font: str, font_size: int, rng: np.random.Generator | None, augment: bool
) -> tuple[np.ndarray, np.ndarray]:
    """render()'s image and its tokens' boxes (len(tokens), 4): x0, y0, x1, y1 in pixels (x1, y1 exclusive),
    NaN rows for tokens without ink of their own ({, }, ^, _) or when the layout could not be matched."""
    with _collect_boxes() as sink:
        img = render(tokens, font, font_size, rng, augment)
    return img, sink[0]


def _is_radical(c: str) -> bool:
    """Whether a glyph is a root's sign: "\\__radicalbig__" and its sizes in cm, the character √ in the other sets."""
    return c == "\N{SQUARE ROOT}" or c.startswith("\\__radical")


def render_handwritten(
    tokens: list[str],
    font: str,
    font_size: int,
    rng: np.random.Generator,
    raster,
    jitter: float = 1.0,
    bank=None,
    distort: float = 0.0,
    allographs: float = 0.0,
    script_place: float = 0.0,
    font_mix: float = 0.0,
    spacing: float = 0.0,
    size_jitter: float = 0.0,
    more_forms: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """data.style=handwritten: the image of `tokens` drawn as pen strokes on mathtext's layout (font set `font`
    at `font_size`), rasterised like InkML by `raster` (wapstable.data.crohme.Raster), and its tokens' boxes
    (NaN rows for inkless tokens, all NaN when the layout could not be matched to the tokens). With `bank`
    (wapstable.data.ink_bank: data.glyphs=crohme), each symbol the bank has is a real written sample of it.
    `jitter` scales every glyph's random scale, rotation, shift and wobble and the expression's slant (data.jitter;
    0 draws the layout exactly); `distort` > 0 also changes each glyph's shape (data.distort, hw.distort_glyph);
    `allographs` is the chance that a symbol with other hand-written forms is drawn in one (data.allographs);
    `script_place` the chance that a script is moved to where writers put it (data.script_place, hw.place_scripts);
    `font_mix` the chance that a glyph is drawn in a stroke font drawn for it alone (data.font_mix); `spacing` how
    far apart the symbols are set beyond mathtext's spacing, as writers set them (data.spacing, hw.spread_symbols);
    `size_jitter` the spread of the expression's size: its typical symbol drawn raster.symbol_size times
    exp(N(0, size_jitter)) px (data.size_jitter); `more_forms` the chance that a symbol of hw.MORE_FORMS, or a
    root's sign, is drawn in one of its other forms (data.more_forms)."""
    from wapstable.data import handwriting as hw
    from wapstable.data.crohme import rasterize_traces

    _, recorded = _laid_out(tokens, font, font_size, record=True)
    items = sorted(recorded, key=lambda item: item[0])
    matched = _match(tokens, recorded)
    owners = [m[0] for m in matched] if matched is not None else [None] * len(items)
    text_font = hw.text_font(rng)
    drawn: list[tuple[int | None, np.ndarray]] = []  # (token index, stroke)
    k = 0
    while k < len(items):
        _, kind, box, c = items[k]
        if kind == "g" and _is_radical(c):
            bar = items[k + 1][2] if k + 1 < len(items) and items[k + 1][1] == "r" else None
            end, top = (bar[2], (bar[1] + bar[3]) / 2) if bar is not None else (box[2], box[1])
            strokes = hw.draw_radical(box, end, top, rng, jitter, font_size, bank, more_forms)
            k += bar is not None  # the bar is drawn with its sign
        elif kind == "r":
            strokes = hw.draw_rule(box, rng, jitter, font_size, bank)
        else:
            glyph_font = text_font
            if font_mix > 0 and rng.random() < font_mix:  # no draw at 0: the images stay bit for bit
                glyph_font = hw.text_font(rng)
            strokes = hw.draw_glyph(
                c, box, font_size, glyph_font, rng, jitter, bank, distort, allographs, more_forms
            )
        drawn += [(owners[k], s) for s in strokes]
        k += 1
    if not drawn:
        raise ValueError(f"nothing to draw for {' '.join(tokens)!r}")
    if script_place > 0 and matched is not None:
        drawn = hw.place_scripts(tokens, drawn, rng, script_place, jitter)
    if spacing > 0 and matched is not None:
        drawn = hw.spread_symbols(tokens, drawn, rng, spacing, jitter)
    traces = [s for _, s in drawn]
    if jitter > 0:  # a slant shared by the whole expression, as a writer's
        y_mid = float(np.median(np.concatenate(traces)[:, 1]))
        traces = hw.slant(traces, float(rng.normal(0.05, 0.1) * jitter), y_mid)
    symbol_size = raster.symbol_size
    if size_jitter > 0 and symbol_size > 0:  # no draw at 0: the images stay bit for bit
        symbol_size *= float(np.exp(rng.normal(0, size_jitter)))
    transform: list = []
    img = rasterize_traces(
        traces, raster.height, raster.line_width, symbol_size=symbol_size, transform=transform
    )
    lo, scale, offset = transform[0]
    boxes = no_boxes(len(tokens))
    if matched is not None:
        pad = raster.line_width / 2 + 0.5
        h, w = img.shape
        for (owner, _), stroke in zip(drawn, traces):
            px = (stroke - lo) * scale + offset
            x0, y0 = px.min(0) - pad
            x1, y1 = px.max(0) + pad
            _grow(boxes, owner, (max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1)))
    return img, boxes


# -----------------------------------------------------------------------------
# splits and cache


def _render_chunk(job: tuple) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """(image, token boxes) of each label of the job, and how many layouts did not match their tokens."""
    (
        split_code,
        start,
        labels,
        fonts,
        font_size,
        augment,
        seed,
        raster,
        bank_file,
        jitter,
        distort,
        allographs,
        script_place,
        font_mix,
        spacing,
        size_jitter,
        more_forms,
    ) = job
    out, failures = [], box_failures
    unmatched = (
        0  # handwritten layouts that did not match their tokens (render() counts its own in box_failures)
    )
    bank = None
    if bank_file is not None:
        from wapstable.data.ink_bank import load_bank

        bank = load_bank(bank_file)
    with _collect_boxes() as sink:
        for i, tokens in enumerate(labels, start):
            rng = _rng(seed, _RENDER, split_code, i)
            font = fonts[int(rng.integers(len(fonts)))]
            if raster is not None:  # data.style=handwritten
                image, boxes = render_handwritten(
                    tokens,
                    font,
                    font_size,
                    rng,
                    raster,
                    jitter=jitter if augment else 0.0,
                    bank=bank,
                    distort=distort if augment else 0.0,
                    allographs=allographs if augment else 0.0,
                    script_place=script_place if augment else 0.0,
                    font_mix=font_mix if augment else 0.0,
                    spacing=spacing if augment else 0.0,
                    size_jitter=size_jitter if augment else 0.0,
                    more_forms=more_forms if augment else 0.0,
                )
                unmatched += bool(np.isnan(boxes).all())
                out.append((image, boxes))
                continue
            image = render(tokens, font, font_size, rng, augment)
            out.append((image, sink.pop() if sink else no_boxes(len(tokens))))
    return out, box_failures - failures + unmatched


def _worker_init() -> None:
    # one intra-op thread: the tensors are tiny, and libgomp is not safe to use with many threads after a fork
    torch.set_num_threads(1)


@contextmanager
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _render_all(labels: dict[str, list[list[str]]], cfg, params: dict) -> dict[str, list[tuple]]:
    total = sum(len(v) for v in labels.values())
    workers = int(cfg.render_workers or 0)
    raster = bank_file = None
    if params.get("style") == "handwritten":
        from wapstable.data.crohme import Raster

        raster = Raster.of(cfg)
    if params.get("glyphs") == "crohme":
        from wapstable.data.ink_bank import cache_file, load_bank

        bank_file = str(cache_file(cfg.cache_dir, params["glyph_bank"]))  # _cache_params built it
        load_bank(bank_file)  # once here: the render workers fork with it
    chunk = max(1, min(256, math.ceil(total / max(1, 4 * workers))))
    jobs, owners = [], []
    for code, split in enumerate(SPLITS):
        for start in range(0, len(labels[split]), chunk):
            batch = labels[split][start : start + chunk]
            jobs.append(
                (
                    code,
                    start,
                    batch,
                    params["fonts"],
                    params["font_size"],
                    params["augment"],
                    params["seed"],
                    raster,
                    bank_file,
                    params.get("jitter", GLYPH_STRAYING["jitter"]),
                    params.get("distort", GLYPH_STRAYING["distort"]),
                    params.get("allographs", GLYPH_STRAYING["allographs"]),
                    params.get("script_place", GLYPH_STRAYING["script_place"]),
                    params.get("font_mix", GLYPH_STRAYING["font_mix"]),
                    params.get("spacing", GLYPH_STRAYING["spacing"]),
                    params.get("size_jitter", GLYPH_STRAYING["size_jitter"]),
                    params.get("more_forms", GLYPH_STRAYING["more_forms"]),
                )
            )
            owners.append(split)
    t0 = time.perf_counter()
    if workers <= 1 or len(jobs) <= 1:
        with _single_thread():
            results = [_render_chunk(job) for job in jobs]
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else None
        with mp.get_context(method).Pool(min(workers, len(jobs)), initializer=_worker_init) as pool:
            results = pool.map(_render_chunk, jobs, chunksize=1)
    dt = time.perf_counter() - t0
    log.info("rendered %d images in %.1f s (%.0f images/s)", total, dt, total / max(dt, 1e-9))
    failures = sum(n for _, n in results)
    if failures:
        log.warning(
            "%d of %d layouts did not match their tokens: those images have no symbol boxes", failures, total
        )
    images = {split: [] for split in SPLITS}
    for split, (rendered, _) in zip(owners, results):
        images[split] += rendered
    return images


def _cache_params(cfg) -> dict:
    _check_glyphs(cfg)
    fonts = [str(f) for f in cfg.fonts]
    if not fonts:
        raise UserError(f"data.fonts must name at least one mathtext font set of {list(FONTS)}")
    for font in fonts:
        try:
            _font_properties(font, int(cfg.font_size))  # an unknown font set fails here, not in a worker
        except ValueError as e:
            raise UserError(f"data.fonts: {e}") from None
    if _key(cfg, "frequencies") != "grammar" and _key(cfg, "symbols") != "crohme":
        raise UserError(
            f"data.frequencies={_key(cfg, 'frequencies')} weighs the symbols of the CROHME dictionary; "
            "set data.symbols=crohme with it, or data.frequencies=grammar"
        )
    if min(cfg.num_train, cfg.num_valid, cfg.num_test) < 0:
        raise UserError("data.num_train, num_valid and num_test must not be negative")
    return dict(
        format=FORMAT_VERSION,
        num_train=int(cfg.num_train),
        num_valid=int(cfg.num_valid),
        num_test=int(cfg.num_test),
        difficulty=int(cfg.difficulty),
        fonts=fonts,
        font_size=int(cfg.font_size),
        augment=bool(cfg.augment),
        seed=int(cfg.seed),
        # a new renderer or random stream may draw other pixels for the same config
        matplotlib=matplotlib.__version__,
        torch=torch.__version__,
        torchvision=importlib.metadata.version("torchvision"),
        numpy=np.__version__,
        code=code_hash(*DRAWING_CODE),
        # only when not the default, so that the caches of default configs stay valid
        **({"symbols": _key(cfg, "symbols")} if _key(cfg, "symbols") != "base" else {}),
        **({"frequencies": _key(cfg, "frequencies")} if _key(cfg, "frequencies") != "grammar" else {}),
        **(_handwriting_params(cfg) if _key(cfg, "style") == "handwritten" else {}),
    )


def _key(cfg, name: str) -> str:
    """A data key that selects what is drawn, as a string; a config from before it existed has its default."""
    return str(
        getattr(
            cfg,
            name,
            {"symbols": "base", "style": "printed", "glyphs": "fonts", "frequencies": "grammar"}[name],
        )
    )


def _check_glyphs(cfg) -> None:
    if _key(cfg, "glyphs") != "fonts" and _key(cfg, "style") != "handwritten":
        raise UserError(f"data.glyphs={cfg.glyphs} draws handwriting: set data.style=handwritten as well")
    if _key(cfg, "style") != "handwritten":
        for name in _straying(cfg):  # only the keys not at their defaults
            raise UserError(
                f"data.{name}={getattr(cfg, name)} shapes handwritten glyphs: set data.style=handwritten as well"
            )


def _straying(cfg) -> dict[str, float]:
    """data.jitter, data.distort, data.allographs, data.script_place, data.font_mix, data.spacing, data.size_jitter
    and data.more_forms where they are not at their defaults (GLYPH_STRAYING); a config from before they existed has the defaults. A
    negative or NaN value is refused, a chance (data.allographs, data.script_place, data.font_mix,
    data.more_forms) over 1, and
    data.size_jitter over 1 (a spread of e times the size either way, nothing a writer does)."""
    values = {name: float(getattr(cfg, name, default)) for name, default in GLYPH_STRAYING.items()}
    for name, v in values.items():
        if not v >= 0:  # NaN too
            raise UserError(
                f"data.{name}={v} must be >= 0 (data.jitter=1 is the usual jitter of each glyph, data.distort=0 "
                "leaves its shape alone, data.allographs=0 draws every glyph as the fonts do, data.script_place=0 "
                "leaves every script where mathtext puts it, data.font_mix=0 draws an expression in one font, "
                "data.spacing=0 keeps mathtext's spacing, data.size_jitter=0 draws every expression at "
                "data.symbol_size, data.more_forms=0 draws the symbols of MORE_FORMS as the fonts do)"
            )
    for name, (zero, one) in GLYPH_CHANCES.items():
        if values[name] > 1:
            raise UserError(
                f"data.{name}={values[name]} is a chance: set it between 0 ({zero}) and 1 ({one})"
            )
    if values["size_jitter"] > 1:
        raise UserError(
            f"data.size_jitter={values['size_jitter']} is a spread of sizes on a log scale: set it between 0 (every "
            "expression at data.symbol_size) and 1 (0.2 spreads them as CROHME writers' sizes spread)"
        )
    return {name: v for name, v in values.items() if v != GLYPH_STRAYING[name]}


def _handwriting_params(cfg) -> dict:
    from wapstable.data.crohme import Raster

    if int(cfg.line_width) < 1 or int(cfg.height) < 16:
        raise UserError(
            f"data.style=handwritten needs data.line_width >= 1 and data.height >= 16, got {cfg.line_width} and "
            f"{cfg.height}"
        )
    out = dict(
        style="handwritten",
        handwriting=HANDWRITING_VERSION,
        raster=list(Raster.of(cfg)),
        hershey=importlib.metadata.version("hershey-fonts"),
        pillow=importlib.metadata.version("pillow"),
    )
    out.update(_straying(cfg))  # only when not the default, so that the caches of default configs stay valid
    if "size_jitter" in out and str(cfg.scale) != "symbol":
        raise UserError(
            f"data.size_jitter={cfg.size_jitter} spreads the size symbols are drawn at, which data.scale={cfg.scale} "
            "does not keep: set data.scale=symbol as well (or data.size_jitter=0)"
        )
    if _key(cfg, "glyphs") == "crohme":  # real symbols: the bank's key names the files they were cut from
        out["glyphs"] = "crohme"
        out["glyph_bank"] = _bank_path(cfg).parent.name
    return out


def _bank_path(cfg) -> Path:
    """data.glyphs=crohme: the cached bank of symbols cut from data.root/data.train (built on first use)."""
    from wapstable.data.ink_bank import bank_path  # its DataError is a UserError: one sentence

    if not cfg.root:
        raise UserError(
            "data.glyphs=crohme cuts real symbols from the CROHME training files: set data.root to the "
            "CROHME_labeled_2016 folder"
        )
    return bank_path(Path(cfg.root).expanduser() / cfg.train, float(cfg.valid_fraction), cfg.cache_dir)


def _save(path: Path, splits: dict[str, list[Sample]], params: dict) -> None:
    arrays = {"params": np.array(json.dumps(params, sort_keys=True))}
    for split, samples in splits.items():
        arrays[f"{split}_shapes"], arrays[f"{split}_pixels"] = pack_images([s.image for s in samples])
        arrays[f"{split}_tokens"] = np.array([" ".join(s.tokens) for s in samples], dtype=str)
        # one row per token of every label in turn: x0, y0, x1, y1 in pixels, NaN for a token without ink
        boxes = [s.boxes if s.boxes is not None else no_boxes(len(s.tokens)) for s in samples]
        arrays[f"{split}_boxes"] = np.concatenate(boxes) if boxes else no_boxes(0)
    write_npz(path, arrays, compress=True)


def _load(z, params: dict) -> dict[str, list[Sample]]:
    """The splits of an open cache file `z`; ValueError when it holds other parameters or its arrays disagree."""
    if json.loads(str(z["params"])) != params:
        raise ValueError("the cached parameters differ from the config")
    splits = {}
    for split in SPLITS:
        shapes, pixels, labels = z[f"{split}_shapes"], z[f"{split}_pixels"], z[f"{split}_tokens"]
        if len(shapes) != params[f"num_{split}"] or len(labels) != len(shapes):
            raise ValueError(f"{split} holds {len(shapes)} samples, expected {params[f'num_{split}']}")
        images = unpack_images(shapes, pixels)
        tokens = [str(label).split(" ") for label in labels]
        boxes = z[f"{split}_boxes"]
        ends = np.cumsum([len(t) for t in tokens], dtype=np.int64)
        if boxes.shape != (int(ends[-1]) if len(ends) else 0, 4):
            raise ValueError(f"{split} holds {len(boxes)} token boxes for {ends[-1]} tokens")
        splits[split] = [
            Sample(f"{split}-{i:06d}", image, t, boxes[end - len(t) : end])
            for i, (image, t, end) in enumerate(zip(images, tokens, ends))
        ]
    return splits


def cache_path(cache_dir, params: dict) -> Path:
    """The cache file of the splits of `params` (_cache_params) under `cache_dir`: named by their hash."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "synthetic" / key / "splits.npz"


def build_splits(cfg) -> dict[str, list[Sample]]:
    """Render (or load from the cache) the synthetic train/valid/test splits described by `cfg`.

    No expression appears in two splits. Test is drawn first, then valid, then train, each from its own stream,
    so growing num_train leaves valid and test unchanged.
    """
    params = _cache_params(cfg)
    path = cache_path(cfg.cache_dir, params)
    splits = read_npz(path, lambda z: _load(z, params), "rendering it again")
    if splits is not None:
        log.info("loaded synthetic splits from %s", path)
        return splits
    check_writable(path.parent)  # before the render, not after
    labels, taken = {}, frozenset()
    for code, split in reversed(list(enumerate(SPLITS))):
        rng = _rng(params["seed"], _LABELS, code)
        labels[split] = _unique_expressions(
            params[f"num_{split}"],
            rng,
            params["difficulty"],
            taken,
            params.get("symbols", "base"),
            params.get("frequencies", "grammar"),
        )
        taken = taken | {" ".join(t) for t in labels[split]}
    images = _render_all(labels, cfg, params)
    splits = {
        split: [
            Sample(f"{split}-{i:06d}", im, t, boxes)
            for i, ((im, boxes), t) in enumerate(zip(images[split], labels[split]))
        ]
        for split in SPLITS
    }
    _save(path, splits, params)
    return splits
