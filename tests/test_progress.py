"""Progress in a log file: plain lines where rich's live bars would draw nothing until the end."""

import io

from rich.console import Console
from rich.progress import Progress

from attnzoo.progress import LineProgress, progress


def test_a_terminal_gets_rich_bars_and_a_file_gets_lines():
    assert isinstance(progress(Console(file=io.StringIO(), force_terminal=True)), Progress)
    assert isinstance(progress(Console(file=io.StringIO())), LineProgress)


def test_lines_on_each_new_description_on_completion_and_every_interval():
    out = io.StringIO()
    with progress(Console(file=out, width=200), every_s=3600) as bar:
        epochs = bar.add_task("epochs", total=2, note="")
        batches = bar.add_task("batches", total=1, note="")
        for epoch in range(2):
            bar.reset(batches, total=3, description=f"epoch {epoch + 1}", note="")
            for _ in range(3):
                bar.update(batches, advance=1, note="loss 0.5")
            bar.update(epochs, completed=epoch + 1, note=f"val mse {epoch}")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "epoch 1 0/3 ", "epoch 1 3/3 loss 0.5", "epochs 1/2 val mse 0",  # a task's first update: a line
        "epoch 2 0/3 ", "epoch 2 3/3 loss 0.5", "epochs 2/2 val mse 1"]
    out = io.StringIO()
    bar = progress(Console(file=out), every_s=0)
    task = bar.add_task("cells", total=100)
    bar.update(task, advance=1)
    bar.update(task, advance=1)
    assert len(out.getvalue().splitlines()) == 2


def test_a_tasks_first_update_prints_soon_after_boot(monkeypatch):
    """time.monotonic counts from boot: ten seconds after it, a first update is still a line."""
    import attnzoo.progress as module

    monkeypatch.setattr(module.time, "monotonic", lambda: 10.0)
    out = io.StringIO()
    bar = progress(Console(file=out, width=200), every_s=3600)
    bar.update(bar.add_task("epochs", total=2), completed=1)
    assert out.getvalue().splitlines() == ["epochs 1/2  (0:00)"]
