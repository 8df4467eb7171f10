"""Where each key of a TOML document stands: path -> (line, column).

``tomllib`` reports positions only for syntax errors; a pipeline's semantic
errors (an unknown stage, a bad size) must name a line too. This scanner
walks a document that ``tomllib`` already accepted and records the position
of every table header, array-of-tables element and key, keyed by the same
path the parsed data uses (strings for keys, ints for array elements).
"""

from __future__ import annotations

Path = tuple[str | int, ...]

_BARE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.line = 1
        self.col = 1
        self.positions: dict[Path, tuple[int, int]] = {}
        self.array_counts: dict[Path, int] = {}

    # -- characters ---------------------------------------------------------
    def peek(self, n: int = 0) -> str:
        j = self.i + n
        return self.text[j] if j < len(self.text) else ""

    def startswith(self, s: str) -> bool:
        return self.text.startswith(s, self.i)

    def advance(self, n: int = 1) -> None:
        for _ in range(n):
            if self.i >= len(self.text):
                return
            if self.text[self.i] == "\n":
                self.line += 1
                self.col = 1
            else:
                self.col += 1
            self.i += 1

    def skip_blank(self, newlines: bool) -> None:
        while self.i < len(self.text):
            c = self.peek()
            if c in " \t\r" or (newlines and c == "\n"):
                self.advance()
            elif c == "#":
                while self.i < len(self.text) and self.peek() != "\n":
                    self.advance()
            else:
                return

    # -- pieces -------------------------------------------------------------
    def key(self) -> list[str]:
        parts: list[str] = []
        while True:
            self.skip_blank(newlines=False)
            c = self.peek()
            if c in "\"'":
                parts.append(self.string())
            else:
                start = self.i
                while self.peek() in _BARE and self.peek():
                    self.advance()
                parts.append(self.text[start : self.i])
            self.skip_blank(newlines=False)
            if self.peek() == ".":
                self.advance()
                continue
            return parts

    def string(self) -> str:
        quote = self.peek()
        if self.startswith(quote * 3):
            self.advance(3)
            start = self.i
            while self.i < len(self.text) and not self.startswith(quote * 3):
                self.advance(2 if quote == '"' and self.peek() == "\\" else 1)
            value = self.text[start : self.i]
            self.advance(3)
            while self.peek() == quote:  # up to two quotes may close the content
                self.advance()
            return value
        self.advance()
        out = []
        while self.i < len(self.text) and self.peek() != quote:
            if quote == '"' and self.peek() == "\\":
                out.append(self.text[self.i : self.i + 2])
                self.advance(2)
                continue
            out.append(self.peek())
            self.advance()
        self.advance()
        return "".join(out)

    def value(self, path: Path) -> None:
        c = self.peek()
        if c in "\"'":
            self.string()
        elif c == "[":
            self.array(path)
        elif c == "{":
            self.inline_table(path)
        else:
            while self.peek() and self.peek() not in ",]}\n#":
                self.advance()

    def array(self, path: Path) -> None:
        self.advance()  # [
        index = 0
        while True:
            self.skip_blank(newlines=True)
            if self.peek() in ("]", ""):
                self.advance()
                return
            self.positions.setdefault(path + (index,), (self.line, self.col))
            self.value(path + (index,))
            index += 1
            self.skip_blank(newlines=True)
            if self.peek() == ",":
                self.advance()

    def inline_table(self, path: Path) -> None:
        self.advance()  # {
        while True:
            self.skip_blank(newlines=True)
            if self.peek() in ("}", ""):
                self.advance()
                return
            self.key_value(path)
            self.skip_blank(newlines=True)
            if self.peek() == ",":
                self.advance()

    def key_value(self, table: Path) -> None:
        line, col = self.line, self.col
        parts = self.key()
        path = table + tuple(parts)
        for depth in range(len(table) + 1, len(path) + 1):
            self.positions.setdefault(path[:depth], (line, col))
        self.skip_blank(newlines=False)
        if self.peek() == "=":
            self.advance()
        self.skip_blank(newlines=False)
        self.value(path)

    def document(self) -> dict[Path, tuple[int, int]]:
        table: Path = ()
        while True:
            self.skip_blank(newlines=True)
            if self.i >= len(self.text):
                return self.positions
            line, col = self.line, self.col
            if self.startswith("[["):
                self.advance(2)
                name = tuple(self.key())
                self.advance(2)
                index = self.array_counts.get(name, 0)
                self.array_counts[name] = index + 1
                table = name + (index,)
                self._header(name, line, col)
                self.positions[table] = (line, col)
            elif self.peek() == "[":
                self.advance()
                name = tuple(self.key())
                self.advance()
                table = self._resolve_table(name)
                self._header(table, line, col)
            else:
                self.key_value(table)

    def _header(self, table: Path, line: int, col: int) -> None:
        # [[stor.stages]] first declares 'stor': an error about that section points here.
        for depth in range(1, len(table) + 1):
            self.positions.setdefault(table[:depth], (line, col))

    def _resolve_table(self, name: Path) -> Path:
        # [a.b] below [[a]] means a sub-table of a's latest element.
        resolved: list[str | int] = []
        for depth, part in enumerate(name):
            resolved.append(part)
            prefix = tuple(name[: depth + 1])
            if prefix in self.array_counts and depth < len(name) - 1:
                resolved.append(self.array_counts[prefix] - 1)
        return tuple(resolved)


def key_positions(text: str) -> dict[Path, tuple[int, int]]:
    """Positions (1-based line, column) of every table and key in ``text``."""
    return _Scanner(text).document()


def locate(positions: dict[Path, tuple[int, int]], path: Path) -> tuple[int, int]:
    """The position of ``path``, or of its nearest ancestor that has one."""
    for depth in range(len(path), 0, -1):
        found = positions.get(tuple(path[:depth]))
        if found is not None:
            return found
    return (1, 1)
