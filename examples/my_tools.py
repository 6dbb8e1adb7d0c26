"""User tools, loaded with ``rollout.multi_turn.tools=[examples/my_tools.py:unit_price,...]``.

A tool is a plain function with type hints and a docstring whose ``Args:`` section describes
every argument: its JSON schema (what chat templates that take ``tools=`` show the model) comes
from ``transformers.utils.get_json_schema``. It returns text (anything else is ``str()``-ed);
an exception, a bad argument or a call longer than ``rollout.multi_turn.tool_timeout_s``
becomes an error observation the model reads, counted in ``tool/errors`` — never a crash.
The file is imported once per process.
"""

PRICES = {"apple": 0.5, "bread": 2.25, "milk": 1.1}


def unit_price(item: str) -> str:
    """The price of one unit of an item in the shop, in euros.

    Args:
        item: the item's name, e.g. "apple"
    """
    if item.lower() not in PRICES:
        raise KeyError(f"no item {item!r}; the shop sells {sorted(PRICES)}")
    return f"{PRICES[item.lower()]:.2f}"


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and rounds the result to 2 decimals.

    Listed under the built-in's name, this one replaces the built-in ``calculator``.

    Args:
        expression: digits, + - * / and parentheses, e.g. "3*0.5+2.25"
    """
    from otbrl.tools import calculator as exact

    return f"{float(exact(expression)):.2f}"
