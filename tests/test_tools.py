"""otbrl.tools: the calculator against exact rational arithmetic, tool resolution, the executor's
error policy (raise, timeout, bad arguments, unknown tool) and the two call formats."""

import json
import random
import time
from fractions import Fraction
from pathlib import Path

import pytest

from otbrl.tools import (
    CompactFormat,
    HermesFormat,
    ToolCall,
    ToolExecutor,
    calculator,
    make_tool,
    resolve_tools,
    tool_schemas,
    tools_for_row,
)
from otbrl.tools.calculator import format_number


def _random_expression(rng: random.Random, depth: int) -> tuple[str, Fraction]:
    """A random expression and its value computed directly with Fractions (the reference)."""
    if depth == 0 or rng.random() < 0.3:
        value = rng.randint(0, 999)
        return str(value), Fraction(value)
    op = rng.choice(["+", "-", "*", "/", "neg", "paren", "^"])
    if op == "neg":
        text, value = _random_expression(rng, depth - 1)
        return f"-({text})", -value
    if op == "paren":
        text, value = _random_expression(rng, depth - 1)
        return f"({text})", value
    left, lv = _random_expression(rng, depth - 1)
    if op == "^":
        e = rng.randint(0, 3)
        return f"({left})^{e}", lv**e
    right, rv = _random_expression(rng, depth - 1)
    if op == "/" and rv == 0:
        return f"({left})+({right})", lv + rv
    value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}[op]
    return f"({left}){op}({right})", value


def test_calculator_equals_exact_rational_arithmetic():
    rng = random.Random(0)
    for _ in range(300):
        text, value = _random_expression(rng, 4)
        if len(text) > 200 or max(len(str(abs(value.numerator))), len(str(value.denominator))) > 50:
            continue
        assert calculator(text) == format_number(value), text
    assert calculator("1234*56") == "69104"
    assert calculator(" 2 ** 10 - 24 / 3 ") == "1016"
    assert calculator("1/3") == "0.333333" and calculator("1/3*3") == "1"
    assert calculator("7//2") == "3" and calculator("7%4") == "3" and calculator("-2^2") == "-4"
    assert calculator("2^-1") == "0.5" and calculator("2^3^2") == "512"  # right-associative
    assert calculator("1.5*4") == "6" and calculator(".25+.75") == "1"


@pytest.mark.parametrize(
    "bad",
    [
        "__import__('os').system('true')",  # nothing like eval: letters are not in the grammar
        "1+",
        "(1+2",
        "1 2",
        "",
        "2^0.5",
        "2^1000",
        "9" * 201,
        "(" * 40 + "1" + ")" * 40,
        "10^59*10^59",
    ],
)
def test_calculator_refuses_what_is_not_in_the_grammar(bad):
    with pytest.raises(ValueError, match="expression"):
        calculator(bad)


def test_calculator_division_by_zero_and_types():
    with pytest.raises(ZeroDivisionError):
        calculator("1/(2-2)")
    with pytest.raises(ZeroDivisionError):
        calculator("0^-1")
    with pytest.raises(TypeError, match="expression"):
        calculator(12)


