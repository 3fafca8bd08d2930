"""Progress lines, the result document and the timed epochs of a benchmark run."""
import json
import os
import platform
import statistics
import time
import traceback

import torch

T0 = time.perf_counter()  # the run's start (this module's import): log lines and the time budget count from it


def log(msg: str) -> None:
    """Prints ``msg`` after the seconds since the run started."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def first_line(error: BaseException) -> str:
    """``"ErrorType: first line of the message"`` (300 characters at most), for tables and the JSON."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def device_name(device) -> str:
    """The GPU's name, or the CPU's processor (machine) string."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


class Recorder:
    """The result document, rewritten (atomically) to ``path`` after every configuration (``path`` empty: kept in
    memory only).  ``data`` holds ``meta`` and ``e2e.py``'s sections (``graph``, ``batches``, ``inference``,
    ``transfer``, ``training``, ``profiles``, ``errors``, ``skipped``, ``timeline``, ``summary``); a benchmark with
    other rows deletes the sections it does not fill."""

    def __init__(self, path, meta, device_type: str = "cpu"):
        self.path, self.device_type = path, device_type
        self.data = dict(meta=meta, graph={}, batches={}, inference=[], transfer=[], training=[],
                         profiles=[], errors=[], skipped=[], timeline={}, summary={})
        self.cuda_broken = None

    def finish(self, tables_markdown: str) -> None:
        """Prints the recorded errors and skipped configurations, keeps the tables in the document and saves it."""
        if self.data["errors"]:
            print(f"\n{len(self.data['errors'])} error(s) recorded: " +
                  "; ".join(f"{e['where']}: {e['error'][:100]}" for e in self.data["errors"][:8]))
        if self.data["skipped"]:
            print(f"{len(self.data['skipped'])} configuration(s) skipped (see JSON 'skipped')")
        self.data["tables_markdown"] = tables_markdown
        self.save()

    def save(self) -> None:
        """Writes the document (with the run's elapsed seconds) to ``path`` through a temporary file."""
        if not self.path:
            return
        self.data["meta"]["elapsed_s"] = round(time.perf_counter() - T0, 1)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def error(self, where: str, error: BaseException) -> str:
        """Records ``error`` (its first line and traceback) under ``errors``, prints it and returns the first line;
        a broken CUDA context marks the rest of the GPU work to be skipped."""
        message = first_line(error)
        self.data["errors"].append(dict(where=where, error=message,
                                        traceback=traceback.format_exc(limit=6)[-2500:]))
        print(f"    ERROR in {where}: {message}", flush=True)
        if self.device_type == "cuda" and not cuda_alive():
            self.cuda_broken = message  # a sticky error: later GPU work would only fail again
            print("    the CUDA context is broken: the remaining GPU configurations are skipped", flush=True)
        self.save()
        return message


def cuda_alive() -> bool:
    """Whether the CUDA context still runs work (an illegal address or a device assert is sticky)."""
    try:
        torch.cuda.synchronize()
        value = (torch.ones(1, device="cuda") + 1).item()
        return value == 2.0
    except Exception:  # noqa: BLE001
        return False


def epoch_stats(times) -> dict:
    """The record of timed epochs (ms): median, extremes, each one, and how many."""
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                times_ms=[round(v, 3) for v in times], reps=len(times))


class Runner:
    """Timed epochs of a run on ``device`` under ``args.time_budget``, ``args.reps`` and ``args.warmup``, with
    skipped configurations recorded in ``rec``."""

    def __init__(self, args, device, rec: Recorder):
        self.args, self.device, self.rec = args, device, rec
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        """Waits for the GPU (nothing on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def time_left(self) -> float:
        """Seconds left of ``args.time_budget``, counted from the run's start."""
        return self.args.time_budget - (time.perf_counter() - T0)

    def allowed(self, label: str, need_s: float = 0.0) -> bool:
        """Whether ``label`` may start (``need_s`` seconds left and the CUDA context alive); if not, it is recorded
        under ``skipped`` with the reason."""
        if self.rec.cuda_broken:
            reason = f"skipped: CUDA context broken earlier ({self.rec.cuda_broken[:80]})"
        elif self.time_left() < need_s:
            reason = f"skipped: time budget ({self.args.time_budget:.0f} s) reached"
        else:
            return True
        self.rec.data["skipped"].append(dict(what=label, reason=reason))
        print(f"    {label}: {reason}", flush=True)
        return False

    def epoch_ms(self, fn) -> float:
        """Milliseconds of one call of ``fn``: CUDA events on the current stream, or the wall clock on the CPU."""
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def measure(self, fn, reps=None, warmup=None) -> dict:
        """Warm-up epochs, then the median of ``reps`` timed epochs (fewer if the budget runs short)."""
        reps = self.args.reps if reps is None else reps
        warmup = self.args.warmup if warmup is None else warmup
        t = time.perf_counter()
        for _ in range(warmup):
            fn()
        self.sync()
        first = (time.perf_counter() - t) / max(warmup, 1)
        times = []
        for i in range(reps):
            if i >= 1 and self.time_left() < 2 * first + 5:
                break  # keep what we have; the budget guard will skip what follows
            times.append(self.epoch_ms(fn))
        return epoch_stats(times)
