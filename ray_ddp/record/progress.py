"""Live progress in the driver while fit() blocks: a bar on a terminal, lines otherwise.

Runs on the driver, in a thread that polls ``progress.json``, which the metrics callback
rewrites in the Ray Train controller after every report. On a terminal it draws a tqdm
bar (epoch/step, loss, samples/s, ETA); when stdout is not a terminal (job logs, CI,
pipes) it prints one plain line per report it sees; ``--quiet`` shows neither. Straggler
warnings (decided in the callback, which sees every report), preemption checkpoints and
an early stop are printed either way.

The display only shows: a read the storage fails is read again at the next poll, and an
error it did not expect is one warning line, after which it polls on. Neither can end
the fit or change how it ended.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional
from ray_ddp.record.events import Event, attribute_hangs, from_records, steps_to_redo, where_restarted
from ray_ddp.record.folder import Progress, RunFolder
from ray_ddp.errors import StorageError
from ray_ddp.storage import read_json


def read_progress(folder: RunFolder) -> Optional[Progress]:
    """The run's progress.json, or None: none yet, or a file that is not one (it is
    written atomically, so only one someone else put there). A storage that cannot be
    read raises StorageError."""
    try:
        return Progress.from_dict(read_json(folder.fs, folder.progress))
    except ValueError:
        return None


def format_progress(p: Progress) -> str:
    """A report as the one plain line shown where there is no bar."""
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
    """The straggler warning's one line, from progress.json's ``straggler``."""
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
    cause = "Ray Train restarted the worker group the hang watch ended (within --max-failures)" \
        if e.type == "hang" else e.cause
    return f"{e.type} after step {e.step}: {cause}; {where_restarted(e) or 'not restarted'}{steps_to_redo(e.steps_lost)}"


def format_settled(e: Event) -> str:
    """A restart's line once its new group said where it started: a node's snapshot."""
    return f"{e.type} after step {e.step}: {where_restarted(e)}{steps_to_redo(e.steps_lost)}"


def format_preemption(e: dict[str, Any]) -> str:
    """A preemption checkpoint's one line, from one of progress.json's ``preemptions``."""
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
        """No bar yet: the first report knows the total."""
        self.bar = None

    def show(self, p: Progress) -> None:
        """Move the bar to report ``p``'s step, its epoch, loss and samples/s beside it."""
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=p.total_steps, initial=0, unit="step", dynamic_ncols=True,
                            file=sys.stdout, leave=True)
        self.bar.set_description(f"epoch {p.epoch}/{p.epochs}")
        self.bar.set_postfix_str(f"loss {p.loss:.4f}, {p.samples_per_s:,.0f} samples/s")
        self.bar.update(p.step - self.bar.n)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar (or plainly before it is drawn)."""
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        """Close the bar, if one was drawn."""
        if self.bar is not None:
            self.bar.close()


@contextmanager
def show_progress(folder: RunFolder, echo: Callable[[str], None],
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
    display = _Display(folder, echo, _Bar() if terminal else None, hangs)
    say = _warn_once(display.write)
    stop = threading.Event()

    def poll() -> None:
        """Show each new report every ``every_s`` until the block ends."""
        while not stop.wait(every_s):
            show_safely(display.show_new, say)

    thread = threading.Thread(target=poll, name="ray_ddp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        # the last report, if it can be read: the display never decides how the fit ended
        show_safely(display.show_new, say)
        if display.bar is not None:
            display.bar.close()


class _Display:
    """What the poll has shown so far, and the showing of each new progress.json."""

    def __init__(self, folder: RunFolder, echo: Callable[[str], None],
                 bar: Optional[_Bar], hangs: Callable[[], list[Event]]) -> None:
        """Take what progress.json already holds as shown."""
        self.folder, self.echo, self.bar, self.hangs = folder, echo, bar, hangs
        seen = _read_for_display(folder)  # a resumed run's old file: not news
        self.last_time = seen.time if seen else None
        self.warned: set[tuple[int, int]] = set()
        self.told = len(seen.preemptions) if seen else 0  # preemptions already printed
        # Ray Train's restarts and resizes already printed (a new controller starts its list
        # afresh, so they are told apart by their time, not counted)
        # each event said, and the node of the snapshot its restart was said to load from
        self.told_events = {(e.type, e.time): e.from_node for e in from_records(seen.events if seen else None)}
        self.hangs_told: set = set()  # the times of the hangs whose restart was told
        self.shown: Optional[tuple] = None  # (step, time) of the report shown last

    def write(self, line: str) -> None:
        """Print ``line`` above the bar, or echo it."""
        (self.bar.write if self.bar else self.echo)(line)

    def show_new(self) -> None:
        """Show what progress.json holds that was not shown yet: a straggler warning,
        preemption checkpoints, restarts and resizes, then the report itself."""
        p = _read_for_display(self.folder)
        if p is None or p.time == self.last_time:
            return
        self.last_time = p.time
        self._warn_of_straggler(p.straggler)
        self._tell_preemptions(p.preemptions)
        self._tell_events(from_records(p.events))
        self._show_report(p)

    def _warn_of_straggler(self, straggler: Optional[dict[str, Any]]) -> None:
        """Warn of a straggling rank once per straggle (its rank and the step it began)."""
        if straggler and (straggler["rank"], straggler["since_step"]) not in self.warned:
            self.warned.add((straggler["rank"], straggler["since_step"]))
            self.write(format_straggler(straggler))

    def _tell_preemptions(self, events: list[dict[str, Any]]) -> None:
        """Say each preemption checkpoint not said yet."""
        if len(events) < self.told:  # a new controller (a resumed run) starts its list afresh
            self.told = 0
        for event in events[self.told:]:
            self.write(format_preemption(event))
        self.told = len(events)

    def _tell_events(self, events: list[Event]) -> None:
        """Say each restart or resize of Ray Train's not said yet; a restart that followed
        a hang the watch declared is told as that hang's. A restart said as it happened
        (from run storage's newest checkpoint, the driver's knowledge then) whose new group
        then loaded a node's snapshot, newer, is said again, settled."""
        for event in events:
            key = (event.type, event.time)
            if key in self.told_events:
                if self.told_events[key] is None and event.from_node is not None:
                    self.told_events[key] = event.from_node
                    self.write(format_settled(event))
                continue
            self.told_events[key] = event.from_node
            unused = [h for h in self.hangs() if h.time not in self.hangs_told]
            [event], left = attribute_hangs([event], unused)
            self.hangs_told.update(h.time for h in unused if h not in left)
            self.write(format_event(event))

    def _show_report(self, p: Progress) -> None:
        """Show ``p``'s report, if it is a new one: on the bar or as a line, and after it
        an early stop's line."""
        # a write that only added an event or a new group's nodes is not a new report
        report = (p.step, p.report_time or p.time)
        if p.step is None or report == self.shown:
            return
        self.shown = report
        if self.bar is not None:
            self.bar.show(p)
        else:
            self.echo(format_progress(p))
        if p.early_stop:  # the run's last report: after its progress line
            self.write(format_early_stop(p.early_stop))


def _read_for_display(folder: RunFolder) -> Optional[Progress]:
    """read_progress, None where the storage fails: the display shows what it can read,
    and the next poll (or the last read) reads the file again."""
    try:
        return read_progress(folder)
    except StorageError:
        return None


def show_safely(show: Callable[[], None], say: Callable[[str], None]) -> None:
    """One poll of the display. An error it did not expect (a bug, a file it cannot
    show) is one warning line and the poll goes on: the display thread never dies
    silently, and never ends the fit."""
    try:
        show()
    except Exception as err:  # any: this thread's death would be silent to the user
        first = (str(err).strip().splitlines() or [""])[0][:200]
        say(f"warning: the progress display failed ({type(err).__name__}: {first}); training goes on, "
            "and its progress shows again with the next report it can read")


def _warn_once(write: Callable[[str], None]) -> Callable[[str], None]:
    """``write``, each distinct line once (an error that repeats every poll is said once)."""
    said: set[str] = set()

    def say(line: str) -> None:
        """Write ``line`` unless it was written already."""
        if line not in said:
            said.add(line)
            write(line)

    return say
