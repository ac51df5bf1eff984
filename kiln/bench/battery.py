"""The tool-call battery: fixed prompts with tools, and the judge of a streamed answer.

A call is clean when the streamed ``tool_calls`` assemble into exactly the expected
function(s), each one's arguments parse as a JSON object whose values meet the case's
expectations (and name no parameter the tool does not declare), and no tool-call or
reasoning markup leaks into ``content`` (or a tool call into the reasoning, where an unparsed
call ends up when ``</think>`` is missed). Prose before a call is allowed: models do that.

The cases aim at known streaming failures: a short last parameter that arrives in the same
delta as ``</function>`` (one MTP step carries several tokens; kiln's P64), a think -> call
boundary (reasoning parser on; P62), parallel calls (tool indexes), a code argument full of
quotes and newlines (JSON escaping), and a question that needs no tool at all.

Public API:
    BATTERY_VERSION, CASES               the versioned battery
    ToolCase(id, aim, user, tools, expected, example)   .request_body()
    Expected(name, arguments)            arguments: parameter -> Equals / Contains
    Equals(value), Contains(text)
    judge(case, result) -> Judgement     clean, problems (one line each)
    select_cases(ids) -> tuple[ToolCase, ...]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kiln.bench.client import StreamResult
from kiln.bench.prompts import select_by_id

BATTERY_VERSION = "kiln-battery-1"

# Markup of the Hermes (<tool_call>{json}) and Qwen3-Coder (<function=...><parameter=...>)
# formats and of the reasoning block: none of it belongs in what a client shows the user.
TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
THINK_MARKUP = ("<think>", "</think>")


class _Expectation:
    """What one argument must be: ``check`` says how it fails (None: it is right)."""

    def matches(self, got: object) -> bool:
        raise NotImplementedError

    def wanted(self) -> str:
        """The expected value, as a problem line names it."""
        raise NotImplementedError

    def check(self, got: object) -> str | None:
        return None if self.matches(got) else f"is {json.dumps(got)[:60]}, expected {self.wanted()}"


@dataclass(frozen=True)
class Equals(_Expectation):
    value: object

    def matches(self, got: object) -> bool:
        # bool is an int in Python: `True == 1`; a boolean parameter must come back a boolean
        return isinstance(self.value, bool) == isinstance(got, bool) and got == self.value

    def wanted(self) -> str:
        return json.dumps(self.value)

    def describe(self) -> str:
        return f"= {self.wanted()}"


@dataclass(frozen=True)
class Contains(_Expectation):
    text: str  # case-insensitive

    def matches(self, got: object) -> bool:
        return isinstance(got, str) and self.text.lower() in got.lower()

    def wanted(self) -> str:
        return f"a string containing {self.text!r}"

    def describe(self) -> str:
        return f"contains {self.text!r}"


@dataclass(frozen=True)
class Expected:
    name: str
    arguments: dict  # parameter -> Equals | Contains


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


WEATHER = _tool("get_weather", "Current weather in a city.", {
    "city": {"type": "string", "description": "City name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
}, ["city", "unit"])
TIMER = _tool("set_timer", "Start a kitchen timer.", {
    "label": {"type": "string"}, "minutes": {"type": "integer", "description": "Whole minutes"},
}, ["label", "minutes"])
REMINDER = _tool("create_reminder", "Create a reminder on a date.", {
    "title": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
    "urgent": {"type": "boolean"},
}, ["title", "date", "urgent"])
INVENTORY = _tool("record_inventory", "Record how many of an item are in stock.", {
    "item": {"type": "string"}, "count": {"type": "integer"},
}, ["item", "count"])
PYTHON = _tool("run_python", "Run a Python snippet and return what it prints.", {
    "code": {"type": "string", "description": "Python source code"},
}, ["code"])


@dataclass(frozen=True)
class ToolCase:
    id: str
    aim: str  # the streaming failure it is meant to catch
    user: str
    tools: tuple[dict, ...]
    expected: tuple[Expected, ...]  # empty: no tool call wanted
    example: tuple[tuple[str, dict], ...]  # a correct answer (name, arguments), for the docs and the tests
    max_tokens: int = 2048
    ordered: bool = field(default=False)  # parallel calls may come in any order

    def request_body(self) -> dict:
        return {"messages": [{"role": "user", "content": self.user}], "tools": list(self.tools),
                "tool_choice": "auto", "max_tokens": self.max_tokens, "temperature": 0.0}

    def declared(self, name: str) -> set[str] | None:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return set(tool["function"]["parameters"]["properties"])
        return None


CASES: tuple[ToolCase, ...] = (
    ToolCase("weather", "a short enum as the last parameter (closes with </function>)",
             "What is the weather in Paris right now? Use celsius.", (WEATHER,),
             (Expected("get_weather", {"city": Contains("paris"), "unit": Equals("celsius")}),),
             (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
    ToolCase("timer-integer-last", "a one-token integer as the last parameter (P64)",
             "Set a timer called tea for 4 minutes.", (TIMER,),
             (Expected("set_timer", {"label": Contains("tea"), "minutes": Equals(4)}),),
             (("set_timer", {"label": "tea", "minutes": 4}),)),
    ToolCase("reminder-boolean-last", "three parameters, a boolean last (P64)",
             "Remind me to renew my passport on 2031-03-14. It is urgent.", (REMINDER,),
             (Expected("create_reminder", {"title": Contains("passport"), "date": Equals("2031-03-14"),
                                           "urgent": Equals(True)}),),
             (("create_reminder", {"title": "Renew passport", "date": "2031-03-14", "urgent": True}),)),
    ToolCase("think-then-call", "arithmetic to reason about, then a call (think -> tool boundary)",
             "I had 3 boxes of 12 eggs and broke 5 of them. Work out how many eggs are left, then "
             "record that number with the inventory tool (item: eggs).", (INVENTORY,),
             (Expected("record_inventory", {"item": Contains("egg"), "count": Equals(31)}),),
             (("record_inventory", {"item": "eggs", "count": 31}),)),
    ToolCase("parallel-calls", "two calls in one answer (tool indexes)",
             "What is the weather in Tokyo and in Oslo? Use celsius for both; call the tool once per city.",
             (WEATHER,),
             (Expected("get_weather", {"city": Contains("tokyo"), "unit": Equals("celsius")}),
              Expected("get_weather", {"city": Contains("oslo"), "unit": Equals("celsius")})),
             (("get_weather", {"city": "Tokyo", "unit": "celsius"}),
              ("get_weather", {"city": "Oslo", "unit": "celsius"}))),
    ToolCase("code-argument", "quotes, newlines and braces inside a string argument (JSON escaping)",
             'Use run_python to print the sum of the numbers 1 to 100 with an f-string like f"sum={total}".',
             (PYTHON,), (Expected("run_python", {"code": Contains("print")}),),
             (("run_python", {"code": 'total = sum(range(1, 101))\nprint(f"sum={total}")'}),)),
    ToolCase("choose-among-tools", "the right function among several, the last parameter short",
             "Start a timer named pasta for 9 minutes.", (WEATHER, TIMER, REMINDER),
             (Expected("set_timer", {"label": Contains("pasta"), "minutes": Equals(9)}),),
             (("set_timer", {"label": "pasta", "minutes": 9}),)),
    ToolCase("no-tool-needed", "tools offered but none wanted: plain content, no markup",
             "What is the capital of France? Answer in one word.", (WEATHER, TIMER), (), ()),
)

def select_cases(ids: list[str] | None) -> tuple[ToolCase, ...]:
    return select_by_id(CASES, ids, "--cases", "tool-call case")


@dataclass
class Judgement:
    case: str
    clean: bool
    problems: list[str]

    def to_json(self) -> dict:
        return {"case": self.case, "clean": self.clean, "problems": self.problems}


def _markup(text: str, markers: tuple[str, ...]) -> str | None:
    return next((marker for marker in markers if marker in text), None)


def _check_call(case: ToolCase, expected: Expected, name: str, arguments: str) -> list[str]:
    if name != expected.name:
        return [f"called {name or '(no name)'!r}, expected {expected.name!r}"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return [f"{name}: arguments do not parse as JSON: {arguments[:80]!r}"]
    if not isinstance(parsed, dict):
        return [f"{name}: arguments are not a JSON object: {arguments[:80]!r}"]
    problems = []
    for parameter, want in expected.arguments.items():
        if parameter not in parsed:
            problems.append(f"{name}: argument {parameter!r} is missing (got {arguments[:80]!r})")
        elif (why := want.check(parsed[parameter])) is not None:
            problems.append(f"{name}: argument {parameter!r} {why}")
    declared = case.declared(name) or set()
    problems += [f"{name}: undeclared argument {extra!r}" for extra in sorted(set(parsed) - declared)]
    return problems


def _match(case: ToolCase, calls: list) -> list[str]:
    """Problems of the calls against the expected ones (in any order for parallel calls)."""
    if len(calls) != len(case.expected):
        names = ", ".join(call.name or "?" for call in calls) or "none"
        return [f"{len(calls)} tool call(s) ({names}), expected {len(case.expected)}"]
    remaining = list(calls)
    problems = []
    for expected in case.expected:
        # the call this expectation fits best: the first with no problem, else the first left
        checked = [(call, _check_call(case, expected, call.name, call.arguments)) for call in remaining]
        call, found = next(((c, p) for c, p in checked if not p), checked[0])
        remaining.remove(call)
        problems += found
    return problems


def judge(case: ToolCase, result: StreamResult) -> Judgement:
    """Is the streamed answer to ``case`` a clean tool call (or clean content, if none is wanted)?"""
    if not result.ok:
        return Judgement(case.id, False, [f"request failed: {result.error}"])
    problems = []
    if leaked := _markup(result.content, TOOL_MARKUP):
        problems.append(f"tool-call markup {leaked!r} leaked into content: {result.content.strip()[:80]!r}")
    if leaked := _markup(result.content, THINK_MARKUP):
        problems.append(f"reasoning markup {leaked!r} leaked into content")
    if leaked := _markup(result.reasoning, TOOL_MARKUP):
        problems.append(f"tool-call markup {leaked!r} inside the reasoning (the call was not parsed)")
    if result.finish_reason == "length":  # else a cut-off reasoning would pass for a parser fault
        problems.append(f"the answer was cut off at max_tokens ({case.max_tokens}) before it finished")
    calls = sorted(result.tool_calls, key=lambda call: call.index)
    problems += _match(case, calls)
    if not case.expected and not result.content.strip():
        problems.append("no content: the answer is empty")
    return Judgement(case.id, not problems, problems)
