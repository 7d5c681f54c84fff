"""JupyterLab in a real browser: Playwright drives Debian's Chromium against `jupyter lab` started from this
environment, on throwaway copies of the notebooks.

nbval and papermill run the notebooks headless, where a widget that never renders, an error only the front end
shows, or a plot that never updates go unseen. Here:
1. notebook 07 with `interactive = True`: the widget form appears with the parameter glossary, an invalid layout
   shows the validation message (and Apply refuses it), a valid change is applied, the smoke run starts from the
   cells below and its live figure is redrawn at the steps labkit.course.pretrain.follow.figure_steps() names; the
   cells that read its result run without an error (the notebook's later sections, evaluation and the way back to
   HF, are nbval's: they show nothing live);
2. notebook 04a (main run only, few steps): the live plot is redrawn every 10 steps while the kernel trains.
Every wait is for a state the page must reach (a live figure says which redraw it is and which step it shows, see
labkit.course.plots.LiveView), never for something to happen within a time: the budget only ends a hang.
Screenshots land in runs/ui/ (git-ignored) with report.json (phase times, what was seen).

Needs Debian's Chromium and a CJK font (`apt-get install -y chromium fonts-noto-cjk`) and the playwright package
(the `test` extra); skipped without them. Playwright's own browser download is never used. The whole module keeps
to LABKIT_UI_BUDGET_S seconds (default 1200, a guard against a hang); the server and every process under it are
ended afterwards.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.paths import NOTEBOOKS, ROOT, RUNS

CHROMIUM = "/usr/bin/chromium"
APT = "apt-get update && apt-get install -y chromium fonts-noto-cjk"
PLAYWRIGHT_PIN = "playwright==1.65.2"  # as in pyproject.toml's test extra
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic"]
# A guard against a hang, never a speed limit: both notebooks take ~100 CPU-seconds (user + sys), ~50-100 s of wall
# time on 2 idle cores. In the full suite on a loaded machine (3 test workers and 2 busy processes on 2 cores) the
# module gets about a fifth of a core: ~500 s. The default leaves room over that for a slower CPU.
BUDGET_S = float(os.environ.get("LABKIT_UI_BUDGET_S", "1200"))
SHOTS = RUNS / "ui"
# the kernel must not think it is headless (labkit.course.nb.headless), or the form stays off
HEADLESS_ENV = ("CI", "PAPERMILL_INPUT_PATH", "LABKIT_HEADLESS", "MPLBACKEND")
LAB_SETTINGS = {  # a fresh settings folder: no news prompt over the page, every cell in the DOM
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"playwright is not installed: pip install '{PLAYWRIGHT_PIN}' (or pip install -e '.[test]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"Chromium is not installed at {CHROMIUM}: {APT}"
    fonts = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True) \
        if shutil.which("fc-list") else None
    if fonts is None or not fonts.stdout.strip():
        return f"no CJK font (Chinese would render as empty boxes): {APT}"
    for module in ("jupyterlab", "ipywidgets", "nbformat"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: pip install -e '.[lab,test]'"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


# ---------------------------------------------------------------------------------------------- time


class Deadline:
    """One budget for the whole module; every wait takes at most what is left of it."""

    def __init__(self, seconds: float):
        self.total, self.start = seconds, time.monotonic()
        self.end = self.start + seconds
        self.phases: dict[str, float] = {}
        self.seen: dict[str, int] = {}  # what each test saw, for runs/ui/report.json

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            pytest.fail(f"over the {self.total:g} s budget (LABKIT_UI_BUDGET_S) while {what}; phases so far: "
                        f"{self.phases}")
        return left

    def ms(self, what: str) -> float:
        """What is left of the budget, in ms: the timeout of a wait for a state (it guards against a hang only)."""
        return 1000 * self.left(what)

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.monotonic() - self.start, 1)


# ---------------------------------------------------------------------------------------------- notebooks


def _set_params(source: str, **values) -> str:
    """Rewrite `name: T = value  # comment` lines of a parameters cell."""
    for name, value in values.items():
        source, n = re.subn(rf"^({name}\s*(?::[^=\n]*)?=\s*)([^#\n]*?)(\s*#.*)?$",
                            lambda m: m.group(1) + repr(value) + (m.group(3) or ""), source, flags=re.M)
        assert n == 1, f"parameter {name} not found once in the parameters cell"
    return source


def copy_notebook(name: str, dst_dir: Path, params: dict, last_cell: str | None = None,
                  drop: tuple = ()) -> tuple[Path, list]:
    """A copy of notebooks/<name> with new parameter values, optionally cut after the cell containing `last_cell`
    and without the cells containing one of `drop` (sections the test does not look at, which nbval runs anyway).
    Returns its path and its cells' sources (cell i of the file is cell i in the page)."""
    import nbformat

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = _set_params(cell.source, **params)
    if last_cell:
        nb.cells = nb.cells[:index_of(nb.cells, last_cell) + 1]
    gone = {index_of(nb.cells, text) for text in drop}
    nb.cells = [c for i, c in enumerate(nb.cells) if i not in gone]
    path = dst_dir / name
    nbformat.write(nb, path)
    return path, [c.source for c in nb.cells]


