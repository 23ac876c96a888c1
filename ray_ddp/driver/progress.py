"""Live progress in the driver while fit() blocks: a bar on a terminal, lines otherwise.

Runs on the driver, in a thread that polls ``progress.json``, which the metrics callback
rewrites in the Ray Train controller after every report. On a terminal it draws a tqdm
bar (epoch/step, loss, samples/s, ETA); when stdout is not a terminal (job logs, CI,
pipes) it prints one plain line per report it sees; ``--quiet`` shows neither. Straggler
warnings (decided in the callback, which sees every report), preemption checkpoints and
an early stop are printed either way.

"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional
from ray_ddp.driver.events import Event, attribute_hangs, from_records, where_restarted
from ray_ddp.run_folder import Progress, RunFolder
from ray_ddp.storage import StorageConfig, read_json


def read_progress(store: StorageConfig, run_path: str) -> Optional[Progress]:
    """The run's progress.json, or None: none yet, or a file that is not one (it is
    written atomically, so only one someone else put there). A storage that cannot be
    read raises StorageError."""
    try:
        return Progress.from_dict(read_json(store.fs, RunFolder(run_path).progress))
    except ValueError:
        return None


def format_progress(p: Progress) -> str:
    line = f"epoch {p.epoch}/{p.epochs}  step {p.step}/{p.total_steps}  loss {p.loss:.4f}"
    for value, label in ((p.accuracy, "acc"), (p.perplexity, "ppl")):
        if value is not None:
            line += f"  {label} {value:.4f}"
    line += f"  {p.samples_per_s:,.0f} samples/s"
    if p.val_loss is not None:
        line += f"  val_loss {p.val_loss:.4f}"
        for value, label in ((p.val_accuracy, "val_acc"), (p.val_perplexity, "val_ppl")):
            if value is not None:
                line += f"  {label} {value:.4f}"
    if p.checkpoint:
        line += f"  saved {p.checkpoint}"
    return line


def format_straggler(s: dict[str, Any]) -> str:
    return (f"warning: rank {s['rank']} is straggling: its own work (data + forward) took "
            f"{s['ratio']:.1f}x the median rank's for {s['reports']} reports in a row "
            f"({s['busy_s']:.3f} s vs {s['median_s']:.3f} s); check its node "
            f"({(s.get('node_id') or '?')[:12]})")


def format_event(e: Event) -> str:
    """A worker-group restart Ray Train made itself, or a resize, as one line. A hang's
    cause was its own line when the watch ended the group: this one says where the new
    group started."""
    if e.type == "resize":
        return f"resize after step {e.step}: {e.cause}"
    redo = e.steps_lost
    cause = "Ray Train restarted the worker group the hang watch ended (within --max-failures)" \
        if e.type == "hang" else e.cause
    return (f"{e.type} after step {e.step}: {cause}; {where_restarted(e) or 'not restarted'}"
            + (f": {redo} step{'s' if redo != 1 else ''} to redo" if redo else ""))


def format_preemption(e: dict[str, Any]) -> str:
    nodes = ", ".join(n[:12] for n in e["node_id"].split(","))
    return (f"node {nodes} is being preempted (deadline in {max(0.0, e['deadline_in_s']):.0f} s): "
            f"checkpoint {e['checkpoint']} saved")


def format_early_stop(e: dict[str, Any]) -> str:
    """--early-stop's one line, from progress.json's ``early_stop``."""
    best = f"best {e['best']:.4f} at epoch {e['best_epoch']}" if e.get("best") is not None else "no best yet"
    times = f"{e['stale']} validation" + ("" if e["stale"] == 1 else "s")
    return (f"early stop: val_loss {e['val_loss']:.4f} has not improved for {times} ({best}); "
            f"stopped after epoch {e['epoch']} of {e['epochs']}")


class _Bar:
    """A tqdm bar over global steps; created on the first report (total known then)."""

    def __init__(self) -> None:
        self.bar = None

    def show(self, p: Progress) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=p.total_steps, initial=0, unit="step", dynamic_ncols=True,
                            file=sys.stdout, leave=True)
        self.bar.set_description(f"epoch {p.epoch}/{p.epochs}")
        self.bar.set_postfix_str(f"loss {p.loss:.4f}, {p.samples_per_s:,.0f} samples/s")
        self.bar.update(p.step - self.bar.n)

    def write(self, line: str) -> None:
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def show_progress(store: StorageConfig, run_path: str, echo: Callable[[str], None],
                  enabled: bool, terminal: Optional[bool] = None,
                  every_s: float = 1.0, hangs: Callable[[], list[Event]] = list) -> Iterator[None]:
    """Poll progress.json until the block ends, showing each new report. ``hangs``: the
    hangs the watch declared in this fit so far, so that the restart that followed one is
    told as that hang's (Ray Train saw only processes the watch killed)."""
    if not enabled:
        yield
        return
    if terminal is None:
        terminal = echo is print and sys.stdout.isatty()
    bar = _Bar() if terminal else None
    seen = read_progress(store, run_path)  # a resumed run's old file: not news
    last_time = seen.time if seen else None
    warned: set[tuple[int, int]] = set()
    told = len(seen.preemptions) if seen else 0  # preemptions already printed
    # Ray Train's restarts and resizes already printed (a new controller starts its list
    # afresh, so they are told apart by their time, not counted)
    told_events = {(e.type, e.time) for e in from_records(seen.events if seen else None)}
    hangs_told: set = set()  # the times of the hangs whose restart was told
    stop = threading.Event()

    shown = None  # (step, time) of the report shown last

    def show_new() -> None:
        nonlocal last_time, told, shown
        p = read_progress(store, run_path)
        if p is None or p.time == last_time:
            return
        last_time = p.time
        straggler = p.straggler
        if straggler and (straggler["rank"], straggler["since_step"]) not in warned:
            warned.add((straggler["rank"], straggler["since_step"]))
            (bar.write if bar else echo)(format_straggler(straggler))
        events = p.preemptions
        if len(events) < told:  # a new controller (a resumed run) starts its list afresh
            told = 0
        for event in events[told:]:
            (bar.write if bar else echo)(format_preemption(event))
        told = len(events)
        for event in from_records(p.events):
            if (event.type, event.time) not in told_events:
                told_events.add((event.type, event.time))
                unused = [h for h in hangs() if h.time not in hangs_told]
                [event], left = attribute_hangs([event], unused)
                hangs_told.update(h.time for h in unused if h not in left)
                (bar.write if bar else echo)(format_event(event))
        # a write that only added an event or a new group's nodes is not a new report
        report = (p.step, p.report_time or p.time)
        if p.step is None or report == shown:
            return
        shown = report
        if bar is not None:
            bar.show(p)
        else:
            echo(format_progress(p))
        if p.early_stop:  # the run's last report: after its progress line
            (bar.write if bar else echo)(format_early_stop(p.early_stop))

    def poll() -> None:
        while not stop.wait(every_s):
            show_new()

    thread = threading.Thread(target=poll, name="ray_ddp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        show_new()
        if bar is not None:
            bar.close()
