"""Sphinx extension for otbrl's site: the references generated from the code, and math as
MathML rendered at build time (browsers draw it natively; nothing is fetched to read a page).

A page asks for a generated part with a marker line of its own:
``<!-- otbrl: config-reference -->`` (every configuration key, ``otbrl.config.describe``) or
``<!-- otbrl: cli-reference -->`` (every command's ``--help``, from the CLI's parsers).
"""

from __future__ import annotations

import argparse
import os
import re

from docutils import nodes
from latex2mathml.converter import convert

MARKER = re.compile(r"^<!--\s*otbrl:\s*([\w-]+)\s*-->\s*$", re.M)


def cli_markdown() -> str:
    """Every command's help as printed by ``otbrl COMMAND --help`` (80 columns); the
    configuration keys a config command's help lists are the configuration reference's."""
    from otbrl import cli
    from otbrl.research.compare import build_parser as compare_parser

    os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal: the same width everywhere
    parser = cli._build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in commands._choices_actions}
    out = ["## `otbrl`", "", "```text", parser.format_help().rstrip(), "```"]
    for name, sub in commands.choices.items():
        if name == "compare":  # a parser of its own, which reads the arguments itself
            sub = compare_parser()
        keys = sub.epilog is not None and "configuration keys" in sub.epilog
        sub.epilog = None
        text = sub.format_help().rstrip()
        out += ["", f"## `otbrl {name}`", "", helps.get(name) or "", "", "```text", text, "```"]
        if keys:
            out += ["", "Its configuration keys: [Configuration keys](reference-config.md)."]
    return "\n".join(out) + "\n"


def config_markdown() -> str:
    from otbrl.config.describe import reference_markdown

    return reference_markdown()


GENERATORS = {"config-reference": config_markdown, "cli-reference": cli_markdown}


def _fill(app, docname: str, source: list[str]) -> None:
    def generated(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{docname}: no generated part {name!r} (known: {list(GENERATORS)})")
        return GENERATORS[name]()

    source[0] = MARKER.sub(generated, source[0])


def _inline(self, node: nodes.Element) -> None:
    self.body.append(convert(node.astext(), display="inline"))
    raise nodes.SkipNode


def _block(self, node: nodes.Element) -> None:
    self.body.append(f'<div class="math-block">{convert(node.astext(), display="block")}</div>\n')
    raise nodes.SkipNode


def setup(app):
    app.connect("source-read", _fill)
    app.add_html_math_renderer("mathml", (_inline, None), (_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