def index_of(cells, text: str) -> int:
    found = [i for i, c in enumerate(cells) if text in (c if isinstance(c, str) else c.source)]
    assert len(found) == 1, f"{text!r} is in cells {found}, expected exactly one"
    return found[0]


# ---------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_tree(proc: subprocess.Popen, known: dict) -> list[str]:
    """End the server and everything under it (kernels, their training processes); return what survived."""
    import psutil

    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            known.setdefault(p.pid, p)
    except psutil.NoSuchProcess:
        pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    alive = [p for p in known.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    return [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in alive]


@pytest.fixture(scope="module")
def deadline():
    return Deadline(BUDGET_S)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, deadline):
    """`jupyter lab` on a free loopback port with a random token over a throwaway notebooks folder, and a Chromium
    page factory. Yields a namespace; ends the browser, the server and every process under it afterwards."""
    import psutil
    from playwright.sync_api import sync_playwright

    tmp = tmp_path_factory.mktemp("ui")
    root, jupyter = tmp / "notebooks", tmp / "jupyter"
    root.mkdir()
    for rel, value in LAB_SETTINGS.items():
        f = jupyter / "settings" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value), encoding="utf-8")
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):  # every screenshot there is from this run
        old.unlink()
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in HEADLESS_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               JUPYTER_CONFIG_DIR=str(jupyter / "config"), JUPYTER_DATA_DIR=str(jupyter / "data"),
               JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"),
               JUPYTER_PLATFORM_DIRS="1", GLOG_v=env.get("GLOG_v", "3"))
    log = open(tmp / "jupyter.log", "w", encoding="utf-8")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={jupyter / 'settings'}", f"--LabApp.workspaces_dir={jupyter / 'workspaces'}"]
    server = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    known: dict = {}
    watchdog = threading.Timer(deadline.left("starting") + 30, lambda: end_tree(server, known))
    watchdog.daemon = True
    watchdog.start()
    base = f"http://127.0.0.1:{port}"
    pw = browser = None
    try:
        while True:  # the server answers its status API with the token once it is up
            assert server.poll() is None, f"jupyter lab exited {server.returncode}:\n{_tail(tmp / 'jupyter.log')}"
            deadline.left("waiting for jupyter lab to answer")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        deadline.mark("server up")
        pw = sync_playwright().start()
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                                     timeout=deadline.ms("starting Chromium"))
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        problems: list[str] = []

        def open_notebook(name: str) -> Notebook:
            page = context.new_page()
            page.on("pageerror", lambda e: problems.append(f"{name}: page error: {e}"))
            page.on("console", lambda m: problems.append(f"{name}: console {m.type}: {m.text}")
                    if m.type == "error" else None)
            page.set_default_timeout(deadline.ms(f"opening {name}"))
            # a workspace of its own, so the page does not also restore the notebooks other pages had open
            page.goto(f"{base}/lab/workspaces/{Path(name).stem}/tree/{name}?token={token}")
            nb = Notebook(page, name)
            page.wait_for_function(f"(path) => {{ {FIND} return {KERNEL_IDLE}; }}", arg=name,
                                   timeout=deadline.ms(f"starting {name}'s kernel"))
            return nb

        yield type("Lab", (), dict(root=root, tmp=tmp, open=staticmethod(open_notebook), problems=problems,
                                   deadline=deadline, log=tmp / "jupyter.log"))
    finally:
        watchdog.cancel()
        try:
            if browser is not None:
                browser.close()
            if pw is not None:
                pw.stop()
        finally:
            survivors = end_tree(server, known)
            log.close()
            deadline.mark("closed")
            report = {"budget_s": deadline.total, "phases_s": deadline.phases, "seen": deadline.seen}
            (SHOTS / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
            assert not survivors, f"processes left behind: {survivors}"
            assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in known.values())


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])


