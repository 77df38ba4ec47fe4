"""The terminal report (rich): a summary per rank, a compact timeline, findings by bytes at stake."""

from __future__ import annotations

import io
import textwrap
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .console import hang, plain_console
from .format import (
    count,
    fit_site,
    format_bytes,
    format_signed_bytes,
    format_us,
    span,
    sparkline,
    torch_version_words,
)
from .words import breakdown as breakdown_words
from .words import capacity as capacity_words
from .words import diff as diff_words
from .words import gate as gate_words
from .words import peaks as peak_words
from .words import simulate as sim_words

if TYPE_CHECKING:  # annotations only: rendering imports no analysis code
    from ..report.diff import Diff
    from ..report.model import RankSummary, Report
    from ..simulate.whatif import Simulation

_SEVERITY_STYLE = {"critical": "bold white on red", "high": "bold red", "medium": "yellow", "low": "cyan",
                   "info": "dim"}
_APPLIES_STYLE = {True: "green", False: "dim", None: "yellow"}


_count = count  # ``1 rank``, ``2 ranks``: a count with its noun, never ``rank(s)`` (render/format.py)


_VERDICT_STYLE = {"capacity": "bold white on red", "fragmentation": "bold black on yellow",
                  "deferred-free": "bold black on yellow", "growth": "bold white on red", "imbalance": "bold black on yellow",
                  "kept-exception": "bold white on red",
                  "healthy": "bold black on green", "empty": "bold black on white"}


def _verdict_panel(report: Report) -> Panel | None:
    from .words import verdict as verdict_words
    v = report.verdict
    if v is None:
        return None
    parts: list = [Text(verdict_words.summary(v))]
    said = verdict_words.assumptions(v)
    if said:  # listed once, here: the summary says the answer and its kind, each rank's line refers to these
        parts.append(Text("\nWhat fits assumes:", style="bold"))
        parts += [hang(a, 2, "- ") for a in said]
    if v.to_do:
        parts.append(Text("\nWhat to do:", style="bold"))
        for i, act in enumerate(verdict_words.actions(v), 1):
            parts.append(hang(act, 2, f"{i}. "))
    body = Group(*parts)
    ranks = span(v.ranks)
    title = Text.assemble(Text(f" {v.kind.upper()} ", style=_VERDICT_STYLE.get(v.kind, "bold")),
                          f" rank{'s' if len(v.ranks) > 1 else ''} {ranks} ")
    return Panel(body, title=title, title_align="left", box=box.HEAVY)


def _fitted_table(rows: list[tuple[str, ...]], width: int, *, justify: tuple[JustifyMethod, ...],
                  headers: tuple[str, ...] | None = None) -> Table:
    """A borderless table whose last column is an allocation site, fitted (:func:`fit_site`) into what the
    other columns leave of ``width``, so that no cell is cut and no file:line is broken."""
    t = Table(box=None if headers is None else box.SIMPLE_HEAD, show_header=headers is not None, show_edge=False,
              pad_edge=False,
              padding=(0, 1))
    n = len(justify)
    for j, just in enumerate(justify):
        t.add_column(headers[j] if headers else "", justify=just, no_wrap=True)
    cells = [max([len(r[j]) for r in rows] + [len(headers[j]) if headers else 0]) for j in range(n - 1)]
    gap = 2 if headers is None else 3  # the padding on both sides, and a box's column separator
    room = max(width - sum(cells) - gap * (n - 1), 24)
    for r in rows:
        t.add_row(*r[:-1], fit_site(r[-1], room))
    return t


def _rank_table(report: Report) -> Table:
    """One row per rank; short cells so that 80 columns hold it (details follow per rank)."""
    t = Table(title="Ranks", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, padding=(0, 1))
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("rank", "right"), ("events", "right"), ("peak allocated", "right"), ("peak reserved", "right"),
        ("verdict", "left"), ("OOM request", "right"))
    for col, just in columns:
        t.add_column(col, justify=just, no_wrap=True)
    for r in report.ranks:
        oom = f"[bold red]{format_bytes(r.oom.requested_bytes)}[/]" if r.oom is not None else "-"
        t.add_row(str(r.rank), f"{r.events:,}" if r.has_history else "[dim]none[/]",
                  format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
                  r.verdict.kind if r.verdict else "-", oom)
    return t


