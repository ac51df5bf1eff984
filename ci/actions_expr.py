"""GitHub Actions expressions (``${{ … }}``), evaluated the way the Actions runner does, for
``ci/run_workflow.py``.

    evaluate(text, context) -> value           one expression (an ``if:``, or inside ``${{ }}``)
    interpolate(value, context) -> value       ``${{ }}`` in a string replaced; a string that is one
                                               expression keeps its value's type (``matrix:``)

Supported: literals (``null``, ``true``, ``false``, numbers, ``'strings'`` with ``''``), property
access (``a.b``, ``a['b']``), ``!``, ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``&&``, ``||``
(returning an operand, as GitHub does), parentheses, and the functions ``contains``,
``startsWith``, ``endsWith``, ``format``, ``join``, ``toJSON``, ``fromJSON``, ``hashFiles``,
``success``, ``failure``, ``always``, ``cancelled``. String comparison ignores case, as GitHub's.
A missing property is ``null``. Anything else is an error naming the expression.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from pathlib import Path

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>'(?:[^']|'')*')|(?P<name>[A-Za-z_][\w-]*)"
                    r"|(?P<op>==|!=|<=|>=|&&|\|\||[!<>()\[\].,*]))")
_TEMPLATE = re.compile(r"\$\{\{(.*?)\}\}", re.S)


class ExpressionError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match:
            raise ExpressionError(f"cannot read {text!r} at {text[pos:]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def to_string(value) -> str:
    if value is None:
        return ""
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value, indent=2)
    return str(value)


def truthy(value) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, float) and value == 0)


def _number(value):
    if value is None:
        return 0
    if isinstance(value, bool):
        return 1 if value else 0
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value) if value.strip() else 0
        except ValueError:
            return float("nan")
    return float("nan")


def _compare(a, b):
    """GitHub's loose comparison: same types compare directly (strings ignoring case), otherwise as numbers."""
    if isinstance(a, str) and isinstance(b, str):
        return (a.lower() > b.lower()) - (a.lower() < b.lower())
    if type(a) is type(b) and isinstance(a, (dict, list)):
        return 0 if a is b else None
    x, y = _number(a), _number(b)
    if x != x or y != y:  # NaN: nothing is equal
        return None
    return (x > y) - (x < y)


