"""An ipywidgets form for notebook 07's parameters: it edits a copy, shows the planner's verdict as values change,
and writes the values back into the notebook (and re-validates `run`) only when Apply is clicked.

The parameters cell stays the source of truth: the form is opt-in (`interactive = True`) and does nothing under
papermill, nbval or CI (`labkit.course.nb.headless()`). Validation never runs inside an Output widget, whose context would
swallow the exception; the verdict is plain HTML.
"""
from __future__ import annotations

import html

from labkit.config import AMP_LEVELS
from labkit.course.nb import headless
from labkit.course.pretrain.params import DEFAULTS, PARAMS, PRESETS
from labkit.course.pretrain.runspec import resolve
from labkit.errors import LabkitError

FIELDS = ("preset", "device_target", "devices", "nodes", "device_memory_gib", "dp", "mp", "pp", "optimizer_shard",
          "micro_batch", "accum", "global_batch", "seq_len", "recompute", "amp_level", "lr", "warmup_steps",
          "min_lr", "steps", "save_every")
CHOICES = {"device_target": [None, "CPU", "GPU", "Ascend"], "amp_level": [None, *AMP_LEVELS],
           "optimizer_shard": [None, True, False]}


def _show(value) -> str:
    return "None" if value is None else str(value)


def _parse(name: str, text: str):
    import yaml

    text = text.strip()
    if text in ("", "None", "none", "null"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise LabkitError(f"{name}: {text!r} is not a value", "write a number, a word, or None") from None


def verdict_html(run) -> str:
    """One paragraph: layout, batch, memory against the device, predicted speed, and whether it trains here."""
    p, t, s = run.cfg.parallel, run.cfg.train, run.strategy
    mem = s.memory_gib["total"]
    ok = '<b style="color:green">fits</b>' if s.fits else '<b style="color:red">does not fit</b>'
    where = "trains here" if run.can_train else f"plan only here ({html.escape(run.why_not or '')})"
    return (f"<p>dp {p.dp} × mp {p.mp} × pp {p.pp} ({p.parallel_mode}, optimizer_shard {p.optimizer_shard}) · "
            f"micro_batch {t.micro_batch} × dp {p.dp} × accum {t.accum} = {t.global_batch} × {run.cfg.data.seq_len} "
            f"tokens<br>{mem:.1f} of {run.device_memory_gib:g} GiB per device: {ok} · {s.step_time_s:.3g} s/step · "
            f"{s.tokens_per_s_per_device:,.0f} tokens/s per device · MFU {s.mfu:.0%} · {where}</p>")


def error_html(e: LabkitError) -> str:
    fix = f"<br>fix: {html.escape(e.fix)}" if e.fix else ""
    return f'<p style="color:#b00"><b>{html.escape(e.what)}</b>{fix}</p>'


class ParameterForm:
    """The form over a copy of `namespace`'s parameters (a notebook's globals())."""

    def __init__(self, namespace: dict):
        import ipywidgets as W


        self.namespace = namespace
        self.values = {k: namespace.get(k, DEFAULTS[k]) for k in PARAMS}  # the copy the form edits
        self.inputs, self.texts = {}, set()
        style = {"description_width": "11em"}
        for name in FIELDS:
            # the glossary on the label: ipywidgets 8 drops `tooltip` on a widget that has a description
            label = dict(description=f'<abbr title="{html.escape(PARAMS[name].help)}">{name}</abbr>',
                         description_allow_html=True, style=style)
            options = list(PRESETS) if name == "preset" else CHOICES.get(name)
            if options:  # by index: ipywidgets 8 takes value=None as "nothing selected", an empty box
                w = W.Dropdown(options=[(_show(o), o) for o in options], index=options.index(self.values[name]),
                               **label)
            else:
                w = W.Text(value=_show(self.values[name]), placeholder="None", continuous_update=False, **label)
                self.texts.add(name)
            w.observe(self._changed, names="value")
            self.inputs[name] = w
        self.verdict = W.HTML()
        self.status = W.HTML()
        self.button = W.Button(description="Apply / 应用", button_style="primary",
                               tooltip="write these values into the notebook and re-validate `run`")
        self.button.on_click(self.apply)
        self.widget = W.VBox([
            W.HTML("<b>参数表单 / Parameters</b> (None = the preset's value; dp/mp/pp None = the planner's choice; "
                   "hover a name for its meaning / 悬停名称查看说明)"),
            W.GridBox(list(self.inputs.values()), layout=W.Layout(grid_template_columns="repeat(3, 1fr)")),
            self.verdict, W.HBox([self.button, self.status])])
        self._changed()

    def read(self) -> dict:
        """The parameters as the form shows them (unchanged ones from the copy)."""
        out = dict(self.values)
        for name, w in self.inputs.items():
            out[name] = _parse(name, w.value) if name in self.texts else w.value
        return out

    def check(self, check_files: bool = False):
        values = self.read()
        return values, resolve(values, check_files=check_files)

    def _changed(self, change=None) -> None:
        try:
            _, run = self.check()
            self.verdict.value = verdict_html(run)
        except LabkitError as e:
            self.verdict.value = error_html(e)
        self.status.value = ""

    def apply(self, _button=None):
        """Write the values into the namespace and set `run` there; an invalid set changes nothing."""
        try:
            values, run = self.check(check_files=True)
        except LabkitError as e:
            self.status.value = error_html(e)
            return None
        self.namespace.update(values)
        self.namespace["run"] = run
        self.values = values
        self.status.value = "<p>applied: run the cells below / 已应用，请运行下面的单元</p>"
        return run

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def parameter_form(namespace: dict, enabled: bool = False):
    """Show the form when `enabled` and a front end can use it; otherwise say why not and return None."""
    if not enabled or headless():
        print("widget form off (interactive = False, or papermill/nbval/CI): the parameters cell rules")
        return None
    form = ParameterForm(namespace)
    from IPython.display import display

    display(form)
    return form