def _breakdown_text(r: RankSummary, width: int, listed: list[str] | None = None) -> Group:
    """What holds the memory of rank ``r`` at its breakdown's event, its largest holders, and what fits;
    ``listed``: the assumptions already listed under the verdict (an estimate resting on the same is not
    listed again)."""
    from .words import fits as fits_words
    bd = r.breakdown
    if bd is None:
        return Group()
    said = breakdown_words.said(bd)
    out: list = [Text(), hang(Text(said.total, style="bold")), hang(Text(said.source, style="dim"))]
    if said.unknown:
        out.append(hang(said.unknown, style="dim"))
    out += [hang(line, style="dim") for line in said.named]
    if r.holders:
        out.append(Text("  largest holders (their blocks' sizes, the allocator's rounding included):", style="bold"))
        rows = [(f"  {format_bytes(h.bytes)}", f"{h.count}", f"{breakdown_words.line(h.category)}, {h.phase}", h.label)
                for h in r.holders[:6]]
        out.append(_fitted_table(rows, width, justify=("right", "right", "left", "left"),
                                 headers=("  bytes", "blocks", "what, phase", "allocated at")))
    fits = fits_words.tail(r.fits, listed)
    if fits is not None:
        out.append(hang(Text.assemble((fits.lead, "bold"), fits.answer)))
        out += [hang(n, 2, "note: ", style="dim") for n in fits.notes]
        out += [hang(a, 4, "- ") for a in fits.assumptions]
    return Group(*out)


def _timeline(r: RankSummary) -> Group:
    top = max(r.series.get("reserved") or [0])
    text = Text()
    text.append(f"rank {r.rank}", style="bold")
    if r.trace_kind:
        text.append(f": {r.trace_kind}")
        if r.frameworks:
            text.append(f" · {', '.join(r.frameworks)}", style="dim")
        text.append("\n  ")
    if not r.has_history:
        text.append(f"final state only: {format_bytes(r.peak_reserved_bytes)} reserved, "
                    f"{format_bytes(r.peak_allocated_bytes)} allocated")
        return Group(text)
    text.append(f"over {r.events:,} events, {format_us(r.duration_us)}")
    if r.steps:
        text.append(f", {r.steps} step{'s' if r.steps > 1 else ''} ({r.step_source})")
    text.append("\n  reserved  ")
    text.append(sparkline(r.series.get("reserved", []), top), style="magenta")
    text.append(f"  peak {format_bytes(r.peak_reserved_bytes)}")
    text.append(peak_words.job_peak(r.peak_source, r.job_peak_reserved_bytes, r.reserved_peak_missed,
                                    r.reserved_peak_missed_material), style="bold")
    text.append("\n  allocated ")
    text.append(sparkline(r.series.get("allocated", []), top), style="green")
    text.append(f"  peak {format_bytes(r.peak_allocated_bytes)}")
    text.append(peak_words.job_peak(r.peak_source, r.job_peak_allocated_bytes, r.allocated_peak_missed,
                                    r.allocated_peak_missed_material), style="bold")
    out: list = [text]
    if r.peak_source == "unknown-before-window":
        out.append(hang(peak_words.BEFORE_WINDOW_UNKNOWN, style="yellow"))
    an = r.anatomy_at_peak
    if an is not None:
        out.append(hang(peak_words.anatomy(an), 2, "at the peak of reserved: "))
    return Group(*out)