class _Parser:
    def __init__(self, text: str, context: dict):
        self.text, self.context = text, context
        self.tokens, self.i = _tokens(text), 0

    def peek(self, value: str | None = None):
        if self.i >= len(self.tokens):
            return None
        token = self.tokens[self.i]
        return token if value is None or token[1] == value else None

    def take(self, value: str | None = None):
        token = self.peek(value)
        if token is None:
            raise ExpressionError(f"{self.text!r}: expected {value or 'more'}")
        self.i += 1
        return token

    def parse(self):
        value = self.or_()
        if self.i != len(self.tokens):
            raise ExpressionError(f"{self.text!r}: unexpected {self.tokens[self.i][1]!r}")
        return value

    def or_(self):
        value = self.and_()
        while self.peek("||"):
            self.take()
            right = self.and_()
            value = value if truthy(value) else right
        return value

    def and_(self):
        value = self.comparison()
        while self.peek("&&"):
            self.take()
            right = self.comparison()
            value = right if truthy(value) else value
        return value

    def comparison(self):
        value = self.unary()
        while self.peek() and self.peek()[1] in ("==", "!=", "<", "<=", ">", ">="):
            op = self.take()[1]
            result = _compare(value, self.unary())
            value = {"==": result == 0, "!=": result != 0, "<": result == -1, "<=": result in (-1, 0),
                     ">": result == 1, ">=": result in (1, 0)}[op]
        return value

    def unary(self):
        if self.peek("!"):
            self.take()
            return not truthy(self.unary())
        return self.postfix(self.primary())

    def primary(self):
        kind, text = self.take()
        if text == "(":
            value = self.or_()
            self.take(")")
            return value
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "str":
            return text[1:-1].replace("''", "'")
        if kind != "name":
            raise ExpressionError(f"{self.text!r}: unexpected {text!r}")
        if text in ("true", "false"):
            return text == "true"
        if text == "null":
            return None
        if self.peek("("):
            self.take()
            args = []
            while not self.peek(")"):
                args.append(self.or_())
                if not self.peek(")"):
                    self.take(",")
            self.take(")")
            return self.call(text, args)
        if text not in self.context:
            raise ExpressionError(f"{self.text!r}: unknown context {text!r}")
        return self.context[text]

    def postfix(self, value):
        while True:
            if self.peek("."):
                self.take()
                key = self.take()[1]
                value = _member(value, key)
            elif self.peek("["):
                self.take()
                key = self.or_()
                self.take("]")
                value = _member(value, key)
            else:
                return value

    def call(self, name: str, args: list):
        lowered = name.lower()
        status = self.context.get("__status__", "success")
        if lowered == "success":
            return status == "success"
        if lowered == "failure":
            return status == "failure"
        if lowered == "always":
            return True
        if lowered == "cancelled":
            return False
        if lowered == "fromjson":
            return json.loads(to_string(args[0]))
        if lowered == "tojson":
            return json.dumps(args[0], indent=2)
        if lowered == "contains":
            hay, needle = args
            if isinstance(hay, list):
                return any(_compare(item, needle) == 0 for item in hay)
            return to_string(needle).lower() in to_string(hay).lower()
        if lowered == "startswith":
            return to_string(args[0]).lower().startswith(to_string(args[1]).lower())
        if lowered == "endswith":
            return to_string(args[0]).lower().endswith(to_string(args[1]).lower())
        if lowered == "format":
            return re.sub(r"\{(\d+)\}", lambda m: to_string(args[1 + int(m.group(1))]), to_string(args[0]))
        if lowered == "join":
            items = args[0] if isinstance(args[0], list) else [args[0]]
            return (to_string(args[1]) if len(args) > 1 else ",").join(to_string(i) for i in items)
        if lowered == "hashfiles":
            return _hash_files(Path(self.context.get("__workspace__", ".")), [to_string(a) for a in args])
        raise ExpressionError(f"{self.text!r}: unknown function {name}()")


def _member(value, key):
    if isinstance(value, dict):
        if key in value:
            return value[key]
        folded = {str(k).lower(): v for k, v in value.items()}  # contexts are case-insensitive
        return folded.get(str(key).lower())
    if isinstance(value, list) and isinstance(key, (int, float)) and 0 <= int(key) < len(value):
        return value[int(key)]
    return None


def _hash_files(root: Path, patterns: list[str]) -> str:
    files = sorted({Path(p) for pattern in patterns for p in glob.glob(str(root / pattern), recursive=True)
                    if Path(p).is_file()})
    if not files:
        return ""
    outer = hashlib.sha256()
    for path in files:
        outer.update(hashlib.sha256(path.read_bytes()).digest())
    return outer.hexdigest()


_STATUS_FUNCTIONS = ("success", "failure", "always", "cancelled")


def with_status(condition) -> str:
    """An ``if:`` as GitHub evaluates it: one that calls no status function (``success()``,
    ``failure()``, ``always()``, ``cancelled()``) is implicitly ``success() && (…)``, so a step
    whose ``if:`` is ``github.event_name == 'push'`` does not run after an earlier step failed."""
    if isinstance(condition, bool):
        text = "true" if condition else "false"
    else:
        text = str(condition).strip()
        whole = _TEMPLATE.fullmatch(text)
        if whole:
            text = whole.group(1).strip()
    tokens = _tokens(text)
    calls = any(kind == "name" and value.lower() in _STATUS_FUNCTIONS and i + 1 < len(tokens)
                and tokens[i + 1][1] == "(" for i, (kind, value) in enumerate(tokens))
    return text if calls else f"success() && ({text})"


def evaluate(text: str, context: dict):
    return _Parser(text.strip(), context).parse()


def interpolate(value, context: dict):
    """``value`` with every ``${{ }}`` evaluated; dicts and lists are walked."""
    if isinstance(value, dict):
        return {k: interpolate(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, context) for v in value]
    if not isinstance(value, str):
        return value
    whole = _TEMPLATE.fullmatch(value.strip())
    if whole:
        return evaluate(whole.group(1), context)
    return _TEMPLATE.sub(lambda m: to_string(evaluate(m.group(1), context)), value)
