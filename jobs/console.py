"""The `shardline` command's console: rich on stderr, and the reporter (foundation.report)
that shows the library's stages, notes and warnings on it."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from shardline.foundation.report import Reporter

# soft_wrap: the lines go unbroken to a log (spark-submit's, a scheduler's) as to a terminal.
# Rich otherwise breaks them at 80 columns when stderr is no terminal, paths mid-word.
console = Console(stderr=True, highlight=False, soft_wrap=True)


class ConsoleReporter(Reporter):
    """The library's lines on the command's console: stage marks in bold and green, the
    wall time dimmed, warnings in yellow. The library's text is plain, so it is escaped
    (messages quote settings like [pipelines] that rich would eat as markup)."""

    def stage_started(self, title: str) -> None:
        console.print(f"[bold]→[/] {escape(title)} …")

    def stage_done(self, title: str, seconds: float) -> None:
        console.print(f"[green]✓[/] {escape(title)} [dim]({seconds:.1f} s)[/]")

    def warn(self, text: str) -> None:
        console.print(f"  [yellow]{escape(text)}[/]")

    def line(self, text: str) -> None:
        console.print(escape(text))
