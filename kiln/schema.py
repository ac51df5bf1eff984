"""The schemas of the files users edit, and the one-line error a file that breaks one gets.

Public API:
    SCHEMAS                          the schema names: "image", "pins", "registries"
    schema_path(name) -> Path        ``kiln/schemas/<name>.schema.json`` (JSON Schema 2020-12)
    schema(name) -> dict
    check(document, name, path)      raises KilnError: the file, the key path, what is wrong;
                                     an unknown key or table names the closest valid one
    skip_format_grammars()           for a process that is only kiln (the command line): import
                                     jsonschema without rfc3987-syntax's grammars (below)

Each schema is the one place a file's keys are declared: ``images/*.toml`` (``image``),
``pins.toml`` (``pins``) and the registries config (``registries``). The loaders check a file
against its schema first (unknown keys, missing keys, types), then make the checks a schema
cannot (patches exist, SMs are known, tags render valid OCI tags, ...). The same files are
published in ``docs/schemas/`` for editors and other tools (a test keeps them equal).
To add a key or table: add it to the schema, then read it in the loader (docs/DEFINITIONS.md).
"""

from __future__ import annotations

import datetime
import difflib
import functools
import json
import re
import sys
from pathlib import Path

from kiln.errors import KilnError

SCHEMAS = ("image", "pins", "registries")

_skip_format_grammars = False
# What jsonschema imports, where installed, only to check ``format``s kiln's schemas never assert
# (``jsonschema[format]``); ``idna`` stays, as requests needs it anyway.
_FORMAT_PACKAGES = ("rfc3987_syntax", "rfc3987", "rfc3986_validator", "rfc3339_validator", "isoduration",
                    "webcolors", "uri_template", "fqdn", "jsonpointer")


def skip_format_grammars() -> None:
    """Import jsonschema, when kiln first needs it, without the optional ``rfc3987-syntax``.

    Where that package is installed (``jsonschema[format]``, which kiln's test extras bring in
    through cyclonedx-python-lib's validator), importing jsonschema compiles its 38 lark grammars
    for the ``iri`` formats: 1.5 s, more than a cached build takes; the other format packages
    (``_FORMAT_PACKAGES``: arrow through isoduration among them) cost 30 ms more. kiln's schemas
    assert no format, so the command line, a process that runs nothing else, skips them all:
    jsonschema then checks none of those formats in that process. A library caller (a test
    validating an SBOM's formats in the same process) keeps jsonschema whole: only
    ``kiln.commands.entry`` asks.
    """
    global _skip_format_grammars
    _skip_format_grammars = True


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# An unknown key explains the rest (a misspelt table is also a missing one): reported first.
_PRIORITY = {"additionalProperties": 0, "required": 1}


def schema_path(name: str) -> Path:
    return Path(__file__).with_name("schemas") / f"{name}.schema.json"


@functools.cache
def schema(name: str) -> dict:
    return json.loads(schema_path(name).read_text())


@functools.cache
def _validator(name: str):
    hide = [] if not _skip_format_grammars or "jsonschema" in sys.modules else \
        [package for package in _FORMAT_PACKAGES if package not in sys.modules]
    for package in hide:
        sys.modules[package] = None  # its import raises ImportError: jsonschema goes without it
    try:
        import jsonschema  # imported on first use: kiln's commands start without it
    finally:
        for package in hide:
            del sys.modules[package]

    base = jsonschema.validators.validator_for(schema(name))
    # TOML has integers and floats apart: 86.0 is not an SM (JSON Schema would take it).
    strict_int = base.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool))
    validator = jsonschema.validators.extend(base, type_checker=strict_int)
    return validator(schema(name))


def check(document: dict, name: str, path: Path | str) -> None:
    """Raise a KilnError naming ``path`` and the first key at fault, if ``document`` breaks the schema."""
    errors = list(_validator(name).iter_errors(document))
    if errors:
        error = min(errors, key=lambda e: (_PRIORITY.get(e.validator, 2), len(e.absolute_path)))
        raise KilnError(f"{path}: {_explain(error)}")


def _explain(error) -> str:
    keys = list(error.absolute_path)
    where = _key_path(keys) or "(top level)"
    kind, value, sub = error.validator, error.instance, error.schema
    if kind == "additionalProperties":
        return _unknown(keys, value, sub)
    if kind == "required":
        missing = next(k for k in error.validator_value if k not in value)
        wanted = sub.get("properties", {}).get(missing, {})
        if wanted.get("type") == "object":
            return f"{_key_path([*keys, missing])}: missing [{_key_path([*keys, missing])}] table"
        return f"{_key_path([*keys, missing])}: missing ({_expected(wanted)})"
    if kind == "type":
        return f"{where}: expected {_expected(sub)}, not {_describe(value)}"
    if kind in ("minItems", "minProperties", "minLength") and error.validator_value == 1:
        return f"{where}: must not be empty"
    if kind == "minimum":
        return f"{where}: {_describe(value)} is less than {error.validator_value}"
    if kind == "enum":
        return f"{where}: {value!r} is not one of {', '.join(map(str, error.validator_value))}"
    if kind == "pattern" and "description" in sub:
        return f"{where}: {value!r} is not {sub['description']}"
    return f"{where}: {error.message}"


def _unknown(keys: list, table: dict, sub: dict) -> str:
    """The first unknown key of ``table`` (document order), with the closest valid one."""
    known = sub.get("properties", {})
    key = next(k for k in table if k not in known)
    is_table = isinstance(table[key], dict)

    def shown(name: str, as_table: bool) -> str:
        full = _key_path([*keys, name])
        return f"[{full}]" if as_table else full

    what = "table" if is_table else "key"
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {shown(close[0], known[close[0]].get('type') == 'object')}?"
    else:
        tables = [k for k, s in known.items() if s.get("type") == "object"]
        valid = (tables if is_table and tables else list(known))
        hint = f"valid: {', '.join(shown(k, known[k].get('type') == 'object') for k in valid) or 'none'}"
    return f"{shown(key, is_table)}: unknown {what}; {hint}"


def _key_path(keys: list) -> str:
    """TOML spelling: ``model.kernels.head_dim``, ``pins."v0.33.0".role``, ``sms[0]``."""
    text = ""
    for key in keys:
        if isinstance(key, int):
            text += f"[{key}]"
        else:
            part = key if _BARE_KEY.match(key) else json.dumps(key)
            text += f".{part}" if text else part
    return text


def _expected(sub: dict) -> str:
    kind = sub.get("type")
    if kind == "array":
        items = sub.get("items", {})
        return f"a list of {_plural(_expected(items))}" if "type" in items else "a list"
    if kind == "object":
        values = sub.get("additionalProperties")
        return f"a table of {_plural(_expected(values))}" if isinstance(values, dict) and "type" in values \
            else "a table"
    if "enum" in sub:
        return "one of " + ", ".join(map(str, sub["enum"]))
    return {"string": "a string", "integer": "an integer", "boolean": "true or false",
            "number": "a number"}.get(kind, "a value")


def _plural(noun: str) -> str:
    """``a list of strings`` -> ``lists of strings``."""
    head, of, tail = noun.removeprefix("an ").removeprefix("a ").partition(" of ")
    return f"{head}s{of}{tail}"


def _describe(value) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (datetime.date, datetime.time)):
        return f"the date/time {value.isoformat()}"
    return repr(value)