# ---------------------------------------------------------------------------------------------- the page

# JavaScript on the page (the server runs with --LabApp.expose_app_in_browser): the notebook panel open at `path`
FIND = ("const w = window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main'))"
        ".find(x => x.context && x.context.path === path);")
KERNEL_IDLE = ("!!w && !!w.sessionContext.session && !!w.sessionContext.session.kernel && "
               "w.sessionContext.session.kernel.status === 'idle' && w.content.widgets.length > 0")
# every code cell: execution count (null = not run) and the errors among its outputs, from the notebook's model
CELL_STATES = """const m = w.content.model; const out = [];
  for (let i = 0; i < m.cells.length; i++) { const c = m.cells.get(i); if (c.type !== 'code') continue;
    const errors = [];
    for (let j = 0; j < c.outputs.length; j++) { const o = c.outputs.get(j).toJSON();
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue); }
    out.push({index: i, count: c.executionCount, errors: errors}); }
  return out;"""


class Notebook:
    """One notebook in its own page; cell i of the page is cell i of the file."""

    def __init__(self, page, path: str):
        self.page, self.path = page, path

    @property
    def panel(self):
        wid = self.page.evaluate(f"(path) => {{ {FIND} return w.id; }}", self.path)
        return self.page.locator(f"[id='{wid}']")

    def cell(self, index: int):
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(index)

    def states(self) -> list[dict]:
        return self.page.evaluate(f"(path) => {{ {FIND} {CELL_STATES} }}", self.path)

    def errors(self) -> list[str]:
        return [f"cell {c['index']}: {e}" for c in self.states() for e in c["errors"]]

    def run_menu(self, item: str, select: int | None = None) -> None:
        """Select cell `select` (by its prompt), then Run > `item` from the menu bar."""
        if select is not None:
            self.cell(select).locator(".jp-InputPrompt").click()
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name=item, exact=True).click()

    def wait_executed(self, deadline: Deadline, upto: int, what: str) -> None:
        """Until every code cell up to index `upto` has run and none is queued; an error output fails at once."""
        while True:
            states = self.states()
            errors = [f"cell {c['index']}: {e}" for c in states for e in c["errors"]]
            assert not errors, f"{what}: the front end shows errors: {errors}"
            todo = [c["index"] for c in states if c["index"] <= upto and c["count"] is None]
            if not todo and not any(running(self.cell(c["index"])) for c in states if c["index"] <= upto):
                return
            deadline.left(f"{what} (cells not run yet: {todo})")
            self.page.wait_for_timeout(250)


def running(cell) -> bool:
    return "*" in cell.locator(".jp-InputPrompt").inner_text()


# a cell's live figure (labkit.course.plots.LiveView): which redraw it is, the step it shows and its image, at once
FIGURE_STATE = """(cell) => { const i = cell.querySelector('.jp-OutputArea-output img[data-update]');
  return i && {update: Number(i.dataset.update), step: Number(i.dataset.step), src: i.getAttribute('src')}; }"""