USER_TOOLS = '''
import time

def calculator(expression: str) -> str:
    """A user calculator that replaces the built-in one.

    Args:
        expression: anything
    """
    return "user:" + expression

def boom(x: int) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("kaput")

def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"

def add(a: int, b: int) -> int:
    """Adds.

    Args:
        a: first
        b: second
    """
    return a + b

def no_hints(x):
    return x
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


def test_resolve_builtins_user_files_and_replacement(user_file):
    tools = resolve_tools(["calculator"])
    assert list(tools) == ["calculator"] and tools["calculator"].fn is calculator
    schema = tools["calculator"].schema
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    # a user tool named like a built-in replaces it, wherever either is listed
    for specs in ([f"{user_file}:calculator"], ["calculator", f"{user_file}:calculator"]):
        tools = resolve_tools(specs)
        assert list(tools) == ["calculator"]
        assert tools["calculator"].fn("1+1") == "user:1+1"
    tools = resolve_tools([f"{user_file}:add", "calculator"])
    assert list(tools) == ["add", "calculator"] and tools["add"].parameters == ("a", "b")
    assert tool_schemas(["add"], tools) == [tools["add"].schema]


def test_resolve_errors_name_the_spec(user_file):
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_tools(["calculater"])
    with pytest.raises(ValueError, match="does not exist"):
        resolve_tools(["missing.py:fn"])
    with pytest.raises(ValueError, match=r"has no 'nope'.*add"):
        resolve_tools([f"{user_file}:nope"])
    with pytest.raises(ValueError, match="type hints"):
        resolve_tools([f"{user_file}:no_hints"])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        resolve_tools([f"{user_file}:add", f"{user_file}:add"])
    with pytest.raises(TypeError, match="list of tool specs"):
        resolve_tools("calculator")
    with pytest.raises(TypeError, match="callable"):
        make_tool(3)


def test_a_user_file_is_executed_once(tmp_path):
    counter = tmp_path / "count.txt"
    path = tmp_path / "t.py"
    path.write_text(f"open({str(counter)!r}, 'a').write('x')\n" + USER_TOOLS.split("def boom")[0])
    resolve_tools([f"{path}:calculator"])
    resolve_tools([f"{path}:calculator"])
    assert counter.read_text() == "x"


def test_tools_for_row_reads_both_schemas():
    tools = resolve_tools(["calculator"])
    assert tools_for_row({"extra_info": {}}, tools) == ["calculator"]
    assert tools_for_row({"extra_info": {"tools": ["calculator"]}}, tools) == ["calculator"]
    verl_row = {"extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": {}}}}}
    assert tools_for_row(verl_row, tools) == ["calculator"]
    assert tools_for_row({"extra_info": {"tools": []}}, tools) == []
    with pytest.raises(ValueError, match=r"extra_info\.tools: tools \['search'\]"):
        tools_for_row({"extra_info": {"tools": ["search"]}}, tools)
    with pytest.raises(ValueError, match="list of tool names"):
        tools_for_row({"extra_info": {"tools": "calculator"}}, tools)


def test_executor_turns_every_failure_into_a_counted_observation(user_file):
    tools = resolve_tools(["calculator", f"{user_file}:boom", f"{user_file}:nap"])
    tools["add"] = resolve_tools([f"{user_file}:add"])["add"]
    executor = ToolExecutor(tools, timeout_s=0.5)
    calls = [
        ToolCall("calculator", {"expression": "6*7"}),
        ToolCall("calculator", "6*7"),  # the single parameter given as text
        ToolCall("boom", {"x": 1}),
        ToolCall("nap", {"seconds": 5.0}),
        ToolCall("nap", {"seconds": 0.0}),
        ToolCall("search", {"q": "x"}),
        ToolCall(None, error="the tool call is not valid JSON (Expecting value)"),
        ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("calculator", {"expr": "1"}),
        ToolCall("add", "1 2"),  # text for a two-parameter tool
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("calculator", {"expression": "1"}),  # not allowed for this row
    ]
    allowed = [None] * 11 + [["boom"]]
    start = time.monotonic()
    results = executor.run(calls, allowed)
    assert time.monotonic() - start < 2.0  # the sleeper did not hold the batch for 5 s
    texts = [r.text for r in results]
    errors = [r.error for r in results]
    assert texts[:2] == ["42", "42"] and errors[:2] == [False, False]
    assert errors[2] and "boom raised RuntimeError: kaput" in texts[2]
    assert errors[3] and "timed out after 0.5 s" in texts[3]
    assert texts[4] == "awake" and not errors[4]
    assert errors[5] and "unknown tool 'search'" in texts[5]
    assert errors[6] and "not valid JSON" in texts[6]
    assert errors[7] and "ZeroDivisionError" in texts[7]
    assert errors[8] and "TypeError" in texts[8]
    assert errors[9] and "pass them by name" in texts[9]
    assert texts[10] == "5" and not errors[10]  # a non-str result is JSON-encoded
    assert errors[11] and "unknown tool 'calculator'; available: boom" in texts[11]
    with pytest.raises(ValueError, match="timeout_s"):
        ToolExecutor(tools, timeout_s=0)


def test_hung_tool_threads_are_bounded(caplog):
    """A tool that never returns leaves at most ``max_hung`` threads alive: its later calls are
    answered with an error without a thread (once the hung ones end, it runs again), the other
    tools run as before, and the run is told once."""
    import threading

    from otbrl.tools import make_tool

    release = threading.Event()

    def hang(x: str) -> str:
        """Never answers in time.

        Args:
            x: ignored.
        """
        release.wait()
        return "late"

    def echo(x: str) -> str:
        """Answers at once.

        Args:
            x: what to answer.
        """
        return x

    tools = {"hang": make_tool(hang), "echo": make_tool(echo)}
    executor = ToolExecutor(tools, timeout_s=0.05, max_hung=3)
    before = threading.active_count()
    try:
        first = executor.run([ToolCall("hang", "a")] * 5)  # 5 at once: all start, all time out
        assert all(r.error and "timed out" in r.text for r in first)
        for _ in range(3):
            later = executor.run([ToolCall("hang", "b"), ToolCall("echo", "hi")])
            assert later[0].error and "5 earlier calls of it are still running" in later[0].text
            assert later[1].text == "hi" and not later[1].error
        assert threading.active_count() - before == 5  # no new hung thread
        assert sum("past their timeout" in r.message for r in caplog.records) == 1
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert executor.run([ToolCall("hang", "c")])[0].text == "late"
    with pytest.raises(ValueError, match="max_hung"):
        ToolExecutor(tools, max_hung=0)


def test_hermes_parse():
    fmt = HermesFormat(resolve_tools(["calculator"]))
    text = fmt.call_text("calculator", {"expression": "2+2"})
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert fmt.parse("no call here") == []
    assert fmt.parse("I will compute. " + text) == [ToolCall("calculator", {"expression": "2+2"})]
    two = fmt.parse(text + "\n" + text)
    assert len(two) == 2 and all(c.error is None for c in two)
    as_string = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "1"})})
    assert fmt.parse(f"<tool_call>{as_string}</tool_call>") == [
        ToolCall("calculator", {"expression": "1"})
    ]
    (bad,) = fmt.parse("<tool_call>{'name': 'calculator'}</tool_call>")
    assert bad.name is None and "not valid JSON" in bad.error
    (nameless,) = fmt.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert "must be a JSON object with a" in nameless.error
    (open_,) = fmt.parse('<tool_call>{"name": "calculator"')
    assert "unterminated" in open_.error
    (listy,) = fmt.parse('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert listy.name == "calculator" and "must be a JSON object" in listy.error


def test_what_the_policy_writes_in_a_call_is_a_sample_error_never_a_crash():
    """Nesting past Python's recursion limit and integers past its digit limit made
    ``json.loads`` raise RecursionError / ValueError out of the parser (and the agent loop)."""
    hermes = HermesFormat(resolve_tools(["calculator"]))
    compact = CompactFormat(resolve_tools(["calculator", "calculator"]))
    deep = '{"name": "calculator", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    huge = '{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}"
    inner = json.dumps({"name": "calculator", "arguments": "[" * 100_000})
    for text, why in ((deep, "nested too deeply"), (huge, "digits"), (inner, "nested too deeply")):
        (call,) = hermes.parse(f"<tool_call>{text}</tool_call>")
        assert call.error is not None and why in call.error, call.error
    (call,) = compact.parse("<tool_call>calculator:{" + '"x": ' + "9" * 5000 + "}</tool_call>")
    assert call.name == "calculator" and "digits" in call.error


def test_compact_parse(user_file):
    one = CompactFormat(resolve_tools(["calculator"]))
    assert one.call_text("calculator", {"expression": "12*3"}) == "<tool_call>12*3</tool_call>"
    assert one.parse("<tool_call>12*3</tool_call>") == [ToolCall("calculator", "12*3")]
    assert one.parse("<tool_call>calculator:12*3</tool_call>") == [ToolCall("calculator", "12*3")]
    assert one.parse("69104") == []
    many = CompactFormat(resolve_tools(["calculator", f"{user_file}:add"]))
    text = many.call_text("add", {"a": 1, "b": 2})
    assert text == '<tool_call>add:{"a": 1, "b": 2}</tool_call>'
    assert many.parse(text) == [ToolCall("add", {"a": 1, "b": 2})]
    (nameless,) = many.parse("<tool_call>12*3</tool_call>")
    assert nameless.name is None and "name the tool" in nameless.error
    (bad,) = many.parse("<tool_call>add:{a: 1}</tool_call>")
    assert bad.name == "add" and "not valid JSON" in bad.error


def test_the_examples_tool_file():
    """The worked example of docs/tools.md: examples/my_tools.py resolves, its calculator
    replaces the built-in, and its failure becomes an error observation."""
    root = Path(__file__).resolve().parents[1]
    spec = str(root / "examples" / "my_tools.py")
    tools = resolve_tools(["calculator", f"{spec}:unit_price", f"{spec}:calculator"])
    assert list(tools) == ["calculator", "unit_price"]
    props = tools["unit_price"].schema["function"]["parameters"]["properties"]
    assert props == {"item": {"type": "string", "description": 'the item\'s name, e.g. "apple"'}}
    results = ToolExecutor(tools, timeout_s=5.0).run(
        [
            ToolCall("unit_price", {"item": "Bread"}),
            ToolCall("calculator", {"expression": "3*0.5+2.25"}),
            ToolCall("calculator", {"expression": "1/3"}),
            ToolCall("unit_price", {"item": "caviar"}),
        ],
        [None] * 4,
    )
    assert [r.text for r in results[:3]] == ["2.25", "3.75", "0.33"]
    assert results[3].error and "no item 'caviar'" in results[3].text


def test_one_file_with_reward_and_tools_runs_once(tmp_path):
    """A file named by reward.function and by rollout.multi_turn.tools is executed once: both
    keys load it through the same user-code cache (it may count calls or hold state)."""
    from otbrl.rewards import resolve_reward_function

    path = tmp_path / "task_code.py"
    path.write_text(
        "import builtins\n"
        "builtins.otbrl_test_runs = getattr(builtins, 'otbrl_test_runs', 0) + 1\n"
        "def reward(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(solution_str == ground_truth)\n"
        "def lookup(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: the key\n    """\n'
        "    return key.upper()\n"
    )
    import builtins

    before = getattr(builtins, "otbrl_test_runs", 0)
    fn = resolve_reward_function(f"{path}:reward")
    tools = resolve_tools([f"{path}:lookup"])
    resolve_reward_function(f"{path}:reward")
    assert builtins.otbrl_test_runs - before == 1
    assert fn("s", "7", "7", {}) == 1.0 and tools["lookup"].fn("ab") == "AB"
