"""The renderer protocol (``oomdoctor.render.protocol``): every command's ``--format`` choices are its renderers in the
registry, each renderer is a ``Renderer`` (a rich one also draws on a terminal), and the output helper
(``oomdoctor.cli.output.emit``) writes what the renderer returns, the same bytes to a file and to ``-``."""

from __future__ import annotations

import click
import pytest
from builder import llama3_8b_plan_specs

from oomdoctor.cli.main import cli
from oomdoctor.cli.output import emit
from oomdoctor.render.protocol import (
    RENDERERS,
    ConsoleDrawer,
    FunctionRenderer,
    Renderer,
    RichRenderer,
    formats,
)


def _commands() -> dict[str, click.Command]:
    out: dict[str, click.Command] = {}
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        c = cli.get_command(ctx, name)
        assert c is not None
        if isinstance(c, click.Group):
            out.update({f"{name} {n}": sub for n, sub in c.commands.items()})
        else:
            out[name] = c
    return out


def _format_choices(c: click.Command) -> list[str] | None:
    for p in c.params:
        if p.name == "fmt" and isinstance(p.type, click.Choice):
            return list(p.type.choices)
    return None


@pytest.mark.parametrize("name", sorted(_commands()))
def test_a_commands_formats_are_its_renderers(name):
    choices = _format_choices(_commands()[name])
    if choices is None:
        return
    if name == "run":  # its report is diagnose's, on standard output: text or JSON
        assert choices == [f for f in formats("diagnose") if f != "html"]
        return
    assert choices == formats(name)
    assert _commands()[name].params[[p.name for p in _commands()[name].params].index("fmt")].default == choices[0]


@pytest.mark.parametrize("key", list(RENDERERS), ids=" ".join)
def test_every_renderer_keeps_the_protocol(key):
    r = RENDERERS[key]
    assert isinstance(r, Renderer)
    assert isinstance(r, ConsoleDrawer) == isinstance(r, RichRenderer)
    assert r.output_file_extension and r.output_is_binary == (r.output_file_extension == "pickle")
    assert isinstance(r, (FunctionRenderer, RichRenderer))


def test_every_command_with_a_report_is_in_the_registry():
    registered = {c for c, _ in RENDERERS}
    with_output = {n for n, c in _commands().items() if any(p.name in ("output", "snapshot") for p in c.params)}
    assert with_output - {"run"} <= registered, sorted(with_output - registered)


def test_emit_writes_the_renderers_bytes_to_a_file_and_to_standard_output(tmp_path, capsysbinary):
    f = tmp_path / "schema.json"
    assert emit(str(f), "schema", "json", "fit").kind == "file"
    capsysbinary.readouterr()
    emit("-", "schema", "json", "fit")
    dash = capsysbinary.readouterr().out
    emit(None, "schema", "json", "fit")
    plain = capsysbinary.readouterr().out
    assert f.read_bytes() == dash == plain == RENDERERS[("schema", "json")].render("fit").encode()


def test_a_rich_renderer_draws_on_the_terminal_and_writes_plain_text(tmp_path, capsys):
    from oomdoctor.plan.estimate import estimate

    model, train, hw, base = llama3_8b_plan_specs()
    from dataclasses import replace

    e = estimate(model, train, replace(base, dp=8), hw)
    out = tmp_path / "e.txt"
    w = emit(str(out), "plan estimate", "text", e)
    text = out.read_text()
    assert w.size == len(text.encode()) and "\x1b[" not in text
    assert max(len(line) for line in text.splitlines()) <= 130
    assert emit(None, "plan estimate", "text", e).kind is None  # drawn
    assert capsys.readouterr().out.strip()