def _finding_panel(i: int, f) -> Panel:
    from .words import findings as finding_words
    from .words import predict as predict_words
    ranks = ",".join(str(r) for r in f.ranks)
    head = f"rank{'s' if len(f.ranks) > 1 else ''} {ranks} · {format_bytes(f.bytes)} at stake"
    version = f.evidence.as_dict().get("torch_version")
    if version:
        head += f" · PyTorch {torch_version_words(version)}"
    parts: list = [Text(head, style="dim")]
    related = finding_words.related_line(f)
    if related:
        parts.append(Text(related, style="dim"))
    parts.append(Text(finding_words.summary(f)))
    if f.sites:
        parts.append(Text("\nWhere:", style="bold"))
        for s in f.sites[:3]:
            parts.append(hang(s.label, 2, f"{format_bytes(s.bytes):>10}  {s.count:>5} blocks  "))
            if s.user_frame and s.user_frame not in s.label:
                parts.append(hang(s.user_frame, 30, "called from ", style="dim"))
    if f.fixes:
        parts.append(Text("\nFix:", style="bold"))
        for n, fx in enumerate(f.fixes, 1):
            mark, style = finding_words.applies_mark(fx), _APPLIES_STYLE[fx.applies]
            line = Text.assemble((f"[{fx.versions}] ", "dim"), finding_words.fix_text(fx), (f"  {mark}", style))
            parts.append(hang(line, 2, f"{n}. "))
            if fx.prediction:
                parts.append(hang(predict_words.prediction(fx.prediction), 5, "simulated: ", style="cyan"))
            parts.append(hang(fx.source, 5, "source: ", style="dim"))
    # the heading is the finding's id, always; its title opens the box, whole (rich cuts a long box title with an
    # ellipsis, so a title in the heading was there only when it was short: issue 52)
    body = Group(Text(finding_words.title(f), style="bold"), *parts)
    sev = Text(f" {f.severity.upper()} ", style=_SEVERITY_STYLE.get(f.severity, ""))
    return Panel(body, title=Text.assemble(sev, f" {i}. {f.id} "), title_align="left", box=box.ROUNDED)


GROUPED_RANKS = 4
"""Above this many ranks the text groups alike ranks (a job of 8 ranks reads in under 80 lines) (``--all-ranks`` prints every rank's section)."""
MAX_GROUP_LINES = 8
MAX_FINDING_LINES = 8


def _group_lines(report: Report, width: int) -> list[Text]:
    """The ranks grouped like a job: the odd groups first (with what makes them odd), then the typical one, and
    the distribution of the peaks."""
    g = report.groups
    out = []
    odd = [x for x in g.groups if x.odd]
    for x in odd[:MAX_GROUP_LINES]:
        peak = format_bytes(x.max_peak_reserved_bytes)
        out.append(Text(f"  odd: rank{'s' if len(x.ranks) > 1 else ''} {span(x.ranks)}: {x.verdict}, peak {peak}; "
                        + "; ".join(x.why), style="bold yellow"))
    if len(odd) > MAX_GROUP_LINES:
        out.append(Text(f"  and {len(odd) - MAX_GROUP_LINES} more odd groups (--all-ranks, or --format json)"))
    for x in g.groups:
        if not x.odd:
            lo, hi = format_bytes(x.min_peak_reserved_bytes), format_bytes(x.max_peak_reserved_bytes)
            out.append(Text(f"  ranks {span(x.ranks)} alike: {x.verdict}, peak reserved {lo}"
                            + (f" to {hi}" if hi != lo else "") + "; top holders "
                            + (", ".join(fit_site(h, max(width - 40, 20)) for h in x.holders) or "none")))
    out.append(Text(f"  peak reserved: min {format_bytes(g.min.bytes)} (rank {g.min.rank}), median "
                    f"{format_bytes(g.median.bytes)} (rank {g.median.rank}), max {format_bytes(g.max.bytes)} "
                    f"(rank {g.max.rank})"))
    return out


def _rank_section(r: RankSummary, width: int, listed: list[str] | None = None) -> list[RenderableType]:
    """Rank ``r``'s section: its timeline, what holds its memory, its notes."""
    out: list[RenderableType] = [_timeline(r), _breakdown_text(r, width, listed)]
    for w in r.warnings:
        out.append(hang(w, 2, "note: ", style="yellow"))
    if r.truncated and r.has_history:
        out.append(hang(f"the trace starts after some blocks were allocated: {r.unmatched_frees} frees without "
                        f"their alloc, {r.ghost_blocks} blocks never seen; their state at the start was "
                        "reconstructed from the final segments", 2, "note: ", style="dim"))
    return out


def _listed(report: Report) -> list[str]:
    """The assumptions the verdict box lists (:func:`oomdoctor.render.words.verdict.assumptions`)."""
    from .words import verdict as verdict_words

    return verdict_words.assumptions(report.verdict) if report.verdict is not None else []


