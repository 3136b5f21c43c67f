"""Each token's box in an InkML image: the traceGroups name one symbol's traces and its MathML element, and the
MathML's symbols, in LaTeX's order, are matched one to one to the tokens that draw ink."""

import numpy as np

from wapstable.data.ink.inkml import local_tag
from wapstable.data.latex import INKLESS, DataError, normalize_crohme, tokenize_latex
from wapstable.data.sample import no_boxes

XML_ID = "{http://www.w3.org/XML/1998/namespace}id"
MATHML_SYMBOLS = ("mi", "mn", "mo", "mtext")  # the elements that hold one written symbol
MATHML_MARKS = (
    "mfrac",
    "msqrt",
)  # a fraction's bar and a root's sign: written before their arguments in LaTeX


def _mathml_order(root) -> list[str]:
    """The xml:ids of the truth MathML's symbols in LaTeX's order: a fraction's bar and a root's sign before their
    arguments, the rest in document order."""
    math = next((a for a in root if local_tag(a.tag) == "annotationXML" and a.get("type") == "truth"), None)
    out = []

    def visit(el):
        tag = local_tag(el.tag)
        if (tag in MATHML_SYMBOLS or tag in MATHML_MARKS) and el.get(XML_ID):
            out.append(el.get(XML_ID))
        for child in el:
            visit(child)

    if math is not None:
        visit(math)
    return out


def inked_tokens(tokens: list[str]) -> list[int]:
    """The indices of the tokens that draw a symbol: not braces, scripts' ^ and _, or a root index's [ ]."""
    out, index_depth = [], 0
    for i, tok in enumerate(tokens):
        if tok == "[" and i and tokens[i - 1] == "\\sqrt":
            index_depth = 1
            continue
        if index_depth and tok == "]":
            index_depth = 0
            continue
        if tok not in INKLESS:
            out.append(i)
    return out


def truth_names_token(token: str, truth: str) -> bool:
    """Whether a traceGroup's truth annotation (`truth`, as the writer's file spells it) names `token` of the
    normalised label: the same symbol once normalised, or for a fraction the bar written as "-" or "\\over"."""
    if token == "\\frac":
        return truth in ("-", "\\frac", "\\over")
    try:
        return normalize_crohme(tokenize_latex(truth)) == [token]
    except DataError:
        return False


def symbol_boxes(
    root, tokens: list[str], traces: dict, transform, line_width: int, shape
) -> np.ndarray | None:
    """(len(tokens), 4) boxes x0, y0, x1, y1 in the image's pixels of each token's strokes, from the traceGroups
    (each names one symbol's traces and its MathML element), NaN for tokens without ink; None when the symbols do
    not match the tokens one to one (a file without traceGroups, a count or a symbol that differs)."""
    groups = {}
    for tg in root.iter():
        if local_tag(tg.tag) != "traceGroup":
            continue
        href = next((c.get("href") for c in tg if local_tag(c.tag) == "annotationXML"), None)
        truth = next(
            (c.text for c in tg if local_tag(c.tag) == "annotation" and c.get("type") == "truth"), None
        )
        refs = [c.get("traceDataRef") for c in tg if local_tag(c.tag) == "traceView"]
        if href and truth and refs:
            groups[href] = (truth.strip(), refs)
    order, inked = _mathml_order(root), inked_tokens(tokens)
    if not groups or len(order) != len(inked):
        return None
    lo, scale, offset = transform
    pad = line_width / 2 + 0.5
    h, w = shape
    boxes = no_boxes(len(tokens))
    for i, ref in zip(inked, order):
        if ref not in groups or not truth_names_token(tokens[i], groups[ref][0]):
            return None
        pts = [traces[t] for t in groups[ref][1] if t in traces and len(traces[t])]
        if not pts:
            return None
        px = (np.concatenate(pts)[:, :2] - lo) * scale + offset
        x0, y0 = px.min(0) - pad
        x1, y1 = px.max(0) + pad
        boxes[i] = (max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1))
    return boxes
