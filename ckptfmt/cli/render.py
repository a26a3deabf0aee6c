"""The CLI's progress bar on stderr (its text goes through ``ckptfmt.tools.output``)."""

from __future__ import annotations

from fsspec.callbacks import Callback
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


class ByteProgress(Callback):
    """An fsspec progress callback (bytes) shown as a rich bar on stderr, for ``with`` blocks; silent when
    ``quiet`` (``--json``) or when stderr is not a terminal: a bar in a log file is noise."""

    def __init__(self, description: str, *, quiet: bool):
        super().__init__()
        errors = Console(stderr=True)
        self.bar = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=errors, transient=True,
            disable=quiet or not errors.is_terminal,
        )
        self.task = self.bar.add_task(description, total=None)

    def call(self, *args, **kwargs):
        self.bar.update(self.task, total=self.size, completed=self.value)

    def __enter__(self) -> ByteProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