def _grouped(report: Report, width: int) -> list[RenderableType]:
    """A job of many ranks in under 80 lines at 80 columns: the groups, one section (the first odd rank's, else
    the first rank's), the findings one line each."""
    from .words import findings as finding_words
    out: list[RenderableType] = [Text(f"Ranks: {len(report.ranks)}, grouped (alike: same verdict, same top holders, "
                                      "peaks within 1%):", style="bold")]
    for line in _group_lines(report, width):
        out.append(hang(Text(line.plain.lstrip(), style=line.style), 2))
    odd = next((x for x in report.groups.groups if x.odd), None)
    first = odd.ranks[0] if odd else report.ranks[0].rank
    out += _rank_section(next(x for x in report.ranks if x.rank == first), width, _listed(report))
    for n in report.notes[:3]:
        out.append(Text(f"note: {n}", style="yellow"))
    shown = report.findings[:MAX_FINDING_LINES]
    out.append(Text(f"{_count(len(report.findings), 'finding')}, most severe first:" if shown else "No finding.",
                    style="bold"))
    for f in shown:
        out.append(hang(f"rank{'s' if len(f.ranks) > 1 else ''} {span(sorted(f.ranks))} · "
                        f"{format_bytes(f.bytes)} · {finding_words.title(f)}", 2, f"{f.severity.upper()} [{f.id}] "))
    if len(report.findings) > MAX_FINDING_LINES:
        out.append(Text(f"  and {len(report.findings) - MAX_FINDING_LINES} more"))
    out.append(Text("--all-ranks prints every rank and each finding in full; --format json keeps every rank.",
                    style="dim"))
    return out


def text_parts(report: Report, width: int, *, all_ranks: bool = False) -> list[RenderableType]:
    """What the terminal prints of ``report`` at ``width`` columns, in order, one renderable a
    ``console.print``: the verdict first, then the ranks with what holds their memory, then the findings (those
    under the materiality threshold on one line each). Above :data:`GROUPED_RANKS` ranks, unless ``all_ranks``,
    alike ranks are grouped (:mod:`oomdoctor.report.groups`) and the odd ones named on the second line."""
    from .words import findings as finding_words
    grouped = len(report.ranks) > GROUPED_RANKS and not all_ranks and report.groups is not None
    v = report.verdict
    head = Text(f"oomdoctor {report.oomdoctor_version}: ", style="bold")
    if v is not None:
        edge = (f", at the edge with {v.evidence['headroom_percent']}% headroom," if "headroom_percent" in v.evidence
                else "")
        head.append(f"{v.kind}{edge} on rank{'s' if len(v.ranks) > 1 else ''} {span(v.ranks)}",
                    style="bold")
        found = gate_words.headline_findings(report)
        if found:
            head.append(f"; {found}", style="bold yellow")
        head.append(f"; {gate_words.headline_ranks(report)}")
    else:
        head.append(gate_words.headline_ranks(report))
    out: list[RenderableType] = [head]
    if report.unread:
        out.append(hang(gate_words.unread_line(report.unread), 0, style="bold yellow"))
    if grouped:
        assert report.groups is not None  # grouped
        odd = [x for x in report.groups.groups if x.odd]
        out.append(Text("odd ranks: " + ("; ".join(f"{span(x.ranks)} ({', '.join(x.why)})" for x in odd[:3])
                                         + (f"; and {len(odd) - 3} more groups" if len(odd) > 3 else "")
                                         if odd else "none, all ranks alike"), style="bold yellow"))
    panel = _verdict_panel(report)
    if panel is not None:
        out.append(panel)
    if grouped:
        return out + _grouped(report, width)
    out.append(_rank_table(report))
    listed = _listed(report)
    for r in report.ranks:
        out += _rank_section(r, width, listed)
    for n in report.notes:
        out.append(Text(f"note: {n}", style="yellow"))
    out.append(Text())
    material = [f for f in report.findings if f.severity not in ("low", "info")]
    minor = [f for f in report.findings if f.severity in ("low", "info")]
    if not material:
        out.append(Text("No finding worth fixing.", style="bold green"))
    else:
        out.append(Text(f"{_count(len(material), 'finding')}, most severe first:", style="bold"))
        for i, f in enumerate(material, 1):
            out.append(_finding_panel(i, f))
    if minor:
        m = report.materiality or {}
        rule = (f" (under max({m['fraction']:.0%} of peak reserved, {format_bytes(m['min_bytes'])}) at stake, or a cost "
                "in time only)" if m else "")
        out.append(Text(f"Also noted, too small to be worth fixing first{rule}:", style="dim"))
        for f in minor:
            out.append(hang(f"{format_bytes(f.bytes)} · {finding_words.title(f)}", 2, f"[{f.id}] ", style="dim"))
    return out