def follow_figure(nb: Notebook, index: int, deadline: Deadline, what: str, shot: str,
                  last_step: int) -> tuple[dict[int, str], dict]:
    """Read cell `index`'s live figure until the cell has finished and its figure shows step `last_step`: states the
    kernel must reach. How often this looks decides only which redraws it also catches on the way, so each reading
    is checked, not counted: the redraw number never goes back, one number is one image, a new number a new image.
    The first figure caught after another is saved as runs/ui/<shot>_1.png, the final one as <shot>_2.png.
    Returns the image of each redraw caught (redraw number -> src) and the final state (update, step, src)."""
    cell, caught, state = nb.cell(index), {}, None
    while True:
        busy = running(cell)  # read before the figure: once the cell has finished, its figure is the last one
        state = cell.evaluate(FIGURE_STATE)
        if state:
            n, src = state["update"], state["src"]
            assert not caught or n >= max(caught), f"{what}: the figure went back from update {max(caught)} to {n}"
            assert caught.get(n, src) == src, f"{what}: update {n} showed two different images"
            if n not in caught:
                assert src not in caught.values(), f"{what}: update {n} shows the image of an earlier update"
                caught[n] = src
                if len(caught) == 2:
                    cell.locator(".jp-Cell-outputArea").screenshot(path=SHOTS / f"{shot}_1.png")
            if not busy and state["step"] == last_step:
                cell.locator(".jp-Cell-outputArea").screenshot(path=SHOTS / f"{shot}_2.png")
                return caught, state
        errors = nb.errors()
        assert not errors, f"{what}: the front end shows errors: {errors}"
        shown = state and f"update {state['update']}, step {state['step']}"
        deadline.left(f"{what} (the cell {'runs' if busy else 'is not running'}; its figure: {shown})")
        nb.page.wait_for_timeout(200)


@pytest.fixture
def last_view():
    """Pages registered here are saved as runs/ui/<name>_last.png when the test ends, passed or failed."""
    pages = []
    yield lambda page, name: pages.append((page, name))
    for page, name in pages:
        if not page.is_closed():
            page.screenshot(path=SHOTS / f"{name}_last.png")
            page.close()


