"""Token vocabulary in WAP's dictionary format: one `tok<TAB>index` line per token, `<eol>` = 0."""

from collections.abc import Iterable
from pathlib import Path

EOL = "<eol>"


class Vocab:
    """Maps tokens to indices; index 0 is the end token `<eol>`, as in the original WAP dictionary."""

    def __init__(self, tokens: list[str]):
        if not tokens or tokens[0] != EOL:
            raise ValueError(f"a vocabulary must start with the end token {EOL!r} at index 0")
        if len(set(tokens)) != len(tokens):
            raise ValueError("a vocabulary must not list a token twice")
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self.tokens == other.tokens

    @classmethod
    def build(cls, labels: Iterable[list[str]]) -> "Vocab":
        """A vocabulary of every token in `labels`, sorted, after `<eol>`."""
        seen = {t for label in labels for t in label}
        seen.discard(EOL)
        return cls([EOL, *sorted(seen)])

    def encode(self, tokens: list[str], where: str = "a label") -> list[int]:
        """Token indices, without the end token; an unknown token is a user error naming it."""
        try:
            return [self.index[t] for t in tokens]
        except KeyError as e:
            raise ValueError(
                f"{where} contains the token {e.args[0]!r}, which is not in the vocabulary; "
                "add it to the dictionary file or drop the sample"
            ) from None

    def decode(self, indices: Iterable[int]) -> list[str]:
        """Tokens up to (not including) the first `<eol>`."""
        out = []
        for i in indices:
            if i == 0:
                break
            out.append(self.tokens[i])
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text("".join(f"{t}\t{i}\n" for i, t in enumerate(self.tokens)), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Vocab":
        """Read a `tok<TAB>index` dictionary file (WAP's `dictionary.txt` format)."""
        pairs = []
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise ValueError(f"{path}:{n}: expected 'token<TAB>index', got {line!r}")
            pairs.append((int(parts[1]), parts[0]))
        pairs.sort()
        if [i for i, _ in pairs] != list(range(len(pairs))):
            raise ValueError(f"{path}: indices must run 0..{len(pairs) - 1} without gaps")
        return cls([t for _, t in pairs])