def render_text(report: Report, console: Console, *, all_ranks: bool = False) -> None:
    """Print ``report`` on ``console`` (:func:`text_parts` at the console's width)."""
    for part in text_parts(report, console.width, all_ranks=all_ranks):
        console.print(part)


def _oom_text(oom, reach: str = "complete") -> Text:
    if oom is None:
        return Text(sim_words.NO_OOM[reach], style="green")
    return Text(sim_words.OOM_AT.format(event=oom.event_index), style="bold red")


_MATCHES_STYLE = {True: "green", False: "bold red", None: ""}


def _matches_text(m: bool | None) -> Text:
    return Text(sim_words.MATCHES[m], style=_MATCHES_STYLE[m])


def _one_a_line(config: str) -> str:
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string with one option a line (the commas between options; those inside a
    ``[...]`` list stay), so that a table cell of settings never cuts one."""
    out, depth = [], 0
    for ch in config:
        depth += (ch == "[") - (ch == "]")
        out.append(",\n  " if ch == "," and depth == 0 else ch)
    return "".join(out)


def render_simulation_text(sim: Simulation, console: Console) -> None:
    """Print an ``oomdoctor simulate`` result: the replays side by side, the self-replay check, and the
    recommendation."""
    console.print(Text(sim_words.headline(sim), style="bold"))
    console.print(hang(sim_words.file_line(sim), 0, "file: "))
    console.print(sim_words.recorded(sim))
    console.print(hang(capacity_words.limit(sim.capacity, sim.recorded_oom_event), 0, "capacity: ", style="dim"))
    rec_id = id(sim.recommendation.result) if sim.recommendation else None
    for mode, title in sim_words.FREES.items():
        rows = [r for r in sim.results if r.deferred_frees == mode]
        if not rows:
            continue
        checked = any(r.matches_recorded is not None for r in rows)
        console.print(Text(title + ":", style="italic"))
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        table.add_column("PYTORCH_CUDA_ALLOC_CONF", overflow="fold")  # words: one setting a line, folded if need be
        for col in ("peak\nreserved", "peak\nallocated", "OOM") + (("check",) if checked else ()):
            table.add_column(col, justify="right" if col.startswith("peak") else "left", no_wrap=True)
        for r in rows:
            cells = [Text.assemble(("★ ", "bold green") if id(r) == rec_id else "  ", _one_a_line(str(r.config))),
                     format_bytes(r.peak_reserved_bytes), format_bytes(r.peak_allocated_bytes),
                     _oom_text(r.oom, sim.reach)]
            table.add_row(*cells, *((_matches_text(r.matches_recorded),) if checked else ()))
        console.print(table)
    if sim.recommendation:
        console.print(Text("★ recommended", style="dim"))
    console.print(hang(sim_words.REACH[sim.reach].format(event=sim.recorded_oom_event), 0, "replayed: ", style="dim"))
    v = sim.self_replay.validation
    if v is not None:
        style = "green" if v.exact else "bold red"
        console.print(Text(sim_words.self_replay(v), style=style))
    for r in sim.results:
        for w in r.warnings:
            console.print(hang(w, 2, sim_words.warning_lead(r), style="yellow"))
    for n in sim_words.notes(sim):
        console.print(Text(f"note: {n}", style="dim"))
    rec = sim_words.recommended(sim)
    if rec is not None:
        body = Text()
        body.append(rec.setting, style="bold")
        if rec.frees:
            body.append(rec.frees, style="bold")
        body.append(rec.outcome)
        parts: list = [body]
        if rec.replays is not None:
            parts.append(Text(rec.replays, style="dim"))
        if rec.before:
            parts.append(Text("Before you set it:", style="bold"))
            parts += [hang(x, 2, "- ") for x in rec.before]
        console.print(Panel(Group(*parts), title="recommendation", title_align="left", box=box.ROUNDED))
    elif sim.search_wall_s is not None:
        console.print(Text(sim_words.NONE_AVOIDS, style="bold red"))


def render_text_plain(report: Report, width: int = 120, *, all_ranks: bool = False) -> str:
    """The text report as a string without colour (for files and logs)."""
    buf = io.StringIO()
    render_text(report, plain_console(buf, width), all_ranks=all_ranks)
    return buf.getvalue()


def render_simulation_text_plain(sim: Simulation, width: int = 120) -> str:
    """The simulation's text as a string without colour."""
    buf = io.StringIO()
    render_simulation_text(sim, plain_console(buf, width))
    return buf.getvalue()