def test_07_form_validates_applies_and_the_smoke_run_plots_live(lab, last_view):
    from playwright.sync_api import expect

    from labkit.course.pretrain import PARAMS
    from labkit.course.pretrain.follow import figure_steps
    from labkit.course.widgets import FIELDS

    d = lab.deadline
    _, src = copy_notebook("07_pretrain.ipynb", lab.root, dict(interactive=True, steps=8,
                                                                output_dir=str(lab.tmp / "run07")),
                           last_cell='nb.check(summary["final_loss"] < summary["first_loss"]')
    i_form, i_launch = index_of(src, "widgets.parameter_form("), index_of(src, "pretrain.launch(run)")
    nb = lab.open("07_pretrain.ipynb")
    last_view(nb.page, "07")
    d.mark("07 open")

    nb.run_menu("Run All Above Selected Cell", select=i_form + 1)  # the markdown cell after the form
    nb.wait_executed(d, i_form, "cells up to the form")
    form = nb.cell(i_form).locator(".widget-vbox").first
    form.wait_for(timeout=d.ms("the widget form to render"))
    d.mark("07 form shown")

    def field(name):
        return form.locator(".widget-inline-hbox").filter(has=nb.page.get_by_text(name, exact=True))

    # every field is there, its label carries the glossary, and None shows as None (not an empty box)
    for name in FIELDS:
        assert field(name).locator("abbr").get_attribute("title") == PARAMS[name].help, name
    for name in ("device_target", "optimizer_shard", "amp_level"):
        assert field(name).locator("select").input_value() == "None", name
    expect(field("steps").locator("input")).to_have_value("8", timeout=d.ms("the steps field"))
    verdict, status = form.locator(":scope > .widget-html").nth(1), form.locator(".widget-hbox .widget-html")
    apply = form.get_by_role("button", name="Apply / 应用")
    expect(verdict).to_contain_text("fits", timeout=d.ms("the verdict"))
    expect(verdict).to_contain_text("trains here", timeout=d.ms("the verdict"))
    form.screenshot(path=SHOTS / "07_form.png")

    # an invalid layout: 1 device cannot hold dp 2; the verdict says so and Apply refuses it
    dp = field("dp").locator("input")
    dp.fill("2")
    dp.press("Enter")
    expect(verdict).to_contain_text("dp x mp x pp must equal devices (1): dp 2 does not divide 1",
                                    timeout=d.ms("the validation message"))
    apply.click()
    expect(status).to_contain_text("must equal devices", timeout=d.ms("Apply refusing"))
    form.screenshot(path=SHOTS / "07_form_invalid.png")

    # a valid change: the planner's layout back, 12 steps instead of 8, applied
    dp.fill("None")
    dp.press("Enter")
    steps = field("steps").locator("input")
    steps.fill("12")
    steps.press("Enter")
    expect(verdict).to_contain_text("fits", timeout=d.ms("the verdict after the fix"))
    apply.click()
    expect(status).to_contain_text("applied", timeout=d.ms("Apply"))
    form.screenshot(path=SHOTS / "07_form_applied.png")
    d.mark("07 applied")

    # the cells below, the smoke run among them, from the applied values; its figure is redrawn at given steps (in
    # order, however many steps one read of metrics.jsonl brings), so the final figure's redraw number is known
    redraws = figure_steps(12)
    assert len(redraws) >= 2, f"a 12-step run would redraw its figure only at steps {redraws}"
    nb.run_menu("Run Selected Cell and All Below", select=i_form + 1)
    caught, final = follow_figure(nb, i_launch, d, "the smoke run", "07_live", last_step=12)
    d.mark("07 trained")
    d.seen["07 figure redraws (the kernel's)"] = final["update"]
    d.seen["07 figures the page caught on the way"] = len(caught)
    expect(nb.cell(i_launch).locator(".jp-OutputArea-output").first).to_contain_text("step 12/12",
                                                                                      timeout=d.ms("the status"))
    assert final["update"] == len(redraws), \
        f"the live figure was redrawn {final['update']} times, expected {len(redraws)} (at steps {redraws})"
    nb.wait_executed(d, len(src) - 1, "the cells that read the run's result")
    d.mark("07 done")
    assert not lab.problems, lab.problems


HAND_WRITTEN_04 = ("## 2. 亲手写一个训练步", "hand_cfg = cfg_for(", "模型、优化器和两个编译图", "def micro_step(",
                   "亲手写的一步与工具一致", "hand_diff = max(")  # notebook 04a's section 2 and its comparison


def test_04_live_plot_updates_while_the_kernel_trains(lab, last_view):
    d = lab.deadline
    # section 2's training step by hand (~30 s, not needed by the main run) stays out: this test is about the plot
    steps = 20
    _, src = copy_notebook("04a_single_card.ipynb", lab.root, dict(steps=steps, eval_every=0,  # no validation graph
                                                                  output_dir=str(lab.tmp / "run04")),
                           last_cell='nb.check(main["final_loss"]', drop=HAND_WRITTEN_04)
    i_train = index_of(src, "LivePlot(every=10")
    redraws = steps // 10  # LivePlot redraws at steps 10 and 20; close() adds none (no step after the last redraw)
    nb = lab.open("04a_single_card.ipynb")
    last_view(nb.page, "04")
    d.mark("04 open")
    nb.run_menu("Run All Cells")
    caught, final = follow_figure(nb, i_train, d, "notebook 04a's main run", "04a_live", last_step=steps)
    d.mark("04 trained")
    d.seen["04 figure redraws (the kernel's)"] = final["update"]
    d.seen["04 figures the page caught on the way"] = len(caught)
    assert final["update"] == redraws, f"the live plot was redrawn {final['update']} times, expected {redraws} " \
                                       f"(every 10 of {steps} steps)"
    nb.wait_executed(d, len(src) - 1, "notebook 04a")
    d.mark("04 done")
    assert not lab.problems, lab.problems
