"""The Jinja environment: StrictUndefined, no autoescape (shell, not HTML), and two filters that make any
value inert where it lands -- `shq` (one shell word, shlex.quote) and `comment` (one comment line)."""

from __future__ import annotations

import hashlib
import shlex
from functools import cache
from pathlib import Path

import jinja2

from stepdeploy.resources import templates_dir

# The checkout's top-level templates/, shipped in the wheel as stepdeploy/templates/ (stepdeploy/resources.py), so an
# installed wheel renders as a source checkout does.
TEMPLATES_DIR = templates_dir()


def shell_quote(value: object) -> str:
    if value is None or isinstance(value, jinja2.Undefined):
        raise jinja2.UndefinedError("shq got no value")
    quoted = shlex.quote(str(value))
    # shlex leaves '=x' bare, which is valid but reads as a typo of '==' after `export KEY=` (SC1097).
    return f"'{quoted}'" if quoted.startswith("=") else quoted


def comment_line(value: object) -> str:
    """Text safe inside a `# ...` line: control characters (newlines) shown escaped, never executed."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(value))


@cache
def environment(directory: Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["shq"] = shell_quote
    env.filters["comment"] = comment_line
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    return env


def render(name: str, **values: object) -> str:
    return environment().get_template(name).render(**values)


def template_sha256(name: str) -> str:
    return hashlib.sha256((TEMPLATES_DIR / name).read_bytes()).hexdigest()