_STATUS_STYLE = {"resolved": "bold green", "new": "bold red", "changed": "yellow", "unchanged": "dim"}


def render_diff_text(diff: Diff, console: Console) -> None:
    """Print a before/after comparison: peaks per rank pair, findings by status, sites that moved."""
    console.print(Text(diff_words.headline(diff), style="bold"))
    console.print(Text(diff_words.PEAKS_LEGEND, style="dim"))
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "peak", "before", "after", "saved", "OOM"):
        t.add_column(col, justify="left" if col in ("peak", "OOM") else "right", no_wrap=True)
    for r in diff.ranks:
        t.add_row(str(r.rank), "reserved", format_bytes(r.before_peak_reserved_bytes),
                  format_bytes(r.after_peak_reserved_bytes), format_signed_bytes(r.peak_reserved_saved_bytes),
                  diff_words.oom(r))
        t.add_row("", "allocated", format_bytes(r.before_peak_allocated_bytes), format_bytes(r.after_peak_allocated_bytes),
                  format_signed_bytes(r.peak_allocated_saved_bytes), "")
    console.print(t)
    for r in diff.ranks:
        for side, an in (("before", r.before_anatomy), ("after", r.after_anatomy)):
            if an is None:
                continue
            console.print(hang(diff_words.anatomy(an), 2, diff_words.anatomy_lead(r, side)))
    for n in diff.notes:
        console.print(Text(f"note: {n}", style="yellow"))
    console.print()
    if not diff.findings:
        console.print(Text(diff_words.NO_FINDING, style="green"))
    for f in diff.findings:
        lead = Text.assemble((f"{f.status:>9} ", _STATUS_STYLE[f.status]), f"[{f.id}] ")
        console.print(hang(diff_words.finding(f), 0, lead))
    for r in diff.ranks:
        if not r.sites:
            continue
        console.print(Text(diff_words.sites_title(r), style="italic"))
        rows = [(format_bytes(x.before_bytes), format_bytes(x.after_bytes), format_signed_bytes(x.saved_bytes), x.label)
                for x in r.sites]
        st = _fitted_table(rows, console.width, justify=("right", "right", "right", "left"),
                           headers=("before", "after", "saved", "site"))
        console.print(st)


def render_diff_text_plain(diff: Diff, width: int = 120) -> str:
    buf = io.StringIO()
    render_diff_text(diff, plain_console(buf, width))
    return buf.getvalue()


def render_paragraph(report: Report, *, snapshot: str | None = None, width: int = 100,
                     holders: int = 3) -> str:
    """The diagnosis in one paragraph (what the framework callbacks print at the end of training or
    after an out-of-memory error): the verdict, what holds the memory on the verdict's first rank
    (its breakdown and ``holders`` largest holders), what fits, the actions in the framework's words,
    and where the snapshot is. Plain text wrapped at ``width`` columns."""
    from .words import paragraph as paragraph_words
    lines = paragraph_words.lines(report, snapshot=snapshot, holders=holders)
    if lines is None:
        return paragraph_words.nothing(report)  # one line, as it is
    return "\n".join(textwrap.fill(x, width, subsequent_indent="  ", break_on_hyphens=False,
                                   break_long_words=False) for x in lines)


def render_peak_holders(report: Report, *, holders: int = 5) -> str:
    """What the first rank of ``report`` held at its breakdown's event, as lines for a test failure
    (the pytest plugin's ``limit_cuda_memory``): the categories, then the largest holders."""
    if not report.ranks or report.ranks[0].breakdown is None:
        return "no allocation history was recorded: holders unknown"
    r = report.ranks[0]
    bd = r.breakdown
    assert bd is not None  # checked above
    lines = [f"{breakdown_words.at(bd)}: {format_bytes(bd.allocated_bytes)} allocated = "
             + " + ".join(breakdown_words.terms(bd))]
    if r.holders:
        lines.append("largest holders:")
        lines += [f"  {format_bytes(h.bytes):>10}  {_count(h.count, 'block'):>10}  {breakdown_words.line(h.category)}  {h.label}"
                  for h in r.holders[:holders]]
    return "\n".join(lines)
