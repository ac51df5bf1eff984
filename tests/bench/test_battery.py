"""The tool-call battery: clean streams pass; each kind of dirty stream is caught and named."""

from __future__ import annotations

import json

import pytest

from kiln.bench.battery import CASES, Contains, Equals, Expected, judge, select_cases
from kiln.bench.client import StreamResult, ToolCall, connect
from kiln.bench.run import BenchSettings, run_battery
from kiln.errors import KilnError

BY_ID = {case.id: case for case in CASES}


def battery(server, runs=1, cases=CASES):
    return run_battery({"A": connect(server.url)}, cases, runs, BenchSettings())


def problems(run, case_id):
    (judgement,) = [j for j in run.judgements("A", case_id)]
    return judgement.problems


def test_a_clean_server_is_clean_on_every_case(serve):
    server = serve(reasoning_tokens=3)
    run = battery(server, runs=2)
    assert run.clean("A") == (2 * len(CASES), 2 * len(CASES))
    sent = server.posts()[0].body
    assert sent["tools"] and sent["tool_choice"] == "auto" and sent["stream"] is True
    assert [lab for lab, *_ in run.results] == ["A"] * 2 * len(CASES)


def test_the_p64_failure_last_parameter_lost_is_dirty(serve):
    run = battery(serve(tool_mode="p64"))
    assert problems(run, "timer-integer-last") == [
        "set_timer: arguments do not parse as JSON: '{\"label\": \"tea\", '"]
    assert problems(run, "code-argument") == ["run_python: argument 'code' is missing (got '{}')"]
    # the first of two parallel calls is intact, the last one is not
    assert problems(run, "parallel-calls") == [
        "get_weather: arguments do not parse as JSON: '{\"city\": \"Oslo\", '"]
    assert run.clean("A", "no-tool-needed") == (1, 1)
    assert run.clean("A") == (1, len(CASES))


def test_markup_leaked_into_content_is_dirty(serve):
    run = battery(serve(tool_mode="leak"), cases=select_cases(["weather"]))
    found = problems(run, "weather")
    assert found[0].startswith("tool-call markup '<tool_call>' leaked into content: '<tool_call>\\n<function=get_weather>")
    assert found[1] == "0 tool call(s) (none), expected 1"


def test_a_call_left_inside_the_reasoning_is_dirty(serve):
    run = battery(serve(tool_mode="in_reasoning"), cases=select_cases(["think-then-call"]))
    assert problems(run, "think-then-call") == [
        "tool-call markup '<tool_call>' inside the reasoning (the call was not parsed)",
        "0 tool call(s) (none), expected 1"]


def test_the_wrong_function_and_unparsable_arguments_are_dirty(serve):
    run = battery(serve(tool_mode="wrong_name"), cases=select_cases(["weather"]))
    assert problems(run, "weather") == ["called 'get_weather_v2', expected 'get_weather'"]
    run = battery(serve(tool_mode="bad_json"), cases=select_cases(["reminder-boolean-last"]))
    (problem,) = problems(run, "reminder-boolean-last")
    assert problem.startswith("create_reminder: arguments do not parse as JSON: \"{'title': 'Renew passport'")


def test_a_dropped_stream_is_a_dirty_attempt_with_its_reason(serve):
    run = battery(serve(drop_requests=frozenset({0}), drop_after_chunks=2), cases=select_cases(["weather"]))
    assert problems(run, "weather") == ["request failed: the stream broke off after 3 chunk(s), before [DONE]"]


def answer(*calls, content="", reasoning=""):
    return StreamResult(ok=True, content=content, reasoning=reasoning, tool_calls=[
        ToolCall(index, f"call-{index}", name, arguments) for index, (name, arguments) in enumerate(calls)])


def test_values_are_checked_with_their_types():
    case = BY_ID["reminder-boolean-last"]
    ok = answer(("create_reminder", '{"title": "Passport renewal", "date": "2031-03-14", "urgent": true}'))
    assert judge(case, ok).clean
    as_int = answer(("create_reminder", '{"title": "passport", "date": "2031-03-14", "urgent": 1}'))
    assert judge(case, as_int).problems == ["create_reminder: argument 'urgent' is 1, expected true"]
    timer = BY_ID["timer-integer-last"]
    as_text = answer(("set_timer", '{"label": "Tea", "minutes": "4"}'))
    assert judge(timer, as_text).problems == ["set_timer: argument 'minutes' is \"4\", expected 4"]
    extra = answer(("set_timer", '{"label": "tea", "minutes": 4, "sound": "bell"}'))
    assert judge(timer, extra).problems == ["set_timer: undeclared argument 'sound'"]
    not_object = answer(("set_timer", '[4]'))
    assert judge(timer, not_object).problems == ["set_timer: arguments are not a JSON object: '[4]'"]


def test_an_answer_cut_off_at_max_tokens_says_so():
    cut = answer(reasoning="Let me think about the timer, it should be")
    cut.finish_reason = "length"
    assert judge(BY_ID["timer-integer-last"], cut).problems == [
        "the answer was cut off at max_tokens (2048) before it finished", "0 tool call(s) (none), expected 1"]


def test_parallel_calls_in_any_order_and_extra_calls():
    case = BY_ID["parallel-calls"]
    swapped = answer(("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                     ("get_weather", '{"city": "Tokyo, Japan", "unit": "celsius"}'))
    assert judge(case, swapped).clean
    one = answer(("get_weather", '{"city": "Oslo", "unit": "celsius"}'))
    assert judge(case, one).problems == ["1 tool call(s) (get_weather), expected 2"]
    three = answer(*[("get_weather", '{"city": "Oslo", "unit": "celsius"}')] * 3)
    assert judge(case, three).problems == ["3 tool call(s) (get_weather, get_weather, get_weather), expected 2"]


def test_prose_before_a_call_is_allowed_but_think_markup_is_not():
    case = BY_ID["weather"]
    call = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert judge(case, answer(call, content="Let me check that for you.")).clean
    assert judge(case, answer(call, content="hmm</think>")).problems == [
        "reasoning markup '</think>' leaked into content"]
    assert judge(BY_ID["no-tool-needed"], answer()).problems == ["no content: the answer is empty"]
    assert judge(BY_ID["no-tool-needed"], answer(call, content="Paris")).problems == [
        "1 tool call(s) (get_weather), expected 0"]


def test_the_battery_is_well_formed():
    assert len({case.id for case in CASES}) == len(CASES)
    for case in CASES:
        # the example answer of every case is judged clean: the expectations are satisfiable
        calls = [(name, json.dumps(args)) for name, args in case.example]
        content = "Paris" if not case.expected else ""
        assert judge(case, answer(*calls, content=content)).clean, case.id
        for expected in case.expected:
            assert set(expected.arguments) <= case.declared(expected.name), case.id
    assert Equals(True).check(1) and Contains("x").check(3)
    assert isinstance(Expected("f", {}).arguments, dict)
    with pytest.raises(KilnError, match=r"--cases: unknown tool-call case 'nope' \(known: weather, "):
        select_cases(["weather", "nope"])
